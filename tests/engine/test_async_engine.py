"""AsyncLLMEngine on its own: streams in order, rejections raise, failures reach every waiter, the idle thread
sleeps, shutdown drains within its grace period."""

import asyncio
import time

import pytest
from server_harness import make_engine

from kvserve.engine.async_engine import (
    DrainingError, EngineDeadError, EngineError, EngineState, EngineStoppedError, QueueFullError, RequestCancelled,
)
from kvserve.engine.llm_engine import RequestRejected
from kvserve.engine.sampling_params import SamplingParams


@pytest.fixture
def engine(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    async_engine = make_engine(folder, max_waiting_requests=4)
    async_engine.start()
    return async_engine


def params(max_tokens: int = 8, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


async def collect(stream):
    await stream.accepted()
    outputs = [output async for output in stream]
    stream.close()
    return outputs


def test_outputs_stream_in_order_and_match_the_sync_engine(engine):
    async def run():
        streams = [engine.submit(f"r{i}", [5 + i, 6, 7], params(8)) for i in range(3)]
        return await asyncio.gather(*(collect(s) for s in streams))

    results = asyncio.run(run())
    for outputs in results:
        assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
        final = outputs[-1].outputs[0]
        assert len(final.token_ids) == 8
        assert [t for o in outputs for t in o.outputs[0].delta_token_ids] == final.token_ids
    asyncio.run(engine.shutdown())


def test_rejection_raises_from_accepted(engine):
    async def run():
        stream = engine.submit("bad", [10**6], params())
        with pytest.raises(RequestRejected, match="out of vocabulary"):
            await stream.accepted()
        stream.close()

    asyncio.run(run())
    asyncio.run(engine.shutdown())


def test_step_failure_reaches_every_waiter_and_the_engine_recovers(engine, monkeypatch):
    real_step = engine.engine.step
    monkeypatch.setattr(engine.engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("boom")))

    async def run():
        streams = [engine.submit(f"f{i}", [5, 6, 7], params(20)) for i in range(3)]
        for stream in streams:
            await stream.accepted()
        for stream in streams:
            with pytest.raises(EngineError, match="boom"):
                async for _ in stream:
                    pass
        monkeypatch.setattr(engine.engine, "step", real_step)
        return await collect(engine.submit("after", [5, 6, 7], params(4)))

    outputs = asyncio.run(run())
    assert outputs[-1].finished and engine.state is EngineState.RUNNING
    assert engine.engine.kv_cache.usage == 0.0
    asyncio.run(engine.shutdown())


def test_idle_engine_thread_does_not_spin(engine, monkeypatch):
    calls = {"n": 0}
    real = engine.engine.has_unfinished_requests

    def counting():
        calls["n"] += 1
        return real()

    asyncio.run(collect_one(engine))
    monkeypatch.setattr(engine.engine, "has_unfinished_requests", counting)
    time.sleep(0.3)
    # Asleep on the condition variable: at most the checks of an iteration that was still finishing when the
    # counter went in (on a loaded machine the thread may not have gone to sleep yet), then none; a spinning
    # loop makes thousands of calls in this time.
    settled = calls["n"]
    time.sleep(0.3)
    assert calls["n"] == settled <= 3
    asyncio.run(engine.shutdown())


async def collect_one(engine):
    return await collect(engine.submit("one", [5, 6], params(2)))


def test_close_aborts_and_frees_blocks(engine):
    async def run():
        stream = engine.submit("long", [5, 6, 7], params(200))
        await stream.accepted()
        await stream.__anext__()
        stream.close()
        with pytest.raises(RequestCancelled):
            await stream.__anext__()
        deadline = time.monotonic() + 5
        while engine.snapshot.num_aborted == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    asyncio.run(run())
    snapshot = engine.snapshot
    assert snapshot.num_aborted == 1 and snapshot.stats.num_running == 0 and snapshot.stats.kv_cache_usage == 0.0
    asyncio.run(engine.shutdown())


def test_queue_limit(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    engine = make_engine(folder, max_waiting_requests=2, max_num_seqs=1)  # not started: nothing leaves the queue

    async def run():
        engine.submit("a", [5], params())
        engine.submit("b", [5], params())
        with pytest.raises(QueueFullError):
            engine.submit("c", [5], params())

    asyncio.run(run())


def test_shutdown_lets_running_finish_within_grace_then_aborts(engine, monkeypatch):
    real_step = engine.engine.step

    def slow_step():
        # 240 tokens take 4.8 s or more, past the 2 s grace however fast the machine; 5 tokens leave 1.9 s to
        # spare for a loaded one.
        time.sleep(0.02)
        return real_step()

    monkeypatch.setattr(engine.engine, "step", slow_step)

    async def run():
        quick = engine.submit("quick", [5, 6], params(5))
        slow = engine.submit("slow", [5, 6], params(240))
        quick_outputs = asyncio.create_task(collect(quick))
        slow_outputs = asyncio.create_task(collect(slow))
        await engine.shutdown(grace_period_s=2.0)
        assert (await quick_outputs)[-1].finished
        with pytest.raises(EngineStoppedError):
            await slow_outputs
        with pytest.raises(DrainingError):
            engine.submit("late", [5], params())

    asyncio.run(run())
    assert engine.state is EngineState.STOPPED


def test_a_slow_consumer_gets_merged_outputs(engine):
    async def run():
        stream = engine.submit("slow-reader", [5, 6, 7], params(12))
        await stream.accepted()
        deadline = time.monotonic() + 10
        while engine.snapshot.stats.generation_tokens < 12 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # the loop runs (deliveries arrive) but nobody reads the stream
        await asyncio.sleep(0.05)
        outputs = [output async for output in stream]
        stream.close()
        return outputs

    outputs = asyncio.run(run())
    assert len(outputs) == 1 and outputs[0].finished
    choice = outputs[0].outputs[0]
    assert choice.delta_token_ids == choice.token_ids and len(choice.token_ids) == 12
    assert choice.delta_text == choice.text
    asyncio.run(engine.shutdown())


def test_merged_outputs_keep_every_new_logprob(engine):
    async def run():
        stream = engine.submit("slow-logprobs", [5, 6, 7], params(10, logprobs=2))
        await stream.accepted()
        deadline = time.monotonic() + 10
        while engine.snapshot.stats.generation_tokens < 10 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
        outputs = [output async for output in stream]
        stream.close()
        return outputs

    outputs = asyncio.run(run())
    choice = outputs[-1].outputs[0]
    streamed = [entry for output in outputs for entry in output.outputs[0].delta_logprobs]
    assert [e.token_id for e in streamed] == choice.token_ids and len(streamed) == 10
    asyncio.run(engine.shutdown())


def test_an_engine_that_cannot_recover_is_dead_and_says_so(engine, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.engine, "step", broken)
    monkeypatch.setattr(engine.engine, "abort_request", broken)

    async def run():
        stream = engine.submit("doomed", [5, 6], params(4))
        await stream.accepted()
        with pytest.raises(EngineError, match="device lost"):
            await stream.__anext__()
        stream.close()
        deadline = time.monotonic() + 5
        while engine.is_alive and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError):
            engine.submit("next", [5], params())

    asyncio.run(run())
    assert engine.state is EngineState.DEAD and not engine.is_alive


def test_build_in_thread_builds_and_steps_on_one_thread(tiny_model_dir, monkeypatch):
    """The server's engine is built by the thread that steps it: torch's CPU ops then run on one OpenMP team."""
    import threading

    from kvserve.engine.async_engine import AsyncLLMEngine

    folder, _ = tiny_model_dir("llama")
    threads = {}

    def build():
        threads["build"] = threading.current_thread()
        engine = make_engine(folder).engine
        step = engine.step

        def recording_step():
            threads.setdefault("step", threading.current_thread())
            return step()

        monkeypatch.setattr(engine, "step", recording_step)
        return engine

    async_engine = AsyncLLMEngine.build_in_thread(build)
    assert not async_engine.is_alive  # built, not stepping until started
    async_engine.start()

    async def run():
        return await collect(async_engine.submit("r", [5, 6, 7], params(4)))

    assert len(asyncio.run(run())[-1].outputs[0].token_ids) == 4
    asyncio.run(async_engine.shutdown())
    assert threads["build"] is threads["step"] and threads["build"] is not threading.main_thread()
    assert async_engine.state is EngineState.STOPPED


def test_build_in_thread_raises_what_the_build_raised():
    from kvserve.engine.async_engine import AsyncLLMEngine

    def failing_build():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncLLMEngine.build_in_thread(failing_build)


def test_an_engine_built_in_thread_but_never_started_shuts_down(tiny_model_dir):
    from kvserve.engine.async_engine import AsyncLLMEngine

    folder, _ = tiny_model_dir("llama")
    async_engine = AsyncLLMEngine.build_in_thread(lambda: make_engine(folder).engine)
    asyncio.run(async_engine.shutdown())
    assert not async_engine._thread.is_alive() and async_engine.state is EngineState.STOPPED
