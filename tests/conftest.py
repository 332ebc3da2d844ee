"""Shared test helpers: devices, float64 references and the "at most 2x torch's error" rule."""
import math
import os
import tempfile
import threading
import zlib

# torch.compile's on-disk caches (inductor's FX graphs, AOT autograd's forward / backward pairs) are
# keyed by the traced graph, not by the Python of fastkern's ops: a cache written by another version
# of fastkern served a backward that saved what that version saved (the CPU softmax backward then
# refused (x, row max): it takes y since D-87). Each test session compiles into its own directory
# unless TORCHINDUCTOR_CACHE_DIR is set.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="fastkern-tests-inductor-"))

import pytest  # noqa: E402
import torch  # noqa: E402

import fastkern

CUDA = fastkern.cuda_available() and torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and a CUDA build of fastkern")

DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def dtypes_for(device):
    base = [torch.float32, torch.float16, torch.bfloat16]
    return base + [torch.float64] if device == "cpu" else base


def _device_dtype_params():
    params = []
    for device in ("cpu", "cuda"):
        for dtype in dtypes_for(device):
            marks = (needs_cuda,) if device == "cuda" else ()
            params.append(pytest.param(device, dtype, id=f"{device}-{str(dtype)[6:]}", marks=marks))
    return params


DEVICE_DTYPES = _device_dtype_params()


def rel_error(out, ref):
    """‖out - ref‖ / ‖ref‖ in float64 over the entries the reference holds as finite numbers in
    out's dtype; NaN and inf must sit where that rounded reference has them (a value past the
    dtype's range is inf there, as torch's own output is)."""
    out, rounded, ref = out.double(), ref.to(out.dtype).double(), ref.double()
    assert torch.equal(torch.isnan(out), torch.isnan(rounded)), "NaN pattern differs from the reference"
    inf = torch.isinf(rounded)
    assert torch.equal(out[inf], rounded[inf]) and not torch.isinf(out[~inf]).any(), \
        "inf pattern differs from the reference"
    finite = torch.isfinite(rounded)
    out, ref = out[finite], ref[finite]
    denom, diff = ref.norm().item(), (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def torch_error_bound(out, torch_out, ref, factor=2.0, eps=None):
    """(fastkern's error, torch's error, the bound): fastkern's error against the float64 reference
    may be at most `factor` x torch's own error in the same dtype, plus a tiny epsilon scaled to the
    dtype. In float64 torch *is* the reference, so there the epsilon alone (1e-9, room for
    cancellation in tiny derivatives) is the bound. benchmarks/ab.py reports ours / bound."""
    if eps is None:
        eps = error_eps(out.dtype, out.numel())
    ours, theirs = rel_error(out, ref), rel_error(torch_out, ref)
    return ours, theirs, factor * theirs + eps


def error_eps(dtype, numel):
    """The bound's epsilon for a tensor of `numel` elements of `dtype`."""
    eps = {torch.float64: 1e-9, torch.float32: 1e-7}.get(dtype, 1e-5)
    # with a handful of elements the norm is one or two roundings, and the ratio of two such errors
    # is luck (a near-zero derivative, an exactly representable value): widen for them
    return eps * max(1.0, 64.0 / max(numel, 1))


def row_errors(out, ref):
    """Each row's relative error of 2-d `out` (all finite) against the float64 reference `ref`."""
    return (out.double() - ref).norm(dim=1) / ref.norm(dim=1)


def rows_over_torch_error(out, torch_out, ref, factor=2.0):
    """How many rows of 2-d `out` (all finite) break the bound that torch_error_bound sets a row
    alone: each row's error against the float64 reference over factor x torch's on that row + eps."""
    bound = factor * row_errors(torch_out, ref) + error_eps(out.dtype, out.shape[1])
    return int((row_errors(out, ref) > bound).sum())


def assert_within_torch_error(out, torch_out, ref, what, factor=2.0, eps=None):
    """fastkern's error is within torch_error_bound."""
    ours, theirs, bound = torch_error_bound(out, torch_out, ref, factor, eps)
    assert ours <= bound, f"{what}: fastkern error {ours:.3g} > {factor} x torch {theirs:.3g}"


# Each test draws its inputs from its own seed, the crc32 of its id xor FASTKERN_TEST_SEED (0 unless
# set): a failure reproduces with the same command, alone or under xdist, and a fresh set of draws
# for the whole suite is one variable away (numerical checks of single small rows are draws of a
# distribution whose tail can cross the 2x-torch bound, see test_single_rows_fp32).
SEED_BASE = int(os.environ.get("FASTKERN_TEST_SEED", "0"))


def pytest_report_header(config):
    return f"fastkern test seeds: crc32(test id) ^ FASTKERN_TEST_SEED={SEED_BASE}"


@pytest.fixture(autouse=True)
def seeded(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()) ^ SEED_BASE)


@pytest.fixture
def poison(monkeypatch):
    """Makes every torch.empty / empty_like during the test return NaN-filled floating memory, so an
    element an op forgets to write shows up as NaN."""
    real_empty_like, real_empty = torch.empty_like, torch.empty

    def fill(t):
        if t.is_floating_point() and t.numel():
            t.fill_(math.nan)
        return t

    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_empty_like(*a, **k)))
    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))


def misaligned(shape, dtype, device, offset=1):
    """A contiguous tensor whose storage offset breaks 16-byte alignment."""
    n = math.prod(shape)
    buf = torch.randn(n + offset, dtype=torch.float32, device=device).to(dtype)
    t = buf[offset:].view(shape)
    assert t.data_ptr() % 16 != 0
    return t


def synchronized(t):
    """`t` once the GPU has run everything queued so far; its gradient likewise waits for the GPU
    before it flows on. Calls separated by it cannot overlap on the GPU."""
    torch.cuda.synchronize()
    if t.requires_grad:
        t.register_hook(lambda g: (torch.cuda.synchronize(), g)[1])
    return t


def chain_matches_synchronized(fn, *inputs):
    """Runs fn(*inputs, sync), which applies `sync` to each intermediate result and returns a tuple
    of tensors, eagerly and captured in a CUDA graph, and checks both bit for bit against the same
    calls with the GPU synchronized between them (sync = synchronized). On sm_90 a kernel may
    launch while its predecessor drains (programmatic dependent launch); one that touched memory
    before its grid-dependency wait would read stale values."""
    expected = fn(*inputs, synchronized)
    eager = fn(*inputs, lambda t: t)
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":  # make sanitize's memcheck: capture
        for want, got in zip(expected, eager):                    # needs the caching allocator
            assert torch.equal(got, want), "eager chain differs from the synchronized one"
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream
        fn(*inputs, lambda t: t)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn(*inputs, lambda t: t)
    graph.replay()
    torch.cuda.synchronize()
    for want, got_eager, got_graph in zip(expected, eager, captured):
        assert torch.equal(got_eager, want), "eager chain differs from the synchronized one"
        assert torch.equal(got_graph, want), "captured chain differs from the synchronized one"


def cpu_isas():
    """The FASTKERN_CPU_ISA values this machine runs (csrc/cpu/vec.h: fk_cpu_isa)."""
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        flags = []
    isas = ["generic"]
    if all(f in flags for f in ("avx2", "fma", "f16c")):
        isas.append("avx2")
        if all(f in flags for f in ("avx512f", "avx512dq", "avx512bw", "avx512vl")):
            isas.append("avx512")
            if "avx512_bf16" in flags:  # avx512 then rounds to bf16 with vcvtneps2bf16
                isas.append("avx512-nobf16")
    return isas


def on_cpu_threads(threads, fn):
    """fn() with torch (and so fastkern's CPU kernels) set to `threads` threads."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(saved)


def in_fresh_thread(fn):
    """fn() on a new thread, after one call on this one (so torch's caching allocator already holds
    the blocks it asks for): the new thread's first CUDA work is fastkern's, as on torch's autograd
    thread when a backward starts with a fastkern op. Such a thread has no current CUDA context."""
    fn()
    torch.cuda.synchronize()
    result = {}

    def run():
        try:
            result["out"] = fn()
            torch.cuda.synchronize()
        except Exception as e:  # re-raised on the caller's thread
            result["error"] = e
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["out"]
