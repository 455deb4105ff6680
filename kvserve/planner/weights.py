"""Weight bytes per GPU, from the architecture (every matrix of every layer) or from a checkpoint's headers.

The architecture count lists each weight matrix with the number of tensor-parallel ranks it is split across,
so per-GPU bytes follow vLLM's layout: column/row-parallel projections, experts and the vocab-parallel
embedding split over TP; norms, MoE routers and MLA's down-projections (q_a, kv_a) are replicated. K/V
projections split over min(TP, kv_heads) ranks, because KV heads are replicated beyond that (parallel.py).
Vocab padding to a multiple of 64 per rank is ignored (< 0.1 % of any registry model).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.planner.dtypes import DTYPE_BYTES
from kvserve.planner.parallel import pipeline_stages, validate_parallelism
from kvserve.planner.quant import UNQUANTIZED, WeightQuant
from kvserve.planner.specs import ModelSpec
from kvserve.planner.units import ceil_div, format_bytes, format_params

_FP32_SCALE_BYTES = 4
_FP16_SCALE_BYTES = 2


@dataclass(slots=True, frozen=True)
class Matrix:
    """`count` identical [in_features -> out_features] weights (experts), split across `shards` TP ranks."""

    name: str
    in_features: int
    out_features: int
    count: int = 1
    shards: int = 1
    quantizable: bool = True

    @property
    def num_params(self) -> int:
        return self.count * self.in_features * self.out_features


@dataclass(slots=True, frozen=True)
class WeightGroup:
    """The weights of one decoder layer, or of the embedding/head: matrices plus norm and bias vectors."""

    matrices: tuple[Matrix, ...]
    vector_params: int = 0

    @property
    def num_params(self) -> int:
        return sum(m.num_params for m in self.matrices) + self.vector_params


@dataclass(slots=True, frozen=True)
class WeightEstimate:
    total_params: int
    total_bytes: int
    per_gpu_bytes: int
    quant: WeightQuant
    source: str
    formula: str


def matrix_bytes(matrix: Matrix, quant: WeightQuant, dtype_bytes: int) -> int:
    """Bytes of all `count` copies of a matrix, unsplit, quantization scales and zero points included."""
    effective = quant if matrix.quantizable else UNQUANTIZED
    return matrix.count * _one_matrix_bytes(matrix.in_features, matrix.out_features, effective, dtype_bytes)


def _one_matrix_bytes(in_features: int, out_features: int, quant: WeightQuant, dtype_bytes: int) -> int:
    elements = in_features * out_features
    if quant.method == "fp8":
        if quant.block_shape:
            block_out, block_in = quant.block_shape
            return elements + ceil_div(out_features, block_out) * ceil_div(in_features, block_in) * _FP32_SCALE_BYTES
        return elements + _FP32_SCALE_BYTES
    if quant.method == "int8":
        return elements + out_features * _FP32_SCALE_BYTES
    if quant.method in ("awq", "gptq"):
        groups = ceil_div(in_features, quant.group_size or in_features)
        packed = ceil_div(elements * quant.bits, 8)
        scales = groups * out_features * _FP16_SCALE_BYTES
        zeros = groups * ceil_div(out_features * quant.bits, 32) * 4  # packed into int32 words
        g_idx = in_features * 4 if quant.method == "gptq" else 0
        return packed + scales + zeros + g_idx
    # "none", and "gguf" whose per-tensor types only the file knows (the exact path covers it).
    return elements * dtype_bytes


def decoder_layer_weights(spec: ModelSpec, layer_index: int, tensor_parallel_size: int = 1) -> WeightGroup:
    attention, attention_vectors = _attention_matrices(spec, tensor_parallel_size)
    mlp, mlp_vectors = _mlp_matrices(spec, layer_index, tensor_parallel_size)
    norms = spec.norms_per_layer * spec.hidden_size
    return WeightGroup(attention + mlp, attention_vectors + mlp_vectors + norms)


def _attention_matrices(spec: ModelSpec, tp: int) -> tuple[tuple[Matrix, ...], int]:
    hidden, heads = spec.hidden_size, spec.num_attention_heads
    if spec.is_mla:
        return _mla_matrices(spec, tp)
    q_width, kv_width = heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    kv_shards = min(tp, spec.num_kv_heads)
    matrices = (
        Matrix("q_proj", hidden, q_width, shards=tp),
        Matrix("k_proj", hidden, kv_width, shards=kv_shards),
        Matrix("v_proj", hidden, kv_width, shards=kv_shards),
        Matrix("o_proj", q_width, hidden, shards=tp),
    )
    vectors = (q_width + 2 * kv_width if spec.attention_bias else 0) + (2 * spec.head_dim if spec.qk_norm else 0)
    return matrices, vectors


def _mla_matrices(spec: ModelSpec, tp: int) -> tuple[tuple[Matrix, ...], int]:
    hidden, heads = spec.hidden_size, spec.num_attention_heads
    qk_head = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    if spec.q_lora_rank:
        q_matrices = (
            Matrix("q_a_proj", hidden, spec.q_lora_rank),
            Matrix("q_b_proj", spec.q_lora_rank, heads * qk_head, shards=tp),
        )
        q_vectors = spec.q_lora_rank
    else:
        q_matrices, q_vectors = (Matrix("q_proj", hidden, heads * qk_head, shards=tp),), 0
    matrices = q_matrices + (
        Matrix("kv_a_proj_with_mqa", hidden, spec.kv_lora_rank + spec.qk_rope_head_dim),
        Matrix("kv_b_proj", spec.kv_lora_rank, heads * (spec.qk_nope_head_dim + spec.v_head_dim), shards=tp),
        Matrix("o_proj", heads * spec.v_head_dim, hidden, shards=tp),
    )
    return matrices, q_vectors + spec.kv_lora_rank


def _mlp_matrices(spec: ModelSpec, layer_index: int, tp: int) -> tuple[tuple[Matrix, ...], int]:
    hidden = spec.hidden_size
    if not spec.is_moe_layer(layer_index):
        return _gated_mlp("mlp", hidden, spec.intermediate_size, tp), 0
    experts, width = spec.num_experts, spec.moe_intermediate_size
    matrices = (
        Matrix("router", hidden, experts, quantizable=False),
        Matrix("experts.gate_up", hidden, 2 * width, count=experts, shards=tp),
        Matrix("experts.down", width, hidden, count=experts, shards=tp),
    )
    vectors = experts if spec.model_type == "deepseek_v3" else 0  # e_score_correction_bias
    if spec.num_shared_experts:
        matrices += _gated_mlp("shared_experts", hidden, spec.num_shared_experts * width, tp)
    if spec.shared_expert_intermediate_size:
        matrices += _gated_mlp("shared_expert", hidden, spec.shared_expert_intermediate_size, tp)
        matrices += (Matrix("shared_expert_gate", hidden, 1, quantizable=False),)
    return matrices, vectors


def _gated_mlp(name: str, hidden: int, width: int, tp: int) -> tuple[Matrix, ...]:
    # Every registry family uses a gated MLP (SwiGLU/GeGLU): gate and up projections, then down.
    return (
        Matrix(f"{name}.gate_up", hidden, 2 * width, shards=tp),
        Matrix(f"{name}.down", width, hidden, shards=tp),
    )


def embedding_weights(spec: ModelSpec, tensor_parallel_size: int = 1) -> WeightGroup:
    embed = Matrix("embed_tokens", spec.vocab_size, spec.hidden_size, shards=tensor_parallel_size, quantizable=False)
    return WeightGroup((embed,))


def head_weights(spec: ModelSpec, tensor_parallel_size: int = 1, separate_copy: bool = False) -> WeightGroup:
    """Final norm plus LM head; a tied head costs nothing unless it lives on another PP stage than the embedding."""
    if spec.tie_word_embeddings and not separate_copy:
        return WeightGroup((), spec.hidden_size)
    head = Matrix("lm_head", spec.hidden_size, spec.vocab_size, shards=tensor_parallel_size, quantizable=False)
    return WeightGroup((head,), spec.hidden_size)


def group_bytes(group: WeightGroup, quant: WeightQuant, dtype_bytes: int, per_gpu: bool) -> int:
    total = group.vector_params * dtype_bytes
    for matrix in group.matrices:
        full = matrix_bytes(matrix, quant, dtype_bytes)
        total += ceil_div(full, matrix.shards) if per_gpu else full
    return total


def total_params(spec: ModelSpec) -> int:
    """Parameters loaded for serving: decoder, embeddings, head, extras; not DeepSeek's MTP layers."""
    layers = sum(decoder_layer_weights(spec, i).num_params for i in range(spec.num_layers))
    return layers + embedding_weights(spec).num_params + head_weights(spec).num_params + spec.extra_params


def architecture_bytes(
    spec: ModelSpec,
    model_dtype: str,
    quant: WeightQuant,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> tuple[int, int]:
    """(bytes of the whole model, bytes on the most loaded GPU) from the architecture."""
    dtype_bytes = DTYPE_BYTES[model_dtype]
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    total = sum(group_bytes(decoder_layer_weights(spec, i), quant, dtype_bytes, False) for i in range(spec.num_layers))
    total += group_bytes(embedding_weights(spec), quant, dtype_bytes, False)
    total += group_bytes(head_weights(spec), quant, dtype_bytes, False) + spec.extra_params * dtype_bytes
    stages = pipeline_stages(spec.num_layers, pp)
    per_stage = []
    for index, stage in enumerate(stages):
        stage_bytes = sum(group_bytes(decoder_layer_weights(spec, i, tp), quant, dtype_bytes, True) for i in stage)
        if index == 0:
            stage_bytes += group_bytes(embedding_weights(spec, tp), quant, dtype_bytes, True)
            stage_bytes += ceil_div(spec.extra_params * dtype_bytes, tp)
        if index == len(stages) - 1:
            stage_bytes += group_bytes(head_weights(spec, tp, separate_copy=pp > 1), quant, dtype_bytes, True)
        per_stage.append(stage_bytes)
    return total, max(per_stage)


def estimate_weights(
    spec: ModelSpec,
    model_dtype: str,
    quantization: WeightQuant | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> WeightEstimate:
    """Weight bytes per GPU. `quantization` None serves the checkpoint as it is (vLLM's default).

    Checkpoint headers, when present and not overridden by another quantization, give the exact total; the
    architecture count then only supplies the per-GPU share of it.
    """
    validate_parallelism(spec, tensor_parallel_size, pipeline_parallel_size)
    quant = quantization or spec.quantization or UNQUANTIZED
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    arch_total, arch_per_gpu = architecture_bytes(spec, model_dtype, quant, tp, pp)
    share = arch_per_gpu / arch_total
    params = total_params(spec)
    checkpoint = spec.checkpoint
    if checkpoint and (quantization is None or quantization == spec.quantization):
        exact_total = checkpoint.loaded_bytes(model_dtype)
        per_gpu = exact_total if tp == pp == 1 else round(exact_total * share)
        formula = _exact_formula(checkpoint.float_params, checkpoint.fixed_bytes, model_dtype, exact_total)
        return WeightEstimate(params, exact_total, per_gpu, quant, checkpoint.source,
                              _with_split(formula, share, per_gpu, tp, pp))
    formula = _architecture_formula(spec, params, quant, model_dtype, arch_total)
    return WeightEstimate(params, arch_total, arch_per_gpu, quant, "architecture (config.json)",
                          _with_split(formula, share, arch_per_gpu, tp, pp))


def _exact_formula(float_params: int, fixed_bytes: int, model_dtype: str, total: int) -> str:
    text = f"{format_params(float_params)} float params × {DTYPE_BYTES[model_dtype]} B"
    if fixed_bytes:
        text += f" + {format_bytes(fixed_bytes)} quantized/scales as stored"
    return f"{text} = {format_bytes(total)} (checkpoint headers)"


def _architecture_formula(spec: ModelSpec, params: int, quant: WeightQuant, model_dtype: str, total: int) -> str:
    dtype_bytes = DTYPE_BYTES[model_dtype]
    if quant.method in ("none", "gguf"):
        return f"{format_params(params)} params × {dtype_bytes} B ({model_dtype}) = {format_bytes(total)}"
    quantized = sum(
        m.num_params
        for i in range(spec.num_layers)
        for m in decoder_layer_weights(spec, i).matrices
        if m.quantizable
    )
    other = params - quantized
    quantized_bytes = total - other * dtype_bytes
    return (
        f"{format_params(quantized)} params in {quant.label} ({quantized_bytes / quantized:.3f} B/param incl. scales)"
        f" + {format_params(other)} params × {dtype_bytes} B = {format_bytes(total)}"
    )


def _with_split(formula: str, share: float, per_gpu: int, tp: int, pp: int) -> str:
    if tp == 1 and pp == 1:
        return formula
    return f"{formula}; most loaded GPU at TP {tp} × PP {pp}: {format_bytes(per_gpu)} ({share:.1%} of the model)"
