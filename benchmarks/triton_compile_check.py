"""Compiles every Triton kernel of kvserve/model/triton_kernels/, in every specialization the engine launches,
ahead of time for a CUDA GPU, with no GPU here: Triton's front end, its NVIDIA backend and the ptxas its wheel
ships. A kernel that the interpreter runs (the tests on CPU) may still fail to compile (a type the GPU path
rejects, an API an older Triton lacks, a dot shape below 16); this finds that before a GPU machine does.

    python benchmarks/triton_compile_check.py [--arch 90] [--quick] [--jobs N] [--filter TEXT] [--verbose]
    PYTHONPATH=/tmp/triton36 python benchmarks/triton_compile_check.py   # another Triton (here 3.6, the GPU image's)

--arch 90 (default, H100/H200) or 80 (A100), ...: the target GPUTarget("cuda", ARCH, 32).
--quick: a representative subset (every kernel at an unquantized bf16 cache and at int4, or int8 for the
         writer, head_dim 128, GQA 4): what tests/model/test_triton_compile.py runs.
--jobs N: compile in N processes (default: the CPU count, at most 8).
--filter TEXT: only the specializations whose line contains TEXT (e.g. "_prefill", "kv=int4", "hd=80").
--list: print the specializations, compile nothing.
--verbose: the full text of every error (by default each distinct error is printed once, after the table).

Prints one line per kernel x specialization: OK, the compile time, the registers per thread (255 is the most a
thread gets), "spills": the local memory per thread in 4-byte words (ptxas's stack frame, which is where it
spills: what Triton's n_spills reports on a GPU; anything but 0 is a red flag, shown with ptxas's bytes of spill
stores) and the shared memory Triton allocates (bytes); or FAIL, where, and the innermost error. Exits 1 when any
failed, 2 when this Triton cannot compile for CUDA (no NVIDIA backend or ptxas).

The arguments are those of the host wrappers (kv_write.write_kv, decode_attention.decode_attention and
_shared_chunks, prefill_attention.prefill_attention, launch.kv_arguments), on small CPU tensors of the pool's real
dtypes (allocate_kv_storage builds the cache), passed through Triton's own launch-time binder, so the signature,
the constexprs and the specializations (16-byte aligned pointers, ints divisible by 16, an int equal to 1 made
a constant) are those a launch on the GPU would compile. _launch repeats the wrappers' CUDA-side choices (tile
sizes and num_warps from the modules' constants): a wrapper that chooses differently must be followed there. TRITON_INTERPRET must be unset (this script unsets it
for itself: the kernels must be JITFunctions, not interpreted ones). Triton's cache goes to a fresh temporary
folder unless --cache-dir says otherwise, so every figure is a real compile.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODEL_DTYPES = ("bfloat16", "float16", "float32")
QUANTIZED = ("fp8_e4m3", "fp8_e5m2", "int8", "int4")
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# (head_dim, GQA group, KV heads): Llama-2-7B-like MHA, Llama-3-8B, Qwen2.5-7B (group 7 -> GROUP_PAD 8), at head
# dims 128, 64 and 80 (phi-2's, padded to 128), and 1 KV head (a tensor-parallel shard), which Triton makes a
# constant.
SHAPES = [(hd, group, {1: 32, 4: 8, 7: 4}[group]) for hd in (128, 64, 80) for group in (1, 4, 7)] + [(128, 4, 1)]
BLOCK_SIZE = 16
# Decode launches: (splits of the context, splits of a shared prefix or 0, sliding window or 0). One split and no
# sharing gives num_parts 1 (a constant to Triton); long contexts split, and shared prefixes add parts (read with
# no window). A window of 1000 is an int no power of two above 8 divides: no divisibility hint, unlike 0.
DECODE_SPLITS = ((1, 0, 1000), (8, 4, 0))


@dataclass
class Spec:
    kernel: str
    label: str
    build: tuple  # (builder name, arguments): run in whichever process compiles it
    line: str = field(init=False)

    def __post_init__(self):
        self.line = f"{self.kernel:<21} {self.label}"


def _specs(quick: bool) -> list[Spec]:
    specs = []

    def add(kernel, label, *build):
        specs.append(Spec(kernel, label, build))

    if quick:
        for kv in (None, "int4"):
            shape = (128, 4, 8)
            add("_decode_parts", _label("bfloat16", kv, shape, "splits=8+4"), "decode", "bfloat16", kv, shape, 8, 4,
                0)
            add("_decode_shared_parts", _label("bfloat16", kv, shape, "splits=4"), "shared", "bfloat16", kv, shape, 8,
                4, 0)
            add("_prefill", _label("bfloat16", kv, shape), "prefill", "bfloat16", kv, shape)
        for kv in (None, "int8"):
            add("_write_vectors", _label("bfloat16", kv, (128, 0, 8)), "write", "bfloat16", kv, (128, 0, 8))
        add("_merge_parts", "out=bf16 hd=128 parts=12", "merge", "bfloat16", 128, 12)
        return specs

    caches = [None, *QUANTIZED]  # None: the model dtype (--kv-cache-dtype auto)
    for model in MODEL_DTYPES:
        for kv in caches:
            for shape in SHAPES:
                for splits, shared, window in DECODE_SPLITS:
                    add("_decode_parts", _label(model, kv, shape, _decode_extra(splits, shared, window)), "decode",
                        model, kv, shape, splits, shared, window)
    # An unquantized cache in another dtype than the model's (--kv-cache-dtype bfloat16 under fp32 weights, ...).
    crossed = [(model, kv) for model in MODEL_DTYPES for kv in MODEL_DTYPES if kv != model]
    for model, kv in crossed:
        for splits, shared, window in DECODE_SPLITS:
            add("_decode_parts", _label(model, kv, (128, 4, 8), _decode_extra(splits, shared, window)), "decode",
                model, kv, (128, 4, 8), splits, shared, window)
    for model in MODEL_DTYPES:
        for kv in caches:
            for shape in SHAPES:
                add("_decode_shared_parts", _label(model, kv, shape, "splits=4"), "shared", model, kv, shape, 8, 4, 0)
    for model, kv in crossed:
        add("_decode_shared_parts", _label(model, kv, (128, 4, 8), "splits=4"), "shared", model, kv, (128, 4, 8),
            8, 4, 0)
    for model in MODEL_DTYPES:
        for kv in caches:
            for shape in SHAPES:
                add("_prefill", _label(model, kv, shape), "prefill", model, kv, shape)
    for model, kv in crossed:
        add("_prefill", _label(model, kv, (128, 4, 8)), "prefill", model, kv, (128, 4, 8))
    for model in MODEL_DTYPES:
        for head_dim in (128, 64, 80):
            for num_parts in (1, 12, 64):  # PARTS_PAD 1 (a constant), 16, 64 (32 splits + 32 shared)
                add("_merge_parts", f"out={SHORT[model]} hd={head_dim} parts={num_parts}", "merge", model, head_dim,
                    num_parts)
    writer_shapes = [(hd, 0, kv_heads) for hd in (128, 64, 80) for kv_heads in (32, 8, 4, 1)]
    for model in MODEL_DTYPES:
        for kv in (None, "fp8_e4m3", "fp8_e5m2", "int8"):  # int4 caches are written by torch
            for shape in writer_shapes:
                add("_write_vectors", _label(model, kv, shape), "write", model, kv, shape)
    for model, kv in crossed:
        add("_write_vectors", _label(model, kv, (128, 0, 8)), "write", model, kv, (128, 0, 8))
    return specs


def _decode_extra(splits: int, shared: int, window: int) -> str:
    return f"splits={splits}+{shared}" + (f" win={window}" if window else "")


def _label(model: str, kv: str | None, shape: tuple[int, int, int], extra: str = "") -> str:
    head_dim, group, kv_heads = shape
    kv_name = SHORT.get(kv or model, kv)
    text = f"q={SHORT[model]} kv={kv_name:<8} hd={head_dim:<3}"
    text += f" g={group} kvh={kv_heads:<2}" if group else f" kvh={kv_heads:<2}"
    return f"{text} {extra}".rstrip()


# ----------------------------------------------------------------------------------------------------------------
# The launches, as the host wrappers make them (everything below runs with triton imported, interpreter off).


def _cache(model: str, kv: str | None, kv_heads: int, head_dim: int):
    import torch

    from kvserve.cache.storage.kv_storage import allocate_kv_storage

    quantized = kv if kv in QUANTIZED else None
    dtype = getattr(torch, kv if kv in MODEL_DTYPES else model)
    return allocate_kv_storage(1, 2, BLOCK_SIZE, kv_heads, head_dim, dtype, "cpu", quantized)[0]


def _query(model: str, rows: int, heads: int, head_dim: int):
    import torch

    return torch.zeros(rows, heads, head_dim, dtype=getattr(torch, model))


def _dot_dtype(model: str):
    """launch.dot_dtype for a query on a CUDA device (it reads only its device type and dtype)."""
    from types import SimpleNamespace

    import torch

    from kvserve.model.triton_kernels.launch import dot_dtype

    return dot_dtype(SimpleNamespace(device=torch.device("cuda"), dtype=getattr(torch, model)))


def _launch(name: str, *params):
    """(kernel, positional arguments, keyword arguments) of one launch."""
    from importlib import import_module

    import torch

    from kvserve.model.triton_kernels.launch import format_id, kv_arguments, padded

    # The modules, not the package's attributes of the same names (its host functions).
    dec, kv_write, pre = (import_module(f"kvserve.model.triton_kernels.{module}")
                          for module in ("decode_attention", "kv_write", "prefill_attention"))

    long = torch.int64
    if name == "write":  # kv_write.write_kv, the keys' launch (the values' has the same types)
        model, kv, (head_dim, _, kv_heads) = params
        cache = _cache(model, kv, kv_heads, head_dim)
        num_tokens = 37
        scales, tensor_scale = cache.key_scales, cache.key_tensor_scale
        args = (_query(model, num_tokens, kv_heads, head_dim), torch.zeros(num_tokens, dtype=long), cache.key,
                cache.key if scales is None else scales, cache.key if tensor_scale is None else tensor_scale,
                num_tokens, kv_heads)
        block_t = max(1, min(kv_write.TOKENS_PER_PROGRAM,
                             kv_write.TILE_ELEMENTS // (padded(kv_heads) * padded(head_dim))))  # as write_kv
        return kv_write._write_vectors, args, dict(
            HEAD_DIM=head_dim, BLOCK_T=block_t, HEADS_PAD=padded(kv_heads),
            DIM_PAD=padded(head_dim), FORMAT=format_id(cache))
    if name == "merge":  # decode_attention's last launch
        model, head_dim, num_parts = params
        num_rows = 3 * 8
        part_out = torch.zeros(num_rows * num_parts * padded(head_dim, 16), dtype=torch.float32)
        part_stats = torch.zeros(num_rows * num_parts, dtype=torch.float32)
        out = torch.zeros(3, 8 * head_dim, dtype=getattr(torch, model))
        return dec._merge_parts, (part_out, part_stats, part_stats, out, num_parts), dict(
            HEAD_DIM=head_dim, DIM_PAD=padded(head_dim, 16), PARTS_PAD=padded(num_parts))
    if name in ("decode", "shared"):
        model, kv, (head_dim, group, kv_heads), num_splits, shared_splits, window = params
        cache = _cache(model, kv, kv_heads, head_dim)
        num_seqs = 3
        q = _query(model, num_seqs, kv_heads * group, head_dim)
        kv_args, meta = kv_arguments(cache, head_dim)
        tables = torch.zeros(num_seqs, 37, dtype=long)  # a width (stride) no power of two divides
        context_lens = torch.zeros(num_seqs, dtype=long)
        num_parts = num_splits + shared_splits
        part_out = torch.zeros(num_seqs * kv_heads * group * num_parts * padded(head_dim, 16), dtype=torch.float32)
        part_stats = torch.zeros(num_seqs * kv_heads * group * num_parts, dtype=torch.float32)
        scale = head_dim ** -0.5
        if name == "decode":
            return dec._decode_parts, (
                q, *kv_args, tables, context_lens, context_lens, part_out, part_stats, part_stats, scale, window,
                tables.stride(0), BLOCK_SIZE, kv_heads, num_parts), dict(
                GROUP=group, GROUP_PAD=padded(group), HEAD_DIM=head_dim, DIM_PAD=padded(head_dim, 16), **meta,
                BLOCK_N=dec.BLOCK_TOKENS, NUM_SPLITS=num_splits, HAS_FIRST_TOKEN=shared_splits > 0)
        exact = model == "float32"  # as decode_attention: fp32 tile products take fewer rows, more warps
        members_per_chunk = max(1, (dec.FP32_SHARED_ROWS if exact else dec.MAX_SHARED_ROWS) // padded(group))
        members = torch.zeros(2, members_per_chunk, dtype=long)
        return dec._decode_shared_parts, (
            q, *kv_args, tables, members, context_lens, part_out, part_stats, part_stats, scale, tables.stride(0),
            BLOCK_SIZE, kv_heads, num_parts, num_splits), dict(
            GROUP=group, GROUP_PAD=padded(group), MEMBERS=members_per_chunk, HEAD_DIM=head_dim,
            DIM_PAD=padded(head_dim, 16), **meta, BLOCK_N=dec.BLOCK_TOKENS, NUM_SPLITS=shared_splits,
            DOT_DTYPE=_dot_dtype(model), num_warps=dec.FP32_WARPS if exact else 4)
    if name == "prefill":
        model, kv, (head_dim, group, kv_heads) = params
        cache = _cache(model, kv, kv_heads, head_dim)
        num_tokens = 40
        q = _query(model, num_tokens, kv_heads * group, head_dim)
        out = torch.zeros(num_tokens, kv_heads * group * head_dim, dtype=q.dtype)
        kv_args, meta = kv_arguments(cache, head_dim)
        tables = torch.zeros(2, 37, dtype=long)
        starts, num_past, tile_seqs = (torch.zeros(n, dtype=long) for n in (3, 2, 4))
        group_pad = padded(group)
        exact = model == "float32"  # as prefill_attention
        tile_rows, block_keys = (pre.FP32_TILE_ROWS, pre.FP32_BLOCK_KEYS) if exact else (pre.TILE_ROWS, pre.BLOCK_KEYS)
        return pre._prefill, (
            q, *kv_args, out, tables, starts, num_past, tile_seqs, tile_seqs, head_dim ** -0.5, 0, tables.stride(0),
            BLOCK_SIZE, kv_heads), dict(
            GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=max(1, tile_rows // group_pad), HEAD_DIM=head_dim,
            DIM_PAD=padded(head_dim, 16), **meta, BLOCK_N=block_keys, DOT_DTYPE=_dot_dtype(model),
            num_warps=pre.FP32_WARPS if exact else 4)
    raise ValueError(name)


def _signature(kernel, backend, args, kwargs):
    """(signature, constexprs, attrs, options) as JITFunction.run builds them for a launch with these arguments:
    Triton's own binder and _pack_args (the same in Triton 3.6 through 3.9), with no driver."""
    from triton import knobs
    from triton.runtime.jit import create_function_from_signature

    kwargs = dict(kwargs, debug=kernel.debug or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return signature, constexprs, attrs, options


def _resources(cubin: bytes, ptxas_log: str) -> dict:
    """Registers per thread, local memory per thread (the stack frame ptxas spills to, plus local arrays) and the
    bytes of spill stores: from ptxas's own log (-v, which Triton prints under TRITON_DUMP_PTXAS_LOG), else from
    the wheel's cuobjdump on the cubin (which gives no spill store count)."""
    import re
    import subprocess

    from triton import knobs

    found = {"regs": None, "local": None, "spill_stores": None}
    regs = re.search(r"Used (\d+) registers", ptxas_log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", ptxas_log)
    if regs and frame:
        found.update(regs=int(regs.group(1)), local=int(frame.group(1)), spill_stores=int(frame.group(2)))
        return found
    try:
        tool = knobs.nvidia.cuobjdump.path
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                  check=True).stdout
    except Exception:  # noqa: BLE001 (a wheel without cuobjdump: the figures stay unknown)
        return found
    fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", text))
    if "REG" in fields:
        found.update(regs=int(fields["REG"]), local=int(fields.get("STACK", 0)) + int(fields.get("LOCAL", 0)))
    return found


def _compile(job: tuple[int, Spec, int]) -> dict:
    index, spec, arch = job
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    result = {"index": index, "ok": False}
    try:
        kernel, args, kwargs = _launch(*spec.build)
        target = GPUTarget("cuda", arch, 32)
        backend = make_backend(target)
        signature, constexprs, attrs, options = _signature(kernel, backend, args, kwargs)
        log = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(log):  # ptxas's -v log (TRITON_DUMP_PTXAS_LOG)
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
        result["seconds"] = time.perf_counter() - start
        result["shared"] = getattr(compiled.metadata, "shared", None)
        resources = _resources(compiled.asm["cubin"], log.getvalue())
        result["regs"], result["spill_stores"] = resources["regs"], resources["spill_stores"]
        # Triton's n_spills on a GPU: the function's local memory per thread (CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES) / 4
        result["spills"] = None if resources["local"] is None else resources["local"] // 4
        result["ok"] = True
    except Exception as error:  # noqa: BLE001 (every failure is a result to report)
        result["error"], result["summary"] = _describe(error)
    return result


def _describe(error: BaseException) -> tuple[str, str]:
    """(the error in full, with the errors it was raised from; one line: where, and the innermost cause). Triton's
    CompilationError shows the kernel's source around the failing call, and is raised from what went wrong."""
    chain = [error]
    while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 10:
        chain.append(cause)
    full = "\n--- raised from ---\n".join(f"{type(e).__name__}: {e}".strip() for e in chain)
    root = chain[-1]
    root_lines = [line.strip() for line in str(root).splitlines() if line.strip()]
    summary = f"{type(root).__name__}: {root_lines[-1] if root_lines else ''}"
    if root is not error:
        where = str(error).splitlines()[0].strip() if str(error).strip() else ""
        summary = f"{type(error).__name__} {where} {summary}"
    return full, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90: H100/H200)")
    parser.add_argument("--quick", action="store_true", help="a representative subset")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--filter", default="", help="only lines containing this text")
    parser.add_argument("--list", action="store_true", help="print the specializations, compile nothing")
    parser.add_argument("--cache-dir", help="Triton's cache (default: a fresh temporary folder)")
    parser.add_argument("--verbose", action="store_true", help="every error in full")
    options = parser.parse_args(argv)

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        if "triton" in sys.modules:
            print("TRITON_INTERPRET is set and triton already imported: run this in a fresh process",
                  file=sys.stderr)
            return 2
        del os.environ["TRITON_INTERPRET"]
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is 3.6's default
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # printed into each compile's captured stdout (_resources)
    temporary = None
    if options.cache_dir:
        os.environ["TRITON_CACHE_DIR"] = options.cache_dir
    else:
        temporary = tempfile.TemporaryDirectory(prefix="triton-compile-check-")
        os.environ["TRITON_CACHE_DIR"] = temporary.name

    specs = [s for s in _specs(options.quick) if options.filter in s.line]
    if options.list:
        for spec in specs:
            print(spec.line)
        return 0

    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = get_ptxas(options.arch)
        ptxas_path = ptxas.path
    except Exception as error:  # noqa: BLE001
        print(f"no ptxas for sm_{options.arch}: {error}", file=sys.stderr)
        return 2
    print(f"triton {triton.__version__} ({Path(triton.__file__).parent}), target cuda sm_{options.arch}, "
          f"ptxas {ptxas_path}, {len(specs)} specializations, {options.jobs} jobs")

    jobs = [(i, spec, options.arch) for i, spec in enumerate(specs)]
    started = time.perf_counter()
    if options.jobs > 1 and len(jobs) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # fork: the workers inherit the imports (and the environment set above); nothing here touches a GPU.
        with ProcessPoolExecutor(options.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            results = _report(specs, pool.map(_compile, jobs), options.verbose)
    else:
        results = _report(specs, map(_compile, jobs), options.verbose)
    elapsed = time.perf_counter() - started

    failed = [r for r in results if not r["ok"]]
    spilling = [r for r in results if r["ok"] and r.get("spills")]
    compile_seconds = sum(r.get("seconds", 0.0) for r in results)
    print(f"\n{len(results) - len(failed)} of {len(results)} compiled, {len(failed)} failed, {len(spilling)} spill "
          f"registers to local memory (SPILLS); {elapsed:.1f} s wall, {compile_seconds:.1f} s of compiles")
    if failed and not options.verbose:
        distinct: dict[str, list[str]] = {}
        for r in failed:
            distinct.setdefault(r["error"], []).append(specs[r["index"]].line)
        print(f"\n{len(distinct)} distinct error(s):")
        for error, lines in distinct.items():
            print(f"\n--- {len(lines)} specialization(s), e.g. {' '.join(lines[0].split())}")
            print(error)
    if temporary is not None:
        temporary.cleanup()
    return 1 if failed else 0


def _report(specs: list[Spec], results, verbose: bool) -> list[dict]:
    done = []
    for result in results:
        spec = specs[result["index"]]
        if result["ok"]:
            regs = "?" if result["regs"] is None else result["regs"]
            spills = "?" if result["spills"] is None else result["spills"]
            flag = ""
            if result["spills"]:
                stores = result["spill_stores"]
                flag = "  <-- SPILLS" + ("" if stores is None else f" ({stores} bytes of spill stores)")
            print(f"OK   {spec.line:<66} {result['seconds']:6.2f} s  regs {regs:>3}  spills {spills:>4}  "
                  f"shared {result['shared']:>6}{flag}", flush=True)
        else:
            print(f"FAIL {spec.line:<66} {result['summary']}", flush=True)
            if verbose:
                print("     " + result["error"].replace("\n", "\n     "), flush=True)
        done.append(result)
    return done


if __name__ == "__main__":
    sys.exit(main())
