"""Activation memory of the largest steps the engine can run, measured on CUDA before the KV pool is sized.

Three passes bound a step's transient memory:
- a prefill of the whole token budget (`--max-num-batched-tokens`) continuing the longest past a request can
  have, which gathers that past from the cache, with logits for every token (a request with prompt logprobs
  scores each one);
- a decode step whose portable attention gathers its largest chunk of padded context (`decode_gather_tokens`);
- the sampler over `--max-num-seqs` rows taking its costliest path (penalties, a whole-vocabulary top-p sort,
  logprobs).
The forwards run against a one-block stand-in KV cache (every slot maps to it): attention's transient copies
depend on how many tokens it reads, not on the pool they come from.
"""

from __future__ import annotations

import torch

from kvserve.cache.storage.kv_storage import allocate_kv_storage
from kvserve.config import EngineConfig, SchedulerConfig
from kvserve.engine.request import Request
from kvserve.engine.sampler import sample
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.attention import AttentionMetadata
from kvserve.model.loader import LoadedModel
from kvserve.model.paged_attention import DecodeGroup, PagedAttentionMetadata, PrefillGroup, PrefillSegment

# The portable decode path gathers up to this many padded context tokens per batched token of the step budget:
# per layer, ~8 KB per token for an 8B model (K and V, copied twice), about what a prefill token's activations
# take, so the two forwards' peaks stay of one size.
DECODE_GATHER_TOKENS_PER_BATCHED_TOKEN = 16


def decode_gather_tokens(scheduler: SchedulerConfig) -> int:
    """Padded context tokens the portable decode path gathers per layer at once (see DecodeGroup)."""
    return DECODE_GATHER_TOKENS_PER_BATCHED_TOKEN * scheduler.max_num_batched_tokens


def activation_peak_bytes(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> int:
    """Peak bytes above what is allocated now (the weights) over the profiling passes, on CUDA."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_profiling_passes(config, loaded, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return peak


@torch.inference_mode()
def run_profiling_passes(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The three passes, attention through the portable path (the one CUDA runs); device-agnostic. Returns what
    each produced: the prefill's and the decode's logits, the sampler's tokens."""
    model_cfg = loaded.config
    context_len = min(config.scheduler.max_model_len or model_cfg.max_position_embeddings,
                      model_cfg.max_position_embeddings)
    block_size = config.cache.block_size
    kv_caches = allocate_kv_storage(model_cfg.num_hidden_layers, 1, block_size, loaded.num_kv_heads,
                                    model_cfg.head_dim, loaded.kv_dtype, device, config.cache.kv_cache_dtype)
    return (_prefill_forward(config, loaded, device, kv_caches, context_len),
            _decode_forward(config, loaded, device, kv_caches, context_len), _sampler_pass(config, loaded, device))


def _prefill_forward(config: EngineConfig, loaded: LoadedModel, device: torch.device, kv_caches: list,
                     context_len: int) -> torch.Tensor:
    num_tokens = config.scheduler.max_num_batched_tokens
    num_past = max(0, context_len - num_tokens)
    context_slots = torch.zeros(num_past + num_tokens, dtype=torch.long, device=device) if num_past else None
    paged = PagedAttentionMetadata(
        slot_mapping=torch.zeros(num_tokens, dtype=torch.long, device=device),
        prefill=PrefillGroup([PrefillSegment(0, num_tokens, num_past, context_slots)], kernel_inputs=None),
    )
    positions = (torch.arange(num_tokens, device=device) + num_past) % loaded.config.max_position_embeddings
    return loaded.model(
        torch.zeros(num_tokens, dtype=torch.long, device=device), positions,
        AttentionMetadata(query_start_loc=[0, num_tokens], num_computed_tokens=[num_past], paged=paged),
        kv_caches=kv_caches, logits_indices=torch.arange(num_tokens, device=device),
    )


def _decode_forward(config: EngineConfig, loaded: LoadedModel, device: torch.device, kv_caches: list,
                    context_len: int) -> torch.Tensor:
    # The largest chunk a step can gather: one whole context when it exceeds the bound, otherwise as many
    # sequences as fit, of the length that fills the bound (a shorter max context packs more rows per chunk).
    gather_tokens = decode_gather_tokens(config.scheduler)
    if context_len >= gather_tokens:
        num_seqs, length = 1, context_len
    else:
        num_seqs = min(config.scheduler.max_num_seqs, -(-gather_tokens // context_len))
        length = min(context_len, gather_tokens // num_seqs)
    block_size = config.cache.block_size
    group = DecodeGroup(
        block_tables=torch.zeros(num_seqs, -(-length // block_size), dtype=torch.long, device=device),
        context_lens=torch.full((num_seqs,), length, dtype=torch.long, device=device),
        max_context_len=length,
        block_size=block_size,
        max_gather_tokens=gather_tokens,
    )
    paged = PagedAttentionMetadata(slot_mapping=torch.zeros(num_seqs, dtype=torch.long, device=device), decode=group)
    return loaded.model(
        torch.zeros(num_seqs, dtype=torch.long, device=device),
        torch.full((num_seqs,), length - 1, dtype=torch.long, device=device),
        AttentionMetadata(query_start_loc=list(range(num_seqs + 1)), num_computed_tokens=[length - 1] * num_seqs,
                          paged=paged),
        kv_caches=kv_caches,
    )


def _sampler_pass(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> list:
    """Flat logits (the top-p cut lies past every partial sort) with penalties and top logprobs on every row."""
    num_rows = config.scheduler.max_num_seqs
    params = SamplingParams(temperature=1.0, top_p=0.999, min_p=0.001, repetition_penalty=1.1, presence_penalty=0.1,
                            logprobs=20)
    requests = [Request(str(row), [0], params, [], None, 1) for row in range(num_rows)]
    for request in requests:
        request.append_output_token(0)
    return sample(torch.zeros(num_rows, loaded.config.vocab_size, dtype=loaded.dtype, device=device), requests)
