"""kvserve.cache: KV block bookkeeping (pool, hashes, block tables, prefix caching). No torch here."""

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
