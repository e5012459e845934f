"""The prefix cache's disk tier: full KV blocks kept as files, so a prompt whose prefix was seen
before (in this process or an earlier one) loads its blocks instead of recomputing them.

Pure Python (bytes in, bytes out; the runner turns them into tensors). One file per cached
block, named after its cache key (the chained block hash, kv_cache/manager.py, and its KV group),
in a subdirectory named after a fingerprint of everything that makes a block's bytes mean what
they mean: the cache salt (model file, weight format, tokenizer and chat template), the model
file's size and modification time, the KV dtype, the block size and the KV shape. A file holds
a header (magic, format version, fingerprint, key, payload length) and a BLAKE2b checksum of the
payload; a file that is truncated, corrupt, foreign (another fingerprint or key) or unreadable
is removed and counts as a miss: its tokens are recomputed, never served.

Writes go through one background thread (the step loop only hands over bytes it has already
copied); the directory is kept under its size limit by removing the least recently used files
(reads refresh a file's place, and modification times carry the order across restarts). If
the disk fills up or the directory cannot be written, the tier stops writing, says so in the log
once, and the server goes on serving from memory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from pathlib import Path

from tokios.kv_cache.manager import split_cache_key

logger = logging.getLogger("tokios.kv_cache")

MAGIC = b"TKVB"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sH16s32sQ32s")  # magic, version, fingerprint, key, payload bytes, checksum
SUFFIX = ".kvb"
# Spills waiting for the writer beyond this are dropped (the disk is slower than eviction).
MAX_PENDING_WRITES = 4096


def fingerprint(*parts: object) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(repr(part).encode())
        digest.update(b"\0")
    return digest.digest()


def key_bytes(cache_key: int | tuple[int, int]) -> bytes:
    """A block's cache key (hash, or (group, hash) for KV groups after the first) as 32 bytes."""
    group, block_hash = split_cache_key(cache_key)
    return group.to_bytes(16, "little") + block_hash.to_bytes(16, "little")


class DiskPrefixCache:
    def __init__(self, directory: str | os.PathLike, max_bytes: int, fingerprint_bytes: bytes):
        self.root = Path(directory)
        self.directory = self.root / fingerprint_bytes.hex()
        self.max_bytes = max_bytes
        self._fingerprint = fingerprint_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key bytes -> file bytes, oldest first
        self._total_bytes = 0
        self._pending: queue.Queue = queue.Queue(maxsize=MAX_PENDING_WRITES)
        self._writable = True
        self._warned = False
        self.num_writes = self.num_reads = self.num_rejected = self.num_dropped = 0
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as exc:
            self._disable(f"cannot use {self.directory} ({exc})")
        self._writer = threading.Thread(target=self._write_loop, name="tokios-kv-disk", daemon=True)
        self._writer.start()

    # ---- index -------------------------------------------------------------------------------
    def _scan(self) -> None:
        files = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                stat = path.stat()
                files.append((stat.st_mtime_ns, bytes.fromhex(path.stem), stat.st_size))
            except (OSError, ValueError):
                continue
        for _, key, size in sorted(files):
            self._index[key] = size
            self._total_bytes += size
        self._evict_over_limit()

    def __contains__(self, cache_key) -> bool:
        with self._lock:
            return key_bytes(cache_key) in self._index

    @property
    def num_files(self) -> int:
        return len(self._index)

    @property
    def total_bytes(self) -> int:
        return self._total_bytes

    def _path(self, key: bytes) -> Path:
        return self.directory / f"{key.hex()}{SUFFIX}"

    # ---- reads (the step loop) -----------------------------------------------------------------
    def read(self, cache_key, payload_bytes: int) -> bytes | None:
        """The block's verified payload, or None (a miss; a bad file is removed)."""
        key = key_bytes(cache_key)
        with self._lock:
            if key not in self._index:
                return None
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError as exc:
            self._reject(key, f"cannot read {path.name} ({exc})")
            return None
        problem = self._check(data, key, payload_bytes)
        if problem is not None:
            self._reject(key, f"{path.name} {problem}")
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        try:
            os.utime(path)  # the LRU order survives a restart
        except OSError:
            pass
        self.num_reads += 1
        return data[_HEADER.size:]

    def _check(self, data: bytes, key: bytes, payload_bytes: int) -> str | None:
        if len(data) < _HEADER.size:
            return "is truncated (no header)"
        magic, version, file_fingerprint, file_key, length, checksum = _HEADER.unpack_from(data)
        if magic != MAGIC or version != FORMAT_VERSION:
            return "is not a KV block file of this version"
        if file_fingerprint != self._fingerprint or file_key != key:
            return "belongs to another model, format or block"
        if length != payload_bytes or len(data) != _HEADER.size + length:
            return f"is truncated or the wrong size ({len(data) - _HEADER.size} of {payload_bytes} bytes)"
        if hashlib.blake2b(data[_HEADER.size:], digest_size=32).digest() != checksum:
            return "fails its checksum"
        return None

    def _reject(self, key: bytes, reason: str) -> None:
        self.num_rejected += 1
        logger.warning("KV disk tier: ignoring %s; its tokens are recomputed", reason)
        self._remove(key)

    def _remove(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._total_bytes -= size
        try:
            self._path(key).unlink()
        except OSError:
            pass

    # ---- writes (the writer thread) ----------------------------------------------------------
    def write_async(self, cache_key, payload: bytes) -> None:
        """Queue a block for writing (dropped when the tier cannot write or the queue is full)."""
        if not self._writable:
            return
        key = key_bytes(cache_key)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return
        try:
            self._pending.put_nowait((key, payload))
        except queue.Full:
            self.num_dropped += 1

    def flush(self) -> None:
        """Wait until every queued block is written (or dropped)."""
        self._pending.join()

    def _write_loop(self) -> None:
        while True:
            key, payload = self._pending.get()
            try:
                if self._writable:
                    self._write(key, payload)
            finally:
                self._pending.task_done()

    def _write(self, key: bytes, payload: bytes) -> None:
        size = _HEADER.size + len(payload)
        if size > self.max_bytes:
            return
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, self._fingerprint, key, len(payload),
                              hashlib.blake2b(payload, digest_size=32).digest())
        path = self._path(key)
        partial = path.with_suffix(".partial")
        try:
            with open(partial, "wb") as file:
                file.write(header)
                file.write(payload)
            os.replace(partial, path)  # a reader never sees a half-written file under the real name
        except OSError as exc:
            try:
                partial.unlink()
            except OSError:
                pass
            self._disable(f"cannot write to {self.directory} ({exc})")
            return
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self._total_bytes += size
        self.num_writes += 1
        self._evict_over_limit()

    def _evict_over_limit(self) -> None:
        while True:
            with self._lock:
                if self._total_bytes <= self.max_bytes or not self._index:
                    return
                key = next(iter(self._index))
            self._remove(key)

    def _disable(self, reason: str) -> None:
        self._writable = False
        if not self._warned:  # once: a full disk would say so for every block
            logger.warning("KV disk tier: %s; serving from the memory cache only from now on", reason)
        self._warned = True

    @property
    def is_writable(self) -> bool:
        return self._writable
