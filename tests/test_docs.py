"""The docs point at what exists: every repository path README.md names in backticks, and every
relative link in README.md and docs/ (a file, and for `#anchor` into markdown, one of its headings
as GitHub names them). Generic on purpose: code moves, and these catch the docs left behind."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(path: Path):
    """(line number, text, inside a fenced block) for every line of a markdown file."""
    fenced = False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            yield n, line, True
            continue
        yield n, line, fenced


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: its text as rendered (links as their text, code spans as their
    content), lowercased, punctuation dropped but for '-' and '_', spaces as '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = CODE_SPAN.sub(lambda m: m.group(2), text)
    text = re.sub(r"<[^>]+>", "", text)
    return "".join(c for c in text.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, line, fenced in prose_lines(path):
        m = None if fenced else HEADING.match(line)
        if m is None:
            continue
        a = anchor(m.group(2))
        out.add(a if a not in seen else f"{a}-{seen[a]}")
        seen[a] = seen.get(a, 0) + 1
    return out


def top_level_dirs() -> set[str]:
    """The repository's own top-level folders: a path starting with one of them is the repository's
    (`ORG/NAME`, `path/to/model.gguf` are not). Hidden ones count where git tracks them (`.ci`)."""
    names = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")
             and not p.name.endswith(".egg-info") and p.name not in ("build", "dist")}
    return names | {p.name for p in ROOT.glob(".*") if p.is_dir() and p.name in (".ci", ".github")}


def readme_paths() -> list[tuple[int, str]]:
    """(line, path) for every word in README.md's code (spans and fenced blocks) that starts with
    one of the repository's top-level folders."""
    roots = top_level_dirs()
    found = []
    for n, line, fenced in prose_lines(README):
        chunks = [line] if fenced else [m.group(2) for m in CODE_SPAN.finditer(line)]
        for chunk in chunks:
            for word in re.split(r"[\s=]+", chunk):
                word = word.strip("\"'(),;`")
                if "/" in word and word.split("/", 1)[0] in roots:
                    found.append((n, word))
    return found


def exists(path: Path) -> bool:
    return any(path.parent.glob(path.name)) if any(c in path.name for c in "*?[") else path.exists()


def test_readme_names_only_paths_that_exist():
    paths = readme_paths()
    assert any(p.startswith("tools/") for _, p in paths), "no repository path found: the pattern broke"
    missing = [f"README.md:{n}: `{p}`" for n, p in paths if not exists(ROOT / p)]
    assert not missing, "README.md names paths the repository does not have:\n" + "\n".join(missing)


def relative_links(path: Path) -> list[tuple[int, str]]:
    return [(n, m.group(1)) for n, line, fenced in prose_lines(path) if not fenced
            for m in LINK.finditer(CODE_SPAN.sub("", line))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", m.group(1), re.I)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_a_heading(doc):
    broken = []
    for n, target in relative_links(doc):
        file, _, fragment = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        where = f"{doc.relative_to(ROOT)}:{n}: ({target})"
        if not dest.exists():
            broken.append(f"{where}: no such file")
        elif fragment and dest.suffix == ".md" and fragment.lower() not in anchors(dest):
            broken.append(f"{where}: {dest.name} has no heading with that anchor")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_anchor_follows_githubs_rule():
    assert anchor("Serving (`rtp bench serve`)") == "serving-rtp-bench-serve"
    assert anchor("EPLB's KV lending (`tools/bench_eplb_kv.py`)") == "eplbs-kv-lending-toolsbench_eplb_kvpy"
    assert anchor("Prefill/decode disaggregation") == "prefilldecode-disaggregation"
    assert anchor("Speed × fidelity, [in full](x.md)") == "speed--fidelity-in-full"
