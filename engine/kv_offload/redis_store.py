"""The shared tier: sealed blobs in the deployment's Redis, so a tenant's offloaded prefixes
follow it to whichever replica serves it next.

Layout, under ``<namespace>:kv:<layout digest>:`` (one model's cache layout per prefix, so two
models never mix):

- ``b:<hash hex>``: the blob (``engine.kv_offload.cipher``: nonce, ciphertext, tag);
- ``own``: hash of block hash -> owner tag; ``lru:<tag>``: the tag's blobs by last use (a
  shared clock, ``clock``); ``bytes``: tag -> bytes; ``used``: total bytes.

An owner tag is a keyed digest of the tenant id (not the id), so the store's operator sees
which blobs belong together, not whose they are, and nothing of what they hold without the
tenant's salt. A write is one transaction: a plain ``SET`` of the blob and a Lua script that
indexes it and applies the fair eviction rule of ``DiskStore`` (the least recently used blob of
the owner holding the most bytes per unit of weight goes first), atomic across replicas; a
read is a plain ``GET`` beside a script that refreshes the use order.

Redis going away never fails a request: every call has a short timeout, and after a failure
the tier is down (reads miss, writes are dropped, logged once a minute); the engine thread's
lookups do not try it again, the writer and loader threads do every ``retry_after_s``, and the
first success brings it back. One Redis (or a primary with replicas) serves a deployment whose offloaded
working set fits its memory; past tens of GiB, or for retention longer than its memory holds,
an object-store tier is the next backend (docs/prefix-caching.md).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from engine.kv_offload.tier import ThrottledWarning, TierUsage, fair_shares, owner_tag

logger = logging.getLogger(__name__)

_KNOWN_KEYS = 1 << 16  # block hashes this process saw in the store (its local index)

# Forgets blob h of owner o from the index (its recorded size leaves the counters);
# returns the bytes used after. Shared by the scripts below.
_UNINDEX = """
local function unindex(p, h, o)
  local sz = tonumber(redis.call('HGET', p .. 'sz', h) or redis.call('STRLEN', p .. 'b:' .. h))
  redis.call('DEL', p .. 'b:' .. h)
  redis.call('HDEL', p .. 'own', h)
  redis.call('HDEL', p .. 'sz', h)
  redis.call('ZREM', p .. 'lru:' .. o, h)
  if redis.call('HINCRBY', p .. 'bytes', o, -sz) <= 0 then redis.call('HDEL', p .. 'bytes', o) end
  return redis.call('DECRBY', p .. 'used', sz)
end
"""

# The index of one blob the same transaction SETs (the blob itself never passes through Lua:
# a 700 KiB string copied into and out of Lua costs Redis 3x a plain SET). ARGV: prefix, hash
# hex, owner tag, capacity, the blob's size, the owner's weight, floor and cap (fractions of
# the capacity; '' for none). Evicts until it fits, by ``DiskStore``'s rule: the least
# recently used blob of the owner furthest over its share (over its cap first, then the most
# bytes per unit of weight, never one at or under its floor while another can give); returns
# the blobs evicted.
_PUT_INDEX = _UNINDEX + """
local p, h, owner, cap, size = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
redis.call('HSET', p .. 'w', owner, ARGV[6])
for i, k in ipairs({'lo', 'hi'}) do
  if ARGV[6 + i] == '' then redis.call('HDEL', p .. k, owner)
  else redis.call('HSET', p .. k, owner, ARGV[6 + i]) end
end
local o = redis.call('HGET', p .. 'own', h)
if o then
  redis.call('ZADD', p .. 'lru:' .. o, redis.call('INCR', p .. 'clock'), h)
  return 0
end
local used = tonumber(redis.call('GET', p .. 'used') or '0')
local evicted = 0
while used + size > cap do
  local all = redis.call('HGETALL', p .. 'bytes')
  local victim, best_class, best = nil, -1, -1
  for i = 1, #all, 2 do
    local b = tonumber(all[i + 1])
    if all[i] == owner then b = b + size end
    local w = tonumber(redis.call('HGET', p .. 'w', all[i]) or '1')
    local lo = tonumber(redis.call('HGET', p .. 'lo', all[i]) or '-1')
    local hi = tonumber(redis.call('HGET', p .. 'hi', all[i]) or '-1')
    local class = ((hi >= 0 and b > hi * cap) and 2 or 0) + ((lo < 0 or b > lo * cap) and 1 or 0)
    if class > best_class or (class == best_class and b / w > best) then
      victim, best_class, best = all[i], class, b / w
    end
  end
  if victim == nil then
    redis.call('SET', p .. 'used', 0)
    break
  end
  local oldest = redis.call('ZRANGE', p .. 'lru:' .. victim, 0, 0)
  if #oldest == 0 then
    redis.call('HDEL', p .. 'bytes', victim)
  else
    used = unindex(p, oldest[1], victim)
    evicted = evicted + 1
  end
end
redis.call('HSET', p .. 'own', h, owner)
redis.call('HSET', p .. 'sz', h, size)
redis.call('ZADD', p .. 'lru:' .. owner, redis.call('INCR', p .. 'clock'), h)
redis.call('HINCRBY', p .. 'bytes', owner, size)
redis.call('INCRBY', p .. 'used', size)
return evicted
"""


# ARGV: prefix, hash hex: the blob (read by a plain GET beside it) is now the most recently
# used of its owner's; a blob Redis itself evicted (a maxmemory policy other than noeviction)
# leaves the index, so the budget's counters heal.
_TOUCH = _UNINDEX + """
local p, h = ARGV[1], ARGV[2]
local o = redis.call('HGET', p .. 'own', h)
if not o then return 0 end
if redis.call('EXISTS', p .. 'b:' .. h) == 0 then
  unindex(p, h, o)
  return 0
end
redis.call('ZADD', p .. 'lru:' .. o, redis.call('INCR', p .. 'clock'), h)
return 1
"""

# ARGV: prefix, hash hex: one blob deleted.
_DELETE = _UNINDEX + """
local p, h = ARGV[1], ARGV[2]
local o = redis.call('HGET', p .. 'own', h)
if not o then return 0 end
unindex(p, h, o)
return 1
"""

# ARGV: prefix, then owner tags (none: every owner). Returns blobs deleted.
_DELETE_OWNERS = """
local p = ARGV[1]
local owners = {}
if #ARGV == 1 then
  local all = redis.call('HKEYS', p .. 'bytes')
  for i = 1, #all do owners[#owners + 1] = all[i] end
else
  for i = 2, #ARGV do owners[#owners + 1] = ARGV[i] end
end
local n = 0
for _, o in ipairs(owners) do
  local keys = redis.call('ZRANGE', p .. 'lru:' .. o, 0, -1)
  for _, h in ipairs(keys) do
    redis.call('DEL', p .. 'b:' .. h)
    redis.call('HDEL', p .. 'own', h)
    redis.call('HDEL', p .. 'sz', h)
  end
  n = n + #keys
  redis.call('DEL', p .. 'lru:' .. o)
  for _, k in ipairs({'w', 'lo', 'hi'}) do redis.call('HDEL', p .. k, o) end
  local b = tonumber(redis.call('HGET', p .. 'bytes', o) or '0')
  redis.call('HDEL', p .. 'bytes', o)
  redis.call('DECRBY', p .. 'used', b)
end
if #ARGV == 1 then redis.call('SET', p .. 'used', 0) end
return n
"""

_FAILED = object()  # a call that did not reach Redis


class RedisStore:
    """Blobs in Redis under a byte budget shared fairly by tenants, across replicas.

    Args:
        url: ``redis://host:port/db`` (may hold a password: never logged).
        capacity_bytes: the budget of this deployment's blobs in Redis (every replica should
            give the same; the last writer's applies to its own writes).
        namespace: the deployment's key prefix (``--redis-namespace``).
        layout: the cache layout (``BlockCipher.layout``): blobs of another layout are
            another key space.
        retry_after_s: seconds the tier stays down after a failure.
        client: a ``redis.Redis`` to use instead of connecting to ``url`` (tests).
        owner_key: the secret key of the owner tags (``tier.owner_tag``; every replica must
            give the same: served, it is derived from the master key). None: a key derived
            from ``namespace``, which groups a tenant's blobs without hiding whose they are.
    """

    name = "redis"
    local = False
    write_through = True  # a replica may die with the block in its pool

    def __init__(self, url: str | None, capacity_bytes: int, namespace: str, layout: bytes,
                 retry_after_s: float = 30.0, client=None, owner_key: bytes | None = None
                 ) -> None:
        if client is None:
            import redis  # the optional extra: saltserve[redis]

            # 1 MiB socket reads: a block's blob is read in one or two (64 KiB reads make a
            # GET of 700 KiB three times slower)
            client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0,
                                          health_check_interval=30, socket_read_size=1 << 20)
        self._redis = client
        self.capacity_bytes = capacity_bytes
        digest = hashlib.sha256(layout).hexdigest()[:16]
        self._prefix = f"{namespace}:kv:{digest}:"
        self._tag_key = owner_key or hashlib.sha256(
            b"saltserve/kv-owner/" + namespace.encode()).digest()
        self._scripts = {name: client.register_script(src) for name, src in (
            ("put_index", _PUT_INDEX), ("touch", _TOUCH), ("delete", _DELETE), ("delete_owners", _DELETE_OWNERS))}
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        self._retry_after_s = retry_after_s
        # Down: the engine thread's calls (query, usage) never try; the writer and loader
        # threads retry after ``retry_after_s`` and bring the tier back.
        self._down = False
        self._down_until = 0.0
        self._warn = ThrottledWarning(logger, "KV redis tier: ")
        self.evicted = 0
        self.errors = 0
        self._shares: dict[str, tuple] = {}  # owner -> (weight, floor, cap) sent with writes
        # Owner deletions (tags; None: every owner) that failed while the tier was down, run
        # before the next write or read once it is back.
        self._pending_deletes: list[str | None] = []
        self.deferred_deleted = 0  # blobs those deletions removed once Redis was back
        self._check_policy()

    def _check_policy(self) -> None:
        """Warns when Redis may evict the tier's keys itself: the tier's budget should decide
        (its counters heal as reads find blobs gone, but its fair rule no longer holds)."""
        try:
            policy = self._redis.config_get("maxmemory-policy").get("maxmemory-policy")
        except Exception:  # noqa: BLE001 - CONFIG disabled (managed Redis) or unreachable
            return
        if policy and policy != "noeviction" and not str(policy).startswith("volatile"):
            logger.warning("KV redis tier: Redis evicts keys itself (maxmemory-policy %s); set "
                           "noeviction or a volatile-* policy so that the tier's fair budget "
                           "(--kv-offload-redis-size) decides", policy)

    # -- helpers ------------------------------------------------------------------------------
    def tag(self, owner: str) -> str:
        """The opaque tag stored for ``owner`` (the same on every replica)."""
        return owner_tag(self._tag_key, owner)

    @property
    def up(self) -> bool:
        return not self._down

    def _call(self, script: str, *args, default=None, pipe: tuple = ()):
        """Runs a script (the writer and loader threads), in a transaction with the commands
        ``pipe`` holds (``(method, *args)`` each), returning the script's result, or with
        ``pipe`` the list of every result. While the tier is down, it only tries once
        ``retry_after_s`` has passed since the last failure; a success brings it back, a
        failure marks it down and returns ``default``."""
        if self._down and time.monotonic() < self._down_until:
            return default
        try:
            if pipe:
                p = self._redis.pipeline(transaction=True)
                self._scripts[script](args=[self._prefix, *args], client=p)
                for method, *margs in pipe:
                    getattr(p, method)(*margs)
                result = p.execute()
            else:
                result = self._scripts[script](args=[self._prefix, *args])
        except Exception as e:  # noqa: BLE001 - redis.RedisError, OSError: the tier is down
            self._failed(e)
            return default
        if self._down:
            self._down = False
            logger.warning("KV redis tier: reachable again")
        return result

    def _failed(self, error: Exception) -> None:
        with self._lock:
            self.errors += 1
            self._down = True
            self._down_until = time.monotonic() + self._retry_after_s
            self._warn("unreachable (%s); off for %.0f s, serving goes on",
                       type(error).__name__, self._retry_after_s)

    def _remember(self, key: bytes, present: bool) -> None:
        with self._lock:
            if present:
                self._known[key] = None
                self._known.move_to_end(key)
                if len(self._known) > _KNOWN_KEYS:
                    self._known.popitem(last=False)
            else:
                self._known.pop(key, None)

    # -- OffloadTier --------------------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return key in self._known

    def query(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys or not self.up:
            return [False] * len(keys)
        try:
            pipe = self._redis.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._prefix + "b:" + k.hex())
            found = [bool(n) for n in pipe.execute()]
        except Exception as e:  # noqa: BLE001 - the tier is down, a miss
            self._failed(e)
            return [False] * len(keys)
        for k, present in zip(keys, found, strict=True):
            self._remember(k, present)
        return found

    def set_share(self, owner: str, weight: int, min_fraction: float | None = None,
                  max_fraction: float | None = None) -> None:
        """The owner's weight, floor and cap (stored with its next write, for every
        replica's evictions)."""
        self._shares[owner] = (weight, min_fraction, max_fraction)

    def _run_pending_deletes(self) -> None:
        """Runs the owner deletions that failed while the tier was down (the writer and
        loader threads, before their own call), in order; stops at the first failure."""
        while self._pending_deletes:
            with self._lock:
                if not self._pending_deletes:
                    return
                tag = self._pending_deletes.pop(0)
            n = self._call("delete_owners", *(() if tag is None else (tag,)), default=_FAILED)
            if n is _FAILED:
                with self._lock:
                    self._pending_deletes.insert(0, tag)
                return
            self._forget_known()
            self.deferred_deleted += n

    def put(self, key: bytes, blob: bytes, owner: str) -> bool:
        if len(blob) > self.capacity_bytes:
            return False
        self._run_pending_deletes()
        weight, low, high = self._shares.get(owner, (1, None, None))
        done = self._call("put_index", key.hex(), self.tag(owner), self.capacity_bytes,
                          len(blob), weight, "" if low is None else repr(low),
                          "" if high is None else repr(high),
                          pipe=(("set", self._prefix + "b:" + key.hex(), blob),))
        if done is None:
            return False
        self.evicted += done[0]
        self._remember(key, True)
        return True

    def prefetch(self, keys: Sequence[bytes]) -> None:
        pass  # each get is one round trip; the loader reads blocks in order

    def get(self, key: bytes) -> bytes | None:
        self._run_pending_deletes()
        done = self._call("touch", key.hex(), pipe=(("get", self._prefix + "b:" + key.hex()),))
        blob = None if done is None else done[1]
        self._remember(key, blob is not None)
        return blob

    def delete(self, key: bytes) -> None:
        self._call("delete", key.hex())
        self._remember(key, False)

    def delete_owner(self, owner: str) -> int:
        """Deletes the owner's blobs (written by any replica); while the tier is down the
        deletion waits for it to come back (``_run_pending_deletes``). Returns how many."""
        return self._delete_owners(self.tag(owner))

    def delete_all(self) -> int:
        return self._delete_owners(None)

    def _delete_owners(self, tag: str | None) -> int:
        self._forget_known()
        n = self._call("delete_owners", *(() if tag is None else (tag,)), default=_FAILED)
        self._forget_known()  # (a query during the call may have marked doomed blobs present)
        if n is _FAILED:
            with self._lock:
                if tag is None:
                    self._pending_deletes = [None]
                elif None not in self._pending_deletes and tag not in self._pending_deletes:
                    self._pending_deletes.append(tag)
            return 0
        return n

    def _forget_known(self) -> None:
        with self._lock:
            self._known.clear()  # which of them were the owner's is not known here

    def usage(self) -> TierUsage:
        """Occupancy read from Redis (owners are tags); zeros while the tier is down."""
        if not self.up:
            return TierUsage(self.capacity_bytes, 0, 0, self.evicted, {}, up=False)
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.get(self._prefix + "used")
            pipe.hlen(self._prefix + "own")
            for k in ("bytes", "w", "lo", "hi"):
                pipe.hgetall(self._prefix + k)
            used, blobs, *maps = pipe.execute()
        except Exception as e:  # noqa: BLE001 - the tier is down
            self._failed(e)
            return TierUsage(self.capacity_bytes, 0, 0, self.evicted, {}, up=False)
        owners, weights, lows, highs = ({k.decode(): float(v) for k, v in m.items()}
                                        for m in maps)
        shares = {o: (weights.get(o, 1.0), lows.get(o), highs.get(o)) for o in owners}
        return TierUsage(self.capacity_bytes, int(used or 0), int(blobs), self.evicted,
                         {o: int(n) for o, n in owners.items()},
                         owner_share_bytes=fair_shares(self.capacity_bytes, owners, shares))
