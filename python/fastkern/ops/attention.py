"""Flash attention: torch.library ops fastkern::attention and fastkern::attention_backward, and the
public functions flash_attn_func, flash_attn_varlen_func and scaled_dot_product_attention.

The ops work in flash-attn's layout, q (batch, seqlen_q, heads, head_dim) and k / v (batch,
seqlen_k, kv_heads, head_dim), or packed varlen (total, heads, head_dim) with cu_seqlens; any tensor
whose last dim is contiguous is passed to the kernels by its strides, without a copy (torch's
(B, H, S, D) is a transposed view of the same). Forward returns out (dense, flash layout) and the
fp32 log-sum-exp (B, H, Sq) (varlen: (H, total_q); fp64 for fp64); autograd saves q, k, v, out and
lse, and the backward recomputes the probabilities from them (csrc/cpu/attention.c,
csrc/cuda/attention/). Gradients come back dense in flash layout, shaped like the inputs.
The mask: query i sees key j iff j - i - shift lies in [-window_left, window_right] (-1: unbounded),
shift = Sk - Sq (bottom-right, flash-attn) or 0 (top_left: torch SDPA's is_causal).
"""
import math
import numbers
import os

import torch

from .. import _backend as B
from .._backend import _C

_DETERMINISTIC, _FORCE_GENERAL, _TOP_LEFT = 1, 2, 4  # fastkern.h's FK_ATTN_* flags

_SIGNATURE = ("Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
              "float scale, int window_left, int window_right, bool top_left, bool deterministic")
torch.library.define("fastkern::attention", f"(Tensor q, Tensor k, Tensor v, {_SIGNATURE}) -> (Tensor, Tensor)")
torch.library.define(
    "fastkern::attention_backward",
    f"(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_SIGNATURE}) -> (Tensor, Tensor, Tensor)")


def _check(q, k, v, cu_q, cu_k, max_q, max_k, op):
    """Validates shapes, dtypes and devices; returns (batch, sq, sk, heads, kv_heads, d, dtype code,
    varlen)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        B.check_tensor(t, op, name)
    code = B.dtype_code(q, op, "q")
    B.check_same(k, q, op, "k", "q")
    B.check_same(v, q, op, "v", "q")
    if q.is_cuda and q.dtype == torch.float32:
        raise TypeError(f"fastkern.{op}: q must be float16 or bfloat16 on cuda, got torch.float32 "
                        f"(float32 and float64 attention run on the CPU)")
    varlen = cu_q is not None or cu_k is not None
    rank, layout = (3, "(total, heads, head_dim)") if varlen else (4, "(batch, seqlen, heads, head_dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            raise ValueError(f"fastkern.{op}: {name} must have {rank} dims {layout}, got shape "
                             f"{tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"fastkern.{op}: k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    heads, kv_heads, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"fastkern.{op}: head dims differ: q has {d} and k / v have {k.shape[-1]}")
    if d < 1:
        raise ValueError(f"fastkern.{op}: head_dim must be at least 1, got {d}")
    if q.is_cuda and (d % 8 or d > 256):
        raise ValueError(f"fastkern.{op}: head_dim must be a multiple of 8 and at most 256 on cuda, "
                         f"got {d}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"fastkern.{op}: q's {heads} heads are not a multiple of k / v's {kv_heads} heads")
    if not varlen:
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"fastkern.{op}: batch sizes differ: q has {q.shape[0]} and k / v have "
                             f"{k.shape[0]}")
        return q.shape[0], q.shape[1], k.shape[1], heads, kv_heads, d, code, False
    if cu_q is None or cu_k is None:
        raise ValueError(f"fastkern.{op}: cu_seqlens_q and cu_seqlens_k must be given together")
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        B.check_tensor(t, op, name)
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] < 1:
            raise ValueError(f"fastkern.{op}: {name} must be a 1-d int32 tensor of batch + 1 offsets, "
                             f"got {t.dtype} of shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"fastkern.{op}: {name} is on {t.device} but q is on {q.device}")
    if cu_k.shape[0] != cu_q.shape[0]:
        raise ValueError(f"fastkern.{op}: cu_seqlens_q has {cu_q.shape[0]} entries and cu_seqlens_k "
                         f"{cu_k.shape[0]}: both must be batch + 1")
    for name, value in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if value < 0:
            raise ValueError(f"fastkern.{op}: {name} must be >= 0, got {value}")
    return cu_q.shape[0] - 1, max_q, max_k, heads, kv_heads, d, code, True


def _check_offsets(cu, total, longest, op, name, what):
    """On the CPU: cu_seqlens start at 0, never decrease, end at the packed tensor's length, and no
    sequence is longer than its max_seqlen (on a GPU this would cost a host sync; unchecked)."""
    values = cu.tolist()
    if values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"fastkern.{op}: {name} must rise from 0 to {what}'s {total} rows, got {values}")
    most = max((b - a for a, b in zip(values, values[1:])), default=0)
    if most > longest:
        raise ValueError(f"fastkern.{op}: {name} holds a sequence of {most} rows, longer than "
                         f"max_seqlen_{name[-1]}={longest}")


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _lse_shape(q, plan):
    batch, sq, _, heads, _, _, _, varlen = plan
    return (heads, q.shape[0]) if varlen else (batch, heads, sq)


def _row_major(t):
    """`t` itself when its last dim is contiguous (strides go to the kernel), else a copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _flags(q, top_left, deterministic):
    flags = _TOP_LEFT if top_left else 0
    if deterministic or torch.are_deterministic_algorithms_enabled():
        flags |= _DETERMINISTIC
    if os.environ.get("FASTKERN_ATTENTION_FORCE_GENERAL") == "1":
        flags |= _FORCE_GENERAL
    return flags


def _strides(t, varlen):
    """(batch, row, head) strides in elements, as fastkern.h's fk_attention_args takes them."""
    if t is None:
        return 0, 0, 0
    s = t.stride()
    return (0, s[0], s[1]) if varlen else (s[0], s[1], s[2])


def _args(plan, tensors, ws, nbytes, scale, window, flags):
    """fk_attention_args in fastkern.h's order (pointers, sizes, strides, options)."""
    batch, sq, sk, heads, kv_heads, d, code, varlen = plan
    q, k, v, out, lse, dout, dq, dk, dv, cu_q, cu_k = tensors
    return (B.ptr(q), B.ptr(k), B.ptr(v), B.ptr(out), B.ptr(lse), B.ptr(dout), B.ptr(dq), B.ptr(dk),
            B.ptr(dv), B.ptr(cu_q), B.ptr(cu_k), B.ptr(ws), nbytes, batch, sq, sk, heads, kv_heads, d,
            *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen), *_strides(out, varlen),
            *_strides(dout, varlen), float(scale), window[0], window[1], code, flags)


def _run(fn, backward, plan, tensors, scale, window, flags):
    """Asks the workspace size, allocates it with torch, launches."""
    device, stream = B.launch_args(tensors[0])
    nbytes = _C.attention_workspace(backward, *_args(plan, tensors, None, 0, scale, window, flags), device)
    ws = torch.empty(nbytes, dtype=torch.uint8, device=tensors[0].device) if nbytes else None
    fn(*_args(plan, tensors, ws, nbytes, scale, window, flags), device, stream)


def _prepare(q, k, v, cu_q, cu_k, plan, op):
    q, k, v = _row_major(q), _row_major(k), _row_major(v)
    if plan[7]:
        cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()
        if q.is_cpu:
            _check_offsets(cu_q, q.shape[0], plan[1], op, "cu_seqlens_q", "q")
            _check_offsets(cu_k, k.shape[0], plan[2], op, "cu_seqlens_k", "k")
    return q, k, v, cu_q, cu_k


def _new(shape, like, varlen):
    # varlen on a GPU: rows past cu_seqlens[-1] (unchecked there) are left zero, not garbage
    return (torch.zeros if varlen and like.is_cuda else torch.empty)(shape, dtype=like.dtype, device=like.device)


def _launch(q, k, v, cu_q, cu_k, scale, window, top_left, deterministic, plan, op="attention"):
    """(out, lse) for validated arguments."""
    q, k, v, cu_q, cu_k = _prepare(q, k, v, cu_q, cu_k, plan, op)
    out = _new(q.shape, q, plan[7])
    lse = torch.empty(_lse_shape(q, plan), dtype=_lse_dtype(q), device=q.device)
    if out.numel():
        _run(_C.attention_fwd, 0, plan, (q, k, v, out, lse, None, None, None, None, cu_q, cu_k), scale,
             window, _flags(q, top_left, deterministic))
    return out, lse


def _attention(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left, window_right, top_left, deterministic):
    plan = _check(q, k, v, cu_q, cu_k, max_q, max_k, "attention")
    return _launch(q, k, v, cu_q, cu_k, scale, (window_left, window_right), top_left, deterministic, plan)


def _attention_fake(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left, window_right, top_left,
                    deterministic):
    plan = _check(q, k, v, cu_q, cu_k, max_q, max_k, "attention")
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q, plan), dtype=_lse_dtype(q))


def _attention_backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, window_left,
                        window_right, top_left, deterministic):
    op = "attention_backward"
    plan = _check(q, k, v, cu_q, cu_k, max_q, max_k, op)
    for name, t in (("grad", grad), ("out", out)):
        B.check_tensor(t, op, name)
        B.check_same(t, q, op, name, "q")
        if t.shape != q.shape:
            raise ValueError(f"fastkern.{op}: {name} has shape {tuple(t.shape)}, q has {tuple(q.shape)}")
    if lse.shape != _lse_shape(q, plan) or lse.dtype != _lse_dtype(q) or lse.device != q.device:
        raise ValueError(f"fastkern.{op}: lse must be the {_lse_shape(q, plan)} {_lse_dtype(q)} "
                         f"log-sum-exp the forward returned")
    q, k, v, cu_q, cu_k = _prepare(q, k, v, cu_q, cu_k, plan, op)
    grad, out, lse = _row_major(grad), _row_major(out), lse.contiguous()
    dq, dk, dv = _new(q.shape, q, plan[7]), _new(k.shape, k, plan[7]), _new(v.shape, v, plan[7])
    if dq.numel() or dk.numel():
        _run(_C.attention_bwd, 1, plan, (q, k, v, out, lse, grad, dq, dk, dv, cu_q, cu_k), scale,
             (window_left, window_right), _flags(q, top_left, deterministic))
    return dq, dk, dv


def _attention_backward_fake(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, window_left,
                             window_right, top_left, deterministic):
    _check(q, k, v, cu_q, cu_k, max_q, max_k, "attention_backward")
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k = inputs[:5]
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k)
    ctx.args = inputs[5:]


def _backward(ctx, grad, grad_lse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    backward = _attention_backward if B.plain_eager(grad, q, k, v) else _attention_backward_op
    dq, dk, dv = backward(grad, q, k, v, out, lse, cu_q, cu_k, *ctx.args)
    return dq, dk, dv, *([None] * 9)


class _AttentionFunction(torch.autograd.Function):
    """The eager autograd path: the registered op's context and backward without the dispatcher, on
    arguments the caller validated (`plan`)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left, window_right, top_left,
                deterministic, plan):
        output = _launch(q, k, v, cu_q, cu_k, scale, (window_left, window_right), top_left,
                         deterministic, plan)
        _setup_context(ctx, (q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left, window_right,
                             top_left, deterministic), output)
        ctx.mark_non_differentiable(output[1])
        return output

    @staticmethod
    def backward(ctx, grad, grad_lse):
        return (*_backward(ctx, grad, grad_lse), None)


_attention_apply = B.function_apply(_AttentionFunction)
_attention_op, _attention_backward_op = B.register_op(
    "attention", _attention, _attention_fake, _attention_backward, _attention_backward_fake, _backward,
    _setup_context)


def _number(value, op, name, default):
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"fastkern.{op}: {name} must be a float or None, got {type(value).__name__}")
    return float(value)


def _window(window_size, causal, op):
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise TypeError(f"fastkern.{op}: window_size must be a pair of ints (left, right), got "
                        f"{window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"fastkern.{op}: window_size entries must be >= -1 (-1: unbounded), got "
                         f"{tuple(window_size)}")
    return left, 0 if causal else right


def _call(q, k, v, cu_q, cu_k, max_q, max_k, scale, window, top_left, deterministic, op):
    """(out, lse) by the cheapest route (B.route): straight into the kernel, through the eager
    autograd function, or through the registered op (compile, tracing, transforms)."""
    plan = _check(q, k, v, cu_q, cu_k, max_q, max_k, op)  # bad input is refused here by name
    scale = plan[5] ** -0.5 if scale is None else scale
    deterministic = bool(deterministic)
    route = B.route(q, k, v, cu_q, cu_k)
    if route == B.DIRECT:
        return _launch(q, k, v, cu_q, cu_k, scale, window, top_left, deterministic, plan, op)
    if route == B.GRAD:
        return _attention_apply(q, k, v, cu_q, cu_k, max_q, max_k, scale, *window, top_left,
                                deterministic, plan)
    return _attention_op(q, k, v, cu_q, cu_k, max_q, max_k, scale, *window, top_left, deterministic)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), return_lse=False,
                    deterministic=False):
    """flash-attn's flash_attn_func: q (B, Sq, H, D), k / v (B, Sk, Hkv, D), H a multiple of Hkv.
    softmax_scale defaults to D ** -0.5; causal masks bottom-right aligned (key j > i + Sk - Sq);
    window_size (left, right) keeps keys j with i + Sk - Sq - left <= j <= i + Sk - Sq + right
    (-1: unbounded). Returns out (B, Sq, H, D), and with return_lse also the log-sum-exp (B, H, Sq)
    (fp32; rows that see no key: out 0, lse +inf). deterministic=True (or torch's deterministic
    algorithms) makes the GPU backward bitwise reproducible; the CPU's always is."""
    op = "flash_attn_func"
    scale = _number(softmax_scale, op, "softmax_scale", None)
    out, lse = _call(q, k, v, None, None, 0, 0, scale, _window(window_size, causal, op), False,
                     deterministic, op)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False, window_size=(-1, -1), return_lse=False,
                           deterministic=False):
    """flash-attn's flash_attn_varlen_func: sequences packed along the first dim, q (total_q, H, D),
    k / v (total_k, Hkv, D); sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 (int32
    offsets, batch + 1 of them, on q's device) and likewise for keys; max_seqlen_* bound the lengths.
    Options as flash_attn_func; the log-sum-exp is (H, total_q)."""
    op = "flash_attn_varlen_func"
    scale = _number(softmax_scale, op, "softmax_scale", None)
    out, lse = _call(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), scale,
                     _window(window_size, causal, op), False, deterministic, op)
    return (out, lse) if return_lse else out


def _sdpa_unsupported(query, key, value, attn_mask, dropout_p):
    """The first argument of an SDPA call fastkern's kernels do not take, or None."""
    if attn_mask is not None:
        return "attn_mask"
    if dropout_p > 0:
        return "dropout_p"
    if query.dim() not in (3, 4) or key.dim() != query.dim() or value.dim() != query.dim():
        return "rank"
    if value.shape[-1] != query.shape[-1]:
        return "value_head_dim"
    if key.shape[:-1] != value.shape[:-1] or key.shape[0] != query.shape[0]:
        return "shapes"  # batch broadcasting, or shapes torch itself refuses with its own message
    if query.is_cuda and query.dtype not in (torch.float16, torch.bfloat16):
        return "dtype"  # fp32 SDPA on the GPU (a drop-in must take what torch takes)
    if query.is_cuda and (query.shape[-1] % 8 or query.shape[-1] > 256):
        return "head_dim"
    return None


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention with torch's layout (B, H, S, D) (or (B, S, D))
    and semantics: is_causal masks top-left aligned (key j > query i), scale defaults to D ** -0.5,
    enable_gqa lets H be a multiple of key / value's heads. A general attn_mask, dropout_p > 0, a
    value head dim other than the query's, broadcast batch dims, other ranks, and on the GPU fp32 or a
    head dim not a multiple of 8 up to 256 run torch's SDPA instead, counted in fastkern.stats() (NotImplementedError after fastkern.set_fallback(False))."""
    op = "scaled_dot_product_attention"
    for name, t in (("query", query), ("key", key), ("value", value)):
        B.check_tensor(t, op, name)
    unsupported = _sdpa_unsupported(query, key, value, attn_mask, float(dropout_p))
    if unsupported is not None:
        B.fallback(op, unsupported)
        kwargs = {"enable_gqa": True} if enable_gqa else {}
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, **kwargs)
    scale = _number(scale, op, "scale", None)
    squeeze = query.dim() == 3
    if squeeze:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    if not enable_gqa and key.shape[1] != query.shape[1]:
        raise ValueError(f"fastkern.{op}: query has {query.shape[1]} heads and key / value "
                         f"{key.shape[1]}: pass enable_gqa=True for grouped-query attention")
    window = (-1, 0) if is_causal else (-1, -1)
    out, _ = _call(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, None, 0, 0,
                   scale, window, True, False, op)
    out = out.transpose(1, 2)
    return out.squeeze(1) if squeeze else out


def _plan(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, causal=False,
          window_size=(-1, -1), top_left=False, backward=False):
    """The CUDA strategy fastkern's attention takes for these flash-layout inputs ("cpu" on the CPU):
    for tests and benchmark tables; csrc/cuda/attention/dispatch.cu holds the table."""
    plan = _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "attention")
    window = _window(window_size, causal, "attention")
    tensors = (q, k, v, q, None, q if backward else None, q if backward else None,
               k if backward else None, v if backward else None, cu_seqlens_q, cu_seqlens_k)
    device = q.get_device()
    return _C.attention_plan(bool(backward), *_args(plan, tensors, None, 0, plan[5] ** -0.5, window,
                                                    _flags(q, top_left, False)), device)
