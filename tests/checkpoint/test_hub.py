"""Hugging Face IDs -> local paths (rtp/checkpoint/hub.py), offline: no machine here reaches the
Hub, so each test writes a Hub cache as huggingface_hub lays it out (models--ORG--NAME/ with
refs/, blobs/ and snapshots/ of symlinks) in a temporary HF_HUB_CACHE, from real checkpoints,
and resolves IDs from it with HF_HUB_OFFLINE=1 through huggingface_hub itself."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from tiny_models import make_dense, write_word_tokenizer

from rtp import LLM, SamplingParams
from rtp.checkpoint.hub import ModelNotFound, resolve_model
from rtp.cli import build_parser


def hub_cache(cache: Path, repo: str, files: dict[str, Path | bytes], ref: str = "main") -> Path:
    """Put `files` (name in the repository -> a file to link, or bytes) in the cache as one commit
    of `repo` that `ref` points at; the snapshot directory."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    commit = hashlib.sha1(f"{repo}@{ref}".encode()).hexdigest()
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    for name, source in files.items():
        data = source if isinstance(source, bytes) else None
        digest = hashlib.sha256(data if data is not None else str(Path(source).resolve()).encode()).hexdigest()
        blob = folder / "blobs" / digest
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            if data is not None:
                blob.write_bytes(data)
            else:
                os.symlink(Path(source).resolve(), blob)  # the real checkpoint, not a copy
        link = folder / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    return folder / "snapshots" / commit


@pytest.fixture
def offline(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    make_dense("llama", path)
    write_word_tokenizer(path, 160)
    return path


def test_a_repository_resolves_to_its_snapshot_and_serves_as_the_directory_does(offline, tiny_dir):
    files = {p.name: p for p in tiny_dir.iterdir() if p.is_file()}
    files["README.md"] = b"not wanted"
    snapshot = hub_cache(offline, "acme/tiny-llama", files)
    assert resolve_model("acme/tiny-llama") == snapshot
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [[5, 9, 13, 2, 77]]
    by_id = LLM(model="acme/tiny-llama", dtype="float32", compile=False, max_model_len=64).generate(prompt, params)
    by_path = LLM(model=str(tiny_dir), dtype="float32", compile=False, max_model_len=64).generate(prompt, params)
    assert by_id[0].outputs[0].token_ids == by_path[0].outputs[0].token_ids


def test_revisions(offline, tiny_dir):
    hub_cache(offline, "acme/tiny-llama", {"config.json": tiny_dir / "config.json"})
    tagged = hub_cache(offline, "acme/tiny-llama", {"config.json": tiny_dir / "config.json",
                                                    "model.safetensors": tiny_dir / "model.safetensors"}, ref="v2")
    assert resolve_model("acme/tiny-llama", revision="v2") == tagged
    with pytest.raises(ModelNotFound, match="v9"):
        resolve_model("acme/tiny-llama", revision="v9")


def test_a_gguf_repository_picks_a_file_by_type_name_or_default(offline, default_gguf):
    names = ["smol.Q4_K_M.gguf", "smol.Q4_K.gguf", "smol-q8_0.gguf", "smol.Q4_1.gguf", "fp/smol.F16.gguf"]
    snapshot = hub_cache(offline, "acme/smol-GGUF", {n: default_gguf for n in names})
    assert resolve_model("acme/smol-GGUF") == snapshot / "smol.Q4_K_M.gguf"  # llama.cpp's default
    assert resolve_model("acme/smol-GGUF:q4_k") == snapshot / "smol.Q4_K.gguf"  # not Q4_K_M
    assert resolve_model("acme/smol-GGUF:Q8_0") == snapshot / "smol-q8_0.gguf"
    assert resolve_model("acme/smol-GGUF/fp/smol.F16.gguf") == snapshot / "fp/smol.F16.gguf"
    with pytest.raises(ModelNotFound, match="no GGUF of a Q6_K file.*smol.Q4_1.gguf"):
        resolve_model("acme/smol-GGUF:Q6_K")
    llm = LLM(model="acme/smol-GGUF:Q4_1", compile=False, max_model_len=64)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))
    assert out[0].outputs[0].text


def test_a_split_gguf_brings_all_its_parts(offline):
    parts = {f"big-0000{k}-of-00003.gguf": f"part {k}".encode() for k in (1, 2, 3)}
    snapshot = hub_cache(offline, "acme/big-GGUF", {**parts, "big-Q8_0-00001-of-00002.gguf": b"lonely"})
    assert resolve_model("acme/big-GGUF/big-00001-of-00003.gguf") == snapshot / "big-00001-of-00003.gguf"
    with pytest.raises(ModelNotFound, match="lacks its parts big-Q8_0-00002-of-00002.gguf"):
        resolve_model("acme/big-GGUF:Q8_0")


def test_what_is_missing_is_said_with_where_it_was_looked_for(offline):
    with pytest.raises(ModelNotFound, match=f"acme/nothing is not in the Hugging Face cache {offline}.*OFFLINE"):
        resolve_model("acme/nothing")
    hub_cache(offline, "acme/readme-only", {"README.md": b"hello"})
    with pytest.raises(ModelNotFound, match="has no config.json or a .gguf file; it has: README.md"):
        resolve_model("acme/readme-only")
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model("/no/such/model.gguf")


def test_a_local_path_wins_and_serve_takes_the_model_positionally(tmp_path, monkeypatch):
    local = tmp_path / "acme" / "tiny"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("acme/tiny") == Path("acme/tiny")  # a directory that exists is not an ID
    args = build_parser().parse_args(["serve", "acme/tiny-llama", "--revision", "v2"])
    assert (args.model_ref, args.revision) == ("acme/tiny-llama", "v2")
