"""tools/bench_offline.py runs end to end at the tiniest settings (figures are not asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository


def native_bf16() -> bool:
    """tools/_common.py's test: whether oneDNN multiplies bf16 natively here."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_bench_offline_tiny_prints_a_json_last_line(default_gguf):
    cmd = [sys.executable, str(ROOT / "tools" / "bench_offline.py"), "--quick", "--no-compile",
           "--model", str(default_gguf), "--threads", "1", "--dtypes", "bf16",
           "--requests", "2", "--prompt-lens", "8-16", "--output-lens", "2-4", "--hf-batch-sizes", "2",
           "--single-tokens", "3", "--decode-batch", "4", "--decode-prompt", "8", "--decode-tokens", "3",
           # as many sequences as the decode batch, a step budget over the 32-token single prompt, and a
           # small transformers KV pool: rtp's CPU-graph warm-up and transformers' continuous-batching
           # warm-up capture those sizes, not the full-run defaults (64 sequences, 2048 tokens, 1 GiB)
           "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--kv-cache-bytes", str(32 << 20)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    assert set(figures) >= {"config", "rtp", "transformers_generate", "transformers_continuous", "vllm",
                            "ratios", "targets_met"}
    assert "error" not in figures["rtp"]["bf16"]
    assert figures["rtp"]["bf16"]["lengths_ok"]
    assert "not_run" in figures["vllm"]
    # the oneDNN reference for the batch target: SmolLM2's 30 layers x 4 linears + the LM head (where oneDNN
    # multiplies bf16 natively: its bf16 reorder needs AVX-512 or AMX)
    if native_bf16():
        ref = figures["rtp"]["bf16"]["batch_decode"]["onednn_linears"]
        assert ref["rows"] == 4 and ref["matrices"] == 121 and ref["ms"] > 0
    # the FLOP figure counts every parameter of SmolLM2-135M (134.5 M, the tied LM head once), not only those
    # left dense beside the GGUF blocks (a quantized layer's weight stays on the meta device, data_ptr 0)
    assert 134e6 < figures["rtp"]["bf16"]["batch_decode"]["params"] < 135e6
    assert "Throughput" in out  # the table for people comes first
