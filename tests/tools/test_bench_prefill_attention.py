"""tools/bench_prefill_attention.py keeps working (figures are not asserted: timing belongs in benchmarks)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rtp.kernels import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]  # the repository


@pytest.mark.skipif(not cpu_kernels.tiles_available(), reason="needs a CPU with AVX-512 BF16")
def test_bench_prefill_attention_prints_a_table_and_a_json_last_line():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_prefill_attention.py"), "--tokens", "96",
                          "--chunk", "40", "--repeats", "1"], capture_output=True, text=True, timeout=300,
                         check=True).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    assert [(c["tokens"], c["prompts"]) for c in figures["cases"]] == [(96, 1), (96, 3)]
    assert all(c["new_ms"] > 0 and c["max_abs_diff"] < 0.05 for c in figures["cases"])
    assert "speedup" in out  # the table for people comes first
