"""fastkern.cross_entropy / nn.CrossEntropyLoss: loss and gradients against float64 under the 2x
rule, ignore_index, label smoothing, every reduction, odd class counts, special values, views, the
in-place backward, autograd, compile, graphs, bad input."""
import pytest
import torch
import torch.nn.functional as F

import fastkern
from fastkern.ops import cross_entropy as ce_ops
from conftest import (DEVICE_DTYPES, DEVICES, assert_within_torch_error, misaligned, needs_cuda, on_cpu_threads,
                      rel_error)

REDUCTIONS = ["mean", "sum", "none"]


def targets(rows, classes, device, ignore_index=-100, ignored=0.2):
    """Random class indices with about `ignored` of them set to ignore_index."""
    t = torch.randint(0, max(classes, 1), (rows,), device=device)
    if rows and ignored:
        t[torch.rand(rows, device=device) < ignored] = ignore_index
    return t


def within(out, torch_out, ref, what):
    """The 2x rule; where torch's own result overflows (fp16 on the CPU sums the smoothing term and
    the reduction in fp16: inf at 50257 classes) fastkern must stay within 4 roundings of the dtype."""
    if torch.isinf(torch_out.double()[torch.isfinite(ref)]).any():
        assert rel_error(out, ref) <= 4 * torch.finfo(out.dtype).eps, f"{what}: torch overflowed, fastkern too far"
    else:
        assert_within_torch_error(out, torch_out, ref, what)


def check(x, t, grad=True, **kw):
    """fastkern vs torch (same dtype) vs float64: the loss and dlogits, with the 2x rule."""
    x = x.detach().requires_grad_(grad)
    y = fastkern.cross_entropy(x, t, **kw)
    tx = x.detach().clone().requires_grad_(grad)
    ty = F.cross_entropy(tx, t, **kw)
    rx = x.detach().double().requires_grad_(grad)
    ry = F.cross_entropy(rx, t, **kw)
    assert y.dtype == x.dtype and y.shape == ty.shape
    within(y, ty, ry, "loss")
    if not grad or x.numel() == 0:
        return y
    g = torch.randn(ty.shape, device=x.device).to(x.dtype)  # the reference gets the same rounded g
    (dx,) = torch.autograd.grad(y, x, g)
    (tdx,) = torch.autograd.grad(ty, tx, g)
    (rdx,) = torch.autograd.grad(ry, rx, g.double())
    assert dx.dtype == x.dtype and dx.shape == x.shape
    within(dx, tdx, rdx, "grad")
    return y


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("rows,classes", [(0, 5), (1, 1), (3, 7), (64, 10), (33, 1000), (5, 4096), (7, 4097),
                                          (3, 8191), (4, 50257)], ids=str)
def test_values_and_grads(device, dtype, reduction, rows, classes, poison):
    x = (torch.randn(rows, classes, device=device) * 4).to(dtype)
    check(x, targets(rows, classes, device), reduction=reduction)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.1, 0.5, 1.0])
def test_label_smoothing(device, dtype, reduction, label_smoothing, poison):
    for rows, classes in [(16, 33), (4, 50257)]:
        x = (torch.randn(rows, classes, device=device) * 4).to(dtype)
        check(x, targets(rows, classes, device), reduction=reduction, label_smoothing=label_smoothing)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_ignore_index(device, dtype, reduction, poison):
    x = (torch.randn(40, 300, device=device) * 4).to(dtype)
    for ignore_index in (0, 7, 299, -1):
        t = targets(40, 300, device, ignore_index=ignore_index, ignored=0.5)
        check(x, t, reduction=reduction, ignore_index=ignore_index, label_smoothing=0.2)
    t = torch.full((40,), -100, device=device)  # every row ignored: mean 0 / 0 = NaN, zero gradient
    y = fastkern.cross_entropy(x.requires_grad_(), t, reduction=reduction)
    ref = F.cross_entropy(x.detach().double(), t, reduction=reduction)
    assert torch.equal(y.double().isnan(), ref.isnan()) and (y.double().nan_to_num() == 0).all()
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert (dx == 0).all()


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_special_values(device, dtype):
    n = 1001
    x = torch.randn(6, n, device=device)
    x[0] = float("-inf")              # all -inf: NaN
    x[1, 5] = float("inf")            # +inf: NaN
    x[2, 17] = float("nan")           # NaN: NaN
    x[3, : n // 2] = float("-inf")    # partly -inf: finite
    x[4] = float("nan")               # NaN, but the row is ignored: 0
    x[5] *= 1e4 if dtype != torch.float16 else 3e3
    t = torch.tensor([3, 3, 3, n - 1, -100, 9], device=device)
    y = fastkern.cross_entropy(x.to(dtype), t, reduction="none").double()
    ref = F.cross_entropy(x.to(dtype).double(), t, reduction="none")
    assert torch.equal(y.isnan(), ref.isnan()), (y, ref)
    assert y[4] == 0 and torch.allclose(y[3], ref[3], rtol=1e-2) and torch.allclose(y[5], ref[5], rtol=1e-2)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_views_and_misaligned(device, dtype, poison):
    base = (torch.randn(300, 64, device=device) * 4).to(dtype)
    check(base.t(), targets(64, 300, device))                       # transposed: copied
    check((torch.randn(33, 2002, device=device) * 4).to(dtype)[:, 1::2], targets(33, 1001, device))
    check(misaligned((9, 1000), dtype, device) * 4, targets(9, 1000, device), reduction="sum")
    check(misaligned((5, 50257), dtype, device, offset=3) * 4, targets(5, 50257, device), label_smoothing=0.1)
    t = targets(12, 999, device)
    check((torch.randn(12, 999, device=device) * 4).to(dtype), t[None].expand(2, -1)[1])  # strided target


@pytest.mark.parametrize("device", DEVICES)
def test_padded_rows_in_and_out(device, monkeypatch):
    """Logits in padded rows (row stride 56 for 53 classes) are read in place, not copied; 16-bit CUDA
    dlogits whose rows are not 16-byte multiples come back in padded rows (the LM head's backward
    GEMMs then read them aligned), others contiguous; loss and gradient equal the contiguous
    logits' (bit for bit on the CPU; on the GPU a row's sum order follows its 16-byte alignment, so to
    rounding)."""
    copies = []
    real = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous",
                        lambda t, *a, **kw: (t.is_contiguous() or copies.append(tuple(t.shape))) and real(t, *a, **kw))
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(7, 56, device=device) * 3).to(dtype)[:, :53].requires_grad_()
        t = targets(7, 53, device)
        got = fastkern.cross_entropy(x, t, label_smoothing=0.1)
        (g,) = torch.autograd.grad(got, x)
        assert (7, 53) not in copies
        xc = real(x.detach()).requires_grad_()
        want = fastkern.cross_entropy(xc, t, label_smoothing=0.1)
        (gc,) = torch.autograd.grad(want, xc)
        if device == "cpu":
            assert torch.equal(got, want) and torch.equal(g, gc)
        torch.testing.assert_close((got, g), (want, gc))
        padded = device == "cuda" and dtype == torch.bfloat16
        assert g.stride() == ((56 if padded else 53), 1) and gc.stride() == g.stride()
        if padded:
            assert g.data_ptr() % 16 == 0


@pytest.mark.parametrize("device", DEVICES)
def test_one_dim_logits_and_the_module(device):
    x = torch.randn(11, device=device)
    t = torch.tensor(4, device=device)
    for reduction in REDUCTIONS:
        torch.testing.assert_close(fastkern.cross_entropy(x, t, reduction=reduction),
                                   F.cross_entropy(x, t, reduction=reduction))
    loss = fastkern.nn.CrossEntropyLoss(ignore_index=1, label_smoothing=0.1)
    assert repr(loss) == repr(torch.nn.CrossEntropyLoss())
    x, t = torch.randn(8, 5, device=device), torch.randint(0, 5, (8,), device=device)
    torch.testing.assert_close(loss(x, t), F.cross_entropy(x, t, ignore_index=1, label_smoothing=0.1))
    # what fastkern does not take goes to torch: class weights, (N, C, d) inputs, probability targets
    w = torch.rand(5, device=device)
    torch.testing.assert_close(fastkern.nn.CrossEntropyLoss(weight=w)(x, t), F.cross_entropy(x, t, weight=w))
    x3, t3 = torch.randn(2, 5, 3, device=device), torch.randint(0, 5, (2, 3), device=device)
    torch.testing.assert_close(fastkern.nn.CrossEntropyLoss()(x3, t3), F.cross_entropy(x3, t3))
    p = torch.softmax(torch.randn(8, 5, device=device), -1)
    torch.testing.assert_close(fastkern.nn.CrossEntropyLoss()(x, p), F.cross_entropy(x, p))


def test_gradcheck_float64():
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 6, -100, 3, 3])
    for reduction in REDUCTIONS:
        for smoothing in (0.0, 0.3):
            assert torch.autograd.gradcheck(
                lambda x: fastkern.cross_entropy(x, t, reduction=reduction, label_smoothing=smoothing), (x,))


def test_backward_saves_logits_targets_and_two_small_statistics():
    x = torch.randn(8, 16, requires_grad=True)
    t = torch.randint(0, 16, (8,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
        fastkern.cross_entropy(x, t)
    assert len(saved) == 4 and saved[0] is x and saved[1] is t
    assert saved[2].shape == (8, 2) and saved[2].dtype == torch.float32
    assert saved[3].shape == () and saved[3].item() == 8


@pytest.mark.parametrize("device", DEVICES)
def test_backward_writes_over_free_logits_only(device):
    """A temporary logits tensor nothing else holds takes its own gradient (no second (N, C)
    buffer); a held one (a name, a view of a kept tensor, another node's saved input) does not, and
    every gradient equals the allocating backward's bit for bit."""
    h = torch.randn(64, 32, device=device, requires_grad=True)
    w = torch.randn(1000, 32, device=device, requires_grad=True)
    t = targets(64, 1000, device)
    pointers = []

    def run(keep, inplace=True):
        ce_ops.INPLACE_BACKWARD = inplace
        try:
            logits = h @ w.t()
            logits.register_hook(lambda g: pointers.append(g.data_ptr()) or g)
            ptr = logits.data_ptr()
            kept = {"name": logits, "base": None, "node": None}[keep] if keep else None
            if keep == "base":  # logits a view of a tensor the caller keeps
                kept, logits = logits, logits.view(64, 1000)
            if keep == "node":
                kept = logits.square()
            loss = fastkern.cross_entropy(logits, t, label_smoothing=0.1)
            del logits
            grads = torch.autograd.grad(loss, (h, w))
            return ptr, grads, kept
        finally:
            ce_ops.INPLACE_BACKWARD = True

    assert ce_ops._FREE is not None, "the reference-count probe could not tell free logits from held ones"
    _, want, _ = run(None, inplace=False)
    ptr, grads, _ = run(None)
    assert pointers[-1] == ptr, "the free logits' buffer did not take the gradient"
    for a, b in zip(grads, want):
        assert torch.equal(a, b)
    for keep in ("name", "base", "node"):
        ptr, grads, kept = run(keep)
        assert pointers[-1] != ptr, f"held logits ({keep}) were overwritten"
        for a, b in zip(grads, want):
            assert torch.equal(a, b)


def test_retained_graph_second_backward_fails_after_an_in_place_one():
    h = torch.randn(8, 4, requires_grad=True)
    loss = fastkern.cross_entropy(h * 2, torch.randint(0, 4, (8,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_inductor_passes_the_logits_in_any_layout():
    """The ops are tagged flexible_layout: inductor's padded LM-head rows reach the kernels in place
    (under the default, exact eager strides, it copied 16384 x 50257 logits in each direction)."""
    for op in (torch.ops.fastkern.cross_entropy, torch.ops.fastkern.cross_entropy_backward):
        assert torch.Tag.flexible_layout in op.default.tags


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = torch.randn(6, 40, device=device, requires_grad=True)
    t = targets(6, 40, device)
    t3 = targets(6, 40, device, ignore_index=3, ignored=0.5)
    xh = x.detach().bfloat16().requires_grad_()
    xo = torch.randn(6, 43, device=device).bfloat16().requires_grad_()  # rows not 16-byte multiples
    to = targets(6, 43, device)
    for args in [(x, t, -100, 0.0, "mean", False), (x, t3, 3, 0.1, "sum", False), (x, t, -100, 0.2, "none", False),
                 (xh, t, -100, 0.0, "mean", True), (xh, t, -100, 0.0, "none", True), (xo, to, -100, 0.0, "mean", True)]:
        torch.library.opcheck(torch.ops.fastkern.cross_entropy.default, args)
    for reduction in REDUCTIONS:
        for logits, fp32_loss, target in ((x.detach(), False, t), (xh.detach(), True, t), (xo.detach(), True, to)):
            loss, lse, valid = torch.ops.fastkern.cross_entropy.default(logits, target, -100, 0.1, reduction,
                                                                        fp32_loss)
            assert not loss.isnan().any()
            torch.library.opcheck(torch.ops.fastkern.cross_entropy_backward.default,
                                  (torch.randn_like(loss), logits, target, lse, valid, -100, 0.1, reduction, fp32_loss))


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.loss = torch.nn.Linear(32, 300), fastkern.nn.CrossEntropyLoss(label_smoothing=0.1)

    def forward(self, x, t):
        return self.loss(self.proj(x), t) + fastkern.cross_entropy(self.proj(x), t, reduction="sum") / 100


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    model = Head().to(device)
    compiled = torch.compile(model, fullgraph=True)
    x, t = torch.randn(24, 32, device=device), targets(24, 300, device)
    y_eager, y_compiled = model(x, t), compiled(x, t)
    torch.testing.assert_close(y_compiled, y_eager, rtol=1e-5, atol=1e-5)
    g_eager = torch.autograd.grad(y_eager, list(model.parameters()))
    g_compiled = torch.autograd.grad(y_compiled, list(model.parameters()))
    for a, b in zip(g_eager, g_compiled):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * a.abs().max().item())


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cpu_threads_give_the_one_thread_results(reduction, poison):
    x, t = torch.randn(300, 5003) * 3, targets(300, 5003, "cpu")

    def run():
        loss, lse, valid = torch.ops.fastkern.cross_entropy.default(x, t, -100, 0.1, reduction, False)
        g = torch.ones_like(loss)
        return loss, lse, torch.ops.fastkern.cross_entropy_backward.default(g, x, t, lse, valid, -100, 0.1, reduction,
                                                                             False)
    one, many = on_cpu_threads(1, run), on_cpu_threads(7, run)
    for a, b in zip(one, many):
        assert torch.equal(a, b)


def _cpu_isas():
    flags = open("/proc/cpuinfo").read().split() if __import__("os").path.exists("/proc/cpuinfo") else []
    return ["generic"] + (["avx2"] if "avx2" in flags and "fma" in flags else []) + \
        (["avx512"] if "avx512f" in flags and "avx512dq" in flags else [])


@pytest.mark.parametrize("isa", _cpu_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_isa_paths_match_float64(isa, dtype, monkeypatch, poison):
    monkeypatch.setenv("FASTKERN_CPU_ISA", isa)
    for rows, classes in [(3, 1), (5, 7), (64, 513), (3, 50257)]:
        for smoothing in (0.0, 0.1):
            check((torch.randn(rows, classes) * 4).to(dtype), targets(rows, classes, "cpu"), label_smoothing=smoothing)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(device):
    x = torch.randn(4, 8, device=device)
    t = torch.randint(0, 8, (4,), device=device)
    with pytest.raises(TypeError, match=r"fastkern.cross_entropy: logits must be a floating-point tensor .* got torch.int64"):
        fastkern.cross_entropy(torch.ones(4, 8, dtype=torch.int64, device=device), t)
    with pytest.raises(TypeError, match=r"fastkern.cross_entropy: logits must be a torch.Tensor, got list"):
        fastkern.cross_entropy([[1.0]], t)
    with pytest.raises(TypeError, match=r"target must be an int64 tensor of class indices, got torch.int32"):
        fastkern.cross_entropy(x, t.int())
    with pytest.raises(TypeError, match=r"class indices \(class probabilities are not supported\), got torch.float32"):
        fastkern.cross_entropy(x, torch.rand(4, 8, device=device))
    with pytest.raises(ValueError, match=r"logits must be 2-D \(N, C\), got shape \(2, 2, 8\)"):
        fastkern.cross_entropy(x.view(2, 2, 8), t)
    with pytest.raises(ValueError, match=r"target must have shape \(4,\) for logits of shape \(4, 8\), got \(5,\)"):
        fastkern.cross_entropy(x, torch.zeros(5, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=r"reduction must be 'none', 'mean' or 'sum', got 'avg'"):
        fastkern.cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\], got 1.5"):
        fastkern.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(TypeError, match=r"ignore_index must be an int, got float"):
        fastkern.cross_entropy(x, t, ignore_index=1.0)
    with pytest.raises(TypeError, match=r"label_smoothing must be a float, got str"):
        fastkern.cross_entropy(x, t, label_smoothing="0.1")
    with pytest.raises(ValueError, match=r"\(C,\) logits need a 0-d target"):
        fastkern.cross_entropy(x[0], t)


def test_bad_targets_cpu():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"cross_entropy: target\[2\] = 8 is out of range for 8 classes"):
        fastkern.cross_entropy(x, torch.tensor([0, 1, 8, 3]))
    with pytest.raises(ValueError, match=r"cross_entropy: target\[0\] = -1 is out of range for 8 classes"):
        fastkern.cross_entropy(x, torch.tensor([-1, 1, 2, 3]))
    with pytest.raises(ValueError, match=r"target\[0\] = 0 is out of range for 0 classes"):
        fastkern.cross_entropy(torch.randn(4, 0), torch.zeros(4, dtype=torch.int64))


@needs_cuda
def test_bad_input_cuda():
    with pytest.raises(TypeError, match=r"float32, float16, bfloat16 on cuda, got torch.float64"):
        fastkern.cross_entropy(torch.randn(3, 3, device="cuda", dtype=torch.float64), torch.zeros(3, dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match=r"target is on cpu but logits is on cuda:0"):
        fastkern.cross_entropy(torch.randn(3, 3, device="cuda"), torch.zeros(3, dtype=torch.int64))
    # out-of-range targets cannot raise without a host sync: the row's loss is NaN
    y = fastkern.cross_entropy(torch.randn(3, 3, device="cuda"), torch.tensor([0, 3, 1], device="cuda"), reduction="none")
    assert y.isnan().tolist() == [False, True, False]


@needs_cuda
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cuda_graph_capture_and_replay(reduction):
    x = torch.randn(64, 50257, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = targets(64, 50257, "cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            x.grad = None
            fastkern.cross_entropy(x, t, reduction=reduction).sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    x.grad = None
    with torch.cuda.graph(graph):
        y = fastkern.cross_entropy(x, t, reduction=reduction)
        y.sum().backward()
    for _ in range(2):
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
            t.copy_(targets(64, 50257, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        xr = x.detach().float().requires_grad_()
        yr = F.cross_entropy(xr, t, reduction=reduction)
        yr.sum().backward()
        torch.testing.assert_close(y.float(), yr, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(x.grad.float(), xr.grad, rtol=2e-2, atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_repeat_bit_for_bit_cuda(dtype):
    """The mean's reduction and each row's merge run in a fixed order: 20 calls, the same bits."""
    x = torch.randn(4099, 50257, device="cuda", dtype=dtype, requires_grad=True)
    t = targets(4099, 50257, "cuda")
    y0 = fastkern.cross_entropy(x, t, label_smoothing=0.1)
    (dx0,) = torch.autograd.grad(y0, x)
    for _ in range(20):
        y = fastkern.cross_entropy(x, t, label_smoothing=0.1)
        assert torch.equal(y, y0)
        assert torch.equal(torch.autograd.grad(y, x)[0], dx0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_autocast_gives_an_fp32_loss_from_16_bit_logits(device, reduction):
    """Under autocast torch's cross_entropy returns fp32 (it upcasts the logits to an fp32 copy);
    fastkern returns the fp32 loss too, reading the bf16 logits as they are, and its gradient is bf16."""
    x = (torch.randn(16, 999, device=device) * 3).bfloat16().requires_grad_()
    t = targets(16, 999, device)
    with torch.autocast(device, torch.bfloat16):
        loss = fastkern.cross_entropy(x, t, reduction=reduction, label_smoothing=0.1)
        ref = F.cross_entropy(x, t, reduction=reduction, label_smoothing=0.1)
    assert loss.dtype == ref.dtype == torch.float32
    rx = x.detach().double().requires_grad_()
    want = F.cross_entropy(rx, t, reduction=reduction, label_smoothing=0.1)
    torch.testing.assert_close(loss.double(), want, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(loss)
    (dx,) = torch.autograd.grad(loss, x, g)
    (rdx,) = torch.autograd.grad(want, rx, g.double())
    assert dx.dtype == torch.bfloat16
    torch.testing.assert_close(dx.double(), rdx, rtol=1e-2, atol=1e-5)


@needs_cuda
def test_autocast_bf16_logits_cuda():
    """Under bf16 autocast the LM head's logits are bf16; fastkern takes them as they are (fp32
    inside), where F.cross_entropy upcasts them to an fp32 copy first."""
    h = torch.randn(256, 64, device="cuda", requires_grad=True)
    lin = torch.nn.Linear(64, 50257, device="cuda")
    t = targets(256, 50257, "cuda")
    with torch.autocast("cuda", torch.bfloat16):
        loss = fastkern.cross_entropy(lin(h), t)
        ref = F.cross_entropy(lin(h), t)
    assert loss.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-3, atol=1e-3)
