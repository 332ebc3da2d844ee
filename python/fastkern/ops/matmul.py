"""Matmul / linear with a fused bias and GELU epilogue: the torch.library op fastkern::matmul.

fastkern::matmul(a, b, bias, activation) -> (out, pre) computes out = act(a @ b + bias) with
torch.matmul's broadcasting of batch dims; `pre` is a @ b + bias before the activation, written by
the same kernel when an activation is set (else an empty tensor), and is what autograd saves: the
backward forms d_pre = d_out * act'(pre) with fastkern's GELU backward kernel, then
d_a = d_pre @ b^T and d_b = a^T @ d_pre through fastkern::matmul itself, transposes passed as
strides (no copies), and sums over the batch dims an operand was broadcast along. There is no
separate backward op: the backward is built from fastkern::matmul and fastkern::gelu_backward.

Operands are used in place when each matrix is row-major or column-major (x, w.t(), x.mT); other
strides are copied first. When b is 2-D, a's batch dims fold into its rows (one GEMM). fp32 under
TF32 on Hopper is the exception: the tf32 wgmma reads a K-major a (row-major) and a K-major b
(column-major, as F.linear's weight.t()) or, by computing the transposed product, an N-major b
(row-major, as in x @ w; D-132); other operands are copied K-major first, one pass over them.
FASTKERN_MATMUL_TF32_COPY_B=1 copies an N-major b K-major too (the path before D-132, for A/Bs).
"""
import functools
import os

import torch

from .. import _backend as B
from .._backend import _C
from .gelu import _gelu_backward, _gelu_backward_op

_ACTIVATIONS = {"none": 0, "gelu": 1, "gelu_tanh": 2}
_GELU_APPROXIMATE = {"gelu": "none", "gelu_tanh": "tanh"}
_MM_TF32, _MM_FORCE_GENERAL = 1, 2  # fastkern.h's FK_MM_* flags

torch.library.define(
    "fastkern::matmul", "(Tensor a, Tensor b, Tensor? bias, str activation) -> (Tensor, Tensor)")


def _check(a, b, bias, activation, op="matmul", names=("a", "b")):
    """Validates arguments (a, b with >= 2 dims); returns (batch shape, m, n, k, dtype code,
    activation code)."""
    na, nb = names
    B.check_tensor(a, op, na)
    B.check_tensor(b, op, nb)
    code = B.dtype_code(a, op, na)
    B.check_same(b, a, op, nb, na)
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError(f"fastkern.{op}: {na} and {nb} need at least 2 dims here, got {a.dim()} "
                         f"and {b.dim()}")
    act = _ACTIVATIONS.get(activation) if isinstance(activation, str) else None
    if act is None:
        raise ValueError(f"fastkern.{op}: activation must be None, 'gelu' or 'gelu_tanh', got "
                         f"{activation!r}")
    m, k = a.shape[-2], a.shape[-1]
    n = b.shape[-1]
    if b.shape[-2] != k:
        raise ValueError(f"fastkern.{op}: inner dims differ: {na} is {tuple(a.shape)} and {nb} is "
                         f"{tuple(b.shape)} ({na}.shape[-1] {k} != {nb}.shape[-2] {b.shape[-2]})")
    if b.dim() == 2:  # the common cases skip broadcast_shapes (~5 us a call)
        batch = a.shape[:-2]
    elif a.dim() == 2:
        batch = b.shape[:-2]
    else:
        try:
            batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        except RuntimeError:
            raise ValueError(f"fastkern.{op}: batch dims of {na} {tuple(a.shape[:-2])} and {nb} "
                             f"{tuple(b.shape[:-2])} do not broadcast") from None
    if bias is not None:
        B.check_tensor(bias, op, "bias")
        if bias.shape != (n,):
            raise ValueError(f"fastkern.{op}: bias must have shape ({n},), the output's last dim, "
                             f"got {tuple(bias.shape)}")
        B.check_same(bias, a, op, "bias", na)
    return tuple(batch), m, n, k, code, act


def _layout(rows, cols, sr, sc):
    """(row stride, col stride) to pass for a (rows, cols) matrix with strides (sr, sc) when it is
    row- or column-major with non-overlapping lines (what fastkern.h takes), else None."""
    if rows == 0 or cols == 0:
        return max(cols, 1), 1
    if (sc == 1 or cols <= 1) and (rows <= 1 or sr >= max(cols, 1)):
        return (sr if rows > 1 else max(cols, 1)), 1
    if (sr == 1 or rows <= 1) and (cols <= 1 or sc >= max(rows, 1)):
        return 1, (sc if cols > 1 else max(rows, 1))
    return None


def _batch_stride(shape, strides):
    """The one stride that walks the flattened batch dims, or None when they do not collapse."""
    stride = None
    for size, s in zip(reversed(shape), reversed(strides)):
        if size == 1:
            continue
        if stride is None:
            stride, span = s, s * size
        elif s != span:
            return None
        else:
            span = s * size
    return 0 if stride is None else stride


def _padded(t, rows, cols):
    """A row-major copy of `t`'s matrices whose rows start 128-byte aligned (row stride rounded up
    to 128 bytes: the TMA kernel read 16-byte-aligned rows of 1800 at half the speed, D-113), as a
    view of the same shape."""
    step = 128 // t.element_size()
    pad = -(-cols // step) * step
    out = torch.empty(*t.shape[:-1], pad, dtype=t.dtype, device=t.device)[..., :cols]
    out.copy_(t)
    return out


def _misaligned(t, strides, step=0):
    """Whether a 16-bit CUDA operand falls off the kernels' fast path: its base or a stride between
    its rows / columns / matrices is not a multiple of 16 bytes (TMA and cp.async need them)."""
    return t.is_cuda and t.element_size() == 2 and t.numel() > 0 and (
        t.data_ptr() % 16 or max(strides) % 8 or step % 8)


def _kmajor_tf32(t, strides, side, step):
    """Whether a fp32 operand reaches the tf32 kernel as it is: K-major (a's columns, b's rows
    contiguous), or for side "b-n" (a kernel that takes N-major b) b K- or N-major, with its base and
    other strides 16-byte multiples (dispatch.cu's TF32 row)."""
    inner, outer = (strides[1], strides[0]) if side == "a" else (strides[0], strides[1])
    if side == "b-n" and inner != 1:  # N-major b: its columns contiguous
        inner, outer = strides[1], strides[0]
    return inner == 1 and outer != 1 and outer % 4 == 0 and step % 4 == 0 and t.data_ptr() % 16 == 0


def _operand(t, batch, tf32_side=None):
    """(tensor, batch stride, row stride, col stride) of `t` seen as batch + its matrix: the tensor
    itself when its matrices are row- or column-major, else a contiguous copy (copies before
    broadcasting, so a broadcast operand is never materialized unless its batch dims cannot
    collapse into one stride). A 16-bit CUDA operand whose rows are not 16-byte aligned (a 1793-wide
    matrix, an offset view) is copied into padded rows: one pass over it buys the TMA / cp.async
    kernels, where the element-load path ran at a third of their rate (docs/decisions.md, D-77).
    tf32_side ("a", "b", or "b-n" where the kernel takes an N-major b; fp32 under TF32 on Hopper): an
    operand the tf32 wgmma kernel cannot read in place (see _kmajor_tf32) is copied into padded
    K-major rows."""
    rows, cols = t.shape[-2], t.shape[-1]
    stride = t.stride()
    strides = _layout(rows, cols, stride[-2], stride[-1])
    if strides is None:
        t = t.contiguous()
        strides = _layout(rows, cols, cols, 1)
    if tf32_side is not None and not _kmajor_tf32(t, strides, tf32_side, _batch_stride(
            t.shape[:-2], t.stride()[:-2]) or 0 if t.dim() > 2 else 0):
        t = _padded(t, rows, cols) if tf32_side == "a" else _padded(t.mT, cols, rows).mT
        strides = _layout(rows, cols, t.stride(-2), t.stride(-1))
    if _misaligned(t, strides, _batch_stride(t.shape[:-2], t.stride()[:-2]) or 0 if t.dim() > 2 else 0):
        t = _padded(t, rows, cols)
        strides = _layout(rows, cols, t.stride(-2), 1)
    if not batch:
        return t, 0, *strides
    t = t.expand(*batch, rows, cols)
    step = _batch_stride(batch, t.stride()[:-2])
    if step is None:  # a copy, row-major whatever the layout was
        t = t.reshape(-1, rows, cols).contiguous()
        step, strides = rows * cols, _layout(rows, cols, cols, 1)
    return t, step, *strides


def _tf32_wgmma(device, flags, b_nmajor=False):
    """Whether fp32 K-major operands (with b_nmajor: a K-major a and an N-major b) under these flags
    take the tf32 wgmma kernel on this device: dispatch.cu's own answer for a 128^3 problem (its
    arch, build and flag checks, asked once per build: benchmarks/ab.py swaps _C)."""
    return _tf32_plan(_C, device, flags, b_nmajor)


@functools.lru_cache(maxsize=None)
def _tf32_plan(module, device, flags, b_nmajor):
    b_strides = (128, 1) if b_nmajor else (1, 128)
    args = (0, 0, 0, 0, 0, 1, 128, 128, 128, 0, 128, 1, 0, *b_strides, 0, 128, 0, 0, flags)
    return module.matmul_plan(*args, device) == "wgmma_sm90"


def _flags(t):
    flags = _MM_FORCE_GENERAL if os.environ.get("FASTKERN_MATMUL_FORCE_GENERAL") == "1" else 0
    if t.is_cuda and t.dtype == torch.float32 and (
            torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"):
        flags |= _MM_TF32  # torch's own switches for TF32 in fp32 matmuls
    return flags


def _arguments(a, b, bias, plan, want_pre):
    """(out, pre, the C call's arguments up to flags) for validated inputs."""
    batch, m, n, k, code, act = plan
    flags = _flags(a)
    # fp32 under TF32 on Hopper: K-major copies where needed (n == 1 or k == 0 stay on simt_fp32)
    tf32 = (flags & _MM_TF32 and m > 0 and n > 1 and k > 0 and B.CUDA_COMPILED
            and _tf32_wgmma(a.get_device(), flags))
    side_a, side_b = ("a", "b") if tf32 else (None, None)
    if tf32 and os.environ.get("FASTKERN_MATMUL_TF32_COPY_B") != "1" and _tf32_wgmma(
            a.get_device(), flags, b_nmajor=True):
        side_b = "b-n"  # a row-major b is read in place (D-132)
    rows_folded = b.dim() == 2 and a.dim() > 2
    if rows_folded:  # one GEMM of (prod(batch) * m, k) @ (k, n) when a's rows lie evenly
        try:
            a = a.view(-1, k)
        except RuntimeError:
            rows_folded = False
    if rows_folded:
        n_batch, m_run, a_args = 1, a.shape[0], _operand(a, (), side_a)
        b_args = _operand(b, (), side_b)
    else:
        n_batch, m_run = 1, m
        for size in batch:
            n_batch *= size
        a_args, b_args = _operand(a, batch, side_a), _operand(b, batch, side_b)
    out = torch.empty(*batch, m, n, dtype=a.dtype, device=a.device)
    # pre: written with an activation when wanted; an empty stand-in for the op's second output
    # otherwise, and none at all on the direct path (want_pre=False)
    pre = torch.empty_like(out) if want_pre and act else (out.new_empty(0) if want_pre else None)
    bias = None if bias is None else B.dense(bias)
    args = (a_args[0].data_ptr(), b_args[0].data_ptr(), B.ptr(bias), out.data_ptr(),
            pre.data_ptr() if pre is not None and pre.numel() else 0, n_batch, m_run, n, k,
            *a_args[1:], *b_args[1:],
            0 if rows_folded else m * n, n, code, act, flags)
    return out, pre, args, (a_args[0], b_args[0], bias)


def _launch(a, b, bias, plan, want_pre=True):
    """(out, pre) for validated inputs; pre is empty without an activation, None without want_pre."""
    out, pre, args, _keep = _arguments(a, b, bias, plan, want_pre)
    if out.numel():
        device, stream = B.launch_args(out)
        _C.matmul(*args, device, stream)
    return out, pre


def _matmul(a, b, bias, activation):
    return _launch(a, b, bias, _check(a, b, bias, activation))


def _matmul_fake(a, b, bias, activation):
    batch, m, n, _, _, act = _check(a, b, bias, activation)
    out = a.new_empty(*batch, m, n)
    return out, (torch.empty_like(out) if act else a.new_empty(0))


def _mm(a, b, bias=None, activation="none"):
    """(out, pre) by the cheapest path: straight into the kernel in plain eager code, else through
    the registered op (compile, tracing, transforms)."""
    if B.plain_eager(a, b, bias):
        return _matmul(a, b, bias, activation)
    return _matmul_op(a, b, bias, activation)


def _setup_context(ctx, inputs, output):
    a, b, bias, activation = inputs
    ctx.save_for_backward(a, b, bias, output[1] if activation != "none" else None)
    ctx.activation = activation


def _backward(ctx, grad, grad_pre=None):
    a, b, bias, pre = ctx.saved_tensors
    need_a, need_b, need_bias = ctx.needs_input_grad[:3]
    need_bias = need_bias and bias is not None
    dbias = None
    if pre is not None:  # d_pre = grad * act'(pre); a zero bias makes the same kernel sum dbias
        zero = torch.zeros_like(bias) if need_bias else None
        gelu_backward = _gelu_backward if B.plain_eager(grad, pre) else _gelu_backward_op
        grad, dbias = gelu_backward(grad, pre, zero, _GELU_APPROXIMATE[ctx.activation], need_bias)
    elif need_bias:
        dbias = grad.sum(dim=tuple(range(grad.dim() - 1)))
    da = db = None
    batch, (m, n), k = grad.shape[:-2], grad.shape[-2:], a.shape[-1]
    # An operand broadcast along every batch dim gets one GEMM whose reduction runs over the batch
    # too (its sum then rounds once, in the fp32 accumulator); a partly broadcast one a batched
    # GEMM summed afterwards.
    if need_a:
        if a.shape[:-2] == batch:
            da = _mm(grad, b.transpose(-1, -2))[0]
        elif all(size == 1 for size in a.shape[:-2]):  # (m, batch * n) @ (batch * n, k)
            rows = grad.movedim(-2, 0).reshape(m, -1)
            cols = b.expand(*batch, k, n).transpose(-1, -2).reshape(-1, k)
            da = _mm(rows, cols)[0].view(a.shape)
        else:
            da = _mm(grad, b.transpose(-1, -2))[0].sum_to_size(a.shape)
    if need_b:
        if b.shape[:-2] == batch:
            db = _mm(a.transpose(-1, -2), grad)[0]
        elif all(size == 1 for size in b.shape[:-2]):  # (k, batch * m) @ (batch * m, n)
            rows = a.expand(*batch, m, k).reshape(-1, k).transpose(0, 1)
            db = _mm(rows, grad.reshape(-1, n))[0].view(b.shape)
        else:
            db = _mm(a.transpose(-1, -2), grad)[0].sum_to_size(b.shape)
    return da, db, (dbias if need_bias else None), None


class _MatmulFunction(torch.autograd.Function):
    """The eager autograd path: the registered op's context and backward without its dispatcher
    cost, on arguments the caller validated (`plan`)."""

    @staticmethod
    def forward(ctx, a, b, bias, activation, plan):
        output = _launch(a, b, bias, plan)
        _setup_context(ctx, (a, b, bias, activation), output)
        return output[0]

    @staticmethod
    def backward(ctx, grad):
        return (*_backward(ctx, grad), None)


_matmul_apply = B.function_apply(_MatmulFunction)
torch.library.impl("fastkern::matmul", ("cpu", "cuda"), _matmul)
torch.library.register_fake("fastkern::matmul", _matmul_fake)
torch.library.register_autograd("fastkern::matmul", _backward, setup_context=_setup_context)
_matmul_op = torch.ops.fastkern.matmul.default


def _activation(activation, op):
    if activation is None:
        return "none"
    if activation in ("gelu", "gelu_tanh"):
        return activation
    raise ValueError(f"fastkern.{op}: activation must be None, 'gelu' or 'gelu_tanh', got "
                     f"{activation!r}")


def _call(a, b, bias, activation, op, names):
    plan = _check(a, b, bias, activation, op, names)  # bad input is refused here by name
    route = B.route(a, b, bias)
    if route == B.DIRECT:
        return _launch(a, b, bias, plan, want_pre=False)[0]
    if route == B.GRAD:
        return _matmul_apply(a, b, bias, activation, plan)
    return _matmul_op(a, b, bias, activation)[0]


def matmul(a, b, *, bias=None, activation=None):
    """act(a @ b + bias) with torch.matmul's semantics (1-D operands, broadcast batch dims);
    bias has shape (n,), activation is None, 'gelu' (erf) or 'gelu_tanh'. float32 / float16 /
    bfloat16 on CUDA, those and float64 on CPU."""
    activation = _activation(activation, "matmul")
    B.check_tensor(a, "matmul", "a")
    B.check_tensor(b, "matmul", "b")
    if a.dim() == 0 or b.dim() == 0:
        raise ValueError(f"fastkern.matmul: a and b need at least 1 dim, got {a.dim()} and {b.dim()}")
    if b.dim() == 1 and bias is not None:
        raise ValueError("fastkern.matmul: a bias needs b with at least 2 dims (a 1-D b has no "
                         "output columns)")
    squeeze = []
    if a.dim() == 1:
        a, squeeze = a.unsqueeze(0), squeeze + [-2]
    if b.dim() == 1:
        b, squeeze = b.unsqueeze(-1), squeeze + [-1]
    out = _call(a, b, bias, activation, "matmul", ("a", "b"))
    for dim in sorted(squeeze):
        out = out.squeeze(dim)
    return out


def linear(x, weight, bias=None, *, activation=None):
    """act(x @ weight.T + bias) like torch.nn.functional.linear: weight (out_features,
    in_features) is read in place as a column-major B."""
    activation = _activation(activation, "linear")
    B.check_tensor(x, "linear", "x")
    B.check_tensor(weight, "linear", "weight")
    if weight.dim() != 2:
        raise ValueError(f"fastkern.linear: weight must be 2-D (out_features, in_features), got "
                         f"shape {tuple(weight.shape)}")
    if x.dim() == 0:
        raise ValueError("fastkern.linear: x needs at least 1 dim, got a 0-dim tensor")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fastkern.linear: x's last dim {x.shape[-1]} != weight's in_features "
                         f"{weight.shape[1]} (x {tuple(x.shape)}, weight {tuple(weight.shape)})")
    if x.dim() == 1:
        return _call(x.unsqueeze(0), weight.t(), bias, activation, "linear", ("x", "weight"))[0]
    return _call(x, weight.t(), bias, activation, "linear", ("x", "weight"))


def _plan(a, b, bias=None, activation=None):
    """The CUDA strategy fastkern.matmul(a, b, ...) takes ('cpu' for CPU tensors)."""
    activation = _activation(activation, "matmul")
    plan = _check(a, b, bias, activation)
    out, _, args, _keep = _arguments(a, b, bias, plan, want_pre=True)
    return _C.matmul_plan(*args, out.get_device())
