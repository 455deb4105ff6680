"""The least time this machine needs for a model's decode step and prefill, from the GGUF file's own tensors and
the measured bounds of machine_bounds.py: a decode token reads every matmul weight as the file stores it plus the
K/V of its context (bytes over memory bandwidth), a prefill does the matmul and attention FLOPs (over the
faster of the bf16 and fp32 matmul peaks). Engines that hold the weights wider than the file (bf16) move more
bytes than this bound counts: the bound is the file's, the same for every engine serving it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from machine_bounds import compute_peak, memory_bandwidth

from kvserve.planner.gguf_spec import spec_from_gguf
from kvserve.planner.kv import kv_bytes_per_token


@dataclass(slots=True, frozen=True)
class ModelCost:
    matmul_params: int  # parameters a token multiplies by (the embedding table only when it is also the output)
    matmul_bytes: int  # those parameters' bytes as the file stores them
    kv_token_bytes: int  # f16 K/V of one token over all layers (what the peers keep by default)
    attention_flops_per_pair: int  # FLOPs of one (query, key) pair over all layers and heads: QK^T and PV

    def decode_bound_s(self, contexts: list[int], shared_tokens: int = 0) -> float:
        """One decode step of len(contexts) sequences; K/V of the first `shared_tokens` is read once for all."""
        kv_tokens = sum(contexts) - (len(contexts) - 1) * shared_tokens if contexts else 0
        moved = self.matmul_bytes + self.kv_token_bytes * kv_tokens
        flops = 2 * self.matmul_params * len(contexts) + self.attention_flops_per_pair * sum(contexts)
        return max(moved / memory_bandwidth(), flops / compute_peak())

    def prefill_bound_s(self, tokens: int, cached: int = 0) -> float:
        """Computing `tokens` new prompt tokens after `cached` ones (causal: token i attends to cached + i + 1)."""
        pairs = tokens * cached + tokens * (tokens + 1) // 2
        flops = 2 * self.matmul_params * tokens + self.attention_flops_per_pair * pairs
        return flops / compute_peak()

    def shared_prefix_bound_s(self, prompt_lens: list[int], shared: int, output_tokens: int, cached: bool) -> float:
        """Workload (a): the prompts (the shared part once when `cached`) then `output_tokens` decode steps."""
        if cached:
            prefill = self.prefill_bound_s(shared) + sum(self.prefill_bound_s(n - shared, shared) for n in prompt_lens)
        else:
            prefill = sum(self.prefill_bound_s(n) for n in prompt_lens)
        steps = sum(self.decode_bound_s([n + step for n in prompt_lens], shared if cached else 0)
                    for step in range(output_tokens - 1))
        return prefill + steps


def gguf_cost(path: str | Path) -> ModelCost:
    from gguf import GGUFReader

    spec = spec_from_gguf(Path(path))
    tensors = GGUFReader(path).tensors
    names = {t.name for t in tensors}
    params = stored = 0
    for tensor in tensors:
        looked_up = tensor.name == "token_embd.weight" and "output.weight" in names  # one row a token
        if len(tensor.shape) >= 2 and not looked_up:
            params += int(tensor.n_elements)
            stored += int(tensor.n_bytes)
    pair_flops = 2 * 2 * spec.num_layers * spec.num_attention_heads * spec.head_dim
    return ModelCost(params, stored, kv_bytes_per_token(spec, "float16"), pair_flops)


def fraction(measured_s: float, bound_s: float) -> str:
    """How much of the machine a measured time reaches: bound / measured."""
    return f"{bound_s / measured_s:.0%}" if measured_s > 0 else "-"
