"""benchmarks/gpu_check.sh, the one script a lent GPU runs: its CPU dry run (TRITON_INTERPRET=1, tiny shapes) goes
through every step's code path and leaves the result files a user reads, so the GPU run's first try is not spent
on a typo. Speeds are not asserted (they mean nothing on the interpreter): only that each figure is there."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
KV_DTYPES = {"bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"}
STEPS = ["wheels", "imports", "kernel_tests", "cuda_tests", "bandwidth", "offline"]


def script_env(out: Path) -> dict[str, str]:
    return {**os.environ, "OUT": str(out), "PYTHON": sys.executable}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("gpu-check")
    result = subprocess.run(["bash", str(SCRIPT), "--cpu-dry-run"], env=script_env(out), cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    return out, result


def read_json(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.slow
def test_dry_run_passes_every_step_and_leaves_its_files(dry_run):
    out, result = dry_run
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    steps = read_json(out, "steps.json")
    assert steps["mode"] == "cpu-dry-run" and steps["passed"]
    assert [(s["name"], s["status"]) for s in steps["steps"]] == [(name, "passed") for name in STEPS]
    files = {path.name for path in out.iterdir()}
    assert {"gpu_check.log", "steps.json", "decode_bandwidth.json", "offline.json"} <= files
    assert len(files) <= 8 and all(path.is_file() for path in out.iterdir())  # what a device run brings back


@pytest.mark.slow
def test_log_starts_with_the_machine_and_versions(dry_run):
    out, _ = dry_run
    log = (out / "gpu_check.log").read_text()
    assert log.startswith("kvserve gpu_check (cpu-dry-run)")
    for expected in ("nvidia-smi", "torch ", "triton ", "GPU: ", "=== step offline: passed"):
        assert expected in log


@pytest.mark.slow
def test_bandwidth_has_an_entry_per_kv_dtype_against_the_copy_peak(dry_run):
    out, _ = dry_run
    report = read_json(out, "decode_bandwidth.json")
    assert report["errors"] == []
    assert is_number(report["copy_bandwidth_gbps"])
    entries = report["results"]
    assert {e["kv_dtype"] for e in entries} == KV_DTYPES
    for entry in entries:
        for key in ("bytes_per_token", "bytes_moved", "seconds_per_call", "gbps", "fraction_of_copy_peak",
                    "torch_gbps", "max_abs_error"):
            assert is_number(entry[key]), (entry["kv_dtype"], key)
        assert entry["ok"] and entry["finite"]
    per_token = {e["kv_dtype"]: e["bytes_per_token"] for e in entries}
    # The formats' sizes, so the GPU figures divide by the right bytes: bf16 2 B/element, fp8 1, int4 ~0.5.
    assert per_token["bf16"] == 2 * per_token["fp8_e4m3"] == 2 * per_token["fp8_e5m2"]
    assert per_token["int4"] < per_token["int8"] < per_token["bf16"]


@pytest.mark.slow
def test_offline_has_every_workload_and_configuration_with_ratios_and_memory(dry_run):
    out, _ = dry_run
    report = read_json(out, "offline.json")
    assert report["errors"] == [] and report["attention_backend"] == "triton"
    runs = {(r["workload"], r["prefix_caching"], r["cuda_graphs"]): r for r in report["runs"]}
    assert set(runs) == {(w, pc, g) for w in ("shared_prefix", "mixed") for pc in (True, False) for g in (True, False)}
    for run in runs.values():
        assert run["output_tokens"] > 0 and is_number(run["output_tokens_per_s"])
    # Greedy, EOS ignored: every configuration generates the same tokens, so the ratios compare like with like.
    assert len({(r["workload"], r["output_tokens"]) for r in runs.values()}) == 2
    assert runs[("shared_prefix", True, False)]["prefix_cache_hit_rate"] > 0
    ratios = report["ratios"]
    assert len(ratios["graphs_on_over_off"]) == len(ratios["cached_over_uncached"]) == 4
    assert all(is_number(r["ratio"]) for r in ratios["graphs_on_over_off"] + ratios["cached_over_uncached"])
    assert len(report["memory"]) == 4
    for memory in report["memory"]:
        assert memory["engine"]["attention_backend"] == "triton"
        assert memory["predicted_bytes"] >= memory["pool_bytes"] + memory["weights_bytes"] > 0
        assert memory["observed_peak_bytes"] is None and "CUDA" in memory["observed_note"]


def test_help_and_a_wrong_argument():
    shown = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0 and "--cpu-dry-run" in shown.stdout
    wrong = subprocess.run(["bash", str(SCRIPT), "--gpu"], capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 2 and "unknown argument" in wrong.stderr


@pytest.mark.parametrize("script", ["gpu_decode_bandwidth.py", "gpu_offline.py"])
def test_python_steps_explain_themselves(script):
    shown = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--help"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert shown.returncode == 0 and "--dry-run" in shown.stdout
