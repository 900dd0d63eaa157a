"""The local disk tier: one file per KV block, named by its chained block hash.

- Files are ``<root>/<hash[:2]>/<hash>.kv`` (hex), mode 0600, written to a temporary name and
  renamed into place (``os.replace``), so a write cut short (kill -9, a full disk) never leaves a
  file under a block's name; leftovers of such writes are removed at start. A name is the block
  hash, which reveals nothing without the tenant's salt; the content is the sealed blob
  (``engine.kv_offload.cipher``).
- Capacity (``capacity_bytes``) is shared by tenants as the pool shares its blocks
  (``FairBudget``): a tenant flooding unique prompts pays with its own blobs while another
  tenant is under its share. Blobs found at start have no known tenant until a request opens
  one (they are ``UNCLAIMED``, a tenant of their own for that rule).
- At start the index (hash -> size, owner, use order) is rebuilt from the directory listing in
  file-modification order (no blob is read).

Thread safety: the index changes under the store's lock, and file reads and writes happen
outside it, so the engine thread's lookups and loads never wait for the writer thread's disk
writes.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from engine.kv_offload.tier import ThrottledWarning, TierUsage

logger = logging.getLogger(__name__)

UNCLAIMED = "\x00unclaimed"  # the owner of blobs found at start (no tenant id is this string)
_SUFFIX = ".kv"
_TMP = ".tmp"


class FairBudget:
    """The index of a local tier: blob sizes and owners under a byte budget that owners share
    like the pool's blocks (DESIGN "Multi-tenant capacity").

    When a write does not fit, the least recently used blob of the owner furthest over its
    share goes first: an owner above its cap (``set_share``) first, else the one holding the
    most bytes per unit of weight, never one at or under its floor while another can give.
    Shares follow ``TenantShare``: weight as is; ``min_cache_blocks``/``max_cache_blocks`` as
    the same fraction of this tier's budget as of the pool. Subclasses store the blobs
    (``_drop_blob``).
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._size: dict[bytes, int] = {}
        self._owner: dict[bytes, str] = {}
        self._lru: dict[str, OrderedDict[bytes, None]] = {}
        self._bytes: dict[str, int] = {}
        # owner -> (weight, floor fraction, cap fraction); absent: (1, None, None)
        self._shares: dict[str, tuple[int, float | None, float | None]] = {}
        self.used_bytes = 0
        self.evicted = 0

    def set_share(self, owner: str, weight: int, min_fraction: float | None = None,
                  max_fraction: float | None = None) -> None:
        """The owner's weight, and its floor and cap as fractions of the budget."""
        with self._lock:
            self._shares[owner] = (weight, min_fraction, max_fraction)

    def _drop_blob(self, key: bytes) -> None:
        raise NotImplementedError

    def _add(self, key: bytes, size: int, owner: str) -> None:
        self._size[key] = size
        self._owner[key] = owner
        self._lru.setdefault(owner, OrderedDict())[key] = None
        self._bytes[owner] = self._bytes.get(owner, 0) + size
        self.used_bytes += size

    def _remove(self, key: bytes) -> None:
        self._remove_index_only(key)
        self._drop_blob(key)

    def _remove_index_only(self, key: bytes) -> None:
        owner = self._owner.pop(key)
        size = self._size.pop(key)
        del self._lru[owner][key]
        self._bytes[owner] -= size
        if not self._lru[owner]:
            del self._lru[owner], self._bytes[owner]
        self.used_bytes -= size

    def _victim(self, incoming: int, owner: str | None) -> str:
        """The owner that gives a blob (``owner`` counted with ``incoming`` more bytes)."""
        def rank(o: str) -> tuple:
            held = self._bytes[o] + (incoming if o == owner else 0)
            weight, low, high = self._shares.get(o, (1, None, None))
            over_cap = high is not None and held > high * self.capacity_bytes
            above_floor = low is None or held > low * self.capacity_bytes
            return over_cap, above_floor, held / weight
        return max(self._lru, key=rank)

    def _reserve(self, key: bytes, size: int, owner: str) -> bool | None:
        """Under the lock: True when ``key`` is stored already, False when ``size`` exceeds the
        whole budget, else None after evicting until ``size`` more bytes fit."""
        if key in self._size:
            return True
        if size > self.capacity_bytes:
            return False
        self._fit(size, owner)
        return None

    def _touch(self, key: bytes) -> bool:
        """Under the lock: marks ``key`` most recently used; False when it is not stored."""
        if key not in self._size:
            return False
        self._lru[self._owner[key]].move_to_end(key)
        return True

    def _fit(self, incoming: int, owner: str | None) -> None:
        """Evicts until ``incoming`` more bytes fit."""
        while self.used_bytes + incoming > self.capacity_bytes and self._lru:
            victim = self._victim(incoming, owner)
            self._remove(next(iter(self._lru[victim])))
            self.evicted += 1

    def __contains__(self, key: bytes) -> bool:
        return key in self._size  # one dict lookup (atomic): the engine thread never waits

    def query(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self._size for k in keys]

    def claim(self, key: bytes, owner: str) -> None:
        """Records ``owner`` for a blob found at start (its tenant opened it)."""
        with self._lock:
            if self._owner.get(key) == UNCLAIMED:
                size = self._size[key]
                self._remove_index_only(key)
                self._add(key, size, owner)

    def delete(self, key: bytes) -> None:
        with self._lock:
            if key in self._size:
                self._remove(key)

    def delete_owner(self, owner: str) -> int:
        """Deletes every blob of ``owner``; returns how many."""
        keys = self.forget_owner(owner)
        self.drop_blobs(keys)
        return len(keys)

    def forget_owner(self, owner: str | None) -> list[bytes]:
        """Drops ``owner``'s blobs (every owner's for None) from the index at once (no I/O:
        unreachable from now on) and returns their keys for ``drop_blobs``."""
        with self._lock:
            keys = list(self._size) if owner is None else list(self._lru.get(owner, ()))
            for key in keys:
                self._remove_index_only(key)
            return keys

    def drop_blobs(self, keys: list[bytes]) -> None:
        """Deletes the stored blobs of keys ``forget_owner`` returned (a background job)."""
        for key in keys:
            self._drop_blob(key)

    def delete_all(self) -> int:
        """Deletes every blob; returns how many."""
        keys = self.forget_owner(None)
        self.drop_blobs(keys)
        return len(keys)

    def owner_bytes(self) -> dict[str, int]:
        with self._lock:
            return dict(self._bytes)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self.capacity_bytes, self.used_bytes, len(self._size), self.evicted,
                             dict(self._bytes))

    def __len__(self) -> int:
        with self._lock:
            return len(self._size)


class MemoryStore(FairBudget):
    """Blobs in host memory (the host tier behind a CUDA pool; ``--kv-offload-host-size``).

    Args:
        capacity_bytes: the budget.
    """

    name = "host"
    local = True
    write_through = False

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._blobs: dict[bytes, bytes] = {}
        self._blob_lock = threading.Lock()  # (_drop_blob runs with and without the index lock)

    def _drop_blob(self, key: bytes) -> None:
        with self._blob_lock:
            self._blobs.pop(key, None)

    def put(self, key: bytes, blob: bytes, owner: str) -> bool:
        with self._lock:
            done = self._reserve(key, len(blob), owner)
            if done is not None:
                return done
            with self._blob_lock:
                self._blobs[key] = blob
            self._add(key, len(blob), owner)
        return True

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            if not self._touch(key):
                return None
            with self._blob_lock:
                return self._blobs.get(key)


class DiskStore(FairBudget):
    """Blobs on local disk under a byte budget shared fairly by tenants.

    Args:
        root: the directory (created 0700 if missing).
        capacity_bytes: the budget; blobs are evicted to stay within it.

    A full disk (ENOSPC, EDQUOT) lowers the budget to what the disk held at that moment, so
    the tier goes on within it (logged once a minute); other write errors drop that write.

    Raises:
        OSError: ``root`` cannot be created or listed.
    """

    name = "disk"
    local = True
    write_through = False

    def __init__(self, root: str | os.PathLike, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.write_errors = 0
        self._warn = ThrottledWarning(logger, "KV disk tier: ")
        self._dirs: set[str] = set()  # subdirectories known to exist
        start = time.perf_counter()
        self._scan()
        self.scan_seconds = time.perf_counter() - start  # the start-up index rebuild

    # -- index --------------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / (h + _SUFFIX)

    def _scan(self) -> None:
        found = []
        for sub in self.root.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for f in sub.iterdir():
                if f.name.endswith(_TMP):  # a write cut short
                    f.unlink(missing_ok=True)
                    continue
                if not f.name.endswith(_SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(f.name[:-len(_SUFFIX)])
                    st = f.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self._add(key, size, UNCLAIMED)
        self._fit(0, None)

    def _drop_blob(self, key: bytes) -> None:
        self._path(key).unlink(missing_ok=True)

    # -- blobs --------------------------------------------------------------------------------
    def put(self, key: bytes, blob: bytes, owner: str) -> bool:
        """Stores ``blob`` under ``key`` for ``owner`` (nothing when already stored). Returns
        False when it could not be written (the error is logged; nothing is indexed). The file
        is written outside the lock (one writer thread calls this)."""
        with self._lock:
            done = self._reserve(key, len(blob), owner)
            if done is not None:
                return done
        path = self._path(key)
        tmp = path.with_name(path.name + _TMP)
        try:
            if path.parent.name not in self._dirs:  # (each syscall gives up the GIL once)
                path.parent.mkdir(mode=0o700, exist_ok=True)
                self._dirs.add(path.parent.name)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(blob)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self.write_errors += 1
                full = e.errno in (errno.ENOSPC, errno.EDQUOT)
                if full:  # the disk holds no more than this: stay within it from now on
                    self.capacity_bytes = min(self.capacity_bytes, self.used_bytes)
                    self._fit(0, None)
            cause = errno.errorcode.get(e.errno, type(e).__name__)
            self._warn(f"a write failed ({cause}); the budget is now what the disk holds, "
                       f"{self.capacity_bytes / 2**20:.0f} MiB" if full
                       else f"a write failed ({cause}); the block is not offloaded")
            return False
        with self._lock:
            if key not in self._size:
                self._add(key, len(blob), owner)
        return True

    def get(self, key: bytes) -> bytes | None:
        """The blob under ``key`` (marked most recently used), or None."""
        with self._lock:
            if not self._touch(key):
                return None
        try:
            return self._path(key).read_bytes()
        except OSError:
            self.delete(key)
            return None

