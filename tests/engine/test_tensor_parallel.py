"""Tensor parallelism on CPU (gloo): `LLM(tensor_parallel_size=2)` and `kvserve serve --tensor-parallel-size 2`
generate what transformers generates on the same weights, with each rank holding half the heads and its own
KV pool of the planner's per-GPU size; a worker that dies takes the engine down within seconds, naming its
rank, and leaves no process behind."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_harness import wait_until
from test_engine_parity import MAX_NEW_TOKENS, PROMPT_LENGTHS, make_prompts, reference_greedy
from ports import free_port
from tiny_models import save_model

from kvserve import LLM, SamplingParams
from kvserve.engine.tp_group import WorkerFailed
from kvserve.planner.budget import num_blocks_for_pool
from kvserve.planner.kv import kv_block_bytes
from kvserve.planner.parallel import kv_heads_per_gpu
from kvserve.planner.specs import spec_from_hf_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
COMMON = dict(dtype="float32", device="cpu", max_model_len=512)
# Small enough that prompts are prefilled in chunks and the pool forces preemptions.
CHUNKED_AND_PREEMPTED = dict(num_gpu_blocks_override=40, max_num_batched_tokens=64)
# Mistral's 24-token window keeps two or three blocks a request: a smaller pool preempts it.
POOL_BLOCKS = {"llama": 40, "qwen2": 40, "mistral": 10}


def generate(llm: LLM, prompts=None) -> list[list[int]]:
    outputs = llm.generate(prompts or make_prompts(), GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def assert_same(got, expected, label):
    for index, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{label}: prompt {index} ({PROMPT_LENGTHS[index]} tokens) diverged"


@pytest.fixture(scope="module")
def mqa_model(tmp_path_factory):
    """One KV head for four query heads: at TP 2 each rank keeps a replica of it."""
    folder = tmp_path_factory.mktemp("tiny-mqa")
    return folder, save_model("llama", folder, num_key_value_heads=1)


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.engine.tp.processes]


def gone(pid: int) -> bool:
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return True


def assert_gone(pids: list[int]) -> None:
    assert all(gone(pid) for pid in pids)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_tp2_greedy_matches_transformers_through_chunks_and_preemption(kind, tiny_model_dir):
    folder, hf_model = tiny_model_dir(kind)
    expected = [reference_greedy(hf_model, p, MAX_NEW_TOKENS) for p in make_prompts()]
    llm = LLM(str(folder), tensor_parallel_size=2, **COMMON,
              **(CHUNKED_AND_PREEMPTED | {"num_gpu_blocks_override": POOL_BLOCKS[kind]}))
    try:
        assert_same(generate(llm), expected, f"{kind} TP=2")
        assert llm.engine.scheduler.num_preemptions > 0, "the small pool should have forced preemptions"
        kv = llm.engine.kv_cache
        kv.check_invariants()
        assert kv.num_free_blocks == kv.num_blocks
        pids = worker_pids(llm)
    finally:
        llm.close()
    assert_gone(pids)


def test_kv_heads_fewer_than_ranks_are_replicated(mqa_model):
    folder, hf_model = mqa_model
    expected = [reference_greedy(hf_model, p, MAX_NEW_TOKENS) for p in make_prompts()]
    llm = LLM(str(folder), tensor_parallel_size=2, num_gpu_blocks_override=512, **COMMON)
    try:
        assert llm.engine.loaded.num_kv_heads == 1
        assert kv_heads_per_gpu(spec_from_hf_config(llm.engine.loaded.hf_config), 2) == 1  # the planner agrees
        assert_same(generate(llm), expected, "MQA TP=2")
    finally:
        llm.close()


def test_each_rank_pool_is_the_planners_per_gpu_figure(tiny_model_dir, caplog):
    folder, _ = tiny_model_dir("llama")
    whole = LLM(str(folder), kv_cache_memory=0.01, **COMMON)
    caplog.set_level("INFO", logger="kvserve.engine")
    llm = LLM(str(folder), tensor_parallel_size=2, kv_cache_memory=0.01, **COMMON)
    try:
        spec = spec_from_hf_config(llm.engine.loaded.hf_config)
        block_bytes = kv_block_bytes(spec, 16, "float32", "float32", tensor_parallel_size=2)
        num_blocks = num_blocks_for_pool(int(0.01 * 2**30), block_bytes)
        pool = llm.engine.pool
        assert (pool.block_bytes, pool.num_blocks) == (block_bytes, num_blocks)
        storage = llm.engine.runner.kv_caches
        assert sum(t.numel() * t.element_size() for c in storage for t in c.tensors()) == num_blocks * block_bytes
        assert block_bytes * 2 == whole.engine.pool.block_bytes  # half the KV heads per rank
        # Every rank logs its own pool, of the same size (one block table addresses them all).
        lines = [r.getMessage() for r in caplog.records if "KV cache pool" in r.getMessage()]
        assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"]
        assert all(f"{num_blocks} blocks" in line for line in lines)
        ratio = llm.engine.loaded.weights_bytes / whole.engine.loaded.weights_bytes
        assert 0.5 <= ratio < 0.55  # half of every matrix; the norms are whole on each rank
    finally:
        llm.close()


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_kv_prefix_hits_and_host_tier_under_tp(tiny_model_dir, kv_dtype):
    """int8 KV scales are per (token, head) and int4 keys' per (block, head, channel), so splitting heads leaves
    every value as it was at TP 1 (each rank stages its own heads' filling blocks alike); blocks evicted to the
    host tier carry both ranks' halves and come back whole."""
    folder, _ = tiny_model_dir("llama")
    histories = [[5 + (s * 31 + j * 7) % 300 for j in range(150)] for s in range(4)]
    settings = dict(COMMON, kv_cache_dtype=kv_dtype, num_gpu_blocks_override=24, kv_offloading_size=0.01,
                    max_model_len=256)
    results = []
    for tp in (1, 2):
        llm = LLM(str(folder), tensor_parallel_size=tp, **settings)
        try:
            first = generate(llm, histories)
            again = llm.generate(histories, GREEDY, use_tqdm=False)  # the pool evicted them: from the host tier
            results.append((first, [o.outputs[0].token_ids for o in again], again))
        finally:
            llm.close()
    (first1, again1, _), (first2, again2, outputs2) = results
    assert first2 == first1 and again2 == again1 == first1
    assert sum(o.tier_loaded_tokens.get("host", 0) for o in outputs2) > 0
    assert all(o.num_cached_tokens == 144 for o in outputs2)  # every full block found, in the pool or the tier


def test_a_worker_killed_mid_run_fails_the_engine_naming_its_rank(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    llm = LLM(str(folder), tensor_parallel_size=2, num_gpu_blocks_override=512, **COMMON)
    pids = worker_pids(llm)
    failure: list[BaseException] = []

    def run():
        try:
            llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    assert wait_until(lambda: llm.engine.counters.num_steps > 3, timeout_s=60)
    os.kill(pids[0], signal.SIGKILL)
    killed_at = time.monotonic()
    thread.join(timeout=30)
    assert not thread.is_alive() and time.monotonic() - killed_at < 10
    assert len(failure) == 1 and isinstance(failure[0], WorkerFailed)
    assert "rank 1" in str(failure[0]) and "killed by signal 9" in str(failure[0])
    llm.close()
    assert_gone(pids)


def start_tp_server(folder, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(folder), "--dtype", "float32", "--device",
         "cpu", "--max-model-len", "256", "--num-gpu-blocks-override", "64", "--tensor-parallel-size", "2",
         "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats", "--disable-uvicorn-access-log"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def wait_healthy(process: subprocess.Popen, url: str) -> list[int]:
    """Waits for /health 200; returns the server's child processes (its tensor-parallel workers)."""
    def healthy() -> bool:
        assert process.poll() is None, process.stdout.read()
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    assert wait_until(healthy, timeout_s=120, interval_s=0.2), "server did not come up"
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    # Children of any of its threads: the engine thread, which builds the engine, starts the workers.
    workers = [int(pid) for task in Path(f"/proc/{process.pid}/task").iterdir()
               for pid in (task / "children").read_text().split()]
    assert workers, "the server should have started a worker process"
    return workers


def test_server_with_a_dead_worker_fails_health_then_exits_nonzero(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_tp_server(folder, port)
    try:
        workers = wait_healthy(process, url)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        statuses = []

        def unhealthy_then_gone() -> bool:
            try:
                statuses.append(httpx.get(f"{url}/health", timeout=1).status_code)
            except httpx.TransportError:
                return process.poll() is not None
            return False

        assert wait_until(unhealthy_then_gone, timeout_s=10, interval_s=0.05)
        assert 503 in statuses  # the health check failed before the port closed
        assert process.wait(timeout=10) != 0
        output = process.stdout.read()
        assert "tensor-parallel worker rank 1" in output and "killed by signal 9" in output
        assert_gone(workers)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_killed_server_leaves_no_worker_behind(tiny_model_dir):
    """SIGKILL gives rank 0 no chance to stop anyone: the workers see their pipe close and exit on their own."""
    folder, _ = tiny_model_dir("llama")
    port = free_port()
    process = start_tp_server(folder, port)
    try:
        workers = wait_healthy(process, f"http://127.0.0.1:{port}")
        process.kill()
        process.wait(timeout=10)
        assert wait_until(lambda: all(gone(pid) for pid in workers), timeout_s=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
