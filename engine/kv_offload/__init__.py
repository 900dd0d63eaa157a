"""KV blocks beyond the pool: a local disk tier behind the block pool, sealed per tenant
(``cipher``), with a fair byte budget (``disk``), written off the step and loaded before the
step that needs them (``manager``). docs/prefix-caching.md describes the design."""

from engine.kv_offload.cipher import BlockCipher
from engine.kv_offload.disk import DiskStore
from engine.kv_offload.manager import KVOffloader, OffloadStats

__all__ = ["BlockCipher", "DiskStore", "KVOffloader", "OffloadStats"]
