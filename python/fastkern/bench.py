"""`python -m fastkern.bench [gelu|softmax|attention|cross_entropy|all|train] [--out FILE] [--quick] [--markdown [FILE.json]]`: fastkern against its peers.

Every case is timed in one process next to its peers (torch eager, torch.compile, Triton where
importable) and next to the device's own ceiling, measured in the same run: a device-to-device
copy, counting bytes read plus written. Each case reports ms, GB/s over the fewest bytes the op must
move, percent of that copy bandwidth, and the ratio of each peer's time to fastkern's (> 1: fastkern
is faster). Results go to stdout as a table and, with --out, to a JSON file. --markdown prints the
README's results table of headline cases instead (bench_report.py): from FILE.json when given, with
nothing timed, else from this run.

Each implementation of a case is timed twice, in the listed order and then in reverse, and keeps
its faster time (see time_impls). On a GPU every implementation is timed the same way: its calls
are captured in a CUDA graph and the graph is replayed, so the figure is GPU time with no host time
between calls (host overhead is reported separately, per tiny call), the inputs rotate through
enough fresh copies that no call finds its input in L2, and each sample starts with no L2 lines
kept by an earlier kernel's evict_last loads (release_kept_l2_lines). An implementation that
cannot be captured is timed eagerly and marked so.
"""
import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import fastkern
from fastkern import bench_attention, bench_report

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is optional
    triton = None


# ---- timing ------------------------------------------------------------------------------------

def input_sets(make_inputs, device, nbytes):
    """Enough independent copies of a case's inputs that cycling through them leaves nothing in L2
    from one call to the next (the working set of a round is >= 2x the L2 size)."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
    copies = max(1, min(16, -(-2 * l2 // max(nbytes, 1))))
    return [make_inputs() for _ in range(copies)]


def release_kept_l2_lines(device):
    """Returns every L2 line held under an evict_last ("persisting") policy to normal standing
    (cuCtxResetPersistingL2Cache), so that each timing starts from the same L2, whatever ran before.
    Kernels that load under evict_last (Inductor's softmax, and ours) leave lines that ordinary
    traffic does not evict. On an H100 they moved the next kernel by up to 4 points of copy: our bf16
    (4096, 16384) softmax forward ran at 94% after our own kernels and 90% after torch.compile's, and
    at 94% again once they were released (docs/decisions.md, D-71)."""
    if device.type != "cuda":
        return
    import ctypes
    torch.cuda.synchronize(device)
    driver = getattr(release_kept_l2_lines, "driver", None)
    if driver is None:
        driver = release_kept_l2_lines.driver = ctypes.CDLL("libcuda.so.1")
    status = driver.cuCtxResetPersistingL2Cache()
    if status != 0:
        raise RuntimeError(f"cuCtxResetPersistingL2Cache failed with CUresult {status}")


def _graph_ms(fn, sets, device, repeats):
    """Per-call milliseconds of `fn` over `sets`, captured in one CUDA graph and replayed: the GPU
    time of the kernels alone, with no host time between them (eager timing of a 10 us kernel
    measures Python, not the GPU)."""
    calls = len(sets) * -(-20 // len(sets))
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the capture stream (autograd, allocator, compile)
        for inputs in sets:
            fn(*inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*sets[i % len(sets)])
    graph.replay()
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(repeats):
        release_kept_l2_lines(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def time_ms(fn, sets, device, repeats=15, calls=10):
    """(median milliseconds per call, method). CUDA: replays of a captured CUDA graph ("graph"),
    else back-to-back eager calls ("eager") where capture is impossible, each sample starting with
    no L2 lines kept by earlier kernels (release_kept_l2_lines); CPU: wall time."""
    release_kept_l2_lines(device)
    t0 = time.perf_counter()
    for inputs in sets:  # warm-up, compilation included
        fn(*inputs)
    warm_s = (time.perf_counter() - t0) / len(sets)
    if device.type == "cuda":
        try:
            return _graph_ms(fn, sets, device, repeats), "graph"
        except Exception:  # noqa: BLE001 - any capture failure falls back to eager timing
            torch.cuda.synchronize(device)
    samples = []
    calls = len(sets) * -(-calls // len(sets))
    if device.type == "cpu":  # ~20 ms a sample: long CPU cases (16 ms a call) keep the suite short
        calls = max(1, min(calls, int(0.02 / max(warm_s, 1e-6))))
        repeats = min(repeats, 9)
    for _ in range(repeats):
        release_kept_l2_lines(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for i in range(calls):
            fn(*sets[i % len(sets)])
        if device.type == "cuda":
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / calls)
        else:
            samples.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(samples), "eager"


def time_impls(impls, sets, device, repeats=15, calls=10):
    """{impl: (ms, method, [ms in the listed order, ms in reverse])} for a case's implementations,
    each timed twice, in the listed order and then in the reverse order, keeping its faster time.
    What ran before used to move a time, through L2 lines kept by an earlier kernel (see
    release_kept_l2_lines, which time_ms now calls); timing both orders keeps any effect of the
    order that remains from deciding a tie, and the JSON keeps both times so it can be seen."""
    runs = {impl: [] for impl in impls}
    for impl in [*impls, *reversed(impls)]:
        runs[impl].append(time_ms(impls[impl], sets, device, repeats, calls))
    return {impl: (*min(r), [ms for ms, _ in r]) for impl, r in runs.items()}


def copy_bandwidth_gbs(device, nbytes=1 << 30):
    """The copy ceiling (bytes read + written per second) of a large tensor: the faster of torch's
    copy_ (a DMA memcpy) and an elementwise copy kernel (multiply by 1 into `out`). On an H100 the
    memcpy reached 2.43 TB/s and the kernel 3.0 TB/s; taking only the memcpy would overstate every
    percentage by a quarter."""
    if device.type == "cpu":
        nbytes = 1 << 27
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    if device.type == "cuda":  # let the clocks rise first: the first timing sets every percentage
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.5:
            for _ in range(20):
                dst.copy_(src)
            torch.cuda.synchronize(device)
    ms = min(time_ms(fn, [()], device, repeats=9)[0]
             for fn in (lambda: dst.copy_(src), lambda: torch.mul(src, 1.0, out=dst)))
    return 2 * nbytes / ms / 1e6


def host_overhead_us(fns, device, calls=1000, rounds=15):
    """Microseconds of host time per call of each of `fns` on a tiny tensor (launch-bound). The
    functions are timed in alternating batches and each keeps its fastest batch: interference from
    the rest of the machine only ever adds time, and alternating exposes every function to the same
    conditions, so the ratio between them is stable where single medians drift by 30%."""
    for fn in fns:
        for _ in range(100):
            fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t0) * 1e6 / calls)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return best


# ---- peers ---------------------------------------------------------------------------------------

def gelu_tanh_manual(x):
    """The unfused textbook formula: one kernel per operator in eager mode."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def gelu_tanh_manual_grad(g, x):
    """d/dx of gelu_tanh_manual times g, written out (what torch.compile fuses for backward)."""
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    t = torch.tanh(u)
    du = 0.7978845608028654 * (1.0 + 3 * 0.044715 * x * x)
    return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du)


if triton is not None:
    @triton.jit
    def _triton_gelu_tanh(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
        tl.store(y_ptr + offs, (0.5 * x * (1.0 + t)).to(y_ptr.dtype.element_ty), mask=mask)

    def triton_gelu_tanh(x):
        y = torch.empty_like(x)
        n = x.numel()
        _triton_gelu_tanh[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024)
        return y


def _compiled(fn):
    torch._dynamo.reset()  # every case compiles fresh, for its own shapes
    return torch.compile(fn)


# ---- cases ---------------------------------------------------------------------------------------

def gelu_cases_cpu(device):
    """The CPU issue's GELU cases against torch eager (torch.compile's C++ build per case would
    make the CPU suite minutes long): fwd / bwd, tanh and erf, fp32 and bf16 at 2^22 elements, and
    bias + GELU fwd + bwd (4096, 1024) bf16."""
    n = 1 << 22
    for dtype in (torch.float32, torch.bfloat16):
        size = dtype.itemsize
        tag = f"{str(dtype)[6:]} 2^22"
        x_only = lambda dtype=dtype: (torch.randn(n, device=device, dtype=dtype),)
        g_and_x = lambda dtype=dtype: (torch.randn(n, device=device, dtype=dtype),
                                       torch.randn(n, device=device, dtype=dtype))
        for form, approximate in (("tanh", "tanh"), ("erf", "none")):
            yield (f"gelu {form} fwd {tag}", 2 * n * size, x_only, {
                "fastkern": lambda x, a=approximate: fastkern.gelu(x, approximate=a),
                "torch": lambda x, a=approximate: F.gelu(x, approximate=a)})
            yield (f"gelu {form} bwd {tag}", 3 * n * size, g_and_x, {
                "fastkern": lambda g, x, a=approximate: torch.ops.fastkern.gelu_backward.default(g, x, None, a, False),
                "torch": lambda g, x, a=approximate: torch.ops.aten.gelu_backward(g, x, approximate=a)})
    rows, cols = 4096, 1024

    def bias_inputs():
        return (torch.randn(rows, cols, device=device, dtype=torch.bfloat16, requires_grad=True),
                torch.randn(cols, device=device, dtype=torch.bfloat16, requires_grad=True),
                torch.randn(rows, cols, device=device, dtype=torch.bfloat16))
    step = lambda f: lambda x, b, g: torch.autograd.grad(f(x, b), (x, b), g)  # noqa: E731
    yield (f"bias+gelu fwd+bwd bf16 ({rows},{cols})", 5 * rows * cols * 2, bias_inputs, {
        "fastkern": step(lambda x, b: fastkern.gelu(x, approximate="tanh", bias=b)),
        "torch": step(lambda x, b: F.gelu(x + b, approximate="tanh"))})


def gelu_cases(device, quick=False):
    """Yields (name, bytes moved, make_inputs, {impl: fn(*inputs)}) for each GELU case of the issue.
    Cases are generators so that each is built (and its torch.compile peer reset) right before it
    is timed; make_inputs gives fresh random inputs, so the timer can rotate copies past L2."""
    if device.type == "cpu":
        yield from gelu_cases_cpu(device)
        return
    n = 1 << (22 if quick else 26)
    rows, cols = (1024, 4096) if quick else (16384, 4096)
    for dtype in (torch.float32, torch.bfloat16):
        size = torch.finfo(dtype).bits // 8
        tag = f"{str(dtype)[6:]} 2^{n.bit_length() - 1}"
        x_only = lambda dtype=dtype: (torch.randn(n, device=device, dtype=dtype),)
        g_and_x = lambda dtype=dtype: (torch.randn(n, device=device, dtype=dtype),
                                       torch.randn(n, device=device, dtype=dtype))
        impls = {
            "fastkern": lambda x: fastkern.gelu(x, approximate="tanh"),
            "torch": lambda x: F.gelu(x, approximate="tanh"),
            "manual": gelu_tanh_manual,
            "compile": _compiled(gelu_tanh_manual),
        }
        if triton is not None and device.type == "cuda":
            impls["triton"] = triton_gelu_tanh
        yield (f"gelu tanh fwd {tag}", 2 * n * size, x_only, impls)
        yield (f"gelu tanh bwd {tag}", 3 * n * size, g_and_x, {
            "fastkern": lambda g, x: torch.ops.fastkern.gelu_backward.default(g, x, None, "tanh", False),
            "torch": lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
            "compile": _compiled(gelu_tanh_manual_grad),
        })
        yield (f"gelu erf fwd {tag}", 2 * n * size, x_only, {
            "fastkern": fastkern.gelu,
            "torch": F.gelu,
            "compile": _compiled(lambda x: F.gelu(x)),
        })
        yield (f"gelu erf bwd {tag}", 3 * n * size, g_and_x, {
            "fastkern": lambda g, x: torch.ops.fastkern.gelu_backward.default(g, x, None, "none", False),
            "torch": lambda g, x: torch.ops.aten.gelu_backward(g, x),
        })

    def bias_inputs():
        return (torch.randn(rows, cols, device=device, dtype=torch.bfloat16, requires_grad=True),
                torch.randn(cols, device=device, dtype=torch.bfloat16, requires_grad=True),
                torch.randn(rows, cols, device=device, dtype=torch.bfloat16))
    eager = lambda x, b: F.gelu(x + b, approximate="tanh")
    compiled = _compiled(eager)
    ours = lambda x, b: fastkern.gelu(x, approximate="tanh", bias=b)

    def fwd(f):
        def run(x, b, g):
            with torch.no_grad():
                return f(x, b)
        return run

    def fwd_bwd(f):
        return lambda x, b, g: torch.autograd.grad(f(x, b), (x, b), g)
    nbytes = rows * cols * 2
    yield (f"bias+gelu fwd bf16 ({rows},{cols})", 2 * nbytes, bias_inputs,
           {"fastkern": fwd(ours), "torch": fwd(eager), "compile": fwd(compiled)})
    yield (f"bias+gelu fwd+bwd bf16 ({rows},{cols})", 5 * nbytes, bias_inputs,
           {"fastkern": fwd_bwd(ours), "torch": fwd_bwd(eager), "compile": fwd_bwd(compiled)})


SOFTMAX_SHAPES = [(65536, 128), (32768, 1024), (16384, 4096), (4096, 16384), (1024, 65536),
                  (256, 262144), (3000, 1000)]
# rows that are not a multiple of 16 bytes (bf16; fp32 1100 is packed): ViT's 197 tokens, 257,
# 1100, 4097 (16-bit rows just over 8 KB: one CTA a row in the shared-memory forward), GPT-2's
# 50257-word vocabulary
SOFTMAX_RAGGED_SHAPES = [(151296, 197), (65536, 257), (131072, 1100), (32768, 4097), (4096, 50257)]
# reductions along a dim that is not the last (the column kernels): a middle dim of 1024, the
# leading dim of a matrix, and 19 classes of a segmentation map
SOFTMAX_DIM_SHAPES = [((64, 1024, 512), 1), ((4096, 8192), 0), ((32, 19, 256, 512), 1)]


def softmax_backward_from_output(g, y, dim=-1):
    """What autograd does after torch.softmax: dx = y * (g - sum(g * y)), from the saved output."""
    return y * (g - (g * y).sum(dim, keepdim=True))


SOFTMAX_CPU_LAYOUTS = [((4096, 1024), -1), ((1024, 4096), -1), ((256, 50257), -1), ((64, 65536), -1),
                       ((8192, 256), 0)]


def softmax_cases_cpu(device):
    """The CPU issue's softmax cases against torch eager: softmax and log_softmax, fwd and bwd, fp32
    and bf16 at SOFTMAX_CPU_LAYOUTS, and scaled causal softmax bf16 (2, 8, 512, 512)."""
    for dtype in (torch.float32, torch.bfloat16):
        for shape, dim in SOFTMAX_CPU_LAYOUTS:
            numel, size = math.prod(shape), dtype.itemsize
            tag = f"{str(dtype)[6:]} ({','.join(map(str, shape))})" + (f" dim={dim}" if dim != -1 else "")
            for log in (False, True):
                name = "log_softmax" if log else "softmax"
                ours = fastkern.log_softmax if log else fastkern.softmax
                theirs = torch.log_softmax if log else torch.softmax
                back = torch._log_softmax_backward_data if log else torch._softmax_backward_data

                def bwd_inputs(shape=shape, dim=dim, dtype=dtype, log=log, theirs=theirs):
                    x = torch.randn(shape, device=device, dtype=dtype) * 3
                    y, _ = torch.ops.fastkern.softmax.default(x, dim, 1.0, False, log)
                    return torch.randn_like(x), y, theirs(x, dim)  # each backward reads its own y
                yield (f"{name} fwd {tag}", 2 * numel * size,
                       lambda shape=shape, dtype=dtype: (torch.randn(shape, device=device, dtype=dtype) * 3,), {
                           "fastkern": lambda x, dim=dim, f=ours: f(x, dim),
                           "torch": lambda x, dim=dim, f=theirs: f(x, dim)})
                yield (f"{name} bwd {tag}", 3 * numel * size, bwd_inputs, {
                    "fastkern": lambda g, y, ty, dim=dim, log=log: torch.ops.fastkern.softmax_backward.default(
                        g, y, None, dim, 1.0, False, log),
                    "torch": lambda g, y, ty, dim=dim, back=back: back(g, ty, dim, ty.dtype)})
    b, h, sq = 2, 8, 512
    mask = torch.ones(sq, sq, dtype=torch.bool, device=device).triu(1)
    yield (f"softmax scale+causal fwd bf16 ({b},{h},{sq},{sq})", 2 * b * h * sq * sq * 2,
           lambda: (torch.randn(b, h, sq, sq, device=device, dtype=torch.bfloat16) * 3,), {
               "fastkern": lambda x: fastkern.softmax(x, -1, scale=0.125, causal=True),
               "torch": lambda x: torch.softmax((x * 0.125).masked_fill(mask, float("-inf")), -1)})


def softmax_cases(device, quick=False):
    """Yields forward and backward cases over the issue's shapes and ragged ones, fp32 and bf16, and
    a scaled causal case; each compile peer starts from a reset dynamo, so it is compiled for its
    own shape. Backward inputs are (dy, x, fastkern's row max, torch's saved output y): each impl
    takes what its own forward saved."""
    if device.type == "cpu":
        yield from softmax_cases_cpu(device)
        return
    layouts = [((r, n), -1) for r, n in SOFTMAX_SHAPES + SOFTMAX_RAGGED_SHAPES] + SOFTMAX_DIM_SHAPES
    if quick:
        layouts = [((shape[0] // 16,) + shape[1:], dim) for shape, dim in layouts]
    for dtype in (torch.float32, torch.bfloat16):
        size = torch.finfo(dtype).bits // 8
        for shape, dim in layouts:
            def x_only(shape=shape, dtype=dtype):
                return (torch.randn(shape, device=device, dtype=dtype) * 3,)

            def bwd_inputs(shape=shape, dim=dim, dtype=dtype):
                x = torch.randn(shape, device=device, dtype=dtype) * 3
                _, row_max = torch.ops.fastkern.softmax.default(x, dim, 1.0, False, False)
                return torch.randn_like(x), x, row_max, torch.softmax(x, dim)
            numel = math.prod(shape)
            tag = f"{str(dtype)[6:]} ({','.join(map(str, shape))})" + (f" dim={dim}" if dim != -1 else "")
            yield (f"softmax fwd {tag}", 2 * numel * size, x_only, {
                "fastkern": lambda x, dim=dim: fastkern.softmax(x, dim),
                "torch": lambda x, dim=dim: torch.softmax(x, dim),
                "compile": _compiled(lambda x, dim=dim: torch.softmax(x, dim)),
            })
            compiled_bwd = _compiled(softmax_backward_from_output)
            yield (f"softmax bwd {tag}", 3 * numel * size, bwd_inputs, {
                "fastkern": lambda g, x, row_max, y, dim=dim: torch.ops.fastkern.softmax_backward.default(
                    g, x, row_max, dim, 1.0, False, False),
                "torch": lambda g, x, row_max, y, dim=dim: torch._softmax_backward_data(g, y, dim, y.dtype),
                "compile": lambda g, x, row_max, y, dim=dim, bwd=compiled_bwd: bwd(g, y, dim),
            })
    b, h, sq = (4, 8, 2048) if not quick else (1, 2, 512)
    mask = torch.ones(sq, sq, dtype=torch.bool, device=device).triu(1)
    unfused = lambda x: torch.softmax((x * 0.125).masked_fill(mask, float("-inf")), -1)
    yield (f"softmax scale+causal fwd bf16 ({b},{h},{sq},{sq})", 2 * b * h * sq * sq * 2,
           lambda: (torch.randn(b, h, sq, sq, device=device, dtype=torch.bfloat16) * 3,), {
               "fastkern": lambda x: fastkern.softmax(x, -1, scale=0.125, causal=True),
               "torch": unfused,
               "compile": _compiled(unfused),
           })


def cross_entropy_cases(device, quick=False):
    """fwd+bwd of the GPT-2 LM head's loss: bf16 (16384, 50257) logits (16 x 1024 tokens) and int64
    targets, 10% of them ignore_index. Peers: F.cross_entropy on the bf16 logits; on their fp32 copy,
    which is what bf16 autocast (cross_entropy is on its fp32 list) and Hugging Face's loss (logits
    .float()) run; and torch.compile of each. The logits are leaves here, so fastkern's backward
    allocates dlogits like the others (in a training step the LM head's logits are a temporary and
    its backward writes dlogits over them: python -m fastkern.bench train shows that). Bytes: the
    forward's read plus the backward's read and write of the logits."""
    rows = 256 if quick or device.type == "cpu" else 16384
    for dtype, classes in ((torch.bfloat16, 50257), (torch.float32, 50257)):
        if dtype == torch.float32 and (quick or device.type == "cpu"):
            continue
        rows_here = rows if dtype == torch.bfloat16 else rows // 2

        def inputs(dtype=dtype, rows=rows_here, classes=classes):
            x = (torch.randn(rows, classes, device=device) * 2).to(dtype).requires_grad_()
            t = torch.randint(0, classes, (rows,), device=device)
            t[torch.rand(rows, device=device) < 0.1] = -100
            return x, t

        def fwd_bwd(loss_fn):
            return lambda x, t: torch.autograd.grad(loss_fn(x, t), x)
        upcast = lambda x, t: F.cross_entropy(x.float(), t)
        size = torch.finfo(dtype).bits // 8
        impls = {"fastkern": fwd_bwd(fastkern.cross_entropy), "torch": fwd_bwd(F.cross_entropy),
                 "compile": fwd_bwd(_compiled(lambda x, t: F.cross_entropy(x, t)))}
        if dtype != torch.float32:
            impls["torch_fp32"] = fwd_bwd(upcast)
            torch._dynamo.reset()
            impls["compile_fp32"] = fwd_bwd(torch.compile(upcast))
        yield (f"cross_entropy fwd+bwd {str(dtype)[6:]} ({rows_here},{classes})", 3 * rows_here * classes * size,
               inputs, impls)


SUITES = {"gelu": gelu_cases, "softmax": softmax_cases, "attention": bench_attention.attention_cases,
          "cross_entropy": cross_entropy_cases}
# suites whose cases also report each implementation's peak memory above its inputs (other cases:
# those whose extra says "peak")
MEMORY_SUITES = {"cross_entropy"}


def peak_memory_mb(fn, inputs, device):
    """MB allocated at the peak of one call of fn(*inputs), above what was allocated before it (CUDA;
    None on the CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn(*inputs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return round(peak / 2**20, 1)


def host_overheads(device):
    """Host microseconds per tiny call, fastkern next to the torch function it replaces: inference
    (no grad) and training (input requires grad)."""
    x = torch.randn(16, device=device)
    xg = x.clone().requires_grad_()
    pairs = {"gelu": (lambda: fastkern.gelu(x), lambda: F.gelu(x)),
             "gelu (grad)": (lambda: fastkern.gelu(xg), lambda: F.gelu(xg)),
             "softmax": (lambda: fastkern.softmax(x, -1), lambda: torch.softmax(x, -1)),
             "softmax (grad)": (lambda: fastkern.softmax(xg, -1), lambda: torch.softmax(xg, -1))}
    out = {}
    for name, (ours, theirs) in pairs.items():
        us = host_overhead_us([ours, theirs], device)
        out[name] = {"fastkern": round(us[0], 2), "torch": round(us[1], 2), "ratio": round(us[0] / us[1], 2)}
    return out


# ---- running -------------------------------------------------------------------------------------

def run(suites, device=None, quick=False, only=None, progress=None):
    """Times every case of `suites` on `device`; returns the JSON-ready report. With `progress` (a
    path), each case done is printed to stderr and the report so far written there."""
    started = time.perf_counter()
    device = torch.device(device or ("cuda" if fastkern.cuda_available() and torch.cuda.is_available() else "cpu"))
    copy_gbs = copy_bandwidth_gbs(device)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "fastkern": fastkern.__version__,
        "triton": getattr(triton, "__version__", None),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ceilings": {"copy_gbs": round(copy_gbs, 1)},
        # sm_90+: consecutive fastkern calls in a timed graph overlap launch and set-up with the
        # previous call's tail (programmatic dependent launch) unless FASTKERN_PDL=0
        "pdl": os.environ.get("FASTKERN_PDL", "1") != "0",
        "host_overhead_us": host_overheads(device),
        "cases": [],
    }
    for suite in suites:
        for case in SUITES[suite](device, quick):
            name, nbytes, make_inputs, impls = case[:4]
            extra = case[4] if len(case) > 4 else {}  # matrix-bound suites: "flops", "strategy"
            if only and not any(text in name for text in ([only] if isinstance(only, str) else only)):
                continue
            sets = input_sets(make_inputs, device, nbytes)
            timed = time_impls(impls, sets, device, extra.get("repeats", 15), extra.get("calls", 10))
            peaks = ({impl: peak_memory_mb(fn, sets[0], device) for impl, fn in impls.items()}  # warmed up
                     if suite in MEMORY_SUITES or extra.get("peak") else None)
            del sets
            times = {impl: ms for impl, (ms, _, _) in timed.items()}
            ours = times["fastkern"]
            peers = {k: v for k, v in times.items() if k != "fastkern"}
            # fastkern_*: fastkern forced onto another of its paths, reported but no peer
            best_peer = min((k for k in peers if not k.startswith("fastkern_")), key=peers.get)
            report["cases"].append({
                "suite": suite, "case": name, "bytes": nbytes,
                "ms": {k: round(v, 5) for k, v in times.items()},
                "timing": {k: method for k, (_, method, _) in timed.items()},
                "ms_each_order": {k: [round(v, 5) for v in each] for k, (_, _, each) in timed.items()},
                "gbs": {k: round(nbytes / v / 1e6, 1) for k, v in times.items()},
                "pct_of_copy": round(100 * nbytes / ours / 1e6 / copy_gbs, 1),
                "floor_ms": round(nbytes / copy_gbs / 1e6, 5),
                "speedup_vs": {k: round(v / ours, 3) for k, v in peers.items()},
                "best_peer": best_peer,
                **({"peak_mb": peaks} if peaks else {}),
            })
            if "flops" in extra:
                report["cases"][-1]["tflops"] = {k: round(extra["flops"] / v / 1e9, 4) for k, v in times.items()}
            report["cases"][-1].update({k: v for k, v in extra.items() if k not in ("flops", "repeats", "calls", "peak")})
            if progress:  # a run cut short still leaves the cases done
                print(f"{time.perf_counter() - started:6.0f} s  {name}: {ours:.4f} ms, "
                      f"{report['cases'][-1]['speedup_vs'][best_peer]:.3f}x {best_peer}", file=sys.stderr, flush=True)
                with open(progress, "w") as f:
                    json.dump(report, f, indent=1)
    return report


def format_table(report):
    lines = [f"device: {report['device']}   torch {report['torch']}   copy bandwidth "
             f"{report['ceilings']['copy_gbs']:.0f} GB/s",
             "host time per tiny call, fastkern / torch (us): " +
             ", ".join(f"{k} {v['fastkern']:.1f} / {v['torch']:.1f} ({v['ratio']:.2f}x)"
                       for k, v in report["host_overhead_us"].items()),
             f"{'case':42s} {'fastkern ms':>11s} {'GB/s':>7s} {'%copy':>6s}  speedup vs peers"]
    for c in report["cases"]:
        peers = "  ".join(f"{k} {v:.2f}x" for k, v in c["speedup_vs"].items())
        if "tflops" in c:  # matrix-bound: TFLOP/s in place of GB/s and % of copy
            strategy = f"  [{c['strategy']}]" if "strategy" in c else ""
            lines.append(f"{c['case']:42s} {c['ms']['fastkern']:11.4f} {c['tflops']['fastkern']:7.3f} TFLOP/s  "
                         f"{peers}{strategy}")
            continue
        lines.append(f"{c['case']:42s} {c['ms']['fastkern']:11.4f} {c['gbs']['fastkern']:7.0f} "
                     f"{c['pct_of_copy']:6.1f}  {peers}")
        if c.get("peak_mb") and c["peak_mb"].get("fastkern") is not None:
            lines.append(f"{'':42s} peak MB: " + "  ".join(f"{k} {v:.0f}" for k, v in c["peak_mb"].items()))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fastkern.bench", description=__doc__.splitlines()[0])
    parser.add_argument("suite", nargs="?", default="all", choices=["all", *SUITES, "train"],
                        help="'all' runs every kernel suite; 'train' the end-to-end training step "
                             "(python -m fastkern.bench train --help)")
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument("--only", nargs="+", help="run only the cases whose name contains one of these texts")
    parser.add_argument("--markdown", nargs="?", const="", metavar="FILE.json",
                        help="print the README's headline table (Markdown): of FILE.json if given, "
                             "else of this run")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # its own options: bench_train.py
        from fastkern import bench_train
        return bench_train.main(argv[1:])
    args = parser.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as f:
            report = json.load(f)
        print(bench_report.markdown(report, os.path.basename(args.markdown)))
        return report
    suites = list(SUITES) if args.suite == "all" else [args.suite]
    report = run(suites, args.device, args.quick, args.only, progress=args.out)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(bench_report.markdown(report, args.out) if args.markdown is not None else format_table(report))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
