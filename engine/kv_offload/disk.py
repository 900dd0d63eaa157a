"""The local disk tier: one file per KV block, named by its chained block hash.

- Files are ``<root>/<hash[:2]>/<hash>.kv`` (hex), mode 0600, written to a temporary name and
  renamed into place (``os.replace``), so a write cut short (kill -9, a full disk) never leaves a
  file under a block's name; leftovers of such writes are removed at start. A name is the block
  hash, which reveals nothing without the tenant's salt; the content is the sealed blob
  (``engine.kv_offload.cipher``).
- Capacity (``capacity_bytes``) is shared by tenants as the pool shares its blocks: when a write
  does not fit, the least recently used blob of the tenant holding the most bytes goes first,
  so a tenant flooding unique prompts pays with its own blobs while another tenant is under
  its share. Blobs found at start have no known tenant until a request opens one (they are
  ``UNCLAIMED``, a tenant of their own for the rule above).
- At start the index (hash -> size, owner, use order) is rebuilt from the directory listing in
  file-modification order (no blob is read).

Thread safety: the index changes under the store's lock, and file reads and writes happen
outside it, so the engine thread's lookups and loads never wait for the writer thread's disk
writes.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

logger = logging.getLogger(__name__)

UNCLAIMED = "\x00unclaimed"  # the owner of blobs found at start (no tenant id is this string)
_SUFFIX = ".kv"
_TMP = ".tmp"


class DiskStore:
    """Blobs on local disk under a byte budget shared fairly by tenants.

    Args:
        root: the directory (created 0700 if missing).
        capacity_bytes: the budget; blobs are evicted to stay within it.

    Raises:
        OSError: ``root`` cannot be created or listed.
    """

    def __init__(self, root: str | os.PathLike, capacity_bytes: int) -> None:
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._size: dict[bytes, int] = {}
        self._owner: dict[bytes, str] = {}
        self._lru: dict[str, OrderedDict[bytes, None]] = {}
        self._bytes: dict[str, int] = {}
        self.used_bytes = 0
        self.evicted = 0
        self._scan()

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

    def _add(self, key: bytes, size: int, owner: str) -> None:
        self._size[key] = size
        self._owner[key] = owner
        self._lru.setdefault(owner, OrderedDict())[key] = None
        self._bytes[owner] = self._bytes.get(owner, 0) + size
        self.used_bytes += size

    def _remove(self, key: bytes) -> None:
        self._remove_index_only(key)
        self._path(key).unlink(missing_ok=True)

    def _fit(self, incoming: int, owner: str | None) -> None:
        """Evicts until ``incoming`` more bytes fit: the LRU blob of the owner holding the most
        bytes (``owner`` counted with ``incoming``)."""
        while self.used_bytes + incoming > self.capacity_bytes and self._lru:
            victim = max(self._lru, key=lambda o: self._bytes[o] + (incoming if o == owner
                                                                     else 0))
            self._remove(next(iter(self._lru[victim])))
            self.evicted += 1

    # -- blobs --------------------------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return key in self._size  # one dict lookup (atomic): the engine thread never waits

    def put(self, key: bytes, blob: bytes, owner: str) -> bool:
        """Stores ``blob`` under ``key`` for ``owner`` (nothing when already stored). Returns
        False when it could not be written (the error is logged; nothing is indexed). The file
        is written outside the lock (one writer thread calls this)."""
        with self._lock:
            if key in self._size:
                return True
            if len(blob) > self.capacity_bytes:
                return False
            self._fit(len(blob), owner)
        path = self._path(key)
        tmp = path.with_name(path.name + _TMP)
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
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
            logger.warning("KV disk tier: a write failed (%s); the block is not offloaded",
                           type(e).__name__)
            return False
        with self._lock:
            if key not in self._size:
                self._add(key, len(blob), owner)
        return True

    def get(self, key: bytes) -> bytes | None:
        """The blob under ``key`` (marked most recently used), or None."""
        with self._lock:
            if key not in self._size:
                return None
            self._lru[self._owner[key]].move_to_end(key)
        try:
            return self._path(key).read_bytes()
        except OSError:
            self.delete(key)
            return None

    def claim(self, key: bytes, owner: str) -> None:
        """Records ``owner`` for a blob found at start (its tenant opened it)."""
        with self._lock:
            if self._owner.get(key) == UNCLAIMED:
                size = self._size[key]
                self._remove_index_only(key)
                self._add(key, size, owner)

    def _remove_index_only(self, key: bytes) -> None:
        owner = self._owner.pop(key)
        size = self._size.pop(key)
        del self._lru[owner][key]
        self._bytes[owner] -= size
        if not self._lru[owner]:
            del self._lru[owner], self._bytes[owner]
        self.used_bytes -= size

    def delete(self, key: bytes) -> None:
        with self._lock:
            if key in self._size:
                self._remove(key)

    def delete_owner(self, owner: str) -> int:
        """Deletes every blob of ``owner``; returns how many."""
        with self._lock:
            keys = list(self._lru.get(owner, ()))
            for key in keys:
                self._remove(key)
            return len(keys)

    def delete_all(self) -> int:
        """Deletes every blob; returns how many."""
        with self._lock:
            keys = list(self._size)
            for key in keys:
                self._remove(key)
            return len(keys)

    def owner_bytes(self) -> dict[str, int]:
        with self._lock:
            return dict(self._bytes)

    def __len__(self) -> int:
        with self._lock:
            return len(self._size)
