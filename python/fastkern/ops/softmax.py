"""Softmax and log-softmax with a fused scale and causal mask: torch.library ops
fastkern::softmax and fastkern::softmax_backward.

Forward returns the output and one fp32 statistic per row, the max of the scaled, masked row. What
autograd saves depends on the device (one tensor's worth either way): on CUDA x and that statistic,
and backward recomputes y = exp(x * scale - max) / sum inside its memory-bound kernel; on the CPU,
where that exp costs more than the memory it saves, the output y (D-87).
Rows are reduced along any dim without a transposed copy: the kernels see x as (outer, n, inner).
"""
import math
import numbers

import torch

from .. import _backend as B
from .._backend import _C

torch.library.define(
    "fastkern::softmax", "(Tensor x, int dim, float scale, bool causal, bool log) -> (Tensor, Tensor)")
torch.library.define(
    "fastkern::softmax_backward",
    "(Tensor grad, Tensor saved, Tensor? row_max, int dim, float scale, bool causal, bool log) -> Tensor")


def _name(log):
    return "log_softmax" if log else "softmax"


def _check(x, dim, scale, causal, log):
    """Validates arguments; returns the plan (outer, n, inner, causal_sq, dtype code, device index),
    the device index -1 on the CPU."""
    op = _name(log)
    B.check_tensor(x, op, "x")
    code = B.dtype_code(x, op, "x")
    ndim = max(x.dim(), 1)
    if not -ndim <= dim < ndim:
        raise ValueError(f"fastkern.{op}: dim {dim} is out of range for x with {x.dim()} dims "
                         f"(expected -{ndim} <= dim < {ndim})")
    dim %= ndim
    shape = x.shape if x.dim() else (1,)
    causal_sq = 0
    if causal:
        if x.dim() < 2:
            raise ValueError(f"fastkern.{op}: causal=True needs x with at least 2 dims (query, key), "
                             f"got {x.dim()}")
        if dim != x.dim() - 1:
            raise ValueError(f"fastkern.{op}: causal=True needs dim=-1 (keys on the last dim), got "
                             f"dim={dim}")
        causal_sq = shape[-2]
    device = -1 if x.is_cpu else x.device.index
    return math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:]), causal_sq, code, device


def _stat_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _launch(x, scale, log, plan, stat):
    """(y, row max) for validated arguments (`plan` from _check); without `stat` (no backward will
    follow) the row max is neither allocated nor written, and None stands in for it."""
    outer, n, inner, causal_sq, code, device = plan
    x = B.dense(x)
    y = torch.empty_like(x)
    row_max = torch.empty(outer * inner, dtype=_stat_dtype(x), device=x.device) if stat else None
    if outer and n and inner:
        _C.softmax_fwd(x.data_ptr(), y.data_ptr(), B.ptr(row_max), outer, n, inner, scale, causal_sq, log,
                       code, device, B.stream(device))
    return y, row_max


def _softmax(x, dim, scale, causal, log):
    return _launch(x, scale, log, _check(x, dim, scale, causal, log), True)


def _softmax_fake(x, dim, scale, causal, log):
    outer, _, inner, _, _, _ = _check(x, dim, scale, causal, log)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty(outer * inner, dtype=_stat_dtype(x)))


def _saved(x, output):
    """What backward needs from a forward on x that returned output = (y, row max): (x, row max) on
    CUDA, (y, None) on the CPU."""
    return (x, output[1]) if x.is_cuda else (output[0], None)


def _launch_backward(grad, saved, row_max, scale, log, plan):
    """dx for validated arguments (`plan` from _check on saved)."""
    outer, n, inner, causal_sq, code, device = plan
    grad, saved = B.dense(grad), B.dense(saved)
    dx = torch.empty_like(saved)
    if not (outer and n and inner):
        return dx
    if device >= 0:
        _C.softmax_bwd(grad.data_ptr(), saved.data_ptr(), row_max.data_ptr(), dx.data_ptr(), outer, n,
                       inner, scale, causal_sq, log, code, device, B.stream(device))
    else:
        _C.softmax_bwd_from_output(grad.data_ptr(), saved.data_ptr(), dx.data_ptr(), outer, n, inner,
                                   scale, causal_sq, log, code, torch.get_num_threads())
    return dx


def _softmax_backward(grad, saved, row_max, dim, scale, causal, log):
    """dx from `saved`: x with its row max (CUDA), or the forward's output y with row_max None (CPU)."""
    plan = _check(saved, dim, scale, causal, log)
    outer, inner = plan[0], plan[2]
    op = _name(log) + "_backward"
    B.check_tensor(grad, op, "grad")
    B.check_same(grad, saved, op, "grad", "saved")
    if grad.shape != saved.shape:
        raise ValueError(f"fastkern.{op}: grad has shape {tuple(grad.shape)}, saved has {tuple(saved.shape)}")
    if saved.is_cuda and (row_max is None or row_max.shape != (outer * inner,) or row_max.dtype != _stat_dtype(saved)
                          or row_max.device != saved.device):
        raise ValueError(f"fastkern.{op}: on CUDA saved is x and row_max the ({outer * inner},) "
                         f"{_stat_dtype(saved)} row statistic the forward returned")
    if not saved.is_cuda and row_max is not None:
        raise ValueError(f"fastkern.{op}: on the CPU saved is the forward's output y and row_max None")
    return _launch_backward(grad, saved, row_max, scale, log, plan)


def _softmax_backward_fake(grad, saved, row_max, dim, scale, causal, log):
    _check(saved, dim, scale, causal, log)
    return torch.empty_like(saved, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    x, dim, scale, causal, log = inputs
    ctx.save_for_backward(*_saved(x, output))
    ctx.args = (dim, scale, causal, log)


def _backward(ctx, grad, grad_row_max):
    saved, row_max = ctx.saved_tensors
    backward = _softmax_backward if B.plain_eager(grad, saved) else _softmax_backward_op
    return backward(grad, saved, row_max, *ctx.args), None, None, None, None


class _SoftmaxFunction(torch.autograd.Function):
    """The eager autograd path: what the registered op saves, on arguments the caller validated
    (`args` = (dim, scale, causal, log) and their `plan`). Its one output is y: the row max is saved,
    not returned (a second output cost ~0.3 us a call). Backward reuses the plan: autograd hands it a
    grad of y's shape, dtype and device (D-104)."""

    @staticmethod
    def forward(ctx, x, args, plan):
        output = _launch(x, args[1], args[3], plan, plan[5] >= 0)  # the CPU saves y, not the row max
        ctx.save_for_backward(*_saved(x, output))
        ctx.args, ctx.plan = args, plan
        return output[0]

    @staticmethod
    def backward(ctx, grad):
        saved, row_max = ctx.saved_tensors
        if B.plain_eager(grad, saved):
            return _launch_backward(grad, saved, row_max, ctx.args[1], ctx.args[3], ctx.plan), None, None
        return _softmax_backward_op(grad, saved, row_max, *ctx.args), None, None


_softmax_apply = B.function_apply(_SoftmaxFunction)
_softmax_op, _softmax_backward_op = B.register_op(
    "softmax", _softmax, _softmax_fake, _softmax_backward, _softmax_backward_fake, _backward,
    _setup_context)


_PLANS = {}  # (shape, dtype, device, dim, causal, log) -> _check's plan, for arguments it accepted
_Tensor, _empty_like, _num_threads, _grad_enabled = (
    torch.Tensor, torch.empty_like, torch.get_num_threads, torch.is_grad_enabled)
_dispatch_modes, _functorch_level, _is_dynamo_compiling = (
    B._dispatch_modes, B._functorch_level, torch.compiler.is_dynamo_compiling)


def _call(x, dim, scale, causal, log):
    if type(dim) is not int or type(scale) is not float or type(causal) is not bool:
        # the exact types pass straight through: an isinstance check against the numbers ABCs costs
        # ~0.4 us a call
        if type(dim) is not int and (not isinstance(dim, numbers.Integral) or isinstance(dim, bool)):
            raise TypeError(f"fastkern.{_name(log)}: dim must be an int, got {type(dim).__name__}")
        if type(scale) is not float and (not isinstance(scale, numbers.Real) or isinstance(scale, bool)):
            raise TypeError(f"fastkern.{_name(log)}: scale must be a float, got {type(scale).__name__}")
        causal = bool(causal)
    # bad input is refused by _check, by name, on every path; a plan it gave is kept per signature
    # (a tiny CPU call spent 1.2 of its 4.7 us there); _check refuses devices other than cpu and
    # cuda, so no plan is kept for one. The device is True on the CPU: a device object costs ~0.2 us
    # to build and hash, and True equals no device.
    key = (x.shape, x.dtype, x.is_cpu or x.device, dim, causal, log) if type(x) is _Tensor else None
    plan = _PLANS.get(key)
    # The common eager call in as few Python steps as possible (host time is what a tiny call costs;
    # D-130): a known signature, a dense tensor, no dispatch mode or functorch transform, where
    # route() would say DIRECT (or GRAD when autograd records). is_dynamo_compiling: dynamo folds it
    # to True (eager: a plain False; export and make_fx run on fake tensors or under a dispatch mode,
    # which these checks send to route()).
    if (plan is not None and not _is_dynamo_compiling() and x.is_contiguous() and not _dispatch_modes()
            and _functorch_level() is None):
        if x.requires_grad and _grad_enabled():
            return _softmax_apply(x, (dim, scale, causal, log), plan)
        outer, n, inner, causal_sq, code, device = plan
        y = _empty_like(x)
        if outer and n and inner:
            _C.softmax_fwd(x.data_ptr(), y.data_ptr(), 0, outer, n, inner, scale, causal_sq, log, code, device,
                           _num_threads() if device < 0 else B.stream(device))
        return y
    if plan is None:
        plan = _check(x, dim, scale, causal, log)
        if key is not None and len(_PLANS) < 4096:
            _PLANS[key] = plan
    route = B.route(x)
    if route == B.DIRECT:
        return _launch(x, scale, log, plan, False)[0]
    if route == B.GRAD:
        return _softmax_apply(x, (dim, scale, causal, log), plan)
    return _softmax_op(x, dim, scale, causal, log)[0]


def _plan(x, dim=-1, *, causal=False, log=False, backward=False, aligned=None):
    """(strategy, launch shape) of the CUDA kernel that fastkern.softmax (log_softmax with `log`;
    its backward with `backward`) runs for x along `dim`: e.g. ("rows_warp", "grid=... block=(128,1)
    ..."). `aligned` overrides whether every tensor counts as 16-byte aligned (default: x's own
    alignment). For tests and benchmark tables; csrc/cuda/softmax/dispatch.cu holds the table."""
    outer, n, inner, causal_sq, code, _ = _check(x, dim, 1.0, bool(causal), log)
    if x.device.type != "cuda":
        raise ValueError(f"fastkern.{_name(log)}: _plan needs a CUDA tensor, got {x.device}")
    if aligned is None:
        aligned = x.data_ptr() % 16 == 0
    return _C.softmax_plan(bool(backward), outer, n, inner, causal_sq, bool(log), code, int(bool(aligned)),
                           x.device.index if x.device.index is not None else torch.cuda.current_device())


def softmax(x, dim=-1, *, scale=1.0, causal=False):
    """softmax(x * scale) along `dim`, like torch.softmax(x, dim) when scale=1 and causal=False.
    causal=True treats the last two dims as (query, key) scores and masks key j > query i + Sk - Sq."""
    return _call(x, dim, scale, causal, False)


def log_softmax(x, dim=-1, *, scale=1.0, causal=False):
    """log_softmax(x * scale) along `dim`, like torch.log_softmax; scale and causal as in softmax."""
    return _call(x, dim, scale, causal, True)
