"""The local tiers: blobs on local disk (``DiskStore``) or in host memory (``MemoryStore``)
under a byte budget that tenants share like the pool (``FairBudget``).

- Disk files are ``<root>/<owner tag>/<hash>.kv`` (hex), mode 0600 (directories 0700), written
  to a temporary name and renamed into place (``os.replace``), so a write cut short (kill -9,
  a full disk) never leaves a file under a block's name; leftovers of such writes are removed
  at start. The owner tag is a keyed digest of the tenant id (``tier.owner_tag``; the key is
  derived from the deployment's master key) and a name is the block hash: neither reveals
  anything about the tenant without the key and its salt. The content is the sealed blob
  (``engine.kv_offload.cipher``).
- At start the index (hash -> size, owner tag, use order) is rebuilt from the directory
  listing in file-modification order (no blob is read): every blob keeps its owner, so its
  tenant's share, reset and deletion apply to it from the first moment.

Thread safety: the index changes under the store's lock, and file reads and writes happen
outside it, so the engine thread's lookups and loads never wait for the writer thread's disk
writes.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from engine.kv_offload.tier import ThrottledWarning, TierUsage, fair_shares, owner_tag

logger = logging.getLogger(__name__)

_SUFFIX = ".kv"
_TMP = ".tmp"
_DIRECT_ALIGN = 4096  # O_DIRECT: buffer address and length, a multiple of the disk's block
_TAG_DIR = re.compile(r"[0-9a-f]{24}")
_KEY_FILE = "owner.key"  # the owner-tag key of a tier used without one (the offline engine)


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

    def _drop_blob(self, key: bytes, owner: str) -> None:
        raise NotImplementedError

    def _add(self, key: bytes, size: int, owner: str) -> None:
        self._size[key] = size
        self._owner[key] = owner
        self._lru.setdefault(owner, OrderedDict())[key] = None
        self._bytes[owner] = self._bytes.get(owner, 0) + size
        self.used_bytes += size

    def _remove(self, key: bytes) -> None:
        self._drop_blob(key, self._remove_index_only(key))

    def _remove_index_only(self, key: bytes) -> str:
        """Drops ``key`` from the index; returns its owner."""
        owner = self._owner.pop(key)
        size = self._size.pop(key)
        del self._lru[owner][key]
        self._bytes[owner] -= size
        if not self._lru[owner]:
            del self._lru[owner], self._bytes[owner]
        self.used_bytes -= size
        return owner

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

    def delete(self, key: bytes) -> None:
        with self._lock:
            if key in self._size:
                self._remove(key)

    def delete_owner(self, owner: str) -> int:
        """Deletes every blob of ``owner``; returns how many."""
        keys = self.forget_owner(owner)
        self.drop_blobs(keys)
        return len(keys)

    def forget_owner(self, owner: str | None) -> list[tuple[bytes, str]]:
        """Drops ``owner``'s blobs (every owner's for None) from the index at once (no I/O:
        unreachable from now on) and returns them (key, stored owner) for ``drop_blobs``."""
        with self._lock:
            keys = list(self._size) if owner is None else list(self._lru.get(owner, ()))
            return [(key, self._remove_index_only(key)) for key in keys]

    def drop_blobs(self, blobs: list[tuple[bytes, str]]) -> None:
        """Deletes the stored blobs ``forget_owner`` returned (a background job)."""
        for key, owner in blobs:
            self._drop_blob(key, owner)

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
                             dict(self._bytes),
                             owner_share_bytes=fair_shares(self.capacity_bytes, self._lru,
                                                           self._shares))

    def __len__(self) -> int:
        with self._lock:
            return len(self._size)


class MemoryStore(FairBudget):
    """Blobs in host memory (the host tier behind a CUDA pool; ``--kv-offload-host-size``).

    Args:
        capacity_bytes: the budget.
        write_through: take blocks as soon as a step computes them (else when evicted).
    """

    name = "host"
    local = True

    def __init__(self, capacity_bytes: int, write_through: bool = False) -> None:
        super().__init__(capacity_bytes)
        self.write_through = write_through
        self._blobs: dict[bytes, bytes] = {}
        self._blob_lock = threading.Lock()  # (_drop_blob runs with and without the index lock)

    def _drop_blob(self, key: bytes, owner: str) -> None:
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

    def prefetch(self, keys: Sequence[bytes]) -> None:
        pass  # already in memory

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
        owner_key: the secret key of the owner tags (``tier.owner_tag``; at least 16 bytes).
            None: a random key kept in ``<root>/owner.key`` (0600), for an engine without a
            deployment key.
        write_through: take blocks as soon as a step computes them (else when evicted).

    Owners passed in (tenant ids, "" for none) are stored as their tags; ``usage`` and
    ``owner_bytes`` report tags (``tag`` maps an id to its tag). A full disk (ENOSPC, EDQUOT)
    lowers the budget to what the disk held at that moment, so the tier goes on within it
    (logged once a minute); other write errors drop that write.

    Raises:
        OSError: ``root`` cannot be created or listed.
    """

    name = "disk"
    local = True

    def __init__(self, root: str | os.PathLike, capacity_bytes: int,
                 owner_key: bytes | None = None, write_through: bool = False) -> None:
        super().__init__(capacity_bytes)
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.write_through = write_through
        self._tag_key = owner_key or self._key_file()
        self._tags: dict[str, str] = {}
        self.write_errors = 0
        self._warn = ThrottledWarning(logger, "KV disk tier: ")
        self._dirs: set[str] = set()  # owner directories known to exist
        self._direct = hasattr(os, "O_DIRECT")  # until the file system refuses it
        self._local = threading.local()  # the aligned write buffer of each writing thread
        start = time.perf_counter()
        self._scan()
        self.scan_seconds = time.perf_counter() - start  # the start-up index rebuild

    def _key_file(self) -> bytes:
        """The key in ``<root>/owner.key``, created whole (a temporary file linked into
        place: two processes starting together agree on one key, and a crash never leaves a
        short one). Raises OSError for a key file shorter than 32 bytes."""
        path = self.root / _KEY_FILE
        if not path.exists():
            fd, tmp = tempfile.mkstemp(prefix=".owner.key.", dir=self.root)  # mode 0600
            try:
                os.write(fd, secrets.token_bytes(32))
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # atomic; fails if another process linked its key first
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        key = path.read_bytes()
        if len(key) < 32:
            raise OSError(f"{path} holds {len(key)} bytes, not a 32-byte key")
        return key

    def tag(self, owner: str) -> str:
        """The tag stored for ``owner`` (its directory name)."""
        tag = self._tags.get(owner)
        if tag is None:
            tag = self._tags[owner] = owner_tag(self._tag_key, owner)
        return tag

    # -- index --------------------------------------------------------------------------------
    def _path(self, key: bytes, tag: str) -> Path:
        return self.root / tag / (key.hex() + _SUFFIX)

    def _scan(self) -> None:
        found = []
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            if not _TAG_DIR.fullmatch(sub.name):
                if re.fullmatch(r"[0-9a-f]{2}", sub.name):  # blobs of the earlier layout
                    for f in sub.iterdir():
                        if f.name.endswith((_SUFFIX, _TMP)):
                            f.unlink(missing_ok=True)
                    try:
                        sub.rmdir()
                    except OSError:
                        pass
                continue
            self._dirs.add(sub.name)
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
                found.append((st.st_mtime_ns, key, st.st_size, sub.name))
        for _, key, size, tag in sorted(found):
            if key not in self._size:
                self._add(key, size, tag)
        self._fit(0, None)

    def _drop_blob(self, key: bytes, owner: str) -> None:
        self._path(key, owner).unlink(missing_ok=True)

    # -- owners are stored as tags ------------------------------------------------------------
    def set_share(self, owner: str, weight: int, min_fraction: float | None = None,
                  max_fraction: float | None = None) -> None:
        super().set_share(self.tag(owner), weight, min_fraction, max_fraction)

    def forget_owner(self, owner: str | None) -> list[tuple[bytes, str]]:
        return super().forget_owner(None if owner is None else self.tag(owner))

    # -- blobs --------------------------------------------------------------------------------
    def put(self, key: bytes, blob: bytes, owner: str) -> bool:
        """Stores ``blob`` under ``key`` for ``owner`` (nothing when already stored). Returns
        False when it could not be written (the error is logged; nothing is indexed). The file
        is written outside the lock (one writer thread calls this)."""
        tag = self.tag(owner)
        with self._lock:
            done = self._reserve(key, len(blob), tag)
            if done is not None:
                return done
        path = self._path(key, tag)
        tmp = path.with_name(path.name + _TMP)
        try:
            if tag not in self._dirs:  # (each syscall gives up the GIL once)
                path.parent.mkdir(mode=0o700, exist_ok=True)
                self._dirs.add(tag)
            self._write_file(tmp, blob)
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
                self._add(key, len(blob), tag)
        return True

    def _write_file(self, path: Path, blob: bytes) -> None:
        """Writes ``blob`` to a new file at ``path`` (0600). Where the file system takes it
        (``O_DIRECT``: Linux, and not every file system), straight to the disk from an aligned
        buffer, bypassing the page cache: on a 2-core machine, copying every written block into
        the page cache cost the step about 5% of unique-prompt throughput, and a block is read back at most
        once a prompt returns (``prefetch`` then starts its reads together). Raises OSError."""
        if self._direct:
            size = -(-len(blob) // _DIRECT_ALIGN) * _DIRECT_ALIGN
            buf = getattr(self._local, "buf", None)
            if buf is None or len(buf) < size:  # one per writing thread, reused
                buf = self._local.buf = mmap.mmap(-1, size)  # page-aligned
            buf[:len(blob)] = blob
            buf[len(blob):size] = bytes(size - len(blob))  # no earlier blob's bytes in the pad
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._direct = False  # this file system refuses O_DIRECT: the page cache
                logger.info("KV disk tier: %s does not take O_DIRECT; writes go through the "
                            "page cache", self.root)
            else:
                try:
                    if os.write(fd, memoryview(buf)[:size]) != size:
                        raise OSError(errno.ENOSPC, "short write")
                    os.ftruncate(fd, len(blob))
                finally:
                    os.close(fd)
                return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Starts reading the files of ``keys`` it holds, all at once (``POSIX_FADV_WILLNEED``),
        so the ``get`` calls that follow wait for one round of reads, not one per block (a
        1.5k-token prefix from a cold disk: 36 ms instead of 60 ms on the machine in
        docs/benchmarks.md). A hint: errors are ignored."""
        if not hasattr(os, "posix_fadvise"):
            return
        with self._lock:
            paths = [self._path(k, self._owner[k]) for k in keys if k in self._owner]
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)

    def get(self, key: bytes) -> bytes | None:
        """The blob under ``key`` (marked most recently used), or None."""
        with self._lock:
            if not self._touch(key):
                return None
            tag = self._owner[key]
        try:
            return self._path(key, tag).read_bytes()
        except OSError:
            self.delete(key)
            return None
