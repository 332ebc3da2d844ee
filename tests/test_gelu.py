"""fastkern.gelu: values and gradients against float64, autograd, compile, graphs, bad input."""
import pytest
import torch
import torch.nn.functional as F

import fastkern
from conftest import (CUDA, DEVICE_DTYPES, DEVICES, assert_within_torch_error, chain_matches_synchronized,
                      cpu_isas, misaligned, needs_cuda, on_cpu_threads)

SHAPES = [(1,), (7,), (1023,), (4096,), (2**20 + 3,), (3, 7), (33, 1000), (2, 3, 4096)]


def make(shape, dtype, device, requires_grad=False):
    # drawn in fp32 and rounded, so every dtype sees the same distribution (fresh each call)
    return (torch.randn(shape, device=device) * 3).to(dtype).requires_grad_(requires_grad)


def exact_gelu(v, approximate):
    """The float64 reference: the erf form as v * erfc(-v / sqrt 2) / 2, since torch's
    0.5 * v * (1 + erf(v / sqrt 2)) cancels for negative v (below v ~ -8 even in float64, where
    it drops the cdf term of the gradient: a 1 / v^2 relative error)."""
    if approximate == "none":
        return v * 0.5 * torch.special.erfc(-v * 0.7071067811865476)
    return F.gelu(v, approximate=approximate)


def check_against_torch(x, bias, approximate, dtype):
    """Forward and backward of fastkern vs torch (same dtype) vs float64, with the 2x rule."""
    x = x.detach().requires_grad_()
    b = None if bias is None else bias.detach().requires_grad_()
    y = fastkern.gelu(x, approximate=approximate, bias=b)
    assert y.dtype == dtype and y.shape == x.shape
    grad = torch.randn_like(y)
    y.backward(grad)

    def torch_version(x_, b_, gelu=F.gelu):
        x_ = x_.detach().requires_grad_()
        b_ = None if b_ is None else b_.detach().requires_grad_()
        out = gelu(x_ if b_ is None else x_ + b_, approximate=approximate)
        out.backward(grad.to(out.dtype))
        return out, x_.grad, (None if b_ is None else b_.grad)

    t_y, t_dx, t_db = torch_version(x, b)
    r_y, r_dx, r_db = torch_version(x.double(), None if b is None else b.double(), exact_gelu)
    assert_within_torch_error(y, t_y, r_y, "output")
    assert_within_torch_error(x.grad, t_dx, r_dx, "grad x")
    if b is not None:
        assert b.grad.dtype == dtype
        assert_within_torch_error(b.grad, t_db, r_db, "grad bias")


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_matches_float64_reference(device, dtype, approximate, shape, with_bias, poison):
    x = make(shape, dtype, device)
    bias = make(shape[-1:], dtype, device) if with_bias else None
    check_against_torch(x, bias, approximate, dtype)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("layout", ["transposed", "strided", "misaligned"])
def test_views(device, dtype, layout, poison):
    if layout == "transposed":
        x = make((64, 1000), dtype, device).t()
    elif layout == "strided":
        x = make((33, 2048), dtype, device)[:, ::2]
    else:
        x = misaligned((33, 1000), dtype, device)
    bias = misaligned((x.shape[-1],), dtype, device, offset=3)
    check_against_torch(x, bias, "tanh", dtype)
    check_against_torch(x, None, "none", dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_and_scalar(device):
    for shape in [(0,), (0, 5), (5, 0)]:
        x = torch.randn(shape, device=device, requires_grad=True)
        b = torch.randn(shape[-1:], device=device, requires_grad=True)
        y = fastkern.gelu(x, bias=b)
        assert y.shape == x.shape
        y.sum().backward()
        assert torch.equal(b.grad, torch.zeros_like(b))
    x = torch.tensor(0.7, device=device, requires_grad=True)
    y = fastkern.gelu(x, approximate="tanh")
    assert y.shape == () and torch.allclose(y, F.gelu(x.detach(), approximate="tanh"))
    y.backward()
    assert x.grad.shape == ()


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gradcheck_float64(approximate):
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    b = torch.randn(9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, b: fastkern.gelu(x, approximate, b), (x, b))
    assert torch.autograd.gradcheck(lambda x: fastkern.gelu(x, approximate), (x,))


def test_backward_saves_inputs_not_outputs():
    x = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fastkern.gelu(x, bias=b)
    assert len(saved) == 2
    assert saved[0] is x and saved[1] is b


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = torch.randn(5, 12, device=device, requires_grad=True)
    b = torch.randn(12, device=device, requires_grad=True)
    for args in [(x, b, "tanh"), (x, None, "none")]:
        torch.library.opcheck(torch.ops.fastkern.gelu.default, args)
    g = torch.randn(5, 12, device=device)
    torch.library.opcheck(torch.ops.fastkern.gelu_backward.default, (g, x.detach(), b.detach(), "none", True))


class MLP(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        self.up, self.act, self.down = torch.nn.Linear(32, 64), act, torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    model = MLP(fastkern.nn.GELU("tanh")).to(device)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(16, 32, device=device)
    y_eager, y_compiled = model(x), compiled(x)
    assert torch.allclose(y_eager, y_compiled, atol=1e-5, rtol=1e-5)
    g_eager = torch.autograd.grad(y_eager.sum(), list(model.parameters()))
    g_compiled = torch.autograd.grad(y_compiled.sum(), list(model.parameters()))
    for a, b in zip(g_eager, g_compiled):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_bias_gelu_function(device):
    torch._dynamo.reset()
    x = torch.randn(8, 48, device=device, requires_grad=True)
    b = torch.randn(48, device=device, requires_grad=True)
    f = torch.compile(lambda x, b: fastkern.gelu(x * 2, approximate="none", bias=b).sum(), fullgraph=True)
    dx, db = torch.autograd.grad(f(x, b), (x, b))
    ex, eb = torch.autograd.grad(fastkern.gelu(x * 2, bias=b).sum(), (x, b))
    assert torch.allclose(dx, ex, atol=1e-5) and torch.allclose(db, eb, atol=1e-5)


def test_modules_and_swap():
    m = fastkern.nn.GELU(approximate="tanh")
    assert repr(m) == repr(torch.nn.GELU(approximate="tanh"))
    assert repr(fastkern.nn.GELU()) == "GELU(approximate='none')"
    model = MLP(torch.nn.GELU("tanh"))
    x = torch.randn(4, 32)
    before = model(x)
    fastkern.nn.swap_modules(model)
    assert isinstance(model.act, fastkern.nn.GELU) and model.act.approximate == "tanh"
    assert torch.allclose(model(x), before, atol=1e-6)


@needs_cuda
def test_cuda_graph_capture_and_replay():
    x = torch.randn(256, 1024, device="cuda", requires_grad=True)
    b = torch.randn(1024, device="cuda", requires_grad=True)
    grad = torch.randn(256, 1024, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside capture
        for _ in range(2):
            x.grad = b.grad = None
            fastkern.gelu(x, "tanh", b).backward(grad)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    x.grad = b.grad = None
    with torch.cuda.graph(graph):
        y = fastkern.gelu(x, "tanh", b)
        y.backward(grad)
    for _ in range(2):
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
            b.copy_(torch.randn_like(b))
            grad.copy_(torch.randn_like(grad))
        graph.replay()
        torch.cuda.synchronize()
        xr, br = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        yr = F.gelu(xr + br, approximate="tanh")
        yr.backward(grad)
        assert torch.allclose(y, yr, atol=1e-5)
        assert torch.allclose(x.grad, xr.grad, atol=1e-5) and torch.allclose(b.grad, br.grad, atol=1e-3)


@needs_cuda
@pytest.mark.parametrize("shape", [(4096, 1024), (333, 777)], ids=str)
def test_chained_calls_read_their_predecessors_output_cuda(shape):
    """GELU calls with a bias, each on the previous output, and their backward (bias gradients:
    a partial-sum kernel, then one that reads every CTA's partials) match the same calls run with
    the GPU synchronized between them."""
    def chain(x, biases, g, sync):
        x = x.detach().requires_grad_()
        biases = [b.detach().requires_grad_() for b in biases]
        y = x
        for i, b in enumerate(biases):
            y = sync(fastkern.gelu(y, "tanh" if i % 2 else "none", b))
        return (y, *torch.autograd.grad(y, [x, *biases], g))

    x, g = torch.randn(shape, device="cuda"), torch.randn(shape, device="cuda")
    chain_matches_synchronized(chain, x, [torch.randn(shape[1], device="cuda") for _ in range(4)], g)


@needs_cuda
def test_cuda_runs_on_current_stream_and_device():
    x = torch.randn(1 << 20, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(10_000_000)  # keeps s busy: a launch elsewhere would finish first
        y = fastkern.gelu(x)
    s.synchronize()
    assert torch.allclose(y, F.gelu(x), atol=1e-6)


@needs_cuda
def test_cuda_over_2_pow_31_elements():
    n = 2**31 + 21
    try:
        x = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory")
    x[-4096:] = torch.randn(4096, device="cuda").bfloat16()
    x[:4096] = torch.randn(4096, device="cuda").bfloat16()
    y = fastkern.gelu(x, approximate="tanh")
    for part in (slice(0, 4096), slice(n - 4096, n)):
        assert torch.equal(y[part], F.gelu(x[part].float(), approximate="tanh").bfloat16()) or \
            (y[part].float() - F.gelu(x[part].float(), approximate="tanh")).abs().max() < 0.02
    del x, y
    torch.cuda.empty_cache()


# ---- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(TypeError, match=r"fastkern.gelu: x must be a torch.Tensor, got list"):
        fastkern.gelu([1.0, 2.0])
    with pytest.raises(TypeError, match=r"x must be a floating-point tensor .* got torch.int32"):
        fastkern.gelu(torch.ones(4, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"approximate must be 'none' or 'tanh', got 'fast'"):
        fastkern.gelu(x, approximate="fast")
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\), the last dim of x, got \(4,\)"):
        fastkern.gelu(x, bias=torch.randn(4, device=device))
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\), the last dim of x, got \(1, 8\)"):
        fastkern.gelu(x, bias=torch.randn(1, 8, device=device))
    with pytest.raises(TypeError, match=r"bias has dtype torch.float16 but x has torch.float32"):
        fastkern.gelu(x, bias=torch.randn(8, device=device, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"bias must be a torch.Tensor, got float"):
        fastkern.gelu(x, bias=1.0)
    with pytest.raises(ValueError, match=r"a bias needs x with at least one dim"):
        fastkern.gelu(torch.tensor(1.0, device=device), bias=torch.randn(1, device=device))


@needs_cuda
def test_bad_input_cuda():
    x = torch.randn(4, 8, device="cuda")
    with pytest.raises(ValueError, match=r"bias is on cpu but x is on cuda:0"):
        fastkern.gelu(x, bias=torch.randn(8))
    with pytest.raises(TypeError, match=r"x must be a floating-point tensor of dtype float32, float16, "
                                        r"bfloat16 on cuda, got torch.float64"):
        fastkern.gelu(x.double())


@pytest.mark.parametrize("device,dtype", [p for p in DEVICE_DTYPES if "cuda" in p.id])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_special_values_cuda(device, dtype, approximate):
    # +-inf, NaN, signed zeros and values whose exponent overflows: torch's NaN / inf pattern
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 9.0, -9.0, 20.0, -20.0,
                      -100.0, 1e30, -1e30], device=device).to(dtype)
    x = x.repeat(37)  # a length with a scalar tail after the packs
    y, ref = fastkern.gelu(x, approximate=approximate), F.gelu(x, approximate=approximate)
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    finite = ~torch.isnan(ref)
    assert torch.allclose(y[finite].double(), ref[finite].double(), rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("isa", cpu_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_cpu_isa_paths_match_float64(isa, dtype, approximate, monkeypatch, poison):
    """Each vectorised CPU body, forced by FASTKERN_CPU_ISA, under the 2x rule: lengths with and
    without a vector tail, a bias, a misaligned view, and torch's NaN / inf pattern."""
    monkeypatch.setenv("FASTKERN_CPU_ISA", isa)
    for shape in [(5,), (37,), (4099,), (3, 517)]:
        check_against_torch(make(shape, dtype, "cpu"), None, approximate, dtype)
    check_against_torch(make((7, 1029), dtype, "cpu"), make((1029,), dtype, "cpu"), approximate, dtype)
    check_against_torch(misaligned((9, 300), dtype, "cpu") * 3, None, approximate, dtype)
    # against float64: torch's own fp32 CPU erf form gives NaN at +inf and -0 from x ~ -6 on
    x = torch.tensor([float("inf"), float("nan"), 0.0, -0.0, 9.0, -9.0, 20.0, -20.0, 1e30]).repeat(5).to(dtype)
    y, ref = fastkern.gelu(x, approximate=approximate), exact_gelu(x.double(), approximate)
    assert torch.equal(y.isnan(), ref.isnan())
    finite = ~ref.isnan()
    assert torch.allclose(y[finite].double(), ref[finite], rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("isa", cpu_isas())
@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
def test_erf_form_negative_tail_cpu(bias, isa, monkeypatch):
    """The CPU erf form keeps its accuracy where 1 + erf(v / sqrt 2) cancels (v from -9 to -3):
    values and gradients within 1e-5 of the float64 reference (1 + erff left ~1e-1 there)."""
    monkeypatch.setenv("FASTKERN_CPU_ISA", isa)
    x = torch.linspace(-9.0, -3.0, 601).requires_grad_()
    b = torch.zeros(601).requires_grad_() if bias else None
    y = fastkern.gelu(x, approximate="none", bias=b)
    (dx,) = torch.autograd.grad(y.sum(), x)
    xr = x.detach().double().requires_grad_()
    yr = exact_gelu(xr, "none")
    (dxr,) = torch.autograd.grad(yr.sum(), xr)
    for out, ref in ((y, yr), (dx, dxr)):
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("shape,with_bias", [((2**20 + 3,), False), ((3000, 1500), False), ((3000, 1500), True)],
                         ids=["flat", "rows", "bias"])
def test_cpu_threads_give_the_one_thread_results(shape, with_bias, poison):
    """The CPU kernels split tiles over torch.get_num_threads() threads: 7 threads write every
    element (and the bias gradient, summed over whole columns a thread) bit for bit as 1 thread."""
    x, g = torch.randn(shape), torch.randn(shape)
    b = torch.randn(shape[-1]) if with_bias else None

    def run():
        y = torch.ops.fastkern.gelu.default(x, b, "tanh")
        return (y, *torch.ops.fastkern.gelu_backward.default(g, x, b, "tanh", with_bias))
    one, many = on_cpu_threads(1, run), on_cpu_threads(7, run)
    assert many[2].numel() == (shape[-1] if with_bias else 0)
    for a, c in zip(one, many):
        assert not c.isnan().any() and torch.equal(a, c)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", [(1,), (1023,), (33, 1000), (3, 7), (2, 3, 4096), (5, 1029)], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("bias_grad", [False, True], ids=["nodbias", "dbias"])
def test_backward_second_output_gelu(device, dtype, approximate, shape, with_bias, bias_grad, poison):
    """The backward's optional second output (FusedMLP's backward, D-131): gelu(x + bias) in the same
    pass, the forward's values bit for bit and within 2x of torch's error against float64, while
    dx and dbias stay the plain backward's, bit for bit."""
    from fastkern.ops.gelu import _gelu_backward, _gelu_backward_and_gelu
    x, grad = make(shape, dtype, device), make(shape, dtype, device)
    bias = make(shape[-1:], dtype, device) if with_bias else None
    dx, dbias, y = _gelu_backward_and_gelu(grad, x, bias, approximate, bias_grad)
    assert y.dtype == dtype and y.shape == x.shape and not y.isnan().any()
    assert torch.equal(y, fastkern.gelu(x, approximate=approximate, bias=bias))
    ref_dx, ref_dbias = _gelu_backward(grad, x, bias, approximate, bias_grad)
    assert torch.equal(dx, ref_dx) and torch.equal(dbias, ref_dbias)
    v = x if bias is None else x + bias
    ref = exact_gelu(x.double() if bias is None else x.double() + bias.double(), approximate)
    assert_within_torch_error(y, F.gelu(v, approximate=approximate), ref, "second output")


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_backward_second_output_misaligned(device, dtype, poison):
    """A misaligned x (one element a lane on CUDA) and an empty one."""
    from fastkern.ops.gelu import _gelu_backward_and_gelu
    x, grad = misaligned((33, 1000), dtype, device), make((33, 1000), dtype, device)
    bias = misaligned((1000,), dtype, device, offset=3)
    _, _, y = _gelu_backward_and_gelu(grad, x, bias, "tanh", True)
    assert torch.equal(y, fastkern.gelu(x, approximate="tanh", bias=bias))
    e = torch.empty(0, 5, dtype=dtype, device=device)
    dx, dbias, y = _gelu_backward_and_gelu(e, e, torch.ones(5, dtype=dtype, device=device), "none", True)
    assert dx.shape == y.shape == (0, 5) and torch.equal(dbias, torch.zeros_like(dbias))


@pytest.mark.parametrize("isa", cpu_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_backward_second_output_cpu_isa_paths(isa, dtype, approximate, monkeypatch, poison):
    """Each vectorised CPU body writes the forward's values (vector tails included)."""
    from fastkern.ops.gelu import _gelu_backward_and_gelu
    monkeypatch.setenv("FASTKERN_CPU_ISA", isa)
    for shape, with_bias in [((37,), False), ((7, 1029), True), ((3, 517), False)]:
        x, grad = make(shape, dtype, "cpu"), make(shape, dtype, "cpu")
        bias = make(shape[-1:], dtype, "cpu") if with_bias else None
        _, _, y = _gelu_backward_and_gelu(grad, x, bias, approximate, with_bias)
        assert torch.equal(y, fastkern.gelu(x, approximate=approximate, bias=bias))
