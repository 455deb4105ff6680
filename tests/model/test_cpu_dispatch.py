"""What kvserve picks on a CPU: the ISA family of its kernels, `--dtype auto`, and the start-up line saying so.

The CPUs named here are real ones, by the /proc/cpuinfo flags that matter (the machines this project runs on
are AMD EPYC Zen 3, AVX2 only, and Zen 4, AVX-512 with BF16).
"""

import logging

import pytest
import torch

from kvserve.config import ModelConfig
from kvserve.model import cpu_isa
from kvserve.model.cpu_isa import ISA_ENV, detected_isa, runnable_isas, selected_isa
from kvserve.model.cpu_kernels import cpu_kernels
from kvserve.model.kernel_build import module_name
from kvserve.model.loader import cpu_dispatch_line, load_model, resolve_dtype, resolve_dtypes

ZEN3 = frozenset("sse4_2 avx f16c fma avx2 bmi2".split())
ZEN4 = ZEN3 | frozenset("avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16".split())
SKYLAKE_SP = ZEN3 | frozenset("avx512f avx512dq avx512bw avx512vl".split())
SAPPHIRE_RAPIDS = ZEN4 | frozenset("amx_tile amx_bf16 amx_int8".split())
OLD_X86 = frozenset("sse4_2 avx".split())


@pytest.mark.parametrize("flags,family", [(ZEN3, "avx2"), (ZEN4, "avx512_bf16"), (SKYLAKE_SP, "avx512"),
                                          (SAPPHIRE_RAPIDS, "avx512_bf16"), (OLD_X86, "generic"),
                                          (frozenset(), "generic")])
def test_family_is_the_most_capable_one_the_flags_allow(flags, family):
    assert detected_isa(flags).name == family


def test_each_family_builds_under_its_own_name_with_its_own_flags():
    """One installed module per family, and no family is built for the machine that builds it."""
    names = {module_name(isa) for isa in cpu_isa.ISA_FAMILIES}
    assert len(names) == len(cpu_isa.ISA_FAMILIES)
    for isa in cpu_isa.ISA_FAMILIES:
        assert "-march=native" not in isa.compile_flags
    assert "-mavx512f" not in cpu_isa.ISA_FAMILIES[1].compile_flags  # avx2


def with_flags(monkeypatch, flags):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: flags)


def test_the_cap_lowers_the_family_and_never_raises_it(monkeypatch):
    with_flags(monkeypatch, ZEN4)
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert selected_isa().name == "avx2"
    assert not cpu_isa.native_bf16()
    with_flags(monkeypatch, ZEN3)
    monkeypatch.setenv(ISA_ENV, "avx512_bf16")
    assert selected_isa().name == "avx2"
    monkeypatch.setenv(ISA_ENV, "AVX512")
    assert selected_isa().name == "avx2"
    monkeypatch.setenv(ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="KVSERVE_CPU_ISA"):
        selected_isa()


def config_with(checkpoint_dtype: str | None) -> ModelConfig:
    return ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_hidden_layers": 1, "vocab_size": 100, "torch_dtype": checkpoint_dtype,
    })


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16", None])
def test_auto_dtype_is_bf16_only_with_native_bf16(monkeypatch, checkpoint):
    cpu = torch.device("cpu")
    monkeypatch.delenv(ISA_ENV, raising=False)
    with_flags(monkeypatch, ZEN3)
    assert resolve_dtype("auto", config_with(checkpoint), cpu) == torch.float32
    with_flags(monkeypatch, ZEN4)
    assert resolve_dtype("auto", config_with(checkpoint), cpu) == torch.bfloat16
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert resolve_dtype("auto", config_with(checkpoint), cpu) == torch.float32
    # What the user asks for is what runs.
    assert resolve_dtype("bfloat16", config_with(checkpoint), cpu) == torch.bfloat16
    assert resolve_dtype("auto", config_with("float32"), cpu) == torch.float32


def test_auto_computes_16_bit_checkpoints_in_fp32_and_keeps_their_kv_in_16_bits(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(ISA_ENV, raising=False)
    with_flags(monkeypatch, ZEN3)
    assert resolve_dtypes("auto", config_with("bfloat16"), cpu) == (torch.float32, torch.bfloat16)
    assert resolve_dtypes("auto", config_with("float16"), cpu) == (torch.float32, torch.float16)
    assert resolve_dtypes("auto", config_with("float32"), cpu) == (torch.float32, torch.float32)
    assert resolve_dtypes("float32", config_with("bfloat16"), cpu) == (torch.float32, torch.float32)
    with_flags(monkeypatch, ZEN4)
    assert resolve_dtypes("auto", config_with("bfloat16"), cpu) == (torch.bfloat16, torch.bfloat16)
    assert resolve_dtypes("auto", config_with("float16"), cpu) == (torch.bfloat16, torch.bfloat16)


def test_dispatch_line_says_what_was_chosen_and_why(monkeypatch):
    with_flags(monkeypatch, ZEN3)
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert cpu_dispatch_line(torch.float32, True) == "CPU: AVX2+FMA, no native bf16 -> float32 compute, AVX2+FMA kernels"
    assert cpu_dispatch_line(torch.float32, True, torch.bfloat16) == (
        "CPU: AVX2+FMA, no native bf16 -> float32 compute, bfloat16 KV cache, AVX2+FMA kernels")
    assert "float32 computes faster" in cpu_dispatch_line(torch.bfloat16, True)
    with_flags(monkeypatch, ZEN4)
    assert cpu_dispatch_line(torch.bfloat16, False) == (
        "CPU: AVX-512 with BF16, native bf16 -> bfloat16 compute, portable torch path (no CPU kernels)")


def test_start_up_log_names_the_family_and_dtype(monkeypatch, caplog, tiny_model_dir):
    """Capped to AVX2 on whatever machine runs this: the model loads in fp32 with the AVX2 kernels."""
    if "avx2" not in [isa.name for isa in runnable_isas()]:
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setenv(ISA_ENV, "avx2")
    folder, _ = tiny_model_dir("llama")
    with caplog.at_level(logging.INFO, logger="kvserve.model"):
        loaded = load_model(str(folder), dtype="auto")
    assert loaded.dtype == torch.float32
    kernels_built = cpu_kernels() is not None
    expected = "CPU: AVX2+FMA, no native bf16 -> float32 compute, " + (
        "AVX2+FMA kernels" if kernels_built else "portable torch path (no CPU kernels)")
    assert expected in caplog.messages
    if kernels_built:
        assert loaded.model.fused_kernels.__name__ == module_name(cpu_isa.ISA_FAMILIES[1])
