"""kvserve.cache: KV block bookkeeping (pool, hashes, block tables, prefix caching, the transfer orders for the
tiers, the tiers' counters). Plain Python, no torch (tests/cache/test_cache_layers.py checks it): the tensors,
their formats, the copies and the tiers are the storage layer below, kvserve.cache.storage."""

from kvserve.cache.block_hash import HASH_ALGOS, BlockHash, BlockHasher, get_hash_function
from kvserve.cache.block_pool import BlockPool, FreeBlockQueue, KVBlock, PrefixCacheStats
from kvserve.cache.kv_cache_manager import CacheRequest, KVCacheManager, RequestBlocks

__all__ = [
    "HASH_ALGOS",
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "CacheRequest",
    "FreeBlockQueue",
    "KVBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "RequestBlocks",
    "get_hash_function",
]
