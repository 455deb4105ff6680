"""How tensor and pipeline parallelism split a model across GPUs, with vLLM's rules and validity checks.

Tensor parallelism (TP) splits attention heads: every GPU holds `num_attention_heads / TP` query heads and
`num_kv_heads / TP` KV heads. When there are fewer KV heads than GPUs (Llama-3-70B's 8 KV heads at TP=16), each
KV head is replicated so that every GPU holds exactly one: per GPU `max(1, kv_heads / TP)`. MLA's latent cache
has no heads to split and is replicated on every TP rank, as in vLLM.

Pipeline parallelism (PP) splits the layers into contiguous stages; the planner reports the most loaded GPU.
"""

from __future__ import annotations

from kvserve.planner.errors import PlannerError
from kvserve.planner.specs import ModelSpec


def validate_parallelism(spec: ModelSpec, tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> None:
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if tp < 1 or pp < 1:
        raise PlannerError(f"--tensor-parallel-size and --pipeline-parallel-size must be >= 1 (got TP={tp}, PP={pp})")
    if spec.num_attention_heads % tp != 0:
        raise PlannerError(
            f"--tensor-parallel-size {tp} does not divide {spec.name}'s {spec.num_attention_heads} attention heads; "
            f"valid TP sizes: {', '.join(map(str, valid_tp_sizes(spec)))}"
        )
    kv_heads = spec.num_kv_heads
    if not spec.is_mla and (kv_heads % tp if kv_heads >= tp else tp % kv_heads):
        raise PlannerError(
            f"--tensor-parallel-size {tp} cannot split {spec.name}'s {kv_heads} KV heads evenly (TP must divide "
            f"the KV heads, or be a multiple of them); valid TP sizes: {', '.join(map(str, valid_tp_sizes(spec)))}"
        )
    if pp > spec.num_layers:
        raise PlannerError(f"--pipeline-parallel-size {pp} exceeds {spec.name}'s {spec.num_layers} layers")


def valid_tp_sizes(spec: ModelSpec, limit: int = 64) -> list[int]:
    sizes = []
    for tp in range(1, limit + 1):
        if spec.num_attention_heads % tp:
            continue
        kv = spec.num_kv_heads
        if spec.is_mla or (kv % tp == 0 if kv >= tp else tp % kv == 0):
            sizes.append(tp)
    return sizes


def kv_heads_per_gpu(spec: ModelSpec, tensor_parallel_size: int) -> int:
    """KV heads each GPU stores: kv_heads / TP, or 1 (replicated) when TP exceeds the KV heads. MLA: 1 latent."""
    validate_parallelism(spec, tensor_parallel_size)
    if spec.is_mla:
        return 1
    return max(1, spec.num_kv_heads // tensor_parallel_size)


def pipeline_stages(num_layers: int, pipeline_parallel_size: int) -> list[range]:
    """Contiguous layer ranges per PP stage, split like vLLM's `get_pp_indices`.

    The remainder goes to the stages before the last one, because the last stage also carries the LM head.
    """
    sizes = [num_layers // pipeline_parallel_size] * pipeline_parallel_size
    for offset in range(2, num_layers % pipeline_parallel_size + 2):
        sizes[-offset] += 1
    stages, start = [], 0
    for size in sizes:
        stages.append(range(start, start + size))
        start += size
    return stages
