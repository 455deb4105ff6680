"""KV tiers below the pool (host memory, disk): evicted sessions resume without re-prefill, with the tokens a pool
that never evicts gives; the disk tier survives a restart and never reads a file that does not match."""

import logging
import os
import subprocess
import time
from pathlib import Path

import pytest

from kvserve.cache.storage.block_file import LAYOUT_VERSION, MAGIC, SUFFIX, encode_block_file
from kvserve.engine.llm import LLM
from kvserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
HISTORIES = [[5 + (s * 31 + j * 7) % 300 for j in range(150)] for s in range(4)]
COMMON = dict(dtype="float32", device="cpu", max_model_len=256)
SMALL_POOL = 24  # blocks: 384 tokens, so four 150-token sessions evict each other


def first_turns(llm):
    outputs = llm.generate(HISTORIES, GREEDY, use_tqdm=False)
    return [h + o.outputs[0].token_ids + [7, 8, 9, 10] for h, o in zip(HISTORIES, outputs)]


def second_turns(llm, prompts):
    return llm.generate(prompts, GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama")[0])


@pytest.fixture(scope="module")
def never_evicting(model):
    """The reference: a pool big enough that every session's history stays cached."""
    llm = LLM(model, num_gpu_blocks_override=400, **COMMON)
    turns = first_turns(llm)
    return turns, [o.outputs[0].token_ids for o in second_turns(llm, turns)]


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_host_tier_resumes_evicted_sessions_without_recompute(model, never_evicting):
    turns, expected = never_evicting
    without = LLM(model, num_gpu_blocks_override=SMALL_POOL, **COMMON)
    first_turns(without)
    recomputed = second_turns(without, turns)
    assert tokens(recomputed) == expected
    assert sum(o.num_cached_tokens for o in recomputed) < 144  # evicted: mostly recomputed

    llm = LLM(model, num_gpu_blocks_override=SMALL_POOL, kv_offloading_size=0.01, **COMMON)
    first_turns(llm)
    resumed = second_turns(llm, turns)
    assert tokens(resumed) == expected
    # Every full block of each history (9 x 16 tokens) is a hit: in the pool or loaded from the host tier.
    assert [o.num_cached_tokens for o in resumed] == [144] * 4
    assert sum(o.tier_loaded_tokens.get("host", 0) for o in resumed) >= 144
    host = llm.engine.stats().tiers["host"]
    assert host.hits > 0 and host.loaded_bytes == host.hits * llm.engine.tiers.copier.payload_bytes
    assert host.used_bytes <= host.capacity_bytes
    llm.engine.kv_cache.check_invariants()


def test_quantized_blocks_offload_and_load_back_as_they_are(model):
    reference = LLM(model, num_gpu_blocks_override=400, kv_cache_dtype="int4", **COMMON)
    turns = first_turns(reference)
    expected = tokens(second_turns(reference, turns))
    llm = LLM(model, num_gpu_blocks_override=SMALL_POOL, kv_offloading_size=0.01, kv_cache_dtype="int4", **COMMON)
    first_turns(llm)
    resumed = second_turns(llm, turns)
    assert tokens(resumed) == expected and sum(o.tier_loaded_tokens.get("host", 0) for o in resumed) > 0


@pytest.mark.parametrize("recopied", [False, True])
def test_disk_tier_survives_a_restart(model, never_evicting, tmp_path, recopied):
    turns, expected = never_evicting
    first = LLM(model, num_gpu_blocks_override=SMALL_POOL, kv_disk_path=str(tmp_path), **COMMON)
    first_turns(first)
    first.close()  # the pool's and the host tier's blocks are written out too
    if recopied:  # the checkpoint copied again (a new pod, a restored volume): same bytes, new times
        later = time.time() + 3600
        for file in Path(model).iterdir():
            os.utime(file, (later, later))
    restarted = LLM(model, num_gpu_blocks_override=SMALL_POOL, kv_disk_path=str(tmp_path), **COMMON)
    resumed = second_turns(restarted, turns)
    assert tokens(resumed) == expected
    history_tokens = 4 * 144
    loaded = sum(o.tier_loaded_tokens.get("disk", 0) for o in resumed)
    assert loaded >= 0.9 * history_tokens


def test_a_changed_checkpoint_or_kv_format_leaves_no_orphans(model, tmp_path):
    """Blocks another fingerprint wrote are removed at start: a new KV format does not grow the folder by a
    --kv-disk-size each time."""
    first = LLM(model, num_gpu_blocks_override=SMALL_POOL, kv_disk_path=str(tmp_path), **COMMON)
    first_turns(first)
    first.close()
    written = {path.name for path in tmp_path.glob(f"*{SUFFIX}")}
    assert written
    other_format = LLM(model, num_gpu_blocks_override=SMALL_POOL, kv_disk_path=str(tmp_path), kv_cache_dtype="int8",
                       **COMMON)
    try:
        assert not written & {path.name for path in tmp_path.glob(f"*{SUFFIX}")}
    finally:
        other_format.close()


def test_shutdown_saving_stops_at_its_timeout(model, tmp_path, caplog):
    def saved_at_close(timeout: float) -> tuple[int, int]:
        folder = tmp_path / f"timeout-{timeout}"
        llm = LLM(model, num_gpu_blocks_override=SMALL_POOL, kv_disk_path=str(folder), kv_disk_save_timeout=timeout,
                  **COMMON)
        first_turns(llm)
        llm.engine.tiers.tier("disk").flush()
        before = len(list(folder.glob(f"*{SUFFIX}")))  # what evictions wrote while serving
        llm.close()
        return before, len(list(folder.glob(f"*{SUFFIX}")))

    with caplog.at_level(logging.WARNING, logger="kvserve.cache"):
        before, after = saved_at_close(0)
    assert after == before  # the pool's cached blocks were not saved: the deadline had passed
    assert any("deadline" in record.message for record in caplog.records)
    before, after = saved_at_close(30)
    assert after > before


def _write_files(folder: Path, payload_bytes: int, fingerprint: str) -> dict[str, Path]:
    good = encode_block_file(fingerprint, bytes(payload_bytes))
    files = {
        "garbage": b"not a block file at all",
        "truncated": good[: len(good) // 2],
        "foreign": encode_block_file("another-model", bytes(payload_bytes)),
        "stale": good.replace(f'"layout": {LAYOUT_VERSION}'.encode(), f'"layout": {LAYOUT_VERSION - 1}'.encode()),
    }
    paths = {}
    for index, (name, data) in enumerate(files.items()):
        path = folder / f"{index:032x}{SUFFIX}"
        path.write_bytes(data)
        paths[name] = path
    return paths


def test_bad_tier_files_are_removed_and_recomputed(model, never_evicting, tmp_path, caplog):
    turns, expected = never_evicting
    first = LLM(model, num_gpu_blocks_override=SMALL_POOL, kv_disk_path=str(tmp_path), **COMMON)
    first_turns(first)
    disk = first.engine.tiers.tier("disk")
    first.close()
    bad = _write_files(tmp_path, disk.payload_bytes, disk.fingerprint)
    # A real block whose payload got corrupted after it was written: its header still matches.
    victim = sorted(p for p in tmp_path.glob(f"*{SUFFIX}") if p not in bad.values())[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="kvserve.cache"):
        restarted = LLM(model, num_gpu_blocks_override=SMALL_POOL, kv_disk_path=str(tmp_path), **COMMON)
        assert restarted.engine.tiers.tier("disk").removed_files == len(bad)
        assert not any(path.exists() for path in bad.values())
        resumed = second_turns(restarted, turns)
    assert tokens(resumed) == expected  # never wrong K/V: the corrupt block was recomputed
    assert any("corrupt" in record.message for record in caplog.records)
    assert not victim.exists()
    restarted.engine.kv_cache.check_invariants()


def test_a_full_disk_degrades_to_recompute(model, never_evicting, tmp_path, caplog):
    turns, expected = never_evicting
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 64 KiB tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        with caplog.at_level(logging.WARNING, logger="kvserve.cache"):
            llm = LLM(model, num_gpu_blocks_override=SMALL_POOL, kv_disk_path=str(mount_point), **COMMON)
            first_turns(llm)
            llm.engine.tiers.tier("disk").flush()
            assert tokens(second_turns(llm, turns)) == expected
            llm.close()
        assert any("cannot write" in record.message for record in caplog.records)
        assert sum(f.stat().st_size for f in mount_point.iterdir()) <= 64 * 1024
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def test_tier_size_limits_hold(model, tmp_path):
    block = LLM(model, num_gpu_blocks_override=SMALL_POOL, kv_offloading_size=0.01, **COMMON).engine.tiers.copier
    gib = 2**30
    llm = LLM(model, num_gpu_blocks_override=SMALL_POOL, kv_offloading_size=3 * block.payload_bytes / gib,
              kv_disk_path=str(tmp_path), kv_disk_size=5.5 * (block.payload_bytes + 300) / gib, **COMMON)
    first_turns(llm)
    llm.engine.tiers.tier("disk").flush()
    host, disk = llm.engine.tiers.tier("host"), llm.engine.tiers.tier("disk")
    assert 0 < host.used_bytes <= 3 * block.payload_bytes and len(host.entries) <= 3
    on_disk = sum(f.stat().st_size for f in tmp_path.glob(f"*{SUFFIX}"))
    assert 0 < on_disk == disk.used_bytes <= disk.capacity_bytes
    assert all(f.read_bytes().startswith(MAGIC) for f in tmp_path.glob(f"*{SUFFIX}"))


def test_tiers_need_prefix_caching(model, tmp_path):
    with pytest.raises(ValueError, match="need prefix caching"):
        LLM(model, kv_offloading_size=1, enable_prefix_caching=False, **COMMON)
    with pytest.raises(ValueError, match="kv-offloading-size must be > 0"):
        LLM(model, kv_offloading_size=0, **COMMON)


def test_server_reports_tier_loads_in_usage_and_metrics(tiny_model_dir):
    from server_harness import start_server

    folder, _ = tiny_model_dir("llama")
    running = start_server(folder, num_gpu_blocks_override=SMALL_POOL, kv_offloading_size=0.01, max_model_len=256)
    try:
        client = running.openai()
        histories = [" ".join(f"session {s} line {i} of its history" for i in range(5)) for s in range(4)]
        for text in histories:
            client.completions.create(model="tiny-llama", prompt=text, max_tokens=4, temperature=0)
        again = client.completions.create(model="tiny-llama", prompt=histories[0], max_tokens=4, temperature=0)
        details = again.usage.prompt_tokens_details
        assert details.cached_tokens > 0 and details.tier_loaded_tokens["host"] > 0
        assert details.computed_tokens == again.usage.prompt_tokens - details.cached_tokens
        metrics = running.metrics()
        assert metrics["kvserve:kv_tier_hits_total{tier=host}"] > 0
        assert metrics["kvserve:kv_tier_bytes_total{direction=out,tier=host}"] > 0
        assert metrics["kvserve:kv_tier_load_seconds_count{tier=host}"] == metrics["kvserve:kv_tier_hits_total{tier=host}"]
    finally:
        running.stop()



def test_idle_sessions_leave_the_pool_for_the_host_tier_and_resume_from_it(model, never_evicting):
    """--kv-idle-offload-seconds: a finished session's blocks move to the host tier once it is idle that long
    (the pool keeps room for others without evicting), and its next turn loads them back."""
    turns, expected = never_evicting
    llm = LLM(model, num_gpu_blocks_override=400, kv_offloading_size=0.01, kv_idle_offload_seconds=30, **COMMON)
    engine = llm.engine
    for index, history in enumerate(HISTORIES):
        engine.add_request(f"turn1-{index}", history, GREEDY, session_id=f"user-{index}")
    while engine.has_unfinished_requests():
        engine.step()
    cached_before = engine.kv_cache.num_cached_blocks
    assert engine.offload_idle_sessions() == 0 and 0 < engine.idle_offload_wait() <= 30  # not idle yet
    import time

    moved = engine.offload_idle_sessions(now=time.monotonic() + 31)
    assert moved == 4 * 9 and engine.kv_cache.num_cached_blocks == cached_before - moved
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert engine.idle_offload_wait() is None  # every session moved and forgotten
    resumed = second_turns(llm, turns)
    assert tokens(resumed) == expected
    assert [o.tier_loaded_tokens.get("host", 0) for o in resumed] == [144] * 4
    engine.kv_cache.check_invariants()


def test_idle_offload_needs_a_tier(model):
    with pytest.raises(ValueError, match="kv-idle-offload-seconds moves"):
        LLM(model, kv_idle_offload_seconds=60, **COMMON)


def test_the_server_offloads_an_idle_users_session_by_itself(tiny_model_dir):
    """Through the server: `user` names the session; the engine thread moves its blocks while nothing else
    arrives, and the next turn of that user loads them from the host tier."""
    import time

    from server_harness import start_server

    folder, _ = tiny_model_dir("llama")
    running = start_server(folder, kv_offloading_size=0.01, kv_idle_offload_seconds=0.3, max_model_len=256)
    try:
        client = running.openai()
        text = " ".join(f"the history of alice, line {i}" for i in range(6))
        first = client.completions.create(model="tiny-llama", prompt=text, max_tokens=4, temperature=0, user="alice")
        deadline = time.monotonic() + 10
        while running.metrics().get("kvserve:kv_tier_offloaded_blocks_total{tier=host}", 0) == 0:
            assert time.monotonic() < deadline, "the idle session was never offloaded"
            time.sleep(0.1)
        again = client.completions.create(model="tiny-llama", prompt=text + first.choices[0].text, max_tokens=4,
                                          temperature=0, user="alice")
        assert again.usage.prompt_tokens_details.tier_loaded_tokens["host"] > 0
    finally:
        running.stop()
