"""`rtp serve` (and `rtp route`) in subprocesses on loopback, for the server tests (tests/server/)
and the tensor-parallel server tests (tests/engine/test_parallel.py).

Server starts one on a free port (readiness is waited for separately, so that several load
at once); metrics and wait_idle read /metrics; FAULTY_SERVE is `rtp serve` with a fault hook:
the detokenizer raises for prompts that contain FAULT_MARK, the way a tokenizer bug would hit
one request.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
FAULT_MARK = "FAULT_INJECTION"
ROOT = Path(__file__).resolve().parent.parent  # the repository: servers run from here

FAULTY_SERVE = f"""
import sys
from rtp.checkpoint import tokenizer

init, add = tokenizer.IncrementalDetokenizer.__init__, tokenizer.IncrementalDetokenizer.add

def faulty_init(self, tok, prompt_ids=(), **kw):
    init(self, tok, prompt_ids, **kw)
    self.faulty = {FAULT_MARK!r} in tok.decode(list(prompt_ids))

def faulty_add(self, token_id):
    if self.faulty:
        raise RuntimeError("injected detokenizer failure")
    return add(self, token_id)

tokenizer.IncrementalDetokenizer.__init__ = faulty_init
tokenizer.IncrementalDetokenizer.add = faulty_add
from rtp.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`rtp serve` (or another subcommand that serves HTTP, such as `rtp route`) on a free port."""

    def __init__(self, *args: str, launcher: list[str] | None = None, command: tuple[str, ...] = ("serve",),
                 threads: int | None = None):
        """threads: RTP_NUM_THREADS for the server, for modules that run several at once on this
        2-core machine (each would otherwise take both cores, and their OpenMP teams spin)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = f"rtp {command[0]}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"rtp-{command[0]}-", suffix=".log", delete=False)
        eager = ("--no-compile",) if command[0] == "serve" else ()
        argv = (launcher or [sys.executable, "-m", "rtp"]) + [*command, "--port", str(self.port), *eager, *args]
        env = {**os.environ, "RTP_NUM_THREADS": str(threads)} if threads else None
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    def wait_ready(self, timeout: float = 180.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        pytest.fail(f"{self.name} did not become ready in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return Path(self.log.name).read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log.name)


def metrics(url: str) -> dict[str, float]:
    """The unlabelled view of /metrics: name -> value (labels dropped, one series per name here)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        m = re.match(r"^(rtp:[a-z0-9_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
    return values


def wait_idle(url: str, free_blocks: float, timeout: float = 60.0) -> dict[str, float]:
    """/metrics once nothing runs or waits and free_blocks are free again (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (m["rtp:num_requests_running"] == 0 and m["rtp:num_requests_waiting"] == 0
                and m["rtp:num_free_blocks"] == free_blocks) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]
