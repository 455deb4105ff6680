"""Decode attention bandwidth per KV format: how close the Triton decode kernel comes to the card's memory bandwidth.

    python benchmarks/gpu_decode_bandwidth.py [--out FILE.json] [--dry-run]

Decode attention is memory-bound: each call reads every context token's K and V once and does two multiply-adds
per element read, so its figure of merit is bytes read per second against what the card can move. For each KV
format (bf16, fp8_e4m3, fp8_e5m2, int8, int4) and two batch shapes with Llama-3-8B's heads (32 query heads over 8
KV heads of 128, blocks of 16 tokens, every sequence's blocks scattered over the pool by a shuffled block table):

- bytes moved per call = the K and V bytes of every context token read, data and scales (int4 keys' per-block
  channel bytes spread over the block's tokens); the query and the output are under 0.1% of it and not counted;
- the Triton kernel's seconds per call (CUDA events over --iters calls after --warmup);
- GB/s and its fraction of two peaks: a device-to-device copy measured here (bytes read + written per second, what
  the memory system delivers to a streaming kernel) and the card's nominal figure (H200: 4.8 TB/s);
- the portable torch path's figure for the same call (one gather decoding the blocks to bf16, then two matmuls),
  the path the kernel replaces;
- the kernel's largest deviation from an fp32 reference over the same decoded K/V (finite and within tolerance,
  else the entry is marked not ok and the script exits 1).

The K/V are written through `LayerKVCache.write`, which encodes every format as the engine does (random fp8
bytes could be NaN codes). --dry-run runs tiny shapes on whatever device torch picks (the CPU under
TRITON_INTERPRET=1 in CI): the timings mean nothing there, the code path and the JSON are the same.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

KV_DTYPES = ("bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
MODEL_DTYPE = torch.bfloat16
# Nominal HBM bandwidth by the name torch reports (GB/s = 1e9 bytes/s); the first key found in the name wins.
NOMINAL_PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}
# bf16 output against an fp32 reference over the same decoded K/V: outputs are averages of N(0, 1) values, so
# bf16 rounding alone is ~4e-3; a wrong block or a missed scale is off by O(1).
MAX_ABS_ERROR = 3e-2
SEED = 0


@dataclass(slots=True, frozen=True)
class Shape:
    num_seqs: int
    context_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16

    @property
    def label(self) -> str:
        return f"{self.num_seqs}x{self.context_len}"

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.context_len // self.block_size)


# Llama-3-8B's attention: 8 sequences of 4K tokens (long contexts) and 64 of 1K (a wide batch), 32K / 64K tokens.
GPU_SHAPES = (Shape(8, 4096, 32, 8, 128), Shape(64, 1024, 32, 8, 128))
DRY_RUN_SHAPES = (Shape(2, 40, 4, 2, 32),)


@dataclass(slots=True)
class DecodeCase:
    """One pool in one KV format with the batch that reads it."""

    shape: Shape
    kv_dtype: str
    cache: object  # LayerKVCache
    q: torch.Tensor  # [num_seqs, num_heads, head_dim] in the model dtype
    block_tables: torch.Tensor  # int64 [num_seqs, blocks_per_seq]
    context_lens: torch.Tensor  # int64 [num_seqs]

    @property
    def scale(self) -> float:
        return self.shape.head_dim ** -0.5


def storage_format(kv_dtype: str) -> str | None:
    """allocate_kv_storage's kv_cache_dtype: None keeps the unquantized model dtype."""
    return None if kv_dtype == "bf16" else kv_dtype


def build_case(shape: Shape, kv_dtype: str, device: torch.device) -> DecodeCase:
    """A pool holding exactly the batch's blocks, assigned to the sequences in shuffled order so consecutive
    blocks of a sequence are scattered as in a long-running server, and filled through the cache's writer."""
    from kvserve.cache.storage.kv_storage import allocate_kv_storage

    generator = torch.Generator().manual_seed(SEED)
    num_blocks = shape.num_seqs * shape.blocks_per_seq
    cache = allocate_kv_storage(1, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim, MODEL_DTYPE,
                                device, storage_format(kv_dtype), staging_rows=max(8, shape.num_seqs))[0]
    block_tables = torch.randperm(num_blocks, generator=generator).view(shape.num_seqs, shape.blocks_per_seq)
    positions = torch.arange(shape.context_len)
    slots = (block_tables[:, positions // shape.block_size] * shape.block_size + positions % shape.block_size)
    num_tokens = slots.numel()
    key = torch.randn(num_tokens, shape.num_kv_heads, shape.head_dim, generator=generator).to(MODEL_DTYPE)
    value = torch.randn(num_tokens, shape.num_kv_heads, shape.head_dim, generator=generator).to(MODEL_DTYPE)
    cache.write(slots.flatten().to(device), key.to(device), value.to(device))
    q = torch.randn(shape.num_seqs, shape.num_heads, shape.head_dim, generator=generator).to(MODEL_DTYPE)
    context_lens = torch.full((shape.num_seqs,), shape.context_len, dtype=torch.int64)
    return DecodeCase(shape, kv_dtype, cache, q.to(device), block_tables.to(device), context_lens.to(device))


def bytes_per_token(cache) -> float:
    """K and V bytes per token, scales included: every per-block tensor's bytes over the pool's tokens."""
    num_blocks, block_size = cache.key.shape[:2]
    return sum(t.numel() * t.element_size() for t in cache.tensors()) / (num_blocks * block_size)


def bytes_moved(case: DecodeCase) -> int:
    return round(bytes_per_token(case.cache) * int(case.context_lens.sum()))


def reference_decode(case: DecodeCase, dtype: torch.dtype) -> torch.Tensor:
    """The portable path's arithmetic: gather (and decode) every context token's K/V in `dtype`, then
    softmax(q K^T) V with grouped query heads; [num_seqs, num_heads * head_dim]."""
    shape, cache = case.shape, case.cache
    max_len = int(case.context_lens.max())
    positions = torch.arange(max_len, device=case.q.device)
    slots = case.block_tables[:, positions // shape.block_size] * shape.block_size + positions % shape.block_size
    key, value = cache.gather(slots.flatten(), dtype)
    key = key.view(shape.num_seqs, max_len, shape.num_kv_heads, shape.head_dim)
    value = value.view(shape.num_seqs, max_len, shape.num_kv_heads, shape.head_dim)
    group = shape.num_heads // shape.num_kv_heads
    q = case.q.to(dtype).view(shape.num_seqs, shape.num_kv_heads, group, shape.head_dim)
    scores = torch.einsum("skgd,slkd->skgl", q, key) * case.scale
    padded = positions[None, :] >= case.context_lens[:, None]
    scores = scores.masked_fill(padded[:, None, None, :], float("-inf"))
    probs = scores.float().softmax(-1).to(dtype)
    return torch.einsum("skgl,slkd->skgd", probs, value).reshape(shape.num_seqs, -1)


def triton_decode(case: DecodeCase) -> torch.Tensor:
    from kvserve.model.triton_kernels import decode_attention

    return decode_attention(case.q, case.cache, case.block_tables, case.context_lens, case.scale, 0)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> float:
    """Mean seconds per call: CUDA events on a GPU (the launches queue back to back, as in a forward), the wall
    clock elsewhere."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - started) / iters


def copy_bandwidth_gbps(device: torch.device, num_bytes: int, iters: int, warmup: int) -> float:
    """A device-to-device copy's bytes read + written per second: the practical peak for a streaming kernel."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds = seconds_per_call(lambda: target.copy_(source), device, iters, warmup)
    return 2 * num_bytes / seconds / 1e9


def nominal_peak_gbps(device_name: str) -> float | None:
    return next((gbps for key, gbps in NOMINAL_PEAK_GBPS.items() if key in device_name), None)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"


def fraction(value: float, peak: float | None) -> float | None:
    return None if not peak else value / peak


def measure_case(case: DecodeCase, device: torch.device, iters: int, warmup: int, copy_gbps: float,
                 nominal_gbps: float | None) -> dict:
    """One entry of the JSON: the kernel's and the torch path's speed, and the kernel's deviation."""
    moved = bytes_moved(case)
    out = triton_decode(case)
    synchronize(device)
    error = (out.float() - reference_decode(case, torch.float32)).abs().max().item()
    finite = bool(torch.isfinite(out).all()) and math.isfinite(error)
    kernel_s = seconds_per_call(lambda: triton_decode(case), device, iters, warmup)
    torch_s = seconds_per_call(lambda: reference_decode(case, MODEL_DTYPE), device, max(1, iters // 4), 1)
    gbps = moved / kernel_s / 1e9
    shape = case.shape
    return {
        "kv_dtype": case.kv_dtype, "shape": shape.label, **asdict(shape),
        "bytes_per_token": bytes_per_token(case.cache), "bytes_moved": moved,
        "seconds_per_call": kernel_s, "gbps": gbps,
        "fraction_of_copy_peak": fraction(gbps, copy_gbps), "fraction_of_nominal_peak": fraction(gbps, nominal_gbps),
        "torch_seconds_per_call": torch_s, "torch_gbps": moved / torch_s / 1e9, "speedup_over_torch": torch_s / kernel_s,
        "max_abs_error": error if math.isfinite(error) else None, "finite": finite, "ok": finite and error <= MAX_ABS_ERROR,
    }


def format_entry(entry: dict) -> str:
    nominal = entry["fraction_of_nominal_peak"]
    nominal_text = "" if nominal is None else f" {100 * nominal:5.1f}% of nominal"
    return (f"{entry['kv_dtype']:9} {entry['shape']:8} {entry['bytes_per_token']:7.1f} B/token  "
            f"{entry['seconds_per_call'] * 1e6:9.1f} us  {entry['gbps']:8.1f} GB/s "
            f"{100 * entry['fraction_of_copy_peak']:5.1f}% of copy{nominal_text}  "
            f"torch {entry['torch_gbps']:8.1f} GB/s ({entry['speedup_over_torch']:.1f}x)  "
            f"err {entry['max_abs_error'] if entry['max_abs_error'] is None else format(entry['max_abs_error'], '.1e')}"
            f"{'' if entry['ok'] else '  NOT OK'}")


def write_json(path: Path, report: dict) -> None:
    """Written after every entry: a step cut off by its time limit still leaves what it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(path)


def run(out: Path, dry_run: bool, iters: int, warmup: int, kv_dtypes: tuple[str, ...]) -> int:
    """Measures every (format, shape); returns the exit status (1 when an entry failed or was not ok)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = DRY_RUN_SHAPES if dry_run else GPU_SHAPES
    if dry_run:
        iters, warmup = min(iters, 2), min(warmup, 1)
    name = device_name(device)
    copy_bytes = (8 if dry_run or device.type != "cuda" else 1024) * 2**20
    copy_gbps = copy_bandwidth_gbps(device, copy_bytes, iters, warmup)
    nominal = nominal_peak_gbps(name)
    import triton

    report = {
        "device": name, "torch": torch.__version__, "triton": triton.__version__, "dry_run": dry_run,
        "model_dtype": str(MODEL_DTYPE).removeprefix("torch."), "iters": iters, "warmup": warmup,
        "copy_bandwidth_gbps": copy_gbps, "copy_bytes": copy_bytes, "nominal_peak_gbps": nominal,
        "results": [], "errors": [],
    }
    print(f"{name}: device-to-device copy {copy_gbps:.1f} GB/s (read + written)"
          + ("" if nominal is None else f", nominal {nominal:.0f} GB/s"), flush=True)
    for shape in shapes:
        for kv_dtype in kv_dtypes:
            try:
                case = build_case(shape, kv_dtype, device)
                entry = measure_case(case, device, iters, warmup, copy_gbps, nominal)
                del case
                report["results"].append(entry)
                print(format_entry(entry), flush=True)
            except Exception as exc:  # one format failing must not hide the others' figures
                report["errors"].append({"kv_dtype": kv_dtype, "shape": shape.label, "error": f"{type(exc).__name__}: {exc}"})
                print(f"{kv_dtype:9} {shape.label:8} FAILED: {type(exc).__name__}: {exc}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write_json(out, report)
    failed = report["errors"] or any(not entry["ok"] for entry in report["results"])
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("decode_bandwidth.json"), help="the JSON report")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, 2 timed calls: the code path only")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per figure")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first (compilation, caches)")
    parser.add_argument("--kv-dtypes", default=",".join(KV_DTYPES), help="comma-separated, of " + ", ".join(KV_DTYPES))
    args = parser.parse_args()
    kv_dtypes = tuple(args.kv_dtypes.split(","))
    unknown = set(kv_dtypes) - set(KV_DTYPES)
    if unknown:
        parser.error(f"unknown KV dtypes: {', '.join(sorted(unknown))}")
    torch.manual_seed(SEED)
    with torch.inference_mode():
        status = run(args.out, args.dry_run, args.iters, args.warmup, kv_dtypes)
    print(f"wrote {args.out}", flush=True)
    sys.exit(status)


if __name__ == "__main__":
    main()
