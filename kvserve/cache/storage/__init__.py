"""kvserve.cache.storage: the KV storage layer under the bookkeeping. It owns the tensors: the pool's per-layer
K/V (kv_storage.py) and their quantized formats (kv_quant.py, key_staging.py), the block copies between the
pool and flat payloads (block_copier.py), and the tiers below the pool (tier.py: the protocol; host_tier.py,
disk_tier.py; kv_tiers.py: the coordinator the engine calls with the cache manager's transfer orders)."""
