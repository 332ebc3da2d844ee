"""Cross-entropy fused over the log-softmax: torch.library ops fastkern::cross_entropy and
fastkern::cross_entropy_backward.

Forward returns the loss (reduced or per row), one fp32 pair per row (its max and the log of its
sum of exponentials, whose sum is the row's log-sum-exp; fp64 for fp64 logits) and the count of rows not ignored (what a mean divides by, kept on the device so
nothing waits for the GPU); autograd saves the logits, the targets and those two, never a
probability tensor, and the backward writes dlogits = g * (softmax - smoothed one-hot) in one pass.

Writing the gradient over the logits (as Liger-Kernel does): the eager autograd path writes dlogits
into the saved logits' own buffer when nothing else can see that buffer — the logits are a
temporary of the forward graph that no Python name, view, other autograd node or hook holds (the
usual case for `loss = fastkern.cross_entropy(lm_head(h), labels)`). That saves a (rows, classes)
tensor at the peak of the backward (for GPT-2's vocabulary at 16 x 1024 tokens in fp32: 3.3 GB).
Held logits (a name kept, a view of a kept tensor, logits returned to the caller) get a fresh dlogits.
The saved logits' version counter is bumped after such a write, so a second backward through the
same graph (retain_graph=True) fails with autograd's usual "modified by an inplace operation" error
instead of reading gradients as logits. The test of "nothing else can see it" compares reference
counts with a probe calibrated at import (_calibrate); where the probe cannot tell a held tensor
from a free one, or INPLACE_BACKWARD is False, the backward always allocates. torch.compile and the
other dispatcher paths never write in place (the backward op is functional there).
"""
import sys

import torch

from .. import _backend as B
from .._backend import _C

REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}  # fastkern.h's fk_reduction
INPLACE_BACKWARD = True

# flexible_layout: inductor passes the logits in whatever row stride it made them (its LM-head GEMM
# pads 50257-wide rows), which the kernels read in place; under the default (exact eager strides) it
# copied them into contiguous rows first, once in the forward and once in the backward (~1.1 ms each
# of a GPT-2 step, H100)
_TAGS = (torch.Tag.flexible_layout,)
torch.library.define(
    "fastkern::cross_entropy",
    "(Tensor logits, Tensor target, int ignore_index, float label_smoothing, str reduction, bool fp32_loss)"
    " -> (Tensor, Tensor, Tensor)", tags=_TAGS)
torch.library.define(
    "fastkern::cross_entropy_backward",
    "(Tensor grad, Tensor logits, Tensor target, Tensor lse, Tensor valid, int ignore_index,"
    " float label_smoothing, str reduction, bool fp32_loss) -> Tensor", tags=_TAGS)


def _stat_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _loss_dtype(logits, fp32_loss):
    return torch.float32 if fp32_loss and logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype


def _check(logits, target, ignore_index, label_smoothing, reduction, op="cross_entropy"):
    """Validates arguments; returns (rows, classes, dtype code, reduction code)."""
    B.check_tensor(logits, op, "logits")
    B.check_tensor(target, op, "target")
    code = B.dtype_code(logits, op, "logits")
    if logits.dim() != 2:
        raise ValueError(f"fastkern.{op}: logits must be 2-D (N, C), got shape {tuple(logits.shape)}")
    if target.dtype != torch.int64:
        what = " (class probabilities are not supported)" if target.is_floating_point() else ""
        raise TypeError(f"fastkern.{op}: target must be an int64 tensor of class indices{what}, got "
                        f"{target.dtype}")
    if target.device != logits.device:
        raise ValueError(f"fastkern.{op}: target is on {target.device} but logits is on {logits.device}")
    rows, classes = logits.shape
    if target.shape != (rows,):
        raise ValueError(f"fastkern.{op}: target must have shape ({rows},) for logits of shape "
                         f"{tuple(logits.shape)}, got {tuple(target.shape)}")
    red = REDUCTIONS.get(reduction) if isinstance(reduction, str) else None
    if red is None:
        raise ValueError(f"fastkern.{op}: reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"fastkern.{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    return rows, classes, code, red


def _rows(t):
    """(t, row stride): `t` itself when its rows are contiguous, whatever their stride (a padded
    view), else a contiguous copy."""
    rows, classes = t.shape
    if (classes > 1 and t.stride(1) != 1) or (rows > 1 and t.stride(0) < classes):
        t = t.contiguous()
    return t, (t.stride(0) if rows > 1 else classes)


def _padded_rows(logits):
    """Whether dlogits gets rows padded to a 16-byte multiple: 16-bit CUDA logits whose rows are not
    (GPT-2's 50257 classes). The LM head's backward GEMMs then read it aligned: in place in
    fastkern's matmul (which copied it into padded rows, twice), on cuBLAS's aligned kernels under
    torch.compile (its misaligned one took 8.3 ms of a GPT-2 step against 2.5, H100)."""
    return logits.is_cuda and logits.element_size() == 2 and logits.shape[1] % 8 != 0


def _dlogits(logits):
    """An empty dlogits for `logits`: a (rows, classes) view of padded rows where _padded_rows says so,
    else contiguous. The fake kernel returns the same strides."""
    rows, classes = logits.shape
    if not _padded_rows(logits):
        return torch.empty((rows, classes), dtype=logits.dtype, device=logits.device)
    return torch.empty((rows, -(-classes // 8) * 8), dtype=logits.dtype, device=logits.device)[:, :classes]


def _launch(logits, target, ignore_index, label_smoothing, fp32_loss, plan):
    """(loss, lse, valid) for validated arguments; the loss in fp32 with `fp32_loss` (autocast)."""
    rows, classes, code, red = plan
    (x, x_ld), target = _rows(logits), B.dense(target)
    stat = _stat_dtype(x)
    loss_dtype = _loss_dtype(x, fp32_loss)
    loss = torch.empty(rows if red == 0 else (), dtype=loss_dtype, device=x.device)
    lse = torch.empty(rows, 2, dtype=stat, device=x.device)
    valid = torch.empty((), dtype=stat, device=x.device)
    workspace = torch.empty(rows, dtype=stat, device=x.device) if red and rows else None
    device, stream = B.launch_args(x)
    _C.cross_entropy_fwd(x.data_ptr(), target.data_ptr(), loss.data_ptr(), lse.data_ptr(), valid.data_ptr(),
                         B.ptr(workspace), rows, classes, x_ld, int(ignore_index), float(label_smoothing), red,
                         code, B._DTYPE_CODES[loss_dtype], device, stream)
    return loss, lse, valid


def _cross_entropy(logits, target, ignore_index, label_smoothing, reduction, fp32_loss):
    return _launch(logits, target, ignore_index, label_smoothing, fp32_loss,
                   _check(logits, target, ignore_index, label_smoothing, reduction))


def _cross_entropy_fake(logits, target, ignore_index, label_smoothing, reduction, fp32_loss):
    rows, _, _, red = _check(logits, target, ignore_index, label_smoothing, reduction)
    stat = _stat_dtype(logits)
    return (logits.new_empty(rows if red == 0 else (), dtype=_loss_dtype(logits, fp32_loss)), logits.new_empty(rows, 2, dtype=stat),
            logits.new_empty((), dtype=stat))


def _check_backward(grad, logits, target, lse, valid, ignore_index, label_smoothing, reduction, fp32_loss):
    op = "cross_entropy_backward"
    plan = _check(logits, target, ignore_index, label_smoothing, reduction, op)
    rows, red = plan[0], plan[3]
    B.check_tensor(grad, op, "grad")
    if grad.device != logits.device:
        raise ValueError(f"fastkern.{op}: grad is on {grad.device} but logits is on {logits.device}")
    if grad.dtype != _loss_dtype(logits, fp32_loss):
        raise TypeError(f"fastkern.{op}: grad has dtype {grad.dtype}, the loss {_loss_dtype(logits, fp32_loss)}")
    want = (rows,) if red == 0 else ()
    if grad.shape != want:
        raise ValueError(f"fastkern.{op}: grad must have shape {want} for reduction {reduction!r}, got "
                         f"{tuple(grad.shape)}")
    stat = _stat_dtype(logits)
    for name, t, shape in (("lse", lse, (rows, 2)), ("valid", valid, ())):
        if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != stat or t.device != logits.device:
            raise ValueError(f"fastkern.{op}: {name} must be the {shape} {stat} tensor the forward returned")
    return plan


def _backward_launch(grad, logits, target, lse, valid, ignore_index, label_smoothing, fp32_loss, plan, out=None):
    """dlogits for validated arguments, written into `out` when given (it may be logits itself)."""
    rows, classes, code, red = plan
    grad, (x, x_ld), target = B.dense(grad), _rows(logits), B.dense(target)
    dx = _dlogits(x) if out is None else out
    if dx.numel():
        device, stream = B.launch_args(x)
        _C.cross_entropy_bwd(grad.data_ptr(), x.data_ptr(), target.data_ptr(), lse.data_ptr(), valid.data_ptr(),
                             dx.data_ptr(), rows, classes, x_ld, dx.stride(0) if rows > 1 else classes,
                             int(ignore_index), float(label_smoothing), red, code,
                             B._DTYPE_CODES[_loss_dtype(x, fp32_loss)], device, stream)
    return dx


def _cross_entropy_backward(grad, logits, target, lse, valid, ignore_index, label_smoothing, reduction, fp32_loss):
    plan = _check_backward(grad, logits, target, lse, valid, ignore_index, label_smoothing, reduction, fp32_loss)
    return _backward_launch(grad, logits, target, lse, valid, ignore_index, label_smoothing, fp32_loss, plan)


def _cross_entropy_backward_fake(grad, logits, target, lse, valid, ignore_index, label_smoothing, reduction,
                                 fp32_loss):
    _check_backward(grad, logits, target, lse, valid, ignore_index, label_smoothing, reduction, fp32_loss)
    return _dlogits(logits)


def _setup_context(ctx, inputs, output):
    logits, target, ignore_index, label_smoothing, reduction, fp32_loss = inputs
    ctx.save_for_backward(logits, target, output[1], output[2])
    ctx.args = (ignore_index, label_smoothing, reduction, fp32_loss)


def _backward(ctx, grad, grad_lse=None, grad_valid=None):
    logits, target, lse, valid = ctx.saved_tensors
    backward = _cross_entropy_backward if B.plain_eager(grad, logits) else _cross_entropy_backward_op
    return backward(grad, logits, target, lse, valid, *ctx.args), None, None, None, None, None


# ---- writing dlogits over the saved logits (the module docstring says when) ---------------------

def _refs(t):
    """Who holds `t` (one of ctx.saved_tensors, unpacked by the caller into a local): Python
    references to it, C++ references to its TensorImpl, references to its storage."""
    storage = t.untyped_storage()
    return sys.getrefcount(t), t._use_count(), torch._C._storage_Use_Count(storage._cdata)


def _saved_and_refs(ctx):
    """(saved tensors, _refs of the saved logits), read in this frame by the backward and the probe
    alike, so the calibrated counts and the measured ones come from the same code."""
    logits, target, lse, valid = ctx.saved_tensors
    return (logits, target, lse, valid), _refs(logits)


class _Probe(torch.autograd.Function):
    seen = []

    @staticmethod
    def forward(ctx, x):
        empty = x.new_empty(0)
        ctx.save_for_backward(x, empty, empty, empty)
        return x.sum()

    @staticmethod
    def backward(ctx, grad):
        saved, refs = _saved_and_refs(ctx)
        _Probe.seen.append(refs)
        return grad.expand(saved[0].shape)


def _calibrate():
    """The counts _refs reads for a saved temporary that nothing else holds, or None when they do
    not tell it apart from one kept by a name or by another autograd node's saved tensors."""
    leaf = torch.zeros(2, 2, requires_grad=True)
    _Probe.seen.clear()
    with torch.enable_grad():
        y = leaf * 2
        loss = _Probe.apply(y)
        del y
        loss.backward()  # free
        y = leaf * 2
        _Probe.apply(y).backward()  # held by a name
        z = leaf * 2
        w = z * z  # held by another node's saved tensors
        loss = _Probe.apply(z)
        del z
        loss.backward()
        _Probe.apply(leaf * 2).backward()  # free again
        del w, y
    free, named, node, again = _Probe.seen
    _Probe.seen.clear()
    return free if free == again and free not in (named, node) else None


_FREE = None


class _CrossEntropyFunction(torch.autograd.Function):
    """The eager autograd path: the registered op's context on arguments the caller validated
    (`plan`), and a backward that may write dlogits over the saved logits."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, reduction, fp32_loss, plan):
        output = _launch(logits, target, ignore_index, label_smoothing, fp32_loss, plan)
        _setup_context(ctx, (logits, target, ignore_index, label_smoothing, reduction, fp32_loss), output)
        ctx.plan = plan
        ctx.mark_non_differentiable(output[1], output[2])
        return output

    @staticmethod
    def backward(ctx, grad, grad_lse, grad_valid):
        (logits, target, lse, valid), refs = _saved_and_refs(ctx)
        if not B.plain_eager(grad, logits):
            return (*_backward(ctx, grad), None)
        ignore_index, label_smoothing, _, fp32_loss = ctx.args
        free = (INPLACE_BACKWARD and _FREE is not None and refs == _FREE and logits.grad_fn is not None
                and not logits._is_view() and logits.is_contiguous() and not _padded_rows(logits))
        out = logits if free else None
        dx = _backward_launch(grad, logits, target, lse, valid, ignore_index, label_smoothing, fp32_loss, ctx.plan,
                              out)
        if out is not None:  # a second backward through this graph must not read dlogits as logits
            torch.autograd.graph.increment_version(logits)
        return dx, None, None, None, None, None, None


_FREE = _calibrate()
_cross_entropy_apply = B.function_apply(_CrossEntropyFunction)
_cross_entropy_op, _cross_entropy_backward_op = B.register_op(
    "cross_entropy", _cross_entropy, _cross_entropy_fake, _cross_entropy_backward, _cross_entropy_backward_fake,
    _backward, _setup_context)


def _call(logits, target, ignore_index, reduction, label_smoothing, fp32_loss):
    if type(ignore_index) is not int and (not isinstance(ignore_index, int) or isinstance(ignore_index, bool)):
        raise TypeError(f"fastkern.cross_entropy: ignore_index must be an int, got {type(ignore_index).__name__}")
    if not isinstance(label_smoothing, (int, float)) or isinstance(label_smoothing, bool):
        raise TypeError(f"fastkern.cross_entropy: label_smoothing must be a float, got "
                        f"{type(label_smoothing).__name__}")
    label_smoothing = float(label_smoothing)
    squeeze = isinstance(logits, torch.Tensor) and logits.dim() == 1
    if squeeze:
        if not isinstance(target, torch.Tensor) or target.dim() != 0:
            raise ValueError("fastkern.cross_entropy: (C,) logits need a 0-d target")
        logits, target = logits.unsqueeze(0), target.unsqueeze(0)
    plan = _check(logits, target, ignore_index, label_smoothing, reduction)  # refused here by name
    route = B.route(logits)
    if route == B.DIRECT:
        loss = _launch(logits, target, ignore_index, label_smoothing, fp32_loss, plan)[0]
    elif route == B.GRAD:
        loss = _cross_entropy_apply(logits, target, ignore_index, label_smoothing, reduction, fp32_loss, plan)[0]
    else:
        loss = _cross_entropy_op(logits, target, ignore_index, label_smoothing, reduction, fp32_loss)[0]
    return loss.squeeze(0) if squeeze and reduction == "none" else loss


def cross_entropy(logits, target, *, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """torch.nn.functional.cross_entropy(logits, target, ignore_index=..., reduction=...,
    label_smoothing=...) for (N, C) logits of any float dtype (or (C,) with a 0-d target) and int64
    class targets, computed in fp32 (fp64 for fp64). The loss has the logits' dtype, or fp32 for
    16-bit logits under autocast, as torch's (which autocasts the logits to an fp32 copy first; this
    reads the 16-bit logits as they are)."""
    fp32_loss = isinstance(logits, torch.Tensor) and torch.is_autocast_enabled(logits.device.type)
    return _call(logits, target, ignore_index, reduction, label_smoothing, fp32_loss)
