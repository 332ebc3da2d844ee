"""GELU with an optional fused bias: torch.library ops fastkern::gelu and fastkern::gelu_backward.

Forward saves x and bias only; backward recomputes gelu'(x + bias) from them, so no activation-size
intermediate (x + bias, or the output) is kept for autograd. The bias gradient comes out of the
same backward kernel.
"""
import torch

from .. import _backend as B
from .._backend import _C

_APPROXIMATIONS = {"none": 0, "tanh": 1}

torch.library.define("fastkern::gelu", "(Tensor x, Tensor? bias, str approximate) -> Tensor")
torch.library.define(
    "fastkern::gelu_backward",
    "(Tensor grad, Tensor x, Tensor? bias, str approximate, bool bias_grad) -> (Tensor, Tensor)")


def _check(x, bias, approximate, op="gelu"):
    """Validates arguments; returns the launch plan (rows, cols, dtype code, approximation code)."""
    B.check_tensor(x, op, "x")
    code = B.dtype_code(x, op, "x")
    approx = _APPROXIMATIONS.get(approximate) if isinstance(approximate, str) else None
    if approx is None:
        raise ValueError(f"fastkern.{op}: approximate must be 'none' or 'tanh', got {approximate!r}")
    if bias is None:
        return 1, x.numel(), code, approx
    B.check_tensor(bias, op, "bias")
    if x.dim() == 0:
        raise ValueError(f"fastkern.{op}: a bias needs x with at least one dim, got a 0-dim x")
    if bias.shape != x.shape[-1:]:
        raise ValueError(f"fastkern.{op}: bias must have shape ({x.shape[-1]},), the last dim of x, "
                         f"got {tuple(bias.shape)}")
    B.check_same(bias, x, op, "bias", "x")
    cols = x.shape[-1]
    return (x.numel() // cols if cols else 0), cols, code, approx


def _launch(x, bias, rows, cols, code, approx):
    """y = gelu(x + bias) for validated arguments (a plan from _check)."""
    x = B.dense(x)
    bias = None if bias is None else B.dense(bias)
    y = torch.empty_like(x)
    if rows and cols:
        device, stream = B.launch_args(x)
        _C.gelu_fwd(x.data_ptr(), B.ptr(bias), y.data_ptr(), rows, cols, approx, code, device, stream)
    return y


def _gelu(x, bias, approximate):
    return _launch(x, bias, *_check(x, bias, approximate))


def _gelu_fake(x, bias, approximate):
    _check(x, bias, approximate)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _gelu_backward(grad, x, bias, approximate, bias_grad):
    return _run_backward(grad, x, bias, approximate, bias_grad, False)[:2]


def _gelu_backward_and_gelu(grad, x, bias, approximate, bias_grad):
    """(dx, dbias, gelu(x + bias)): the backward with the forward's values (bit for bit) written in
    the same pass over x (FusedMLP's backward needs both for dh and dW2, D-131). Eager only: no
    registered op, so torch.compile / functorch callers keep _gelu_backward_op and gelu."""
    return _run_backward(grad, x, bias, approximate, bias_grad, True)


def _run_backward(grad, x, bias, approximate, bias_grad, want_y):
    rows, cols, code, approx = _check(x, bias, approximate, "gelu_backward")
    B.check_tensor(grad, "gelu_backward", "grad")
    B.check_same(grad, x, "gelu_backward", "grad", "x")
    if grad.shape != x.shape:
        raise ValueError(f"fastkern.gelu_backward: grad has shape {tuple(grad.shape)}, x has "
                         f"{tuple(x.shape)}")
    grad, x = B.dense(grad), B.dense(x)
    bias = None if bias is None else B.dense(bias)
    dx = torch.empty_like(x)
    y = torch.empty_like(x) if want_y else None
    want_dbias = bias_grad and bias is not None
    dbias = torch.empty_like(bias) if want_dbias else x.new_empty(0)
    if want_dbias and x.numel() == 0:
        return dx, dbias.zero_(), y
    if x.numel():
        device, stream = B.launch_args(x)
        workspace = None
        if want_dbias and device >= 0:
            size = _C.gelu_bwd_workspace(grad.data_ptr(), x.data_ptr(), bias.data_ptr(),
                                         dx.data_ptr(), B.ptr(y), rows, cols, approx, code, device)
            workspace = torch.empty(size, dtype=torch.float32, device=x.device)
        _C.gelu_bwd(grad.data_ptr(), x.data_ptr(), B.ptr(bias), dx.data_ptr(),
                    dbias.data_ptr() if want_dbias else 0, B.ptr(y), B.ptr(workspace), rows, cols,
                    approx, code, device, stream)
    return dx, dbias, y


def _gelu_backward_fake(grad, x, bias, approximate, bias_grad):
    _check(x, bias, approximate, "gelu_backward")
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    want_dbias = bias_grad and bias is not None
    return dx, (torch.empty_like(bias, memory_format=torch.contiguous_format) if want_dbias
                else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate


def _backward(ctx, grad):
    x, bias = ctx.saved_tensors
    bias_grad = bias is not None and ctx.needs_input_grad[1]
    backward = _gelu_backward if B.plain_eager(grad, x, bias) else _gelu_backward_op
    dx, dbias = backward(grad, x, bias, ctx.approximate, bias_grad)
    return dx, (dbias if bias_grad else None), None


class _GeluFunction(torch.autograd.Function):
    """The eager autograd path: the same context and backward as the registered op, at a fraction
    of its host cost (the separate-setup_context form of Function costs 4x this one), on arguments
    the caller validated (`plan`)."""

    @staticmethod
    def forward(ctx, x, bias, approximate, plan):
        _setup_context(ctx, (x, bias, approximate), None)
        return _launch(x, bias, *plan)

    @staticmethod
    def backward(ctx, grad):
        return (*_backward(ctx, grad), None)


_gelu_apply = B.function_apply(_GeluFunction)
_gelu_op, _gelu_backward_op = B.register_op("gelu", _gelu, _gelu_fake, _gelu_backward,
                                             _gelu_backward_fake, _backward, _setup_context)


def gelu(x, approximate="none", bias=None):
    """gelu(x + bias) with torch.nn.functional.gelu's semantics; bias (shape x.shape[-1:]) is
    optional and fused. float32 / float16 / bfloat16 on CUDA, those and float64 on CPU."""
    plan = _check(x, bias, approximate)  # bad input is refused here by name, on every path
    route = B.route(x, bias)
    if route == B.DIRECT:
        return _launch(x, bias, *plan)
    if route == B.GRAD:
        return _gelu_apply(x, bias, approximate, plan)
    return _gelu_op(x, bias, approximate)
