"""`kvserve plan` end to end: in process through kvserve.cli.main and as a subprocess."""

import json
import shutil
import subprocess
import sys

import pytest

from kvserve.cli import main
from kvserve.planner.gpus import GPU_CATALOG
from kvserve.planner.registry import REGISTRY

ISSUE_EXAMPLE = ["plan", "--model", "Qwen/Qwen2.5-14B-Instruct", "--gpu", "A100-80GB", "--max-model-len", "32768",
                 "--max-num-seqs", "32", "--avg-context-len", "16384"]


def _run_json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_issue_example_explains_that_32_requests_of_16k_do_not_fit_and_what_to_change(capsys):
    result = _run_json(capsys, ISSUE_EXAMPLE)
    assert result["kv_bytes_per_token"] == 196_608
    assert result["kv_block_bytes"] == 16 * 196_608
    formula = result["figures"]["kv_bytes_per_token"]["formula"]
    assert formula == "2 (K,V) × 48 layers × 8 KV heads × 128 × 2 B = 192 KiB"
    assert result["verdict"]["status"] == "overcommitted"
    assert result["verdict"]["workload_fits"] is False
    assert result["num_blocks"] * 3 * 2**20 <= result["kv_pool_bytes"] < (result["num_blocks"] + 1) * 3 * 2**20
    fixes = {fix["change"]: fix for fix in result["fixes"]}
    assert fixes["--kv-cache-dtype int4"]["fits"] and fixes["--tensor-parallel-size 2"]["fits"]
    assert not fixes["--kv-cache-dtype fp8"]["fits"]  # 28.6 requests of 16K: close, not enough
    assert fixes["--gpu H200"]["fits"]
    assert any(change.startswith("--max-model-len ") for change in fixes)


def test_issue_example_as_a_table(capsys):
    assert main(ISSUE_EXAMPLE) == 0
    out = capsys.readouterr().out
    for text in ("KV cache per token", "192 KiB", "OVERCOMMITTED", "Workload does NOT fit", "What to change",
                 "--kv-cache-dtype int4", "--gpu H200", "activation reserve is a heuristic"):
        assert text in out


def test_subprocess_kvserve_plan(tmp_path):
    command = [shutil.which("kvserve")] if shutil.which("kvserve") else [sys.executable, "-m", "kvserve.cli"]
    result = subprocess.run(command + ISSUE_EXAMPLE + ["--json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["kv_bytes_per_token"] == 196_608
    result = subprocess.run(command + ["plan", "--model", "no/such-model", "--gpu", "L4"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "unknown model" in result.stderr


def test_fitting_plan_and_check_exit_codes(capsys):
    argv = ["plan", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--gpu", "H100", "--max-num-seqs", "16"]
    result = _run_json(capsys, argv)
    assert result["verdict"]["status"] == "fits" and result["fixes"] == []
    assert main(argv + ["--check"]) == 0
    capsys.readouterr()
    assert main(ISSUE_EXAMPLE + ["--check"]) == 1


def test_model_that_does_not_load_suggests_quantization_and_tp(capsys):
    result = _run_json(capsys, ["plan", "--model", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "A100-80GB",
                                "--max-model-len", "8192"])
    assert result["verdict"]["status"] == "does_not_load" and result["kv_pool_bytes"] < 0
    changes = [fix["change"] for fix in result["fixes"]]
    assert "--quantization fp8" in changes and "--tensor-parallel-size 2" in changes


def test_max_model_len_larger_than_the_pool_fails_at_startup(capsys):
    result = _run_json(capsys, ["plan", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "L4"])
    assert result["verdict"]["status"] == "startup_error"
    assert any(fix["change"].startswith("--max-model-len") for fix in result["fixes"])


def test_tp_and_kv_dtype_flags_flow_through(capsys):
    result = _run_json(capsys, ["plan", "--model", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "H100",
                                "-tp", "4", "--kv-cache-dtype", "fp8", "--max-model-len", "32k"])
    assert result["kv_bytes_per_token"] == 327_680 // 4 // 2
    assert result["inputs"]["max_model_len"] == 32_000
    assert result["inputs"]["resolved_kv_cache_dtype"] == "fp8_e4m3"


def test_activation_reserve_override(capsys):
    result = _run_json(capsys, ISSUE_EXAMPLE + ["--activation-reserve-gib", "2"])
    assert result["activation_reserve_bytes"] == 2 * 1024**3
    assert result["figures"]["activation"]["formula"].startswith("--activation-reserve-gib 2")


def test_gemma_plan_counts_only_the_window_for_windowed_layers(capsys):
    # Gemma 2 9B: 21 of 42 layers use a 4,096-token window, so a pool block holds one group's 21 layers and a
    # request of 8,192 tokens holds 512 blocks of the global group and 256 of the windowed one.
    result = _run_json(capsys, ["plan", "--model", "google/gemma-2-9b-it", "--gpu", "L4", "--avg-context-len", "8k"])
    figures = result["figures"]
    per_layer_block = 16 * 2 * 8 * 256 * 2
    assert figures["kv_block_bytes"]["value"] == 21 * per_layer_block
    assert figures["kv_per_request"]["value"] == (512 + 256) * 21 * per_layer_block  # max-model-len 8,192
    assert figures["concurrency_at_max_model_len"]["value"] == figures["num_blocks"]["value"] / (512 + 256)
    assert any("sliding window" in note for note in result["notes"])


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--gpu", "Z9000"], "unknown GPU"), (["--gpu", "L4", "-tp", "3"], "valid TP sizes"),
     (["--gpu", "L4", "--max-num-seqs", "-4"], "must be positive"),
     (["--gpu", "L4", "--max-model-len", "10M"], "exceeds"),
     (["--gpu", "L4", "--max-model-len", "lots"], "token count"),
     (["--gpu-memory", "-3"], "positive"), (["--max-model-len", "10M"], "exceeds"),
     (["--gpu", "L4", "--gpu-memory-utilization", "1.5"], "utilization")],
)
def test_bad_input_is_a_clear_error(capsys, extra, message):
    assert main(["plan", "--model", "Qwen/Qwen2.5-7B-Instruct"] + extra) == 2
    assert message in capsys.readouterr().err


def _row(out: str, first_cell: str) -> str:
    """The first line of the console table row that starts with first_cell."""
    return next(line for line in out.splitlines() if line.lstrip("│┃ ").startswith(first_cell))


def test_without_a_gpu_the_models_own_figures_and_what_a_gpu_adds(capsys):
    assert main(["plan", "--model", "Qwen/Qwen2.5-14B-Instruct"]) == 0
    out = capsys.readouterr().out
    assert "max-model-len 32,768" in out  # the model's max_position_embeddings
    assert "27.51 GiB" in _row(out, "Weights per GPU") and "× 2 B (bfloat16)" in out
    # KV per token and one request of 32,768 tokens, per KV dtype
    assert "192 KiB" in _row(out, "auto (bfloat16)") and "6 GiB" in _row(out, "auto (bfloat16)")
    assert "96 KiB" in _row(out, "fp8 (fp8_e4m3)") and "3 GiB" in _row(out, "fp8 (fp8_e4m3)")
    assert "99,072 B" in _row(out, "int8") and "3.02 GiB" in _row(out, "int8")
    assert "57 KiB" in _row(out, "int4") and "1.78 GiB" in _row(out, "int4")
    assert "2 (K,V) × 48 layers × 8 KV heads × 128 × 2 B = 192 KiB" in out
    hint = " ".join(out[out.index("No GPU given"):].split())
    for text in ("--gpu NAME", "--gpu-memory GIB", "KV pool", "how many requests fit", "verdict"):
        assert text in hint
    assert "OOM pre-check" not in out and "FITS" not in out  # no verdict without memory to fit in


def test_without_a_gpu_as_json_matches_the_plan_with_one(capsys):
    model = ["plan", "--model", "Qwen/Qwen2.5-14B-Instruct", "--max-model-len", "8192", "--avg-context-len", "1000"]
    alone = _run_json(capsys, model)
    assert alone["gpu"] is None and "verdict" not in alone and "--gpu NAME" in alone["with_gpu"]
    assert alone["inputs"]["max_model_len"] == 8192 and alone["model"]["max_position_embeddings"] == 32768
    by_dtype = {row["kv_cache_dtype"]: row for row in alone["kv_cache_dtypes"]}
    assert list(by_dtype) == ["auto", "fp8", "int8", "int4"]
    assert [row["kv_bytes_per_token"] for row in by_dtype.values()] == [196_608, 98_304, 99_072, 58_368]
    for row in by_dtype.values():
        assert row["kv_bytes_per_request_at_max_model_len"] == 8192 * row["kv_bytes_per_token"]
        assert row["kv_bytes_per_request_at_avg_context_len"] == 1008 * row["kv_bytes_per_token"]  # whole blocks
    # The same figures a plan on a GPU shows, in every KV dtype
    for dtype, row in by_dtype.items():
        plan = _run_json(capsys, model + ["--gpu", "A100-80GB", "--kv-cache-dtype", dtype])
        assert plan["kv_bytes_per_token"] == row["kv_bytes_per_token"]
        assert plan["figures"]["kv_per_request"]["value"] == row["kv_bytes_per_request_at_max_model_len"]
        assert plan["weights_bytes_per_gpu"] == alone["weights_bytes_per_gpu"] == 29_540_067_328


def test_without_a_gpu_flags_still_flow_through(capsys):
    result = _run_json(capsys, ["plan", "--model", "meta-llama/Llama-3.1-70B-Instruct", "-tp", "4",
                                "--kv-cache-dtype", "fp8_e5m2"])
    rows = {row["kv_cache_dtype"]: row for row in result["kv_cache_dtypes"]}
    assert rows["auto"]["kv_bytes_per_token"] == 327_680 // 4  # per GPU: 2 of the 8 KV heads
    assert rows["fp8_e5m2"]["kv_bytes_per_token"] == 327_680 // 4 // 2  # asked for, so shown too
    assert result["weights_bytes_per_gpu"] < result["weights_bytes_total"] // 3


def test_without_a_gpu_check_has_no_verdict_to_check(capsys):
    assert main(["plan", "--model", "Qwen/Qwen2.5-7B-Instruct", "--check"]) == 2
    assert "--check needs --gpu NAME or --gpu-memory GIB" in capsys.readouterr().err


def test_model_is_required(capsys):
    assert main(["plan", "--gpu", "L4"]) == 2
    assert "--model is required" in capsys.readouterr().err


def test_compare_gpus(capsys):
    plans = _run_json(capsys, ISSUE_EXAMPLE[:5] + ["--compare", "gpus", "--avg-context-len", "16384"])
    assert [p["gpu"]["name"] for p in plans] == [g.name for g in sorted(GPU_CATALOG, key=lambda g: g.memory_bytes)]
    assert main(ISSUE_EXAMPLE + ["--compare", "gpus"]) == 0
    assert "MI300X" in capsys.readouterr().out


def test_compare_kv_dtypes(capsys):
    plans = _run_json(capsys, ISSUE_EXAMPLE + ["--compare", "kv-dtypes"])
    per_token = [p["kv_bytes_per_token"] for p in plans]
    assert per_token == [196_608, 98_304, 99_072, 58_368]
    assert main(ISSUE_EXAMPLE + ["--compare", "kv-dtypes"]) == 0
    assert "int4" in capsys.readouterr().out


def test_reference_table(capsys):
    rows = _run_json(capsys, ["plan", "--table"])
    assert len(rows) == len(REGISTRY) >= 25
    llama2 = next(row for row in rows if row["repo_id"] == "meta-llama/Llama-2-7b-hf")
    assert llama2["kv_16bit_per_token"] == 524_288 and llama2["kv_16bit_at_context"] == 2 * 1024**3
    assert llama2["kv_fp8_at_context"] == 1024**3
    assert main(["plan", "--table"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-ai/DeepSeek-V3" in out and "MLA 512+64" in out


def test_list_gpus(capsys):
    assert main(["plan", "--list-gpus"]) == 0
    assert "A100-80GB" in capsys.readouterr().out


def test_cpu_pool_counts_gemma3_window_groups_as_the_engine_allocates_them(capsys):
    # Gemma 3 1B: 22 of 26 layers on a 512-token window, 4 global. A pool block holds 4 layers (one group's): the
    # global group, and 6 window groups (the last with 2 of its 4 slots used). 16 tokens x K,V x 1 head x 256 x 2 B
    # = 16 KiB a layer, so 64 KiB a block; at 8,192 tokens a request holds 512 global blocks and 32 per window group.
    result = _run_json(capsys, ["plan", "--model", "google/gemma-3-1b-it", "--kv-cache-memory", "1",
                                "--max-model-len", "8192", "--avg-context-len", "8192"])
    bf16 = next(kv for kv in result["kv_cache_dtypes"] if kv["kv_cache_dtype"] == "auto")
    pool = bf16["figures"]["cpu_pool_requests"]
    assert pool["value"] == 2**30 // (4 * 16 * 1024) / (512 + 6 * 32)
    assert bf16["kv_bytes_per_request_at_max_model_len"] == (512 + 6 * 32) * 4 * 16 * 1024
