"""Tier 2: KV blocks on disk, one checksummed file per block, shared by every process that opens the
same directory with the same model.

    DIR/<fingerprint>/<key[:2]>/<key>.kv   header, the block's token ids, its bytes (BlockCopier's row)

A file is written to a temporary name beside its final one and renamed, so a reader (this
process or another) sees a whole file or none; a process killed while writing leaves only a
temporary, which the next start removes once its writer is gone. Every read checks the header
(magic, version, fingerprint, key, the block's own token ids, size) and a CRC-32 over tokens and
bytes: a flipped, truncated or foreign file is counted, removed and never served. A write that
fails (disk full, directory read-only or gone) turns writing off with one warning; requests never
see it. The budget is kept per process for the files it knows (written, found at start, read):
the least recently used go first.

Reads run on the tier's reader thread, writes on its writer thread (component.py); `contains` on
the engine thread. The index is shared under a lock.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
from isal.isal_zlib import crc32  # zlib's CRC-32, several times faster (pyproject.toml)

log = logging.getLogger("rtp.kv_tiers")

MAGIC = b"RTPKVBLK"
VERSION = 1
# magic, version, block size, fingerprint, key, payload bytes, CRC-32 of the tokens and the payload
_HEADER = struct.Struct("<8sII16s16sQI")
_STALE_TEMP_SECONDS = 3600.0  # another host's temporary file older than this is an abandoned write


class DiskTier:
    def __init__(self, root: str | os.PathLike, seed: bytes, budget_bytes: int, block_bytes: int, block_size: int):
        self.root = Path(root)
        self.dir = self.root / seed.hex()[:32]
        self.seed, self.budget, self.block_bytes, self.block_size = seed, budget_bytes, block_bytes, block_size
        self.file_bytes = _HEADER.size + 4 * block_size + block_bytes
        self.lock = threading.Lock()
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, least recently used first
        self.bytes = 0
        self.writable = True
        self.files_written = self.bytes_written = self.write_errors = 0
        self.corrupt = self.read_errors = self.evicted = self.temps_removed = 0
        self._host, self._pid, self._temps = socket.gethostname().replace(".", "_"), os.getpid(), 0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as e:
            self._off(e)
        self.id = f"{self._directory_id()}/{self.dir.name}"

    def _directory_id(self) -> str:
        """The directory's identity, the same in every process and on every host that opens it (the
        FlexLB router groups the workers sharing a disk tier by it): a random name the first process
        writes into ROOT/.rtp-kv-id (linked into place whole, so no reader sees it half written); its
        real path where none can be written."""
        path = self.root / ".rtp-kv-id"
        try:
            if not path.exists():
                temp = self.root / f".rtp-kv-id.{self._host}.{self._pid}.tmp"
                temp.write_text(os.urandom(16).hex())
                try:
                    os.link(temp, path)
                except FileExistsError:
                    pass
                finally:
                    temp.unlink(missing_ok=True)
            return path.read_text().strip()
        except OSError:
            return str(self.root.resolve())

    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.dir / h[:2] / f"{h}.kv"

    # -- the engine thread ------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """Whether block `key` is on disk: known here, or written by another process sharing the directory."""
        with self.lock:
            if key in self.index:
                return True
        try:
            size = os.stat(self.path(key)).st_size
        except OSError:
            return False
        with self.lock:
            if key not in self.index:
                self.index[key] = size
                self.bytes += size
        return True

    def known(self, key: bytes) -> bool:
        with self.lock:
            return key in self.index

    # -- the reader thread ------------------------------------------------------------------------

    def prefetch(self, keys: list[bytes]) -> None:
        """Ask the kernel to start reading these blocks' files now, all of them: the drive gets them
        as one deep queue instead of one file after another's latency (measured on a virtual disk:
        see docs/kv_tiers.md)."""
        for key in keys:
            try:
                fd = os.open(self.path(key), os.O_RDONLY)
            except OSError:
                return
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)

    def read(self, key: bytes, tokens: np.ndarray, out: np.ndarray) -> bool:
        """Block `key` (whose own token ids are `tokens`) into `out` (a host row); False, `out` then
        undefined, when the file is gone or is not that block whole."""
        path = self.path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                head = f.read(_HEADER.size + 4 * self.block_size)
                n = f.readinto(memoryview(out)) if len(head) == _HEADER.size + 4 * self.block_size else 0
                extra = f.read(1)
        except FileNotFoundError:
            self._forget(key)
            return False
        except OSError as e:
            self.read_errors += 1
            log.debug("KV disk tier: reading %s failed: %r", path, e)
            return False
        why = self._check(key, tokens, head, n, extra, out)
        if why is not None:
            self.corrupt += 1
            log.warning("KV disk tier: skipped %s (%s); the tokens are recomputed", path, why)
            self._forget(key)
            try:
                path.unlink()
            except OSError:
                pass
            return False
        with self.lock:
            if key in self.index:
                self.index.move_to_end(key)
        try:
            os.utime(path)  # recency survives a restart (the next start orders its index by mtime)
        except OSError:
            pass
        return True

    def _check(self, key: bytes, tokens: np.ndarray, head: bytes, n: int, extra: bytes, out: np.ndarray) -> str | None:
        if len(head) < _HEADER.size + 4 * self.block_size or n != self.block_bytes or extra:
            return "truncated or of another size"
        magic, version, block_size, seed, stored_key, size, crc = _HEADER.unpack_from(head)
        if magic != MAGIC or version != VERSION:
            return "not an rtp KV block file of this version"
        if seed != self.seed or block_size != self.block_size or size != self.block_bytes:
            return "written for another model, KV layout or block size"
        body = head[_HEADER.size:]
        if stored_key != key or body != tokens.astype(np.int32).tobytes():
            return "another block's"
        if crc32(out, crc32(body)) != crc:
            return "checksum mismatch"
        return None

    def _forget(self, key: bytes) -> None:
        with self.lock:
            size = self.index.pop(key, None)
            if size is not None:
                self.bytes -= size

    # -- the writer thread ------------------------------------------------------------------------

    def write(self, key: bytes, tokens: np.ndarray, payload: np.ndarray) -> bool:
        """Block `key` to its file (nothing when it is there already or writing is off)."""
        if not self.writable or self.known(key):
            return False
        path = self.path(key)
        body = tokens.astype(np.int32).tobytes()
        head = _HEADER.pack(MAGIC, VERSION, self.block_size, self.seed, key, self.block_bytes,
                            crc32(payload, crc32(body)))
        self._temps += 1
        temp = path.parent / f".{key.hex()}.{self._host}.{self._pid}.{self._temps}.tmp"
        try:
            path.parent.mkdir(exist_ok=True)
            with open(temp, "wb") as f:  # buffered: a short write (a disk filling up) is retried or raises
                f.write(head + body)
                f.write(memoryview(payload))
            os.replace(temp, path)
        except OSError as e:
            try:
                temp.unlink()
            except OSError:
                pass
            if isinstance(e, FileNotFoundError) and path.parent.exists():
                return False  # another process removed our temporary as abandoned: skip this block
            self._off(e)
            return False
        self.files_written += 1
        self.bytes_written += self.file_bytes
        with self.lock:
            if key not in self.index:
                self.index[key] = self.file_bytes
                self.bytes += self.file_bytes
            self._evict()
        return True

    def _evict(self) -> None:
        while self.bytes > self.budget and self.index:
            key, size = self.index.popitem(last=False)
            self.bytes -= size
            self.evicted += 1
            try:
                self.path(key).unlink()
            except OSError:
                pass

    def _off(self, error: OSError) -> None:
        self.write_errors += 1
        if self.writable:
            self.writable = False
            reason = {errno.ENOSPC: "the disk is full", errno.EROFS: "the file system is read-only",
                      errno.EACCES: "permission denied", errno.EDQUOT: "the disk quota is exhausted"}.get(
                error.errno, repr(error))
            log.warning("KV disk tier: writing to %s failed (%s); the disk tier stores nothing more in this "
                        "process (its files are still read)", self.dir, reason)

    # -- start-up ---------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Index the files already here (oldest first, by mtime) and remove the temporaries of writes
        that will never finish."""
        found = []
        now = time.time()
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                name = entry.name
                try:
                    st = entry.stat()
                except OSError:
                    continue
                if name.endswith(".tmp"):
                    if self._abandoned(name, now - st.st_mtime):
                        try:
                            os.unlink(entry.path)
                            self.temps_removed += 1
                        except OSError:
                            pass
                elif name.endswith(".kv"):
                    try:
                        key = bytes.fromhex(name[:-3])
                    except ValueError:
                        continue
                    found.append((st.st_mtime, key, st.st_size))
        found.sort()
        for _, key, size in found:
            self.index[key] = size
            self.bytes += size
        with self.lock:
            self._evict()

    def _abandoned(self, name: str, age: float) -> bool:
        """A temporary `.<key>.<host>.<pid>.<n>.tmp` whose writer is gone (a process of this host that
        no longer runs, or this very process in an earlier life), or another host's left for long."""
        parts = name.split(".")
        if len(parts) != 6:
            return age > _STALE_TEMP_SECONDS
        host, pid = parts[2], parts[3]
        if host != self._host:
            return age > _STALE_TEMP_SECONDS
        try:
            pid = int(pid)
        except ValueError:
            return True
        if pid == self._pid:
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def stats(self) -> dict:
        with self.lock:
            files, size = len(self.index), self.bytes
        return {"files": files, "bytes": size, "budget_bytes": self.budget, "writable": self.writable,
                "files_written": self.files_written, "bytes_written": self.bytes_written,
                "write_errors": self.write_errors, "corrupt_skipped": self.corrupt, "read_errors": self.read_errors,
                "evicted": self.evicted, "temps_removed": self.temps_removed}
