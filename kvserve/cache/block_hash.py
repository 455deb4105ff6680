"""Chained content hashes of full KV blocks, the keys of the prefix cache.

A block's hash is H(parent block's hash || its token ids || extra keys). Because the parent's hash is folded in,
equal hashes mean equal *prefixes*, not just equal blocks, so a hit lookup walks a request's hashes from the
first block and stops at the first miss.

Encoding is fixed and explicit (little-endian int64 per token, length-prefixed extra keys) and never uses
Python's `hash()`, so hashes are identical across processes and restarts: an offload tier keyed by block hash
stays valid, and two engines on the same model agree on what a prefix is.

Only full blocks are hashed; a partially filled block's content is still changing.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

import xxhash

BlockHash = bytes
HashFunction = Callable[[bytes], bytes]

HASH_ALGOS = ("xxh3_128", "sha256")

# The parent of every first block. A fixed constant (not a per-process random seed) so hashes are stable across
# restarts; tenant isolation comes from the cache salt, not from this seed.
_SEED_MATERIAL = b"kvserve/prefix-cache/v1"

# Tag bytes keep extra keys unambiguous if more kinds (LoRA id, multimodal hashes) are added later.
_CACHE_SALT_TAG = b"S"


def get_hash_function(hash_algo: str) -> HashFunction:
    """`xxh3_128` (fast, 128-bit, default) or `sha256` (cryptographic, for untrusted multi-tenant setups)."""
    if hash_algo == "xxh3_128":
        return xxhash.xxh3_128_digest
    if hash_algo == "sha256":
        return _sha256_digest
    raise ValueError(f"unknown prefix caching hash algorithm {hash_algo!r}; choose one of {', '.join(HASH_ALGOS)}")


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def encode_cache_salt(cache_salt: str | None) -> bytes:
    """Extra-key bytes for a request's first block (empty when the request has no salt)."""
    if not cache_salt:
        return b""
    salt_bytes = cache_salt.encode("utf-8")
    return _CACHE_SALT_TAG + struct.pack("<I", len(salt_bytes)) + salt_bytes


class BlockHasher:
    """Hashes the full blocks of token sequences for one block size and one hash algorithm."""

    __slots__ = ("block_size", "hash_algo", "seed_hash", "_hash_fn", "_token_struct")

    def __init__(self, block_size: int, hash_algo: str = "xxh3_128") -> None:
        assert block_size > 0
        self.block_size = block_size
        self.hash_algo = hash_algo
        self._hash_fn = get_hash_function(hash_algo)
        # One precompiled Struct per block size: packing is the hot part of hashing.
        self._token_struct = struct.Struct(f"<{block_size}q")
        self.seed_hash: BlockHash = self._hash_fn(_SEED_MATERIAL)

    def hash_block(self, parent_hash: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
        # parent_hash and the packed tokens have fixed lengths, so the concatenation is unambiguous.
        return self._hash_fn(parent_hash + self._token_struct.pack(*token_ids) + extra_keys)

    def extend_block_hashes(
        self,
        block_hashes: list[BlockHash],
        token_ids: Sequence[int],
        cache_salt: str | None,
        num_blocks: int,
    ) -> None:
        """Append hashes to `block_hashes` (in place) until it covers the first `num_blocks` full blocks.

        Idempotent and incremental: blocks already hashed are not rehashed, so a request's hashes are computed
        once over its lifetime (prefill chunks, decode, re-admission after preemption).
        """
        block_size = self.block_size
        assert num_blocks * block_size <= len(token_ids), "only full blocks are hashed"
        block_index = len(block_hashes)
        if block_index >= num_blocks:
            return
        parent_hash = block_hashes[-1] if block_hashes else self.seed_hash
        while block_index < num_blocks:
            start = block_index * block_size
            # The salt goes into the first block only: the chain carries it into every later block.
            extra_keys = encode_cache_salt(cache_salt) if block_index == 0 else b""
            parent_hash = self.hash_block(parent_hash, token_ids[start : start + block_size], extra_keys)
            block_hashes.append(parent_hash)
            block_index += 1
