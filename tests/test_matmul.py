"""fastkern.matmul / linear / nn.Linear / nn.FusedMLP: values and gradients against float64,
layouts, broadcasting, autograd, compile, graphs, modules and bad input."""
import itertools
import os
import random

import pytest
import torch
import torch.nn.functional as F

import fastkern
from fastkern.ops import matmul as mm_ops
from conftest import (CUDA, DEVICE_DTYPES, DEVICES, assert_within_torch_error, in_fresh_thread, misaligned, needs_cuda,
                      on_cpu_threads, rel_error)

ACTIVATIONS = [None, "gelu", "gelu_tanh"]
SIZES = [1, 7, 16, 127, 128, 1000, 1793, 4096]
CPU_MAX_MNK = 2**28  # beyond this a CPU case (and its float64 reference) costs seconds


def _grid():
    """A fixed sample of (m, n, k) from SIZES: every size appears in each position, most cases
    small; the CPU runs those with m * n * k <= CPU_MAX_MNK."""
    rng = random.Random(1234)
    shapes = {(s, s, s) for s in (1, 7, 128)} | {(1000, 7, 1793), (7, 4096, 16), (1793, 1, 127),
                                                  (127, 1000, 128), (16, 127, 4096), (4096, 16, 7)}
    while len(shapes) < 16:
        shapes.add(tuple(rng.choice(SIZES) for _ in range(3)))
    return sorted(shapes)


def make(shape, dtype, device, requires_grad=False):
    return torch.randn(shape, device=device).to(dtype).requires_grad_(requires_grad)


def layout(t, major):
    """`t` (…, r, c) with the same values, its matrices row-major ("row"), column-major ("col") or
    at a storage offset of one element ("mis")."""
    if major == "col":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if major == "mis":
        out = misaligned(t.shape, t.dtype, t.device)
        return out.copy_(t)
    return t


def torch_forward(a, b, bias, activation):
    out = torch.matmul(a, b)
    if bias is not None:
        out = out + bias
    if activation is not None:
        out = F.gelu(out, approximate="tanh" if activation == "gelu_tanh" else "none")
    return out


def tf32_round(t):
    """fp32 `t` rounded to tf32 (10 mantissa bits, to nearest): what a TF32 tensor core multiplies."""
    return ((t.detach().contiguous().view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)


def check(a, b, bias, activation, grads=True, tf32=False):
    """fastkern vs torch (same dtype) vs float64, forward and (with grads) every input's gradient,
    under the 2x-torch-error rule. With tf32, the yardstick is the worse of torch's error and that of
    an ideal TF32 product (operands and incoming gradient rounded to tf32, then float64 arithmetic):
    cuBLAS under allow_tf32 still runs some shapes in exact fp32."""
    leaves = [t.detach().requires_grad_(grads) if t is not None else None for t in (a, b, bias)]
    out = fastkern.matmul(leaves[0], leaves[1], bias=leaves[2], activation=activation)
    expect_shape = torch.matmul(a.detach().to("meta"), b.detach().to("meta")).shape
    assert out.shape == expect_shape and out.dtype == a.dtype
    grad = torch.randn_like(out) if grads else None

    def reference(dtype, rounded=lambda t: t):
        ins = [None if t is None else rounded(t).to(dtype).requires_grad_(grads) for t in (a, b, bias)]
        o = torch_forward(*ins, activation)
        gs = torch.autograd.grad(o, [t for t in ins if t is not None], rounded(grad).to(dtype)) if grads else ()
        return o, gs

    t_out, t_grads = reference(a.dtype)
    r_out, r_grads = reference(torch.float64)
    e_out, e_grads = reference(torch.float64, tf32_round) if tf32 else (t_out, t_grads)

    def within(ours, theirs, ideal, ref, what):
        if rel_error(ideal.to(ours.dtype), ref) > rel_error(theirs, ref):
            theirs = ideal.to(ours.dtype)
        assert_within_torch_error(ours, theirs, ref, what)

    within(out, t_out, e_out, r_out, "output")
    if grads:
        ours = torch.autograd.grad(out, [t for t in leaves if t is not None], grad)
        for name, g, tg, eg, rg in zip(("a", "b", "bias"), ours, t_grads, e_grads, r_grads):
            assert g.shape == tg.shape and g.dtype == a.dtype
            within(g, tg, eg, rg, f"grad {name}")


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("mnk", _grid(), ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_reference(device, dtype, mnk, poison):
    m, n, k = mnk
    if device == "cpu" and (m * n * k > CPU_MAX_MNK or (dtype == torch.float64 and m * n * k > 2**24)):
        pytest.skip("too large for the CPU suite")
    i = SIZES.index(m) + 3 * SIZES.index(n) + 5 * SIZES.index(k)  # rotate options over the grid
    activation, with_bias = ACTIVATIONS[i % 3], i % 2 == 0
    majors = list(itertools.product(("row", "col", "mis"), repeat=2))[i % 9]
    a, b = layout(make((m, k), dtype, device), majors[0]), layout(make((k, n), dtype, device), majors[1])
    bias = make((n,), dtype, device) if with_bias else None
    check(a, b, bias, activation, grads=m * n * k <= 2**24)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("majors", list(itertools.product(("row", "col", "mis"), repeat=2)), ids="-".join)
def test_operand_layouts(device, dtype, majors, poison):
    """Every combination of row-major, column-major and misaligned operands, batched, with a
    bias and each activation in turn; view operands are read in place (no copy)."""
    a = layout(make((3, 67, 45), dtype, device), majors[0])
    b = layout(make((3, 45, 38), dtype, device), majors[1])
    bias = make((38,), dtype, device)
    check(a, b, bias, ACTIVATIONS[len(majors[0] + majors[1]) % 3])


BROADCAST_CASES = [
    ((3, 17, 9), (9, 5)),            # b 2-D: a's batch folds into rows
    ((2, 3, 17, 9), (9, 5)),
    ((3, 17, 9), (3, 9, 5)),
    ((2, 1, 7, 9), (3, 9, 5)),       # both broadcast
    ((7, 9), (4, 9, 5)),             # a 2-D, b batched
    ((1, 7, 9), (4, 9, 5)),
    ((4, 7, 9), (1, 9, 5)),
    ((9,), (9, 5)), ((3, 7, 9), (9,)), ((9,), (9,)), ((9,), (2, 9, 5)),  # 1-D like torch.matmul
]


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("shapes", BROADCAST_CASES, ids=str)
def test_batch_broadcasting_and_1d(device, dtype, shapes, poison):
    a, b = make(shapes[0], dtype, device), make(shapes[1], dtype, device)
    bias = make(shapes[1][-1:], dtype, device) if len(shapes[1]) > 1 else None
    check(a, b, bias, "gelu_tanh" if bias is not None else None)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_column_major_batched_a_with_2d_b(device, dtype):
    """a = x.mT of a batched x cannot fold its batch into rows: the batched kernel (b's batch
    stride 0) runs instead, on the views as they are."""
    a = make((3, 9, 17), dtype, device).transpose(-1, -2)
    check(a, make((9, 5), dtype, device), make((5,), dtype, device), "gelu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_k_zero_and_empty(device, activation):
    a, b, bias = torch.randn(4, 0, device=device), torch.randn(0, 6, device=device), torch.randn(6, device=device)
    assert torch.allclose(fastkern.matmul(a, b, bias=bias, activation=activation),
                          torch_forward(a, b, bias, activation), rtol=1e-6, atol=1e-7)
    assert torch.equal(fastkern.matmul(a, b), torch.zeros(4, 6, device=device))
    for sa, sb in [((0, 5), (5, 6)), ((4, 5), (5, 0)), ((0, 4, 5), (5, 6))]:
        x = torch.randn(sa, device=device, requires_grad=True)
        w = torch.randn(sb, device=device, requires_grad=True)
        out = fastkern.matmul(x, w, activation=activation)
        assert out.shape == torch.matmul(x, w).shape
        out.sum().backward()
        assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_float64(activation):
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: fastkern.linear(x, w, b, activation=activation),
                                    (x, w, bias))
    a = torch.randn(2, 1, 4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: fastkern.matmul(a, b, activation=activation), (a, b))
    v = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v, b: fastkern.matmul(v, b), (v, b))


def test_autograd_saves_pre_activation_not_output():
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(32, 16, requires_grad=True)
    b = torch.randn(32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fastkern.linear(x, w, b, activation="gelu")
    assert len(saved) == 4 and saved[0] is x and saved[2] is b
    pre = saved[3]
    assert torch.allclose(pre, x @ w.t() + b, atol=1e-5) and not torch.allclose(pre, y)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    a = torch.randn(2, 5, 12, device=device, requires_grad=True)
    b = torch.randn(12, 7, device=device, requires_grad=True)
    bias = torch.randn(7, device=device, requires_grad=True)
    for args in [(a, b, bias, "gelu"), (a, b, None, "none"), (a, b.t().contiguous().t(), bias, "gelu_tanh"),
                 (a[0], torch.randn(3, 12, 7, device=device), None, "none")]:
        torch.library.opcheck(torch.ops.fastkern.matmul.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    x = torch.randn(4, 16, 32, device=device, requires_grad=True)
    w1, b1 = torch.randn(64, 32, device=device, requires_grad=True), torch.randn(64, device=device, requires_grad=True)
    w2 = torch.randn(3, 64, 8, device=device, requires_grad=True)

    def f(x, w1, b1, w2):
        h = fastkern.linear(x, w1, b1, activation="gelu_tanh")
        return fastkern.matmul(h.unsqueeze(1), w2, activation="gelu").sum()

    compiled = torch.compile(f, fullgraph=True)
    inputs = (x, w1, b1, w2)
    g_eager = torch.autograd.grad(f(*inputs), inputs)
    g_compiled = torch.autograd.grad(compiled(*inputs), inputs)
    for a, b in zip(g_eager, g_compiled):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["amx", "avx512", "avx2", "generic"])
def test_every_cpu_micro_kernel(kernel, monkeypatch, poison):
    """FASTKERN_CPU_MATMUL_KERNEL picks a kernel (amx: bf16 on AMX tiles, the default where the CPU
    has them, else the widest fp32 one; a machine without one falls back to the next): each meets
    the error rule on edge-heavy shapes and layouts."""
    monkeypatch.setenv("FASTKERN_CPU_MATMUL_KERNEL", kernel)
    for dtype in (torch.float32, torch.bfloat16):
        a = layout(make((2, 131, 300), dtype, "cpu"), "col")
        check(a, make((300, 77), dtype, "cpu"), make((77,), dtype, "cpu"), "gelu", grads=False)
        check(make((29, 600), dtype, "cpu"), layout(make((600, 333), dtype, "cpu"), "col"), None, None,
              grads=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cpu_threads_give_the_one_thread_results(dtype, poison):
    a, b, bias = make((2, 300, 257), dtype, "cpu"), make((257, 520), dtype, "cpu"), make((520,), dtype, "cpu")

    def run():
        return torch.ops.fastkern.matmul.default(a, b, bias, "gelu")
    one, many = on_cpu_threads(1, run), on_cpu_threads(3, run)
    for x, y in zip(one, many):
        assert not y.isnan().any() and torch.equal(x, y)


def test_plan_and_flags_cpu(monkeypatch):
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    assert mm_ops._plan(a, b) == "cpu"
    monkeypatch.delenv("FASTKERN_MATMUL_FORCE_GENERAL", raising=False)
    assert mm_ops._flags(a) == 0
    monkeypatch.setenv("FASTKERN_MATMUL_FORCE_GENERAL", "1")
    assert mm_ops._flags(a) == 2


def test_views_are_not_copied(monkeypatch):
    """Row- and column-major operands (w.t(), x.mT) reach the kernel in place."""
    calls = []
    real = mm_ops._C.matmul
    monkeypatch.setattr(mm_ops._C, "matmul", lambda *args: calls.append(args) or real(*args))
    x, w = torch.randn(3, 5, 8), torch.randn(6, 8)
    fastkern.linear(x, w)
    fastkern.matmul(x.transpose(-1, -2), x)
    (first, second) = calls
    assert first[0] == x.data_ptr() and first[1] == w.data_ptr()
    assert first[5:12] == (1, 15, 6, 8, 0, 8, 1) and first[12:15] == (0, 1, 8)  # folded rows, w.t()
    assert second[0] == x.data_ptr() and second[1] == x.data_ptr()
    assert second[9:12] == (40, 1, 8) and second[12:15] == (40, 8, 1)  # x.mT column-major


# ---- CUDA --------------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mnk", [(4096, 4096, 4096), (1793, 1000, 127), (7, 4096, 1793), (128, 128, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_general_kernel_matches_default_cuda(dtype, mnk, monkeypatch):
    m, n, k = mnk
    a, b, bias = make((m, k), dtype, "cuda"), make((k, n), dtype, "cuda"), make((n,), dtype, "cuda")
    default_plan = mm_ops._plan(a, b, bias, "gelu")
    default = fastkern.matmul(a, b, bias=bias, activation="gelu")
    monkeypatch.setenv("FASTKERN_MATMUL_FORCE_GENERAL", "1")
    general_plan = mm_ops._plan(a, b, bias, "gelu")
    general = fastkern.matmul(a, b, bias=bias, activation="gelu")
    assert isinstance(default_plan, str) and isinstance(general_plan, str)
    ref = torch_forward(a.double(), b.double(), bias.double(), "gelu")
    t_out = torch_forward(a, b, bias, "gelu")
    assert_within_torch_error(default, t_out, ref, f"default ({default_plan})")
    assert_within_torch_error(general, t_out, ref, f"general ({general_plan})")


@needs_cuda
@pytest.mark.parametrize("majors", list(itertools.product(("row", "col"), repeat=2)), ids="-".join)
@pytest.mark.parametrize("k", [24, 200], ids=lambda k: f"k{k}")
def test_cuda_general_kernel_large_tile_edges(majors, k, monkeypatch, poison):
    """mma_sm80's 128 x 256 tile (a grid of >= one tile per SM): partial tiles in M, N and K, K
    shorter than the stage ring, every operand major, bias and GELU."""
    monkeypatch.setenv("FASTKERN_MATMUL_FORCE_GENERAL", "1")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tm = -(-sms // 9)  # 9 tiles of 256 across N: >= sms tiles
    a = layout(make((128 * tm - 8, k), torch.bfloat16, "cuda"), majors[0])
    b = layout(make((k, 256 * 9 - 24), torch.bfloat16, "cuda"), majors[1])
    assert mm_ops._plan(a, b, None, "gelu") == "mma_sm80"
    check(a, b, make((b.shape[1],), torch.bfloat16, "cuda"), "gelu", grads=False)


@needs_cuda
@pytest.mark.parametrize("majors", list(itertools.product(("row", "col", "mis"), repeat=2)), ids="-".join)
@pytest.mark.parametrize("edges", ["odd", "by4"])
def test_cuda_fp32_exact_wide_tiles_at_ragged_edges(majors, edges, poison):
    """Exact fp32 on a grid that fills every SM twice (where simt_fp32 takes 128 x
    256 tiles) with m, n one past and three short of a tile ("by4": four past and four short, so
    that row-major B and column-major A rows stay 16-byte aligned: whole tiles take 16-byte copies,
    the edges 4-byte ones), k five (four) past a step, every operand major, bias and GELU."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m, n, k = 128 * 17 + 1, 256 * -(-2 * sms // 18) - 3, 16 * 17 + 5
    if edges == "by4":
        m, n, k = m + 3, n - 1, k - 1
    a = layout(make((m, k), torch.float32, "cuda"), majors[0])
    b = layout(make((k, n), torch.float32, "cuda"), majors[1])
    check(a, b, make((n,), torch.float32, "cuda"), "gelu", grads=False)


def _hopper():
    return CUDA and torch.cuda.get_device_capability() == (9, 0) and "sm_90a" in fastkern.BUILD_INFO["archs"]


def _sms():
    return torch.cuda.get_device_properties(0).multi_processor_count if CUDA else 132


def _rows_aligned(t):
    """Whether a 16-bit operand's rows (along its non-unit stride) start 128-byte aligned as the kernel
    reads them: rows that are not 16-byte aligned are copied into 128-byte aligned ones (ops/matmul.py's
    _padded)."""
    stride = t.stride(-2) if t.stride(-1) == 1 else t.stride(-1)
    return stride % 8 != 0 or stride % 64 == 0


def _wgmma_plan(m, n, k, batch=1, b_aligned=True, a_aligned=True):
    """wgmma_sm90's plan name for 16-bit operands (dispatch.cu's 16-bit sm_90 rows), where K has 4
    steps of 64 or more: 128 x 64 tiles with K split over 2-CTA clusters where 128 x 128 tiles number
    at most a quarter of the SMs; up to half, pairs of tiles sharing B where B's rows are not 128-byte
    aligned (b_aligned False) and 128-row tiles are even in number, else K split (D-128, D-136); 128 x
    256 tiles where K >= 6144 and they number at least twice the SMs (D-139), or where a's rows
    are not 128-byte aligned and their waves cost at most 1.25x (D-144)."""
    sms, tiles_m, steps = _sms(), -(-m // 128), -(-k // 64)
    wide = tiles_m * batch * -(-n // 128)
    tiles_256 = tiles_m * batch * -(-n // 256)
    if k >= 6144 and tiles_256 >= 2 * sms:
        return "wgmma_sm90 128x256"
    if 2 * wide > sms or steps < 4:
        waves, waves_256 = -(-wide // sms), -(-tiles_256 // sms)
        return "wgmma_sm90 128x256" if not a_aligned and 8 * waves_256 <= 5 * waves else "wgmma_sm90"
    if 4 * wide <= sms:
        return "wgmma_sm90 128x64 split-k"
    return "wgmma_sm90 shared-b" if tiles_m % 2 == 0 and not b_aligned else "wgmma_sm90 split-k"


def _long_k(fewer_columns, shorter_k):
    """(m, n, k) with 24 rows of 128 x 256 tiles and enough columns for 2 x SMs tiles, k 6144 (the 128 x
    256 row's edges); one column fewer, or k one shorter."""
    columns = -(-2 * _sms() // 24) - fewer_columns
    return 128 * 24, 256 * columns, 6144 - shorter_k


def _even_tile_rows():
    """An even number of 128-row tiles near SMs / 12: with 4 tile columns, a quarter to half the SMs."""
    return 2 * ((_sms() // 12 + 1) // 2)


# csrc/cuda/matmul/dispatch.cu's table, row by row: (dtype, operand view, forced general, size) ->
# strategy. "large": 128 x 128 tiles for more than half the SMs; "small": 6 of them, k 3 steps;
# "small-long-k": the same with k 16 steps; "mid-long-k": a third of the SMs' tiles (an odd number of
# tile rows), k 16 steps; "mid-even": the same with an even number and B's rows not 128-byte aligned
# (n 504, k 1000); "half": exactly half the SMs' tiles, k 4 steps (the paired rows' edges); "long-k": 128 x
# 256 tiles for exactly twice the SMs, k 6144 (the 128 x 256 row), and just outside it: k 6143
# ("long-k-short") and a tile column fewer ("long-k-few"); "misaligned-a": a's rows 16-byte but not
# 128-byte aligned (k 1016), 4 waves of 128 x 128 tiles (128 x 256); "misaligned-b": only b's rows
# (128 x 128); "misaligned-narrow": a's, but n 128 (128 x 128: a 256-wide tile would be half empty).
DISPATCH_ROWS = [
    (torch.float32, "row", False, "small", lambda: "simt_fp32"),
    (torch.float32, "col", True, "small", lambda: "simt_fp32"),
    (torch.bfloat16, "row", False, "small", lambda: "wgmma_sm90" if _hopper() else "mma_sm80"),
    (torch.float16, "col", False, "small-long-k",
     lambda: "wgmma_sm90 128x64 split-k" if _hopper() else "mma_sm80"),
    (torch.bfloat16, "row", False, "mid-long-k",
     lambda: _wgmma_plan(128 * (_sms() // 12), 512, 1000) if _hopper() else "mma_sm80"),
    (torch.float16, "col", False, "mid-even",
     lambda: _wgmma_plan(128 * _even_tile_rows(), 504, 1000, b_aligned=False) if _hopper() else "mma_sm80"),
    (torch.bfloat16, "col", False, "half",
     lambda: _wgmma_plan(128 * (_sms() // 2), 128, 193) if _hopper() else "mma_sm80"),
    (torch.bfloat16, "col", False, "long-k", lambda: _wgmma_plan(*_long_k(0, 0)) if _hopper() else "mma_sm80"),
    (torch.float16, "row", False, "long-k-short",
     lambda: _wgmma_plan(*_long_k(0, 1)) if _hopper() else "mma_sm80"),
    (torch.bfloat16, "row", False, "long-k-few", lambda: _wgmma_plan(*_long_k(1, 0)) if _hopper() else "mma_sm80"),
    (torch.bfloat16, "row", False, "large", lambda: "wgmma_sm90" if _hopper() else "mma_sm80"),
    (torch.float16, "col", False, "large", lambda: "wgmma_sm90" if _hopper() else "mma_sm80"),
    (torch.bfloat16, "row", False, "misaligned-a",
     lambda: _wgmma_plan(128 * _sms(), 512, 1016, a_aligned=False) if _hopper() else "mma_sm80"),
    (torch.float16, "col", False, "misaligned-a",
     lambda: _wgmma_plan(128 * _sms(), 512, 1016, a_aligned=False, b_aligned=False) if _hopper() else "mma_sm80"),
    (torch.bfloat16, "row", False, "misaligned-b",
     lambda: _wgmma_plan(128 * _sms(), 1016, 1024, b_aligned=False) if _hopper() else "mma_sm80"),
    (torch.bfloat16, "row", False, "misaligned-narrow",
     lambda: _wgmma_plan(128 * _sms(), 128, 1016, a_aligned=False) if _hopper() else "mma_sm80"),
    # a 1793-wide operand is copied into 16-byte aligned rows, so it takes the fast kernel too
    (torch.bfloat16, "ragged", False, "large", lambda: "wgmma_sm90" if _hopper() else "mma_sm80"),
    (torch.bfloat16, "row", True, "small", lambda: "mma_sm80"),
    (torch.bfloat16, "row", True, "small-long-k", lambda: "mma_sm80"),
    (torch.float16, "ragged", True, "large", lambda: "mma_sm80"),
]


@needs_cuda
@pytest.mark.parametrize("dtype,view,forced,size,strategy", DISPATCH_ROWS,
                         ids=[f"cuda-{str(d)[6:]}-{v}-{s}-{'forced' if f else 'auto'}"
                              for d, v, f, s, _ in DISPATCH_ROWS])
def test_dispatch_table(dtype, view, forced, size, strategy, monkeypatch):
    if forced:
        monkeypatch.setenv("FASTKERN_MATMUL_FORCE_GENERAL", "1")
    tall = 128 * (_sms() // 2 + 1)  # one column of 128 x 128 tiles, more than half the SMs
    m, n, k = {"small": (384, 256, 192), "small-long-k": (384, 256, 1000), "large": (tall, 256, 193),
               "mid-long-k": (128 * (_sms() // 12), 512, 1000), "mid-even": (128 * _even_tile_rows(), 504, 1000),
               "half": (128 * (_sms() // 2), 128, 193), "long-k": _long_k(0, 0), "long-k-short": _long_k(0, 1),
               "long-k-few": _long_k(1, 0), "misaligned-a": (128 * _sms(), 512, 1016),
               "misaligned-b": (128 * _sms(), 1016, 1024), "misaligned-narrow": (128 * _sms(), 128, 1016)}[size]
    if view == "ragged":
        m, n, k = (tall // 2 + 1, 1793, 1793)
    a = make((m, k), dtype, "cuda")
    b = make((k, n), dtype, "cuda")
    if view == "col":
        b = b.t().contiguous().t()
    bias = make((n,), dtype, "cuda")
    assert mm_ops._plan(a, b, bias, "gelu_tanh") == strategy()
    out = fastkern.matmul(a, b, bias=bias, activation="gelu_tanh")
    ref = torch_forward(a.double(), b.double(), bias.double(), "gelu_tanh")
    assert_within_torch_error(out, torch_forward(a, b, bias, "gelu_tanh"), ref, strategy())


# (m, n, k, batch) around the small-problem row (K split over 2 CTAs, 128 x 64 tiles or 128 x 128):
# m and n one short of, past and inside a tile (m = 37 leaves a split tile's second row block empty),
# C rows 16-byte aligned (n = 184, 504: TMA stores) or not (185, 503: element stores), k of 1 and 3
# steps (not split), 4 to 16 steps, odd counts split 2 + 3 and 3 + 4, a K tail inside the last step
# (k = 257: one element past 4 steps), a batch; the last five take 128 x 128 tiles for a third of the
# SMs (4 tile columns): an odd number of tile rows (K split), an even one (pairs sharing B where B's
# rows are not 128-byte aligned: n 488 row-major, k 1000 column-major; else K split), a batch of
# 3 x 2 x 8 tiles.
_MID = 128 * (_sms() // 12) - 5
_MID_EVEN = 128 * _even_tile_rows() - 5
SMALL_SHAPES = [(251, 185, 189, 1), (251, 184, 257, 1), (37, 185, 300, 1), (129, 64, 1000, 1), (200, 63, 16, 1),
                (130, 120, 260, 3), (500, 504, 420, 1), (_MID, 503, 323, 1), (_MID, 504, 1000, 1),
                (_MID_EVEN, 488, 257, 1), (_MID_EVEN, 503, 1000, 1), (250, 904, 300, 3)]


@needs_cuda
@pytest.mark.parametrize("majors", list(itertools.product(("row", "col"), repeat=2)), ids="-".join)
@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_hopper_small_problem_edges(shape, majors, poison):
    """wgmma_sm90's small-problem rows (D-128, D-136) at ragged edges, every operand major, bias, GELU,
    and gradients (the pre-activation pass, and backward GEMMs of other shapes) for four shapes."""
    m, n, k, batch = shape
    lead = (batch,) if batch > 1 else ()
    a = layout(make(lead + (m, k), torch.bfloat16, "cuda"), majors[0])
    b = layout(make(lead + (k, n), torch.bfloat16, "cuda"), majors[1])
    bias = make((n,), torch.bfloat16, "cuda")
    if _hopper():
        assert mm_ops._plan(a, b, bias, "gelu") == _wgmma_plan(m, n, k, batch, _rows_aligned(b), _rows_aligned(a))
    check(a, b, bias, "gelu", grads=shape in SMALL_SHAPES[1:3] + SMALL_SHAPES[7:8] + SMALL_SHAPES[9:10])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_hopper_split_k_plain_and_chained(dtype, poison):
    """The split-K instances without bias or activation (C = A B alone), fp16, and three calls in a
    row on one stream (the lean prologue waits for the previous grid per role: each call reads the
    previous call's output)."""
    m, n, k = 384, 320, 640
    a, b = make((m, k), dtype, "cuda"), make((k, n), dtype, "cuda")
    if _hopper():
        assert mm_ops._plan(a, b) == _wgmma_plan(m, n, k, b_aligned=_rows_aligned(b), a_aligned=_rows_aligned(a))
    check(a, b, None, None, grads=False)
    w = make((n, n), dtype, "cuda") / n ** 0.5
    x, ref = fastkern.matmul(a, b), a.double() @ b.double()
    for _ in range(3):
        x, ref = fastkern.matmul(x, w), ref @ w.double()
    torch_x = (a @ b) @ w @ w @ w
    assert_within_torch_error(x, torch_x, ref, "chained split-K calls")


def _hopper_arrangement_shapes():
    """(m, n, k, arrangement) around wgmma_sm90's choice (launch()): ping-pong consumers when a CTA
    gets two 128 x 128 tiles or more (tiles >= 2 x SMs) and C's rows are 16-byte aligned, else
    cooperative. Edge tiles partial, per-CTA tile counts odd and even, k-loops of 1, 2 and 16 steps."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count if CUDA else 132
    shapes = []
    for tiles, k in ((2 * sms - 1, 72), (2 * sms, 40), (2 * sms + 1, 1000), (3 * sms + 5, 128)):
        tn = next(d for d in (7, 5, 3, 2, 1) if tiles % d == 0)  # tiles = tm x tn
        m, n = 128 * (tiles // tn) - 5, 128 * tn - 8
        shapes.append((m, n, k, "ping-pong" if tiles >= 2 * sms else "cooperative"))
    m, n, k, _ = shapes[2]
    shapes.append((m, n + 1, k, "cooperative"))  # C's rows unaligned: element stores
    return shapes


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", _hopper_arrangement_shapes(), ids=lambda s: "x".join(map(str, s[:3])) + "-" + s[3])
def test_cuda_hopper_consumer_arrangements(dtype, shape, poison):
    """Both consumer arrangements of wgmma_sm90 on either side of the boundary, with bias, GELU and
    the pre-activation autograd keeps (the epilogue's two passes), gradients included."""
    m, n, k, _ = shape
    a, b, bias = make((m, k), dtype, "cuda"), make((k, n), dtype, "cuda"), make((n,), dtype, "cuda")
    assert mm_ops._plan(a, b, bias, "gelu_tanh") == ("wgmma_sm90" if _hopper() else "mma_sm80")
    check(a, b, bias, "gelu_tanh", grads=True)


def _ping_pong_shapes():
    """(batch, m, n, k) with 128 x 128 tiles >= 2 x SMs (wgmma_sm90's ping-pong instances): 12 tile
    columns, an even number of tile rows (pairs of tiles of one column: FK_MM_PAIRED_PINGPONG), an
    odd one, and a batch of two; ragged edges, k-loops of 5 and 4 steps."""
    rows = 2 * -(-_sms() // 12) + 2
    return [(1, 128 * rows - 5, 128 * 12 - 8, 300), (1, 128 * (rows + 1) - 3, 128 * 12, 257),
            (2, 64 * rows - 5, 128 * 12 - 8, 200)]


@needs_cuda
@pytest.mark.parametrize("majors", list(itertools.product(("row", "col"), repeat=2)), ids="-".join)
@pytest.mark.parametrize("shape", _ping_pong_shapes(), ids=lambda s: "x".join(map(str, s)))
def test_cuda_hopper_ping_pong_majors(shape, majors, poison):
    """The persistent ping-pong instances (two tiles or more a CTA) with every operand major, bias,
    GELU, the pre-activation and gradients."""
    batch, m, n, k = shape
    lead = (batch,) if batch > 1 else ()
    a = layout(make(lead + (m, k), torch.bfloat16, "cuda"), majors[0])
    b = layout(make(lead + (k, n), torch.bfloat16, "cuda"), majors[1])
    check(a, b, make((n,), torch.bfloat16, "cuda"), "gelu_tanh", grads=True)


@needs_cuda
@pytest.mark.parametrize("majors", list(itertools.product(("row", "col"), repeat=2)), ids="-".join)
@pytest.mark.parametrize("shape", [(128 * 24 - 5, 256 * 12 - 8, 6150), (128 * 24, 256 * 12 - 7, 6144 + 64 * 3 + 5)],
                         ids=lambda s: "x".join(map(str, s)))
def test_cuda_hopper_wide_tiles(shape, majors, poison):
    """The 128 x 256 tiles of long K (D-139) with every operand major, ragged edges, bias, GELU, the
    pre-activation and gradients; C's rows 16-byte aligned (TMA stores) or not (element stores)."""
    m, n, k = shape
    a = layout(make((m, k), torch.bfloat16, "cuda"), majors[0])
    b = layout(make((k, n), torch.bfloat16, "cuda"), majors[1])
    bias = make((n,), torch.bfloat16, "cuda")
    if _hopper():
        assert mm_ops._plan(a, b, bias, "gelu_tanh") == _wgmma_plan(m, n, k, 1, _rows_aligned(b), _rows_aligned(a))
    check(a, b, bias, "gelu_tanh", grads=shape[2] == 6150)


@needs_cuda
@pytest.mark.parametrize("majors", list(itertools.product(("row", "col"), repeat=2)), ids="-".join)
def test_cuda_hopper_misaligned_a_rows(majors, poison):
    """A's rows 16-byte but not 128-byte aligned read in place by 128 x 256 tiles (D-144), K-major (k
    1016) or M-major (m a multiple of 8, not of 64), ragged n, every b major, bias and GELU."""
    m, n, k = 128 * _sms() - 8, 509, 1016
    a = layout(make((m, k), torch.bfloat16, "cuda"), majors[0])
    b = layout(make((k, n), torch.bfloat16, "cuda"), majors[1])
    bias = make((n,), torch.bfloat16, "cuda")
    assert not _rows_aligned(a)
    if _hopper():
        assert mm_ops._plan(a, b, bias, "gelu_tanh") == _wgmma_plan(m, n, k, 1, _rows_aligned(b), False) == \
            "wgmma_sm90 128x256"
    check(a, b, bias, "gelu_tanh", grads=False)


# ---- CUDA, fp32 under TF32 (dispatch.cu's first row) ---------------------------------------------

@pytest.fixture
def tf32():
    """torch.backends.cuda.matmul.allow_tf32 on for the test (fastkern and torch alike), restored after."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _tf32_strategy():
    return "wgmma_sm90" if _hopper() else "simt_fp32"


# K tails (k not a multiple of the 32-element k-tile, nor of 4: copied into padded rows), M / N
# tails, a short k, a batch, a broadcast b. Where cuBLAS runs a shape in exact fp32 (H100: the batch
# of 3 x 67 x 45 x 38), an ideal TF32 product's error is the yardstick (check's tf32).
TF32_SHAPES = [((384, 256), (256, 320)), ((257, 203), (203, 130)), ((1000, 1793), (1793, 1000)),
               ((16, 64), (64, 96)), ((130, 5), (5, 72)), ((3, 67, 45), (3, 45, 38)), ((2, 100, 36), (36, 200))]


@needs_cuda
@pytest.mark.parametrize("majors", list(itertools.product(("row", "col"), repeat=2)), ids="-".join)
@pytest.mark.parametrize("shapes", TF32_SHAPES, ids=lambda s: "x".join(map(str, s[0] + s[1][-1:])))
def test_cuda_tf32_matches_torch_tf32(shapes, majors, tf32, poison):
    """fp32 under allow_tf32: the error of torch.matmul under TF32 in the same run is the yardstick
    (tf32's error, not fp32's), both operand majors, bias + each activation, gradients."""
    i = TF32_SHAPES.index(shapes)
    a = layout(make(shapes[0], torch.float32, "cuda"), majors[0])
    b = layout(make(shapes[1], torch.float32, "cuda"), majors[1])
    bias = make(shapes[1][-1:], torch.float32, "cuda") if i % 2 == 0 else None
    activation = ACTIVATIONS[i % 3]
    n = shapes[1][-1]
    assert mm_ops._plan(a, b, bias, activation) == (_tf32_strategy() if n > 1 else "simt_fp32")
    check(a, b, bias, activation, grads=True, tf32=True)


@needs_cuda
def test_cuda_tf32_linear_bias_gelu(tf32, poison):
    """nn.Linear's weight (N, K) is K-major for B as it is: F.linear + bias + GELU under TF32."""
    x, w, bias = make((4, 96, 200), torch.float32, "cuda"), make((136, 200), torch.float32, "cuda"), \
        make((136,), torch.float32, "cuda")
    out = fastkern.linear(x, w, bias, activation="gelu")
    ref = F.gelu(F.linear(x.double(), w.double(), bias.double()))
    assert_within_torch_error(out, F.gelu(F.linear(x, w, bias)), ref, _tf32_strategy())


@needs_cuda
def test_cuda_tf32_copies_only_operands_the_kernel_cannot_read(tf32, monkeypatch):
    """On Hopper under TF32, w.t() (F.linear's B), a row-major a and a row-major b (x @ w: N-major,
    read in place since D-132) reach the kernel as they are; a b whose rows are not 16-byte aligned,
    and any N-major b under FASTKERN_MATMUL_TF32_COPY_B=1 (the path before D-132), are copied
    K-major. Elsewhere (simt_fp32) nothing is copied."""
    calls = []
    real = mm_ops._C.matmul
    monkeypatch.setattr(mm_ops._C, "matmul", lambda *args: calls.append(args) or real(*args))
    x, w = make((64, 128), torch.float32, "cuda"), make((96, 128), torch.float32, "cuda")
    w_rows, odd_rows = w.t().contiguous(), make((128, 94), torch.float32, "cuda")
    fastkern.linear(x, w)
    fastkern.matmul(x, w_rows)
    fastkern.matmul(x, odd_rows)
    monkeypatch.setenv("FASTKERN_MATMUL_TF32_COPY_B", "1")
    fastkern.matmul(x, w_rows)
    (linear, in_place, unaligned, forced) = calls
    assert linear[0] == x.data_ptr() and linear[1] == w.data_ptr()
    assert in_place[0] == x.data_ptr() and in_place[1] == w_rows.data_ptr() and in_place[12:15] == (0, 96, 1)
    # b's batch, row and column strides: K-major in padded rows where copied
    assert (unaligned[12:15] == (0, 1, 128)) == _hopper() and (forced[12:15] == (0, 1, 128)) == _hopper()


# An N-major b read in place (D-132: the kernel computes C^T = B^T A^T, b's tile from registers): M /
# N / K tails of the 128 x 128 tile and of the 32-wide k-tile, k below one k8 step, one row, a
# batched b (a broadcast a), a's batch folded into rows, bias / activation / pre-activation, and the
# gradients (dB = a^T @ grad takes the same path: grad is an N-major B).
TF32_NMAJOR_SHAPES = [((257, 203), (203, 132)), ((1, 64), (64, 260)), ((130, 3), (3, 72)),
                      ((200, 1000), (1000, 388)), ((3, 67, 45), (3, 45, 40)), ((67, 45), (3, 45, 40)),
                      ((2, 129, 33), (33, 136))]


@needs_cuda
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("shapes", TF32_NMAJOR_SHAPES, ids=lambda s: "x".join(map(str, s[0] + s[1][-1:])))
def test_cuda_tf32_n_major_b(shapes, activation, tf32, poison):
    a, b = make(shapes[0], torch.float32, "cuda"), make(shapes[1], torch.float32, "cuda")
    bias = make(shapes[1][-1:], torch.float32, "cuda") if activation != "gelu" else None
    assert mm_ops._plan(a, b, bias, activation) == _tf32_strategy()
    check(a, b, bias, activation, grads=True, tf32=True)


@needs_cuda
@pytest.mark.parametrize("activation", ["gelu", None], ids=str)
def test_cuda_tf32_n_major_b_view_with_unaligned_c(activation, tf32, poison):
    """A row-major b viewed out of 16-byte-aligned rows (n = 130 of 132) is read in place, while C's
    rows of 130 fp32 are not 16-byte aligned: the swapped epilogue's element stores (and the
    pre-activation's, with GELU)."""
    a, b = make((257, 96), torch.float32, "cuda"), make((96, 132), torch.float32, "cuda")[:, :130]
    bias = make((130,), torch.float32, "cuda")
    assert mm_ops._plan(a, b, bias, activation) == _tf32_strategy()
    check(a, b, bias, activation, grads=True, tf32=True)


@needs_cuda
@pytest.mark.parametrize("shapes", [((384, 256), (256, 320)), ((257, 203), (203, 132))],
                         ids=lambda s: "x".join(map(str, s[0] + s[1][-1:])))
def test_cuda_tf32_n_major_b_matches_the_copied_path(shapes, tf32, monkeypatch):
    """The swapped kernel (b read N-major) and the K-major one (b copied first) multiply the same
    tf32 operands: they agree to fp32 summation-order noise, with a bias and GELU."""
    a, b = make(shapes[0], torch.float32, "cuda"), make(shapes[1], torch.float32, "cuda")
    bias = make(shapes[1][-1:], torch.float32, "cuda")
    swapped = fastkern.matmul(a, b, bias=bias, activation="gelu")
    monkeypatch.setenv("FASTKERN_MATMUL_TF32_COPY_B", "1")
    copied = fastkern.matmul(a, b, bias=bias, activation="gelu")
    torch.testing.assert_close(swapped, copied, rtol=1e-4, atol=1e-4 * copied.abs().max().item())


@needs_cuda
@pytest.mark.parametrize("view,allow,forced", [("row", True, False), ("col", True, False), ("mis", True, False),
                                               ("row", False, False), ("col", True, True)],
                         ids=["cuda-row-tf32", "cuda-col-tf32", "cuda-mis-tf32", "cuda-row-exact",
                              "cuda-col-tf32-forced"])  # "cuda" in the id: tools/sanitize.sh selects by it
def test_dispatch_table_tf32(view, allow, forced, tf32, monkeypatch):
    """The fp32 rows: TF32 allowed on Hopper takes wgmma_sm90 for any operand view (copied K-major
    where needed); exact fp32 or a forced general kernel stays on simt_fp32."""
    torch.backends.cuda.matmul.allow_tf32 = allow
    if forced:
        monkeypatch.setenv("FASTKERN_MATMUL_FORCE_GENERAL", "1")
    a, b = make((384, 192), torch.float32, "cuda"), layout(make((192, 256), torch.float32, "cuda"), view)
    bias = make((256,), torch.float32, "cuda")
    strategy = _tf32_strategy() if allow and not forced else "simt_fp32"
    assert mm_ops._plan(a, b, bias, "gelu_tanh") == strategy
    out = fastkern.matmul(a, b, bias=bias, activation="gelu_tanh")
    ref = torch_forward(a.double(), b.double(), bias.double(), "gelu_tanh")
    assert_within_torch_error(out, torch_forward(a, b, bias, "gelu_tanh"), ref, strategy)


@needs_cuda
def test_cuda_first_cuda_work_of_a_thread():
    # the Hopper kernel's tensor maps failed on a thread without a current context
    # ("cuTensorMapEncodeTiled failed": FusedMLP's backward as the first op of torch's autograd thread)
    a = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
    out = in_fresh_thread(lambda: fastkern.matmul(a, b))
    assert_within_torch_error(out, a @ b, a.double() @ b.double(), "fresh thread")


@needs_cuda
def test_cuda_graph_capture_and_replay():
    x = torch.randn(256, 512, device="cuda", requires_grad=True)
    w = torch.randn(1024, 512, device="cuda", requires_grad=True)
    b = torch.randn(1024, device="cuda", requires_grad=True)
    grad = torch.randn(256, 1024, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            x.grad = w.grad = b.grad = None
            fastkern.linear(x, w, b, activation="gelu_tanh").backward(grad)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    x.grad = w.grad = b.grad = None
    with torch.cuda.graph(graph):
        y = fastkern.linear(x, w, b, activation="gelu_tanh")
        y.backward(grad)
    for _ in range(2):
        with torch.no_grad():
            for t in (x, w, b, grad):
                t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
        yr = F.gelu(F.linear(xr, wr, br), approximate="tanh")
        yr.backward(grad.double())
        for got, want in ((y, yr), (x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
            assert torch.allclose(got.double(), want, rtol=1e-2, atol=1e-2)


@needs_cuda
def test_bad_input_cuda():
    with pytest.raises(ValueError, match=r"fastkern.matmul: b is on cpu but a is on cuda:0"):
        fastkern.matmul(torch.randn(4, 8, device="cuda"), torch.randn(8, 3))
    with pytest.raises(TypeError, match=r"a must be a floating-point tensor of dtype float32, float16, "
                                        r"bfloat16 on cuda, got torch.float64"):
        fastkern.matmul(torch.randn(4, 8, device="cuda").double(), torch.randn(8, 3, device="cuda").double())


# ---- modules -----------------------------------------------------------------------------------

def test_linear_module_is_a_drop_in():
    torch.manual_seed(7)
    ref = torch.nn.Linear(48, 24)
    torch.manual_seed(7)
    ours = fastkern.nn.Linear(48, 24)
    assert repr(ours) == repr(ref) == "Linear(in_features=48, out_features=24, bias=True)"
    assert isinstance(ours, torch.nn.Linear)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    for key in ref.state_dict():  # same init (same draws from the same distribution)
        assert torch.equal(ours.state_dict()[key], ref.state_dict()[key])
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(5, 48)
    assert torch.allclose(ours(x), ref(x), atol=1e-5)
    nobias = fastkern.nn.Linear(4, 3, bias=False, dtype=torch.float64)
    assert nobias.bias is None and nobias.weight.dtype == torch.float64
    assert repr(fastkern.nn.Linear(4, 3, activation="gelu")).endswith("bias=True, activation='gelu')")


def test_swap_modules_shares_parameters_and_fuses_gelu():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU("tanh"), torch.nn.Linear(32, 8))
    x = torch.randn(3, 16)
    before, keys, weight = model(x), model.state_dict().keys(), model[0].weight
    fastkern.nn.swap_modules(model)
    assert type(model[0]) is fastkern.nn.Linear and model[0].activation == "gelu_tanh"
    assert type(model[1]) is torch.nn.Identity and type(model[2]) is fastkern.nn.Linear
    assert model[0].weight is weight and model.state_dict().keys() == keys
    assert torch.allclose(model(x), before, atol=1e-5)
    unfused = fastkern.nn.swap_modules(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU()), fuse=False)
    assert type(unfused[1]) is fastkern.nn.GELU and unfused[0].activation is None


def _saved_bytes(fn):
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_fused_mlp_matches_sequential(device, approximate, bias):
    torch.manual_seed(3)
    seq = torch.nn.Sequential(torch.nn.Linear(64, 256, bias, device=device), torch.nn.GELU(approximate),
                              torch.nn.Linear(256, 48, bias, device=device))
    torch.manual_seed(3)  # both initialise on `device`, from the same seed
    mlp = fastkern.nn.FusedMLP(64, 256, 48, bias=bias, approximate=approximate, device=device)
    assert list(mlp.state_dict()) == list(seq.state_dict())
    for key, value in seq.state_dict().items():
        assert torch.equal(mlp.state_dict()[key], value)  # same init
    seq.load_state_dict(mlp.state_dict())
    mlp.load_state_dict(seq.state_dict())
    x = torch.randn(4, 30, 64, device=device, requires_grad=True)
    grad = torch.randn(4, 30, 48, device=device)
    y_ref, ref_bytes = _saved_bytes(lambda: seq(x))
    y, our_bytes = _saved_bytes(lambda: mlp(x))
    assert torch.allclose(y, y_ref, atol=1e-4, rtol=1e-4)
    assert our_bytes < ref_bytes and ref_bytes - our_bytes >= 4 * 30 * 256 * 4  # gelu(h) not saved
    params = [x, *seq.parameters()]
    g_ref = torch.autograd.grad(y_ref, params, grad)
    g = torch.autograd.grad(y, [x, *mlp.parameters()], grad)
    for a, b in zip(g, g_ref):
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-3)
    with torch.no_grad():
        assert torch.allclose(mlp(x), y_ref, atol=1e-4, rtol=1e-4)


def test_fused_mlp_gradcheck_float64():
    mlp = fastkern.nn.FusedMLP(6, 9, 4, dtype=torch.float64)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(mlp, (x,))
    params = [p.detach().requires_grad_() for p in mlp.parameters()]
    assert torch.autograd.gradcheck(
        lambda x, *p: fastkern.nn._FusedMLPFunction.apply(x, *p, "none"), (x, *params))


def test_fused_mlp_compile_fullgraph():
    torch._dynamo.reset()
    mlp = fastkern.nn.FusedMLP(32, 64, 16)
    x = torch.randn(8, 32, requires_grad=True)
    compiled = torch.compile(mlp, fullgraph=True)
    g_eager = torch.autograd.grad(mlp(x).sum(), [x, *mlp.parameters()])
    g_compiled = torch.autograd.grad(compiled(x).sum(), [x, *mlp.parameters()])
    for a, b in zip(g_eager, g_compiled):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


# ---- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(device):
    a, b = torch.randn(4, 8, device=device), torch.randn(8, 3, device=device)
    with pytest.raises(ValueError, match=r"fastkern.matmul: inner dims differ: a is \(4, 8\) and b is "
                                         r"\(7, 3\)"):
        fastkern.matmul(a, torch.randn(7, 3, device=device))
    with pytest.raises(TypeError, match=r"fastkern.matmul: b has dtype torch.float16 but a has torch.float32"):
        fastkern.matmul(a, b.half())
    with pytest.raises(TypeError, match=r"a must be a floating-point tensor .* got torch.int64"):
        fastkern.matmul(a.long(), b.long())
    with pytest.raises(TypeError, match=r"fastkern.matmul: b must be a torch.Tensor, got list"):
        fastkern.matmul(a, [[1.0]])
    with pytest.raises(ValueError, match=r"bias must have shape \(3,\), the output's last dim, got \(4,\)"):
        fastkern.matmul(a, b, bias=torch.randn(4, device=device))
    with pytest.raises(TypeError, match=r"bias has dtype torch.float64 but a has torch.float32"):
        fastkern.matmul(a, b, bias=torch.randn(3, device=device, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"activation must be None, 'gelu' or 'gelu_tanh', got 'relu'"):
        fastkern.matmul(a, b, activation="relu")
    with pytest.raises(ValueError, match=r"a and b need at least 1 dim, got 0 and 2"):
        fastkern.matmul(torch.tensor(1.0, device=device), b)
    with pytest.raises(ValueError, match=r"batch dims of a \(2,\) and b \(3,\) do not broadcast"):
        fastkern.matmul(torch.randn(2, 4, 8, device=device), torch.randn(3, 8, 3, device=device))
    with pytest.raises(ValueError, match=r"a bias needs b with at least 2 dims"):
        fastkern.matmul(a, b[:, 0], bias=torch.randn(1, device=device))
    w = torch.randn(3, 8, device=device)
    with pytest.raises(ValueError, match=r"fastkern.linear: x's last dim 7 != weight's in_features 8"):
        fastkern.linear(torch.randn(4, 7, device=device), w)
    with pytest.raises(ValueError, match=r"fastkern.linear: weight must be 2-D"):
        fastkern.linear(a, w[0])
    with pytest.raises(ValueError, match=r"fastkern.linear: bias must have shape \(3,\)"):
        fastkern.linear(a, w, torch.randn(8, device=device))
    with pytest.raises(TypeError, match=r"fastkern.linear: weight has dtype torch.bfloat16 but x has "
                                        r"torch.float32"):
        fastkern.linear(a, w.bfloat16())
    with pytest.raises(ValueError, match=r"fastkern.linear: activation must be None, 'gelu' or "
                                         r"'gelu_tanh', got 'tanh'"):
        fastkern.linear(a, w, activation="tanh")
    with pytest.raises(ValueError, match=r"fastkern.nn.FusedMLP: approximate must be 'none' or 'tanh'"):
        fastkern.nn.FusedMLP(4, 8, 4, approximate="erf")


def test_c_waist_refuses_bad_strides():
    """The C entry point checks what the Python layer guarantees (row- or column-major operands)."""
    a, b, c = torch.randn(4, 8), torch.randn(8, 3), torch.empty(4, 3)
    args = [a.data_ptr(), b.data_ptr(), 0, c.data_ptr(), 0, 1, 4, 3, 8, 0, 8, 1, 0, 3, 1, 0, 3, 0, 0, 0, -1, 1]
    bad = list(args)
    bad[10:12] = [2, 2]
    with pytest.raises(ValueError, match=r"matmul: a must be row-major .* got a_row 2, a_col 2"):
        fastkern._C.matmul(*bad)
    bad = list(args)
    bad[18] = 5
    with pytest.raises(ValueError, match=r"matmul: activation must be 0 \(none\), 1 \(gelu\) or 2"):
        fastkern._C.matmul(*bad)
    bad = list(args)
    bad[17] = 9
    with pytest.raises(TypeError, match=r"matmul: unsupported dtype code 9 on CPU"):
        fastkern._C.matmul(*bad)
    fastkern._C.matmul(*args)
    assert torch.allclose(c, a @ b, atol=1e-5)
