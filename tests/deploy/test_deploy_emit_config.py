"""`kvserve plan --emit-config DIR`: the committed GPU overlays are what it writes; its serve.yaml is accepted by
`kvserve serve --config` with the plan's figures; its overlay renders and validates anywhere; plans kvserve serve
could not start are refused before anything is written; and a real server started from the emitted serve.yaml
takes the emitted bench.sh's day-2 test."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys

import kubernetes_validate
import pytest
from deploy_manifests import DEPLOY, needs_kubectl, overlay_names, parse_command_line, render
from deploy_server import running_kvserve

from kvserve.cli import main

GPU_OVERLAYS = [name for name in overlay_names() if name != "cpu"]


def recorded_command(overlay_dir) -> list[str]:
    first = (overlay_dir / "serve.yaml").read_text().splitlines()[0]
    assert first.startswith("# Written by: kvserve plan ")
    return shlex.split(first.removeprefix("# Written by: kvserve "))


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_committed_gpu_overlay_is_what_plan_emit_config_writes(overlay, tmp_path, capsys):
    """Rerunning the command each overlay records gives the same files: overlay and planner cannot drift."""
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    shutil.rmtree(copy / "overlays" / overlay)
    argv = [str(copy / "overlays" / overlay) if word == "DIR" else word
            for word in recorded_command(DEPLOY / "overlays" / overlay)]
    assert main(argv) == 0
    assert f"wrote {copy / 'overlays' / overlay / 'serve.yaml'}" in capsys.readouterr().out
    committed = sorted(p.name for p in (DEPLOY / "overlays" / overlay).iterdir())
    assert sorted(p.name for p in (copy / "overlays" / overlay).iterdir()) == committed
    for name in committed:
        assert (copy / "overlays" / overlay / name).read_text() == (DEPLOY / "overlays" / overlay / name).read_text()
    assert os.access(DEPLOY / "overlays" / overlay / "bench.sh", os.X_OK)


PLANS = [
    ["--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu", "L4", "--max-model-len", "8192", "--max-num-seqs", "8",
     "--kv-cache-dtype", "int8"],
    ["--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "A100-40GB", "--max-model-len", "32k",
     "--kv-cache-dtype", "int4", "--gpu-memory-utilization", "0.85"],
    ["--model", "Qwen/Qwen2.5-14B-Instruct", "--gpu", "H200", "--max-model-len", "32768", "--max-num-seqs", "64",
     "--kv-cache-dtype", "fp8_e5m2", "--block-size", "32"],
]


@pytest.mark.parametrize("plan_args", PLANS, ids=lambda a: a[3])
def test_serve_yaml_is_accepted_by_kvserve_serve_with_the_plans_flags(plan_args, tmp_path, capsys):
    out = tmp_path / "overlay"
    assert main(["plan", *plan_args, "--json", "--emit-config", str(out)]) == 0
    plan = json.loads(capsys.readouterr().out)
    args = parse_command_line(["serve", "--config", "serve.yaml"], (out / "serve.yaml").read_text(), tmp_path)
    inputs = plan["inputs"]
    assert args.model == "/models/" + plan_args[1].split("/")[-1]
    assert args.served_model_name == [plan_args[1]]
    assert (args.device, args.dtype) == ("cuda", inputs["resolved_dtype"])
    assert args.max_model_len == inputs["max_model_len"] and args.max_num_seqs == inputs["max_num_seqs"]
    assert args.kv_cache_dtype == inputs["kv_cache_dtype"] and args.block_size == inputs["block_size"]
    assert args.gpu_memory_utilization == inputs["gpu_memory_utilization"]
    assert args.max_num_batched_tokens == inputs["max_num_batched_tokens"]
    assert args.enable_prefix_caching and args.kv_offloading_size >= plan["kv_pool_bytes"] / 2**30
    assert args.prefix_caching_hash_algo == "sha256"  # the engine is shared by tenants behind the gateway


def test_the_base_and_every_overlay_hash_blocks_with_sha256(tmp_path):
    for serve_yaml in [DEPLOY / "base" / "serve.yaml", *(DEPLOY / "overlays" / name / "serve.yaml"
                                                         for name in GPU_OVERLAYS)]:
        args = parse_command_line(["serve", "--config", "serve.yaml"], serve_yaml.read_text(), tmp_path)
        assert args.prefix_caching_hash_algo == "sha256", serve_yaml


@needs_kubectl
def test_overlay_emitted_outside_the_repository_renders_and_validates(tmp_path, capsys):
    out = tmp_path / "my-deployment"
    assert main(["plan", *PLANS[0], "--emit-config", str(out)]) == 0
    docs = render(out)
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    engine = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "kvserve-engine")
    limits = engine["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1


@needs_kubectl
def test_a_tensor_parallel_plan_deploys_as_one_pod_with_n_gpus(tmp_path, capsys):
    out = tmp_path / "tp2"
    assert main(["plan", "--model", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "H100-80GB", "-tp", "2",
                 "--max-model-len", "8192", "--kv-cache-dtype", "fp8", "--emit-config", str(out)]) == 0
    capsys.readouterr()
    args = parse_command_line(["serve", "--config", "serve.yaml"], (out / "serve.yaml").read_text(), tmp_path)
    assert args.tensor_parallel_size == 2
    docs = render(out)
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    engine = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "kvserve-engine")
    resources = engine["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 2


@pytest.mark.parametrize("plan_args,message", [
    (["--model", "Qwen/Qwen2.5-14B-Instruct", "--gpu", "H100-80GB", "-pp", "2"], "no pipeline parallelism"),
    (["--model", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "L4"], "this plan cannot start"),
    (["--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu", "MI300X"], "no NVIDIA node label for MI300X"),
    (["--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu", "L4", "--quantization", "awq"], "does not load awq"),
    (["--model", "Qwen/Qwen2.5-7B-Instruct"], "give --gpu NAME"),
    (["--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu", "L4", "--compare", "gpus"], "without --compare"),
])
def test_plans_kvserve_serve_cannot_start_are_refused_and_nothing_is_written(plan_args, message, tmp_path, capsys):
    out = tmp_path / "overlay"
    assert main(["plan", *plan_args, "--emit-config", str(out)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1 and not captured.out
    assert not out.exists()


def test_emit_config_imports_no_torch(tmp_path):
    code = ("import sys; from kvserve.cli import main; "
            f"rc = main(['plan', '--model', 'Qwen/Qwen2.5-7B-Instruct', '--gpu', 'L4', '--emit-config', {str(tmp_path)!r}]);"
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_a_server_started_from_the_emitted_serve_yaml_passes_the_emitted_day2_test(tiny_model_dir, tmp_path, capsys):
    """The serve.yaml as the manifests use it (the command line adds what the pod decides: here the model and
    the device instead of /models and CUDA), then bench.sh against it, shortened to a few requests."""
    from kvserve.bench.day2 import verdict_lines

    folder, _ = tiny_model_dir("llama")
    out = tmp_path / "overlay"
    assert main(["plan", "--model", str(folder), "--gpu-memory", "1", "--max-model-len", "1024", "--max-num-seqs",
                 "8", "--emit-config", str(out)]) == 0
    capsys.readouterr()
    with running_kvserve(["--config", str(out / "serve.yaml"), "--model", str(folder), "--device", "cpu",
                          "--dtype", "float32"]) as url:
        results = tmp_path / "day2.json"
        env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
               "NUM_REQUESTS": "6", "OUTPUT": str(results), "PYTHON": sys.executable,
               "TTFT_P95_SLO_MS": "600000", "MIN_POOL_HEADROOM": "0"}
        day2 = subprocess.run(["bash", str(out / "bench.sh"), url], capture_output=True, text=True, env=env,
                              timeout=300)
    assert day2.returncode == 0, day2.stdout + day2.stderr
    assert "--system-prompt-len 864" in (out / "bench.sh").read_text()  # what fits the plan's max-model-len
    report = day2.stdout
    assert "P95 TTFT: " in report and "KV pool headroom: " in report and "day-2 test: PASS" in report
    result = json.loads(results.read_text())
    assert result["summary"]["num_completed"] == 6 and result["summary"]["num_failed"] == 0
    assert 0 <= result["server"]["peak_kv_usage"] <= 1  # a fraction of the pool, as scraped from /metrics
    # The same run against a headroom it cannot have fails.
    lines, ok = verdict_lines(result, 600000, 1.01)
    assert not ok and lines[1].startswith("KV pool headroom: ")
