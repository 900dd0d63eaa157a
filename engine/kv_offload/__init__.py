"""KV blocks beyond the pool: tiers behind the block pool (host memory on CUDA, local disk,
the shared Redis), sealed per tenant (``cipher``), each with a fair byte budget (``disk``,
``redis_store``), written off the step and loaded while the request waits (``manager``).
docs/prefix-caching.md describes the design."""

from engine.kv_offload.cipher import BlockCipher
from engine.kv_offload.disk import DiskStore, FairBudget, MemoryStore
from engine.kv_offload.manager import KVOffloader, LoadJob, OffloadStats, TierStats
from engine.kv_offload.redis_store import RedisStore
from engine.kv_offload.tier import OffloadTier, TierUsage

__all__ = ["BlockCipher", "DiskStore", "FairBudget", "KVOffloader", "LoadJob", "MemoryStore",
           "OffloadStats", "OffloadTier", "RedisStore", "TierStats", "TierUsage"]
