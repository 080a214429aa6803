"""Model references -> local paths, through huggingface_hub.

What a user types where rtp takes a model (`rtp serve REF`, `--model REF`, `LLM(model=REF)`,
`--tokenizer REF`):

    path/to/dir, path/to/model.gguf  used as they are (a path that exists wins over an ID)
    ORG/NAME                         a Hugging Face repository: its config, tokenizer and
                                     safetensors weights (`snapshot_download` with
                                     allow_patterns, nothing else); a repository of GGUF files
                                     only picks one as ORG/NAME:Q4_K_M would
    ORG/NAME:Q4_K_M                  a GGUF repository's file of that quant type (its name
                                     holds the type, case aside, as llama.cpp's -hf matches it)
    ORG/NAME/file.gguf               that file of the repository

A split GGUF (`name-00001-of-00003.gguf`) brings all its parts; the first is returned, and
the GGUF reader loads the parts as one (rtp/checkpoint/gguf.py). `revision` picks a branch,
tag or commit. The environment is read when a reference is resolved, not at import:
HF_HOME, HF_HUB_CACHE (where files go), HF_TOKEN (private repositories; huggingface_hub
reads it) and HF_HUB_OFFLINE=1 (only what the cache holds: nothing is fetched). Downloads
show huggingface_hub's progress bars on a terminal and one log line otherwise.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

log = logging.getLogger("rtp.hub")

# what a safetensors repository needs for rtp to load and serve it
HF_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.json", "chat_template.jinja",
               "*.safetensors", "*.safetensors.index.json"]
# the GGUF a repository of GGUFs gives when no file or type is named (llama.cpp's choice too)
DEFAULT_QUANTS = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q8_0", "Q4_1", "Q4_0", "BF16", "F16")

_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<quant>[\w.-]+)|/(?P<file>[^:]+\.gguf))?$")
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")


class ModelNotFound(FileNotFoundError):
    pass


def resolve_model(ref: str | os.PathLike, revision: str | None = None) -> Path:
    """A local path for a model reference (see the module's docstring)."""
    path = Path(ref).expanduser()
    if path.exists():
        return path
    text = str(ref)
    match = _ID.match(text)
    if match is None:
        raise ModelNotFound(f"model {text!r} does not exist (no such file or directory) and is not a "
                            "Hugging Face ID (ORG/NAME, ORG/NAME:QUANT or ORG/NAME/file.gguf)")
    repo, quant, file = match["repo"], match["quant"], match["file"]
    files = _repo_files(repo, revision)
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if file is not None:
        if file not in files:
            raise ModelNotFound(_missing(repo, revision, f"the file {file}", ggufs))
        return _fetch_gguf(repo, revision, file, files)
    if quant is not None or "config.json" not in files:
        if not ggufs:
            raise ModelNotFound(_missing(repo, revision, "config.json or a .gguf file", sorted(files)[:20]))
        return _fetch_gguf(repo, revision, _pick_gguf(repo, ggufs, quant), files)
    return Path(_download(repo, revision, allow_patterns=HF_PATTERNS))


def _pick_gguf(repo: str, ggufs: list[str], quant: str | None) -> str:
    """The repository's file for a quant type (the first part of a split one)."""
    firsts = [f for f in ggufs if (m := _SPLIT.match(Path(f).name)) is None or m["part"] == "00001"]
    wanted = [quant] if quant is not None else list(DEFAULT_QUANTS)
    for q in wanted:
        # the type as a word of the name: Q4_K matches model.Q4_K.gguf, not model.Q4_K_M.gguf
        pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(q)}(?![A-Za-z0-9_])", re.IGNORECASE)
        found = [f for f in firsts if pattern.search(Path(f).name)]
        if found:
            return min(found, key=len)
    if quant is None and len(firsts) == 1:
        return firsts[0]
    what = f"a {quant} file" if quant else f"one of {', '.join(DEFAULT_QUANTS)}"
    raise ModelNotFound(f"{repo} has no GGUF of {what}; it has: {', '.join(firsts)} "
                        f"(name one as {repo}:TYPE or {repo}/FILE.gguf)")


def _fetch_gguf(repo: str, revision: str | None, file: str, files: set[str]) -> Path:
    split = _SPLIT.match(Path(file).name)
    wanted = [file]
    if split is not None:
        parent = str(Path(file).parent)
        prefix = "" if parent == "." else parent + "/"
        wanted = [f"{prefix}{split['stem']}-{k:05d}-of-{split['count']}.gguf" for k in range(1, int(split["count"]) + 1)]
        missing = [w for w in wanted if w not in files]
        if missing:
            raise ModelNotFound(f"{repo}: the split GGUF {file} lacks its parts {', '.join(missing)}")
    root = Path(_download(repo, revision, allow_patterns=wanted))
    return root / wanted[0]


def _repo_files(repo: str, revision: str | None) -> set[str]:
    """The repository's file names: from the Hub, or offline from the cached snapshot."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if _offline():
        try:
            root = Path(_download(repo, revision, allow_patterns=["config.json", "*.gguf", "*.safetensors*"],
                                  quiet=True))
        except (LocalEntryNotFoundError, FileNotFoundError, OSError) as e:
            raise ModelNotFound(f"{repo}{'@' + revision if revision else ''} is not in the Hugging Face cache "
                                f"{_cache_dir() or '(default: ~/.cache/huggingface/hub)'} and HF_HUB_OFFLINE=1 "
                                f"forbids fetching it ({type(e).__name__})") from None
        return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    try:
        return set(HfApi().list_repo_files(repo, revision=revision))
    except HfHubHTTPError as e:
        raise ModelNotFound(f"{repo}{'@' + revision if revision else ''} could not be listed on the "
                            f"Hugging Face Hub: {e}") from None
    except OSError as e:  # no network: say what to do
        raise ModelNotFound(f"{repo}: the Hugging Face Hub is unreachable ({e}); with the model in the "
                            "cache, set HF_HUB_OFFLINE=1") from None


def _download(repo: str, revision: str | None, *, allow_patterns: list[str], quiet: bool = False) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    terminal = sys.stderr.isatty()
    if not quiet and not _offline():
        log.info("fetching %s%s (%s) into %s", repo, "@" + revision if revision else "",
                 ", ".join(allow_patterns), _cache_dir() or "the Hugging Face cache")
    if not terminal or quiet:
        disable_progress_bars()
    try:
        return snapshot_download(repo, revision=revision, allow_patterns=allow_patterns, cache_dir=_cache_dir(),
                                 local_files_only=_offline())
    finally:
        if not terminal or quiet:
            enable_progress_bars()


def _cache_dir() -> str | None:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _missing(repo: str, revision: str | None, what: str, have: list[str]) -> str:
    listing = ", ".join(have) if have else "nothing"
    return f"{repo}{'@' + revision if revision else ''} has no {what}; it has: {listing}"
