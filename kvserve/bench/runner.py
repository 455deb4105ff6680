"""One benchmark run, end to end: ask the server what it serves, size the text, warm up, scrape /metrics,
drive the load while polling the server's gauges, scrape again, summarize."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console

from kvserve.bench.calibrate import MAX_PROBE_TIMEOUT_S, measure_tokens_per_word
from kvserve.bench.client import CHAT, COMPLETIONS, Target, make_http_client, normalize_base_url
from kvserve.bench.errors import BenchError
from kvserve.bench.file_workload import FileWorkload
from kvserve.bench.loadgen import LoadGenerator, LoadShape
from kvserve.bench.metrics_scrape import GaugePoller, ServerView, scrape, server_view
from kvserve.bench.progress import LiveProgress
from kvserve.bench.records import RequestRecord
from kvserve.bench.server_info import check_fits_context, served_model
from kvserve.bench.sessions import WORKLOADS, Workload
from kvserve.bench.stats import Slo, Summary, summarize
from kvserve.bench.text import TextMaker, WordText, load_tokenizer
from kvserve.bench.workloads import (
    MultiTurnWorkload, PrefixRepetitionWorkload, RandomWorkload, SharedPrefixWorkload,
)

WARMUP_FIRST_SESSION = 1_000_000_000  # warm-up sessions never share their unique text with measured ones


@dataclass(slots=True)
class BenchConfig:
    base_url: str
    workload: str = "shared-prefix"
    model: str | None = None
    endpoint: str = "auto"  # auto | completions | chat
    api_key: str | None = None
    tokenizer: str | None = None
    seed: int = 0
    # load shape
    num_requests: int | None = 100
    duration_s: float | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    warmup: int = 0
    timeout_s: float = 600.0
    check_context: bool = True  # refuse a workload longer than the server's max_model_len
    # sampling
    ignore_eos: bool = False
    temperature: float | None = 0.0
    extra_body: dict = field(default_factory=dict)
    # workload shapes (None: the workload's own default)
    system_prompt_len: int | None = None
    user_len: int | None = None
    input_len: int = 512
    output_len: int | None = None
    range_ratio: float = 0.0
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    num_turns: int = 5
    num_sessions: int | None = None
    think_time_s: float = 0.0
    idle_gap_s: float = 0.0
    idle_gap_every: int = 0
    # results
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    metrics_interval_s: float = 0.5
    scrape_metrics: bool = True
    show_progress: bool = True
    label: str | None = None


@dataclass(slots=True)
class BenchResult:
    label: str
    config: dict
    target: dict  # what was measured: url, model, endpoint, how lengths were sized
    workload: dict
    summary: Summary
    server: ServerView | None
    records: list[RequestRecord]
    notes: list[str] = field(default_factory=list)
    started: str = ""  # wall clock, ISO 8601


def run_benchmark(config: BenchConfig, console: Console | None = None) -> BenchResult:
    return asyncio.run(run_benchmark_async(config, console or Console(stderr=True)))


async def run_benchmark_async(config: BenchConfig, console: Console) -> BenchResult:
    base_url = normalize_base_url(config.base_url)
    notes: list[str] = []
    async with make_http_client(config.timeout_s) as http:
        model = await served_model(http, base_url, config.api_key, config.model)
        target = Target(base_url, model.name, COMPLETIONS, config.api_key, config.temperature, config.ignore_eos,
                        dict(config.extra_body))
        text, length_source = await text_maker(http, target, config, notes)
        workload = build_workload(config, text)
        if config.check_context:
            check_fits_context(model, workload.longest_request())
        target.endpoint = choose_endpoint(config.endpoint, workload)
        shape = load_shape(config, workload)
        generator = LoadGenerator(http, target, workload, config.timeout_s, config.seed)
        await warm_up(generator, config, notes)
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        before = await scrape(http, base_url) if config.scrape_metrics else None
        run, gauges = await measured_run(generator, shape, http, base_url, config, console, before is not None)
        after = await scrape(http, base_url) if before is not None else None
    if before is None and config.scrape_metrics:
        notes.append("the server exports no Prometheus /metrics: server-side figures are missing")
    slo = Slo(config.slo_ttft_ms, config.slo_tpot_ms)
    return BenchResult(
        label=config.label or f"{workload.name}@{base_url}",
        config=config_dict(config),
        target={"base_url": base_url, "model": target.model, "endpoint": target.endpoint,
                "max_model_len": model.max_model_len, "lengths": length_source},
        workload=workload.describe() | {"num_requests": shape.num_requests, "duration_s": shape.duration_s},
        summary=summarize(run.records, run.elapsed_s, slo),
        server=server_view(before, after, gauges, run.elapsed_s),
        records=run.records,
        notes=notes,
        started=started,
    )


async def text_maker(http: httpx.AsyncClient, target: Target, config: BenchConfig,
                     notes: list[str]) -> tuple[TextMaker, str]:
    if config.tokenizer:
        return load_tokenizer(config.tokenizer), f"exact: tokenizer {config.tokenizer}"
    tokens_per_word = None
    for endpoint in (CHAT, COMPLETIONS) if config.endpoint == CHAT else (COMPLETIONS, CHAT):
        probe_target = Target(target.base_url, target.model, endpoint, target.api_key)
        tokens_per_word = await measure_tokens_per_word(http, probe_target, min(config.timeout_s, MAX_PROBE_TIMEOUT_S))
        if tokens_per_word is not None:
            break
    if tokens_per_word is None:
        notes.append("could not measure tokens per word (the server reports no usage.prompt_tokens): "
                      "lengths assume one token per word")
        return WordText(1.0), "assumed: 1 token per word"
    return WordText(tokens_per_word), f"calibrated: {tokens_per_word:.3f} tokens per word"


def build_workload(config: BenchConfig, text: TextMaker) -> Workload:
    name, seed = config.workload, config.seed

    def pick(value, default):
        return default if value is None else value

    if name == "shared-prefix":
        return SharedPrefixWorkload(text, seed, pick(config.system_prompt_len, 2048), pick(config.user_len, 32),
                                    pick(config.output_len, 64))
    if name == "multi-turn":
        return MultiTurnWorkload(text, seed, config.num_turns, pick(config.system_prompt_len, 512),
                                 pick(config.user_len, 64), pick(config.output_len, 64), config.think_time_s,
                                 config.idle_gap_s, config.idle_gap_every)
    if name == "random":
        return RandomWorkload(text, seed, config.input_len, pick(config.output_len, 128), config.range_ratio)
    if name == "prefix-repetition":
        return PrefixRepetitionWorkload(text, seed, config.num_requests or 1000, config.prefix_len, config.suffix_len,
                                        config.num_prefixes, pick(config.output_len, 128))
    if name.startswith("file:"):
        return FileWorkload(Path(name[len("file:"):]), text, config.output_len)
    raise BenchError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")


def choose_endpoint(endpoint: str, workload: Workload) -> str:
    if endpoint == "auto":
        return CHAT if workload.prefers_chat else COMPLETIONS
    if endpoint not in (CHAT, COMPLETIONS):
        raise BenchError(f"--endpoint must be auto, completions or chat, not {endpoint!r}")
    return endpoint


def load_shape(config: BenchConfig, workload: Workload) -> LoadShape:
    num_requests = config.num_requests
    if config.num_sessions is not None:  # multi-turn: sessions x turns, unless --num-requests cuts it shorter
        by_sessions = config.num_sessions * len(workload.session(0).turns)
        num_requests = by_sessions if num_requests is None else min(num_requests, by_sessions)
    if num_requests is None and config.duration_s is None:
        raise BenchError("give --num-requests or --duration (or both: whichever comes first ends the run)")
    if config.request_rate == math.inf and config.max_concurrency is None and num_requests is None:
        raise BenchError("a --duration run without --request-rate needs --max-concurrency")
    return LoadShape(config.request_rate, config.burstiness, config.max_concurrency, num_requests, config.duration_s)


async def warm_up(generator: LoadGenerator, config: BenchConfig, notes: list[str]) -> None:
    """--warmup requests, closed loop, not measured: loads lazy kernels and the shared prefixes the
    production traffic would have found cached; counters are scraped after it."""
    if config.warmup <= 0:
        return
    shape = LoadShape(num_requests=config.warmup, max_concurrency=min(config.warmup, config.max_concurrency or 8))
    run = await generator.run(shape, first_session=WARMUP_FIRST_SESSION)
    failed = [r for r in run.records if not r.ok]
    if failed:
        notes.append(f"{len(failed)} of {len(run.records)} warm-up requests failed ({failed[0].error_kind}: "
                     f"{failed[0].error_message})")


async def measured_run(generator: LoadGenerator, shape: LoadShape, http: httpx.AsyncClient, base_url: str,
                       config: BenchConfig, console: Console, poll_gauges: bool):
    poller = GaugePoller(http, base_url, time.perf_counter(), config.metrics_interval_s)
    polling = asyncio.create_task(poller.poll_forever()) if poll_gauges else None
    progress = LiveProgress(shape.num_requests, console) if config.show_progress else None
    generator.on_record = progress.record_done if progress else None
    try:
        with progress or contextlib.nullcontext():
            run = await generator.run(shape)
    finally:
        if polling is not None:
            polling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await polling
    shift = poller.started_at - run.started_at  # put gauge times on the run's clock
    for sample in poller.samples:
        sample.t_s += shift
    return run, poller.samples


def config_dict(config: BenchConfig) -> dict:
    values = {name: getattr(config, name) for name in config.__dataclass_fields__}
    values.pop("api_key")  # never written to a results file
    values["request_rate"] = "inf" if math.isinf(config.request_rate) else config.request_rate
    return values
