"""Tensor-parallel workers on bad days: they start whatever the main program is (standard input, a script with
no `__main__` guard), a worker that dies or stops answering, before or after the rendezvous, fails the engine
within a bounded time naming its rank, its exit status and its last stderr lines, and two tensor-parallel
engines live side by side in one process, each with its own process group."""

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
from test_engine_parity import reference_greedy
from ports import free_port
from test_tensor_parallel import COMMON, assert_gone, start_tp_server, wait_healthy, worker_pids

from kvserve import LLM, SamplingParams
from kvserve.engine.tp_group import WorkerFailed

# Generous, and far below the 300 s torch's collectives and store wait for a peer by default.
FAILURE_BOUND_S = 60
# A whole engine's start on a busy 2-core machine, as a program of its own.
PROGRAM_BOUND_S = 240
PROMPT = [5, 6, 7, 8, 9]
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

PROGRAM = """\
from kvserve import LLM, SamplingParams
llm = LLM({folder!r}, tensor_parallel_size=2, dtype="float32", device="cpu", max_model_len=512)
params = SamplingParams(temperature=0.0, max_tokens={new_tokens}, ignore_eos=True)
print("TOKENS", list(llm.generate([{prompt}], params, use_tqdm=False)[0].outputs[0].token_ids))
llm.close()
"""


def greedy_tokens(llm: LLM) -> list[int]:
    return list(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def run_program(command: list[str], stdin: str | None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=PROGRAM_BOUND_S,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the program did not finish within {PROGRAM_BOUND_S} s; stderr tail: {str(exc.stderr)[-2000:]}")


@pytest.mark.parametrize("source", ["stdin", "script without a main guard"])
def test_a_program_from_stdin_or_an_unguarded_script_runs_tensor_parallel(source, tiny_model_dir, tmp_path):
    folder, hf_model = tiny_model_dir("llama")
    program = PROGRAM.format(folder=str(folder), new_tokens=NEW_TOKENS, prompt=PROMPT)
    if source == "stdin":
        result = run_program([sys.executable, "-"], program)
    else:
        script = tmp_path / "compare.py"
        script.write_text(program)
        result = run_program([sys.executable, str(script)], None)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = reference_greedy(hf_model, PROMPT, NEW_TOKENS)
    assert f"TOKENS {expected}" in result.stdout


def start_in_thread(folder) -> tuple[threading.Thread, list]:
    """Builds a TP 2 engine in a thread; the list receives the engine or the exception."""
    result: list = []

    def build():
        try:
            result.append(LLM(str(folder), tensor_parallel_size=2, **COMMON))
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            result.append(exc)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    return thread, result


def worker_pids_of(pid: int) -> list[int]:
    """The process's children that are tensor-parallel workers (ours, or multiprocessing-spawned ones, not its
    resource tracker)."""
    pids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except FileNotFoundError:
                continue
            if "tp_worker" in command or "spawn_main" in command:
                pids.append(int(pid))
    return pids


def assert_start_failed_in_bound(thread: threading.Thread, result: list, since: float) -> WorkerFailed:
    thread.join(timeout=FAILURE_BOUND_S)
    assert not thread.is_alive(), f"the engine was still starting {FAILURE_BOUND_S} s after its worker failed"
    assert time.monotonic() - since < FAILURE_BOUND_S
    assert len(result) == 1 and isinstance(result[0], WorkerFailed), result
    return result[0]


def test_a_worker_killed_while_starting_fails_the_start_naming_rank_and_signal(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    thread, result = start_in_thread(folder)
    assert wait_until(lambda: worker_pids_of(os.getpid()), timeout_s=30, interval_s=0.01), "no worker appeared"
    pid = worker_pids_of(os.getpid())[0]
    os.kill(pid, signal.SIGKILL)  # long before it joins: importing torch alone takes longer than this
    error = assert_start_failed_in_bound(thread, result, time.monotonic())
    assert "rank 1" in str(error) and "killed by signal 9" in str(error)
    assert_gone([pid])


FAILING_WORKER = """\
import os, sys
if any("tp_worker" in arg or "spawn_main" in arg for arg in sys.orig_argv):
    sys.stderr.write("worker cannot start: the accelerator fell off the bus\\n")
    sys.stderr.flush()
    os._exit(3)
"""


def test_a_worker_that_exits_while_starting_is_named_with_its_exit_code_and_stderr(tiny_model_dir, tmp_path,
                                                                                    monkeypatch):
    folder, _ = tiny_model_dir("llama")
    # Python imports sitecustomize at start: this one makes only the workers fail, as a broken node would.
    (tmp_path / "sitecustomize.py").write_text(FAILING_WORKER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    started = time.monotonic()
    thread, result = start_in_thread(folder)
    error = assert_start_failed_in_bound(thread, result, started)
    message = str(error)
    assert "rank 1" in message and "exited with code 3" in message
    assert "the accelerator fell off the bus" in message  # its last stderr line


def run_until_failure(llm: LLM) -> tuple[threading.Thread, list]:
    failure: list = []

    def run():
        try:
            llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, failure


def test_a_worker_stopped_mid_run_fails_the_engine_naming_its_rank(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    llm = LLM(str(folder), tensor_parallel_size=2, num_gpu_blocks_override=512, **COMMON)
    pids = worker_pids(llm)
    try:
        thread, failure = run_until_failure(llm)
        assert wait_until(lambda: llm.engine.counters.num_steps > 3, timeout_s=60)
        os.kill(pids[0], signal.SIGSTOP)
        stopped_at = time.monotonic()
        thread.join(timeout=FAILURE_BOUND_S)
        assert not thread.is_alive() and time.monotonic() - stopped_at < FAILURE_BOUND_S
        assert len(failure) == 1 and isinstance(failure[0], WorkerFailed), failure
        assert "rank 1" in str(failure[0]) and "stopped answering" in str(failure[0])
    finally:
        resume_and_kill(pids)
        llm.close()
    assert_gone(pids)


def resume_and_kill(pids: list[int]) -> None:
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def test_a_server_with_a_stopped_worker_fails_its_requests_and_health(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_tp_server(folder, port)
    workers = []
    try:
        wait_healthy(process, url)
        workers = worker_pids_of(process.pid)
        os.kill(workers[0], signal.SIGSTOP)
        stopped_at = time.monotonic()
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=FAILURE_BOUND_S)
        assert response.status_code >= 500 and "rank 1" in response.text

        def health_fails() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code != 200
            except httpx.TransportError:
                return True  # the server has gone: it failed

        assert wait_until(health_fails, timeout_s=FAILURE_BOUND_S - (time.monotonic() - stopped_at))
        assert process.wait(timeout=30) != 0
        output = process.stdout.read()
        assert "tensor-parallel worker rank 1" in output and "stopped answering" in output
        assert_gone(workers)
    finally:
        resume_and_kill(workers)
        if process.poll() is None:
            process.kill()
            process.wait()


def test_two_tensor_parallel_engines_work_side_by_side_in_one_process(tiny_model_dir):
    (llama, llama_hf), (qwen, qwen_hf) = tiny_model_dir("llama"), tiny_model_dir("qwen2")
    expected = [reference_greedy(model, PROMPT, NEW_TOKENS) for model in (llama_hf, qwen_hf)]
    first = LLM(str(llama), tensor_parallel_size=2, **COMMON)
    second = None
    try:
        second = LLM(str(qwen), tensor_parallel_size=2, **COMMON)
        pids = worker_pids(first) + worker_pids(second)
        assert [greedy_tokens(first), greedy_tokens(second)] == expected
        first.close()  # closing one engine's group leaves the other's working
        assert greedy_tokens(second) == expected[1]
    finally:
        first.close()
        if second is not None:
            second.close()
    assert_gone(pids)


def test_the_worker_timeout_is_configurable_in_seconds(monkeypatch):
    from kvserve.engine.tp_group import DEFAULT_WORKER_TIMEOUT_S, WORKER_TIMEOUT_ENV, worker_timeout_s

    monkeypatch.delenv(WORKER_TIMEOUT_ENV, raising=False)
    assert worker_timeout_s() == DEFAULT_WORKER_TIMEOUT_S < FAILURE_BOUND_S
    monkeypatch.setenv(WORKER_TIMEOUT_ENV, "7.5")
    assert worker_timeout_s() == 7.5
    for bad in ("0", "-3", "soon", "nan"):
        monkeypatch.setenv(WORKER_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=WORKER_TIMEOUT_ENV):
            worker_timeout_s()
