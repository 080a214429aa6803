"""The benchmark tools keep working (figures are not asserted: timing belongs in benchmarks)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rtp.kernels import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]  # the repository


def test_bench_runtime_quick_prints_a_json_last_line():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_runtime.py"), "--quick"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    assert set(figures) >= {"scheduler_step_us", "radix", "allocator", "targets_met"}
    assert figures["radix"]["rtp_prompts_per_s"] > 0
    assert "Scheduler" in out and "Radix cache" in out  # the table for people comes first


def test_cli_help_and_info():
    out = subprocess.run([sys.executable, "-m", "rtp", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "info" in out
    info = json.loads(subprocess.run([sys.executable, "-m", "rtp", "info"], capture_output=True,
                                     text=True, check=True).stdout)
    assert info["runtime"].endswith(".so")
    kernels = info["cpu_kernels"]
    flags = set(kernels["cpu_flags"])
    assert kernels["active"] == ({"avx2", "fma", "f16c"} <= flags)  # the lowest ISA path
    want = ("amx" if kernels["amx"] else "avx512bf16") if "avx512_bf16" in flags else "avx2"
    assert kernels["isa"] == (want if kernels["active"] else None)
    assert kernels["amx"] <= ("amx_tile" in kernels["cpu_flags"]) and info["threads"] >= 1
    off = json.loads(subprocess.run([sys.executable, "-m", "rtp", "info"], capture_output=True, text=True, check=True,
                                    env={**os.environ, "RTP_CPU_KERNELS": "0"}).stdout)
    assert off["cpu_kernels"]["active"] is False and off["cpu_kernels"]["amx"] is False
    if kernels["active"]:  # RTP_CPU_ISA selects a lower path
        low = json.loads(subprocess.run([sys.executable, "-m", "rtp", "info"], capture_output=True, text=True,
                                        check=True, env={**os.environ, "RTP_CPU_ISA": "avx2"}).stdout)
        assert low["cpu_kernels"]["isa"] == "avx2" and low["cpu_kernels"]["ops_without_a_variant"] == [
            "linear_tiles", "linear_q4_k", "moe_experts", "linear_lanes"]


def test_bench_eplb_small_trace_prints_a_json_last_line():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_eplb.py"), "--layers", "3", "--experts", "32",
                          "--ranks", "4", "--tokens", "4000", "--real-run-prompts", "4"],
                         capture_output=True, text=True, check=True, timeout=180)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    naive, static, eplb = (result["results"][k]["max_min_mean"] for k in ("naive", "static", "eplb"))
    assert eplb <= static <= naive
    assert 0 < result["results"]["eplb"]["replica_memory_share"] <= 0.15
    real = result["real_run"]  # the small DeepSeek-V3 through the runtime, EPLB's placement applied
    assert real["eplb_output_unchanged"]
    assert real["results"]["eplb"]["max_min_mean"] < real["results"]["naive"]["max_min_mean"]


def test_bench_eplb_kv_prints_what_dropped_replicas_lend():
    """The test Mixtral's shape (tests/engine/test_eplb_engine.py): 2 layers x 4 spare slots of
    21 pages lend 84 blocks."""
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_eplb_kv.py"), "--layers", "2", "--experts", "8",
                          "--spare", "4", "--hidden", "64", "--moe-inter", "112", "--kv-heads", "2", "--head-dim", "16",
                          "--dtype", "fp32"], capture_output=True, text=True, check=True, timeout=120).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["slot_bytes_released"] == figures["slot_bytes"] == 86016
    assert figures["kv_blocks_lent"] == 84 and figures["layer_bytes_released"] == 4 * 86016


@pytest.mark.skipif(not cpu_kernels.tiles_available(), reason="needs a CPU with AVX-512 BF16 (CPU graphs)")
def test_bench_decode_step_times_every_kernel_of_a_replayed_step(default_gguf):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_decode_step.py"), "--rows", "3", "--context", "20",
                          "--repeats", "2", "--threads", "1"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["rows"] == 3 and res["calls"] > 100 and res["replay_ms"] > 0
    kernels = {k["kernel"]: k for k in res["kernels"]}
    assert kernels["decode_attention"]["calls"] == 30  # SmolLM2's 30 layers
    assert sum(k["calls"] for k in res["kernels"]) == res["calls"]
    assert any(name.startswith("lm_head") for name in kernels)
    assert 0 < res["step_utilisation"] < 1
    ref = res["onednn_linears"]  # oneDNN over the same 30 x 4 linears + LM head, the same rows
    assert ref["rows"] == 3 and ref["matrices"] == 121 and 0 < ref["utilisation"] < 1


@pytest.mark.skipif(not cpu_kernels.tiles_available(), reason="needs a CPU with AVX-512 BF16 (CPU graphs)")
@pytest.mark.parametrize("rows", [0, 2])
def test_bench_decode_step_times_a_step_with_a_prompt_from_the_step_graph(default_gguf, rows):
    """--prompt: a prefill chunk (no decode rows) or a mixed step, replayed from the step graph; each
    linear counts the rows it multiplies (the LM head: the sampling rows alone)."""
    prompt = 40
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_decode_step.py"), "--rows", str(rows),
                          "--context", "20", "--prompt", str(prompt), "--repeats", "2", "--threads", "1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["prompt"] == prompt and res["replay_ms"] > 0
    assert res["plan"] == {"tokens": rows + prompt, "samples": rows + 1, "decode_rows": rows, "prefill_rows": 1}
    kernels = {k["kernel"]: k for k in res["kernels"]}
    assert kernels["prefill_attention"]["calls"] == 30 and kernels["prefill_attention"]["gflops"] > 0
    assert sum(k["calls"] for k in res["kernels"]) == res["calls"]
    heads = [k for name, k in kernels.items() if name.startswith("lm_head")]
    assert len(heads) == 1 and heads[0]["calls"] == 1  # the sampling rows' one LM head, not both captures
    # every token through the 30 layers' four linears (576-wide SmolLM2), the LM head over the sampling rows
    layer_flop = 2 * (rows + prompt) * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576)
    head_flop = 2 * (rows + 1) * 576 * 49152
    assert res["linear_gflop"] * 1e9 == pytest.approx(30 * layer_flop + head_flop, rel=1e-6)
    assert ("mixed step" if rows else "prefill chunk") in out.stdout


@pytest.mark.skipif(not cpu_kernels.tiles_available(), reason="rtp's CPU kernels are not available here")
def test_bench_decode_attention_times_the_kernel_alone():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_decode_attention.py"), "--shapes", "3x40,2x600",
                          "--layers", "2", "--repeats", "1", "--threads", "1"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert [(r["rows"], r["keys"]) for r in res["decode_attention"]] == [(3, 40), (2, 600)]
    assert all(r["ms_per_layer"] > 0 and r["kv_gb_per_s"] > 0 for r in res["decode_attention"])
    assert "KV GB/s" in out.stdout  # the table for people comes first


def test_bench_quant_times_each_type_and_prints_a_json_last_line(tmp_path, default_gguf):
    out = subprocess.run([sys.executable, "tools/bench_quant.py", "--types", "Q4_K,Q6_K,BF16", "--layers", "1",
                          "--hidden", "256", "--ffn", "512", "--heads", "4", "--kv-heads", "2", "--batch", "2",
                          "--tokens", "3", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {r["type"]: r for r in figures["rows"]}
    assert set(rows) == {"Q4_K", "Q6_K", "BF16"} and rows["BF16"]["one_row_vs_bf16"] == 1.0
    # Q4_K and Q6_K are multiplied from their blocks where rtp's kernels run
    assert (rows["Q4_K"]["packed_layers"] > 0) == (rows["Q6_K"]["packed_layers"] > 0) == cpu_kernels.available()
    assert not list(tmp_path.glob("*.gguf"))  # each model removed once measured


def test_bench_moe_measures_blocks_eager_and_dense_experts_and_prints_a_json_last_line(tmp_path, default_gguf):
    out = subprocess.run([sys.executable, "tools/bench_moe.py", "--layers", "1", "--experts", "8", "--streams", "1,2",
                          "--tokens", "3", "--prefill", "16", "--dir", str(tmp_path)], capture_output=True, text=True,
                         timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {r["engine"]: r for r in figures["rows"]}
    assert set(rows) == {"rtp blocks", "rtp eager", "rtp dense"}
    assert all(r["decode_1_tok_s"] > 0 and r["decode_2_tok_s"] > 0 and r["pp16_tok_s"] > 0 for r in rows.values())
    assert figures["one_stream_bytes"] > 0 and (figures["stream_gbps"] is not None) == cpu_kernels.tiles_available()
    assert "one stream reads" in out.stdout


@pytest.mark.skipif(not cpu_kernels.tiles_available(), reason="needs a CPU with AVX-512 BF16 (the streaming-read kernel)")
def test_bench_roofline_sets_every_shape_against_its_limit(default_gguf):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_roofline.py"), "--rows", "3", "--contexts", "20",
                          "--prefill-tokens", "48", "--repeats", "1", "--kv-cache-gib", "0.1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    shapes = {r["shape"]: r for r in res["shapes"]}
    assert set(shapes) == {"prefill 48", "decode 3 @ 20", "mixed 20 + 2 decode", "decode 2 @ 20", "decode 1 @ 20"}
    assert shapes["prefill 48"]["tokens"] == 48 and shapes["prefill 48"]["decode_rows"] == 0
    mixed = shapes["mixed 20 + 2 decode"]
    assert mixed["decode_rows"] == 2 and mixed["prefill_rows"] == 1 and mixed["tokens"] == 22
    assert shapes["decode 1 @ 20"]["path"] == "CPU graph"
    for r in shapes.values():
        assert r["ms"] > 0 and r["limit_ms"] > 0 and r["bound"] in ("compute", "memory") and r["bound_share"] >= 0.5
        assert r["of_limit"] == pytest.approx(r["limit_ms"] / r["ms"], rel=0.01)
        # the step's limit is its phases' limits added: the linears', then attention's, each at its own bound
        phases = r["phases"]
        assert set(phases) == {"linears", "attention"}
        assert r["limit_ms"] == pytest.approx(sum(p["limit_ms"] for p in phases.values()), abs=0.002)
    limits = res["limits"]
    assert limits["bf16_gflops"] > 0 and all(v > 0 for v in limits["stream_gb_s"].values())
    assert limits["weights_mib"]["parameters"] > 0


@pytest.mark.skipif(not cpu_kernels.tiles_available(), reason="needs a CPU with AVX-512 BF16 (the streaming-read kernel)")
def test_bench_roofline_sets_a_whole_workload_against_its_steps_limits(default_gguf):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_roofline.py"), "--shapes", "none", "--rows", "4",
                          "--workload", "6:20-60:3-7", "--kv-cache-gib", "0.1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["shapes"] == []
    w = res["workload"]
    assert w["requests"] == 6 and 6 * 3 <= w["generated_tokens"] <= 6 * 7 and 6 * 20 <= w["prompt_tokens"] <= 6 * 60
    groups = w["groups"]
    prompt, decode, every = groups["with prompt rows"], groups["decode only"], groups["all forwards"]
    assert prompt["steps"] >= 2 and decode["steps"] >= 2  # 6 prompts, 4 rows at a time; the last tokens alone
    assert every["steps"] == prompt["steps"] + decode["steps"]
    assert every["measured_s"] == pytest.approx(prompt["measured_s"] + decode["measured_s"], abs=0.002)
    assert 0 < every["measured_s"] <= w["wall_s"]  # the wall adds the host's share
    for g in groups.values():
        assert g["limit_s"] > 0 and g["of_limit"] == pytest.approx(g["limit_s"] / g["measured_s"], rel=0.01)
    assert w["generated_tok_s_at_limit"] == pytest.approx(w["generated_tokens"] / every["limit_s"], rel=0.01)
    assert "at the limit" in out.stdout
    by_rows = w["decode_by_rows"]  # the decode-only steps again, by batch size
    assert sum(b["steps"] for b in by_rows.values()) == decode["steps"] and set(by_rows) <= {"1", "2", "3-4"}
    assert sum(b["measured_s"] for b in by_rows.values()) == pytest.approx(decode["measured_s"], abs=0.005)
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_roofline.py"), "--workload", "6:60-20:3-7"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "REQUESTS:PROMPT_LO-PROMPT_HI" in bad.stderr


def test_bench_speculative_runs_both_engines_side_by_side(default_gguf):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_speculative.py"), "--workloads", "summarise",
                          "--max-tokens", "24", "--streams", "2"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {(r["workload"], r["streams"]): r for r in res["rows"]}
    assert set(rows) == {("summarise", 1), ("summarise", 2)}
    alone = rows["summarise", 1]
    assert alone["identical"] and alone["tokens"] > 0 and alone["plain_tok_s"] > 0 and alone["spec_tok_s"] > 0
    assert alone["acceptance_rate"] is not None and 0 < alone["acceptance_rate"] <= 1  # quoting drafts, some kept


def test_bench_startup_times_a_server_from_command_to_health(default_gguf):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_startup.py"), "--rounds", "1", "--model",
                          str(default_gguf), "--serve-args", "--max-num-seqs 2 --max-model-len 256 --kv-cache-memory 32MiB"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    m = res["median"]
    # every phase seen, in order, before /health answered; the process's own CPU time measured
    assert 0 < m["loaded"] <= m["engine ready"] <= m["serving"] <= m["ready_s"] and m["cpu_s"] > 0
    assert "/health answers" in out.stdout


def test_bench_kv_tiers_runs_every_tier_and_a_restart_and_prints_a_json_last_line(tmp_path):
    out = subprocess.run([sys.executable, "tools/bench_kv_tiers.py", "--conversations", "3", "--turns", "2",
                          "--turn-tokens", "300", "--answer-tokens", "4", "--pool-conversations", "1",
                          "--host-gb", "0.2", "--disk-gb", "0.5", "--drive-mib", "16", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {r["config"]: r for r in figures["rows"]}
    assert set(rows) == {"off", "host", "disk"}
    assert rows["host"]["host_tokens"] > 0 and rows["disk"]["disk_tokens"] + rows["disk"]["host_tokens"] > 0
    restart = figures["restart"]
    assert restart["disk_tokens"] > 0 and restart["loads"] == 3 and restart["cold_ttft_p50_s"] > 0
    assert all(r["alone_p50_s"] > 0 for r in rows.values())
    assert figures["drive_read_gbps"] > 0 and "restart:" in out.stdout


@pytest.mark.skipif(cpu_kernels.isa() != "amx" or not cpu_kernels.has_op("linear_lanes"),
                    reason="needs AMX (the tool's AMX-INT8 kernel beside rtp's AMX and lane kernels)")
def test_bench_amx_int8_gives_the_lane_kernels_bits_and_prints_a_json_last_line():
    out = subprocess.run([sys.executable, "tools/bench_amx_int8.py", "--n", "64", "--k", "96", "--rows", "16,48",
                          "--repeats", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["rows"] for r in figures["rows"]] == [16, 48]
    assert all(r["bits_equal_lanes"] and r["us"]["amx_int8"] > 0 for r in figures["rows"])
