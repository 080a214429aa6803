"""The router is a process of its own: no torch, no engine, up in under a second.

`rtp route --help` and `import rtp.wire` import neither torch nor any rtp.engine module (read
from `python -X importtime`, which lists every module a process imports); a real `rtp route`
on loopback, in front of a stub worker, answers /health in under a second from its start and
imports neither either. The engine imports nothing of rtp.wire (imports run down the tiers).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from servers import ROOT, free_port

from rtp.wire import rpc
from rtp.wire.kv_layout import KVLayout

STARTS = 3  # the fastest of this many starts counts: another process may have had the cores


def imported(argv: list[str]) -> list[str]:
    """The modules a `python -X importtime` run imports (from its stderr)."""
    err = subprocess.run([sys.executable, "-X", "importtime", *argv], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=60, check=True).stderr
    return [line.rsplit("|", 1)[1].strip() for line in err.splitlines() if line.startswith("import time:")]


def heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if m == "torch" or m.startswith(("torch.", "rtp.engine", "rtp.server", "rtp.models",
                                                                 "rtp.kernels"))]


def test_route_help_imports_no_torch_and_no_engine():
    modules = imported(["-m", "rtp", "route", "--help"])
    assert "rtp.cli" in modules and not heavy(modules), heavy(modules)


def test_the_wire_imports_msgspec_alone():
    modules = imported(["-c", "import rtp.wire.rpc, rtp.wire.kv_layout, rtp.wire.error_body"])
    assert "rtp.wire.rpc" in modules and "msgspec" in modules
    assert not heavy(modules) and "numpy" not in modules, modules
    rtp_modules = {m for m in modules if m.startswith("rtp")}
    # the wire and the Base tier under it (SamplingParams and its errors), nothing else of rtp
    assert rtp_modules <= {"rtp", "rtp.wire", "rtp.wire.rpc", "rtp.wire.kv_layout", "rtp.wire.error_body",
                           "rtp.sampling_params", "rtp.errors"}, rtp_modules


def test_the_engine_imports_nothing_of_the_wire_nor_the_server():
    for path in (ROOT / "rtp" / "engine").rglob("*.py"):
        text = path.read_text()
        for package in ("rtp.wire", "rtp.server", "rtp.router", "rtp.http"):
            assert f"import {package}" not in text and f"from {package}" not in text, f"{path} imports {package}"


class _Worker(BaseHTTPRequestHandler):
    """A collocated worker as the master polls it: /health 200, /rpc/stats its load."""

    stats = rpc.encode(rpc.WorkerStats(
        role="collocated", model="stub", block_size=16, total_blocks=64, free_blocks=64, used_blocks=0,
        cached_blocks=0, num_waiting=0, num_running=0, num_reserved=0, queued_prompt_tokens=0,
        prefill_tokens_per_ms=0.0, decode_step_ms=0.0, kv_cache_usage=0.0, kv_layout=KVLayout("float32", [[2, 4]])))

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-type", rpc.CONTENT_TYPE)
        self.send_header("content-length", str(len(self.stats)))
        self.end_headers()
        self.wfile.write(self.stats)


@pytest.fixture(scope="module")
def worker():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Worker)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a running process (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_route(worker: str, model) -> tuple[float, float, list[str]]:
    """Start `rtp route` before the worker; (seconds from the start to its first /health 200, CPU seconds
    it had used by then, the modules it imported)."""
    port = free_port()
    log = tempfile.TemporaryFile("w+")  # not a pipe: the import lines alone would fill one, and block the router
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "rtp", "route", "--collocated", worker,
                             "--port", str(port), "--model", str(model)],
                            stdout=subprocess.DEVNULL, stderr=log, text=True, cwd=ROOT)
    try:
        with httpx.Client(timeout=2.0) as client:
            while True:
                assert proc.poll() is None, f"rtp route exited with {proc.returncode}"
                try:
                    if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.perf_counter() - started < 30, "rtp route did not come up"
                time.sleep(0.002)
        seconds, cpu = time.perf_counter() - started, _cpu_seconds(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.seek(0)
        err = log.read()
        log.close()
    assert proc.returncode == 0, err[-2000:]
    modules = [line.rsplit("|", 1)[1].strip() for line in err.splitlines() if line.startswith("import time:")]
    return seconds, cpu, modules


def test_route_answers_health_within_a_second_of_its_start(worker, default_gguf):
    """In wall-clock time from the process's start, as the issue asks; on a machine whose cores other
    work holds (load average past the core count) in the CPU time the router itself spent, which
    that work cannot inflate (the tokenizer loads once it serves, rtp/router/flexlb.py)."""
    runs = [start_route(worker, default_gguf) for _ in range(STARTS)]
    seconds, cpu, modules = min(runs)
    assert "rtp.router.flexlb" in modules and not heavy(modules), heavy(modules)
    busy = os.getloadavg()[0] > os.cpu_count()
    print(f"rtp route: /health 200 after {seconds:.3f} s, {cpu:.2f} s CPU, {len(modules)} modules "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    assert (cpu if busy else seconds) < 1.0, f"{seconds:.2f} s wall, {cpu:.2f} s CPU"
