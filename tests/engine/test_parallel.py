"""Tensor parallelism on torch.distributed (gloo, 2 processes on this CPU).

Each rank loads its shard of a real checkpoint through the real loader and runs the
whole runtime on the same requests (the scheduler is deterministic, so both ranks
plan the same steps); the logits every rank sees after the vocabulary all-gather
must equal transformers' logits as closely as the single-process model's do. The ranks are
spawned by tests/ranks.py, shared with the expert-parallel and DeepSeek-V3 tests.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from ranks import run_ranks, run_tensor_parallel
from tiny_models import DENSE, hf_reference, make_dense, run_rtp, write_word_tokenizer

import rtp.distributed as dist
from rtp.checkpoint.loader import LoadOptions, load_model
from rtp.engine.tensor_parallel import threads_per_rank


@pytest.mark.parametrize("kind", ["llama", "qwen2-bias", "qwen3-qknorm"])
def test_tp2_logits_match_transformers(kind, tmp_path):
    """tp=2 shards q/kv heads, the MLP and the vocabulary (Qwen2: qkv bias and tied
    embeddings; Qwen3: q/k norm); every rank's gathered logits stay within 1e-4."""
    path, hf = make_dense(kind, tmp_path / "ckpt")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 160, n).tolist() for n in (5, 23, 40)]
    refs = hf_reference(hf, prompts)
    single, _ = run_rtp(path, prompts, refs)
    worst = run_tensor_parallel(path, prompts, refs, tmp_path)
    assert single < 1e-4 and max(worst) < 1e-4, (single, worst)


def test_vocabulary_must_split_evenly(monkeypatch):
    from rtp.models.layers import VocabParallelEmbedding

    monkeypatch.setattr(dist, "_TP_SIZE", 2)
    with pytest.raises(ValueError, match="does not split"):
        VocabParallelEmbedding(161, 8)


def test_heads_must_split_evenly(monkeypatch):
    """SmolLM2-135M (9 heads, 3 kv heads) cannot run at tp=2: a clear error, not a wrong model."""
    from rtp.models.layers import QKVParallelLinear

    monkeypatch.setattr(dist, "_TP_SIZE", 2)
    with pytest.raises(ValueError, match="9 attention heads and 3 kv heads do not split over 2"):
        QKVParallelLinear(576, 64, 9, 3, bias=False)
    QKVParallelLinear(64, 16, 4, 1, bias=False)  # one kv head: replicated on both ranks


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_tp_on_a_model_whose_heads_do_not_split_is_one_clear_line(default_gguf, command):
    """Checked before any rank starts: the one error line, and no follower's traceback under it."""
    import subprocess
    import sys

    args = ["--prompt", "hi"] if command == "generate" else ["--port", "0"]
    out = subprocess.run([sys.executable, "-m", "rtp", command, "--model", str(default_gguf), "--tp", "2", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "9 attention heads and 3 kv heads do not split over 2" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout, out.stderr


def test_bad_rank_is_refused():
    with pytest.raises(ValueError, match="not a rank"):
        dist.init_tensor_parallel(2, 2)
    assert dist.tp_size() == 1


def test_engine_tp2_spawns_followers_and_generates_what_tp1_does(tmp_path):
    """LLM(tensor_parallel_size=2): rank 0 here, a follower process spawned; rank 0 broadcasts
    each step's plan. Greedy tokens equal the single-process engine's; shutdown stops the
    follower."""
    from rtp import LLM, SamplingParams

    path, _ = make_dense("qwen2-bias", tmp_path / "ckpt")
    write_word_tokenizer(path, DENSE["vocab_size"])
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 160, n).tolist() for n in (7, 30, 12)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="float32", compile=False, max_model_len=128, kv_cache_memory=1 << 22)
    want = [o.outputs[0].token_ids for o in LLM(model=str(path), **kw).generate(prompts, params)]
    llm = LLM(model=str(path), tensor_parallel_size=2, **kw)
    try:
        assert dist.tp_size() == 2 and len(llm.engine._followers) == 1
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        got_single = llm.generate(prompts[:1], params)[0].outputs[0].token_ids
    finally:
        llm.engine.shutdown()
    assert got == want and got_single == want[0]
    assert dist.tp_size() == 1 and not llm.engine._followers[0].is_alive()


def _spawned_children(pid: int) -> list[int]:
    """Processes started by `pid` through multiprocessing's spawn (its followers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _tp2_server(tmp_path):
    """`rtp serve --tp 2` (starting) on a tiny random Llama checkpoint."""
    from servers import Server

    path, _ = make_dense("llama", tmp_path / "ckpt")
    write_word_tokenizer(path, DENSE["vocab_size"])
    return path, Server("--model", str(path), "--tp", "2", "--dtype", "float32", "--max-model-len", "128",
                        "--kv-cache-memory", "4MiB")


def test_serve_tp2_answers_then_exits_nonzero_when_a_rank_dies(tmp_path):
    import httpx

    path, server = _tp2_server(tmp_path)
    try:
        server.wait_ready(120)
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": str(path), "prompt": "t5 t6 t7", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["text"].split()) == 6
        followers = _spawned_children(server.proc.pid)
        assert len(followers) == 1
        os.kill(followers[0], signal.SIGKILL)
        assert server.proc.wait(timeout=30) == 1
        assert "tensor-parallel" in server.output()
    finally:
        server.stop()


def test_serve_tp2_sigterm_stops_the_followers_and_exits_0(tmp_path):
    _, server = _tp2_server(tmp_path)
    try:
        server.wait_ready(120)
        followers = _spawned_children(server.proc.pid)
        assert len(followers) == 1
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        assert _state(followers[0]) in (None, "Z")  # gone (or a zombie the server never reaped)
    finally:
        server.stop()


def _zero_tensor_data(path: Path) -> None:
    """Keep a safetensors file's header, zero every tensor's bytes."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[start:] = bytes(len(data) - start)
    path.write_bytes(bytes(data))


def _load_rank(rank: int, init: str, size: int, paths):
    full = load_model(paths[0], torch.float32, torch.device("cpu"))[0].state_dict()  # one rank: the whole model
    dist.init_tensor_parallel(size, rank, backend="gloo", init_method=init, timeout_s=60)
    # rank 1's copy of the checkpoint has all-zero data: only rank 0's reads may reach the weights
    shared = load_model(paths[rank], torch.float32, torch.device("cpu"))[0].state_dict()
    own = load_model(paths[0], torch.float32, torch.device("cpu"), LoadOptions(broadcast=False))[0].state_dict()
    same = sorted(shared) == sorted(own) and all(torch.equal(shared[n], own[n]) for n in own)
    vocab = full["model.embed_tokens.weight"].shape[0] // size
    o_in = full["model.layers.0.self_attn.o_proj.weight"].shape[1] // size
    shards = (torch.equal(shared["model.embed_tokens.weight"], full["model.embed_tokens.weight"][rank * vocab:][:vocab])
              and torch.equal(shared["model.layers.0.self_attn.o_proj.weight"],
                              full["model.layers.0.self_attn.o_proj.weight"][:, rank * o_in:][:, :o_in])
              and torch.equal(shared["model.norm.weight"], full["model.norm.weight"]))
    return same, shards


def test_tp2_loading_reads_once_and_broadcasts_each_rank_its_shard(tmp_path):
    """With two ranks rank 0 reads the checkpoint and broadcasts every tensor: rank 1, given a
    copy whose tensor bytes are all zero, still ends up with exactly the shards it would have
    read itself from the real file, and each shard equals its slice of the tp=1 weights."""
    import shutil

    path, _ = make_dense("llama", tmp_path / "ckpt")
    zeroed = tmp_path / "zeroed"
    shutil.copytree(path, zeroed)
    _zero_tensor_data(zeroed / "model.safetensors")
    assert run_ranks(_load_rank, 2, [path, zeroed], tmp_path=tmp_path) == [(True, True), (True, True)]


_LEAVE = """
import os, sys
from rtp import LLM, SamplingParams
threads = lambda: len(os.listdir("/proc/self/task"))
alone = threads()
llm = LLM(model=sys.argv[1], tensor_parallel_size=2, dtype="float32", compile=False, max_model_len=128,
          kv_cache_memory=1 << 22)
out = llm.generate([[3, 17, 5, 99, 42]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
during = threads()
llm.engine.shutdown()
print(len(out[0].outputs[0].token_ids), alone, during, threads())
"""


def test_shutdown_joins_the_groups_threads(tmp_path):
    """After shutdown no thread of the process group is left: one that outlived it once
    aborted a rank's exit under torchrun ("terminate called without an active exception",
    about 1 run in 20) or hung it, when a gloo worker dropped its last tensor needing the GIL
    the exiting interpreter held. funcol's eager wrappers had kept the group alive past
    destroy_process_group."""
    import subprocess
    import sys

    path, _ = make_dense("llama", tmp_path / "ckpt")
    write_word_tokenizer(path, DENSE["vocab_size"])
    run = subprocess.run([sys.executable, "-c", _LEAVE, str(path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    tokens, alone, during, after = map(int, run.stdout.split())
    assert tokens == 12 and during > alone and after == alone, (alone, during, after)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("nodes", [1, 2], ids=["torchrun-1-node", "torchrun-2-nodes"])
def test_torchrun_tp2_generates_what_one_process_does(nodes, tmp_path):
    """`torchrun ... -m rtp generate --tp 2`: on one node (2 ranks), and on two "nodes" of one
    rank each that meet at a rendezvous address the way hosts do (both on loopback here:
    RANK counts across nodes, LOCAL_RANK starts at 0 on each). Rank 0 prints the text,
    which equals a single process's; the follower prints nothing and exits 0."""
    import subprocess
    import sys

    path, _ = make_dense("llama", tmp_path / "ckpt")
    write_word_tokenizer(path, DENSE["vocab_size"])
    args = ["-m", "rtp", "generate", "--model", str(path), "--prompt", "w3 w17 w5 w99 w42", "--max-tokens", "12",
            "--ignore-eos", "--dtype", "float32", "--no-compile", "--max-model-len", "128"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env)
    assert single.returncode == 0, single.stderr
    port = _free_port()
    per_node = 2 // nodes
    launch = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={per_node}",
              "--master-addr=127.0.0.1", f"--master-port={port}"]
    procs = [subprocess.Popen([*launch, f"--node-rank={n}", *args, "--tp", "2"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for n in range(nodes)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("torchrun did not finish in 300 s: " + "".join(p.communicate()[1][-2000:] for p in procs))
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    text = "".join(out for out, _ in outs)
    assert text.strip() and text == single.stdout


def test_threads_per_rank_shares_the_cores_unless_told(monkeypatch):
    monkeypatch.delenv("RTP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert threads_per_rank(1) == 8 and threads_per_rank(2) == 4 and threads_per_rank(16) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun: 4 of the 8 ranks on this host
    assert threads_per_rank(8) == 2
    monkeypatch.setenv("RTP_NUM_THREADS", "3")
    assert threads_per_rank(8) == 3 and threads_per_rank(1) == 3
    for bad in ("two", "0", "-1"):
        monkeypatch.setenv("RTP_NUM_THREADS", bad)
        with pytest.raises(ValueError, match="RTP_NUM_THREADS must be a whole number"):
            threads_per_rank(1)
