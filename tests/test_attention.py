"""fastkern.flash_attn_func / flash_attn_varlen_func / scaled_dot_product_attention: outputs, lse and
gradients against float64 under the error rule (forward at most 2x the error of torch's math SDPA in
the same dtype, gradients 3x: flash-attn's rule), masks (causal in both alignments, windows, rows
that see no key), GQA / MQA, varlen, strided views, autograd, opcheck, compile, CUDA graphs,
determinism, fallbacks and bad input."""
import re

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fastkern
from fastkern.ops import attention as attention_ops
from conftest import DEVICES, assert_within_torch_error, in_fresh_thread, needs_cuda, on_cpu_threads, rel_error

GRAD_FACTOR = 3.0


def visible(sq, sk, window=(-1, -1), top_left=False, device="cpu"):
    """(sq, sk) bool: query i sees key j iff j - i - shift lies in [-left, right] (-1: unbounded),
    shift = sk - sq (bottom-right, flash-attn) or 0 (top-left, torch SDPA)."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None]
    rel = j - i - (0 if top_left else sk - sq)
    mask = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if window[0] >= 0:
        mask &= rel >= -window[0]
    if window[1] >= 0:
        mask &= rel <= window[1]
    return mask


def torch_attention(q, k, v, scale, mask):
    """torch's math SDPA in q's dtype, flash layout in and out (GQA by repeating k / v); rows that
    see no key give 0 and no gradient (torch itself would give NaN there)."""
    empty = ~mask.any(-1)
    group = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(group, 1)
    vt = v.transpose(1, 2).repeat_interleave(group, 1)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask | empty[:, None], scale=scale)
    return (out * (~empty)[:, None].to(out.dtype)).transpose(1, 2)


def ref_lse(q, k, scale, mask):
    group = q.shape[2] // k.shape[2]
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double().repeat_interleave(group, 2)) * scale
    s = s.masked_fill(~mask, float("-inf")).logsumexp(-1)
    return s.masked_fill(~mask.any(-1), float("inf"))


def assert_lse(lse, ref):
    assert torch.equal(torch.isinf(lse), torch.isinf(ref)), "rows with no visible key must have lse +inf"
    finite = torch.isfinite(ref)
    tol = 1e-10 if lse.dtype == torch.float64 else 2e-5
    assert (lse.double()[finite] - ref[finite]).abs().max().item() <= tol * (1 + ref[finite].abs().max().item())


def check(q, k, v, causal=False, window=(-1, -1), scale=None, grad=True):
    """fastkern.flash_attn_func against torch (same dtype) and float64: out, lse, dq, dk, dv."""
    sq, sk, d = q.shape[1], k.shape[1], q.shape[-1]
    scale_ = d ** -0.5 if scale is None else scale
    mask = visible(sq, sk, (window[0], 0 if causal else window[1]), device=q.device)
    q, k, v = (t.detach().requires_grad_(grad) for t in (q, k, v))
    out, lse = fastkern.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window,
                                        return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], sq)
    assert lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
    tq, tk, tv = (t.detach().requires_grad_(grad) for t in (q, k, v))
    rq, rk, rv = (t.detach().double().requires_grad_(grad) for t in (q, k, v))
    tout, rout = torch_attention(tq, tk, tv, scale_, mask), torch_attention(rq, rk, rv, scale_, mask)
    assert_within_torch_error(out, tout, rout, "out")
    assert_lse(lse, ref_lse(q, k, scale_, mask))
    if not grad or out.numel() == 0:
        return
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), g)
    theirs = torch.autograd.grad(tout, (tq, tk, tv), g)
    refs = torch.autograd.grad(rout, (rq, rk, rv), g.double())
    for name, a, b, r in zip(("dq", "dk", "dv"), ours, theirs, refs):
        assert a.shape == r.shape and a.dtype == q.dtype
        assert_within_torch_error(a, b, r, name, factor=GRAD_FACTOR)


def qkv(b, sq, sk, h, hkv, d, dtype, device="cpu"):
    return (torch.randn(b, sq, h, d, dtype=dtype, device=device),
            torch.randn(b, sk, hkv, d, dtype=dtype, device=device),
            torch.randn(b, sk, hkv, d, dtype=dtype, device=device))


CPU_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]

# (batch, sq, sk, heads, kv_heads, head_dim, causal, window): odd sizes, Sq = 1 decoding, Sq > Sk
# (bottom-right causal leaves the first Sq - Sk rows without keys), GQA / MQA, windows, every tile
# edge of the CPU kernel (64 rows / keys) crossed, its one-query (decoding) path
CASES = [
    (1, 1, 1, 1, 1, 8, False, (-1, -1)),
    (2, 1, 257, 6, 2, 64, False, (-1, -1)),
    (1, 1, 130, 6, 1, 64, True, (-1, -1)),
    (1, 113, 203, 6, 6, 40, False, (-1, -1)),
    (1, 113, 203, 6, 2, 40, True, (-1, -1)),
    (1, 128, 217, 2, 1, 80, True, (-1, -1)),
    (1, 108, 256, 2, 2, 96, False, (-1, -1)),
    (2, 200, 77, 2, 1, 32, True, (-1, -1)),
    (1, 65, 65, 3, 3, 256, True, (-1, -1)),
    (1, 130, 130, 2, 2, 128, False, (17, 5)),
    (1, 100, 150, 2, 1, 24, False, (32, -1)),
    (1, 100, 60, 2, 2, 64, True, (10, -1)),
    (2, 7, 5, 1, 1, 13, False, (1, 2)),
    (1, 129, 140, 2, 1, 64, False, (20, 3)),  # a lone last row (the CPU's one-query path), windowed
]


def _case_params():
    params = []
    for i, case in enumerate(CASES):
        # fp32 and bf16 for every case, fp16 and fp64 for every other one (CPU time)
        for dtype in CPU_DTYPES if i % 2 == 0 else CPU_DTYPES[:2]:
            params.append(pytest.param(case, dtype, id=f"{case}-{str(dtype)[6:]}"))
    return params


@pytest.mark.parametrize("case,dtype", _case_params())
def test_cpu_values_and_gradients(case, dtype, poison):
    b, sq, sk, h, hkv, d, causal, window = case
    check(*qkv(b, sq, sk, h, hkv, d, dtype), causal=causal, window=window)


@pytest.mark.parametrize("sq,sk,causal,dtype", [(512, 256, True, torch.bfloat16), (1023, 1024, True, torch.float32),
                                                (1024, 1023, False, torch.float32)], ids=str)
def test_cpu_longer_sequences(sq, sk, causal, dtype):
    check(*qkv(1, sq, sk, 1, 1, 64, dtype), causal=causal, scale=0.2)


def test_rows_without_keys_are_zero_with_zero_gradients(poison):
    q, k, v = qkv(1, 9, 4, 2, 1, 16, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = fastkern.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out[:, :5], torch.zeros_like(out[:, :5])) and torch.isinf(lse[..., :5]).all()
    assert (lse[..., :5] > 0).all() and torch.isfinite(lse[..., 5:]).all()
    g = torch.zeros_like(out)
    g[:, :5] = 1.0  # gradient only on the empty rows: nothing flows
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    assert not dq.any() and not dk.any() and not dv.any()


@pytest.mark.parametrize("sq,sk", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(sq, sk, poison):
    q, k, v = (t.requires_grad_() for t in qkv(2, sq, sk, 2, 2, 8, torch.float32))
    out, lse = fastkern.flash_attn_func(q, k, v, return_lse=True)
    assert out.shape == q.shape and not out.isnan().any() and not out.any()
    assert lse.shape == (2, 2, sq) and (torch.isinf(lse) & (lse > 0)).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert not dq.isnan().any() and not dq.any() and not dk.any() and not dv.any()
    assert fastkern.flash_attn_func(*qkv(0, 3, 3, 2, 2, 8, torch.float32)).shape == (0, 3, 2, 8)


def varlen_check(lengths_q, lengths_k, h, hkv, d, dtype, causal=False, window=(-1, -1), device="cpu"):
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = torch.randn(total_q, h, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(total_k, hkv, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(total_k, hkv, d, dtype=dtype, device=device, requires_grad=True)
    cu = [torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32) for lengths in (lengths_q, lengths_k)]
    out, lse = fastkern.flash_attn_varlen_func(q, k, v, cu[0], cu[1], max(lengths_q), max(lengths_k),
                                               causal=causal, window_size=window, return_lse=True)
    assert out.shape == q.shape and lse.shape == (h, total_q)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), g)
    scale = d ** -0.5
    results = []
    for as_dtype in (dtype, torch.float64):
        tq, tk, tv = (t.detach().to(as_dtype).requires_grad_() for t in (q, k, v))
        pieces = []
        for b in range(len(lengths_q)):
            qs, ks = slice(cu[0][b], cu[0][b + 1]), slice(cu[1][b], cu[1][b + 1])
            mask = visible(lengths_q[b], lengths_k[b], (window[0], 0 if causal else window[1]), device=device)
            pieces.append(torch_attention(tq[qs][None], tk[ks][None], tv[ks][None], scale, mask)[0])
            if as_dtype == torch.float64 and lengths_q[b]:
                ref = ref_lse(q[qs][None].detach(), k[ks][None].detach(), scale, mask)[0]
                assert_lse(lse[:, qs], ref)
        tout = torch.cat(pieces)
        results.append((tout, torch.autograd.grad(tout, (tq, tk, tv), g.to(as_dtype))))
    (tout, tgrads), (rout, rgrads) = results
    assert_within_torch_error(out, tout, rout, "out")
    for name, a, b, r in zip(("dq", "dk", "dv"), ours, tgrads, rgrads):
        assert_within_torch_error(a, b, r, name, factor=GRAD_FACTOR)


@pytest.mark.parametrize("dtype,causal,window", [
    (torch.float32, False, (-1, -1)), (torch.bfloat16, True, (-1, -1)), (torch.float16, False, (8, 3)),
    (torch.float64, True, (-1, -1))], ids=str)
def test_varlen(dtype, causal, window, poison):
    varlen_check([1, 17, 70, 0, 130, 3], [5, 1, 64, 3, 100, 3], 2, 1, 32, dtype, causal, window)


def test_varlen_matches_dense_per_sequence():
    q, k, v = qkv(3, 50, 70, 4, 1, 16, torch.float32)
    cu_q = torch.tensor([0, 50, 100, 150], dtype=torch.int32)
    cu_k = torch.tensor([0, 70, 140, 210], dtype=torch.int32)
    dense = fastkern.flash_attn_func(q, k, v, causal=True)
    packed = fastkern.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k,
                                             50, 70, causal=True)
    assert torch.equal(packed.view_as(dense), dense)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("b,h,hkv,sq,sk,causal,gqa,scale", [
    (2, 4, 4, 33, 33, True, False, None), (1, 4, 4, 20, 70, True, False, None),
    (1, 4, 4, 70, 20, True, False, 0.3), (2, 6, 2, 1, 90, False, True, None),
    (1, 6, 1, 64, 64, True, True, 1.0)], ids=str)
def test_sdpa_matches_torch(b, h, hkv, sq, sk, causal, gqa, scale, dtype, poison):
    """torch's layout and semantics: top-left causal (rows past Sk see every key), enable_gqa."""
    query = torch.randn(b, h, sq, 48, dtype=dtype, requires_grad=True)
    key = torch.randn(b, hkv, sk, 48, dtype=dtype, requires_grad=True)
    value = torch.randn(b, hkv, sk, 48, dtype=dtype, requires_grad=True)
    out = fastkern.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scale, enable_gqa=gqa)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (query, key, value), g)

    def torch_sdpa(as_dtype):
        tq, tk, tv = (t.detach().to(as_dtype).requires_grad_() for t in (query, key, value))
        with sdpa_kernel(SDPBackend.MATH):
            tout = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, scale=scale, enable_gqa=gqa)
        return tout, torch.autograd.grad(tout, (tq, tk, tv), g.to(as_dtype))
    (tout, tgrads), (rout, rgrads) = torch_sdpa(dtype), torch_sdpa(torch.float64)
    assert out.shape == tout.shape
    assert_within_torch_error(out, tout, rout, "out")
    ideal = flash_ideal_grads(query, key, value, g, dtype, causal, scale, gqa)
    for name, a, t, i, r in zip(("dq", "dk", "dv"), ours, tgrads, ideal, rgrads):
        assert a.shape == r.shape
        if rel_error(i, r) > rel_error(t, r):
            t = i
        assert_within_torch_error(a, t, r, name, factor=GRAD_FACTOR)


def flash_ideal_grads(q, k, v, g, dtype, causal, scale, gqa):
    """The gradients of an exact flash backward (float64 arithmetic) whose only rounding is its
    saved output's, in `dtype`: D = rowsum(dO * O) takes the rounded O, as every flash backward's
    does (FlashAttention-2's, cuDNN's, ours). torch's CPU math SDPA upcasts 16-bit inputs, so its
    error lacks this term, which grows as the softmax sharpens (scale 1.0: 3x torch's dq error).
    dS = P (dP - D) with D off by delta is the gradient of sum(g * O) - sum(delta * lse)."""
    tq, tk, tv = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, scale=scale, enable_gqa=gqa)
    group = q.shape[1] // k.shape[1]
    s = tq @ tk.repeat_interleave(group, 1).transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    delta = (g.double() * (out.detach().to(dtype).double() - out.detach())).sum(-1)
    loss = (out * g.double()).sum() - (delta * s.logsumexp(-1)).sum()
    return [x.to(dtype) for x in torch.autograd.grad(loss, (tq, tk, tv))]


def test_sdpa_three_dims_and_default_backend():
    query, key, value = torch.randn(3, 10, 16), torch.randn(3, 12, 16), torch.randn(3, 12, 16)
    out = fastkern.scaled_dot_product_attention(query, key, value, is_causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(query, key, value, is_causal=True),
                               atol=2e-6, rtol=2e-5)


def test_strided_packed_qkv_is_used_without_copy(monkeypatch, poison):
    """Slices of a packed qkv projection (B, S, 3, H, D) and torch-layout transposes reach the
    kernel by their strides; gradients come back shaped like the inputs."""
    x = torch.randn(2, 77, 3 * 4 * 40, dtype=torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in x.view(2, 77, 3, 4, 40).unbind(2))
    q, k, v = q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_()
    assert not q.is_contiguous() and attention_ops._row_major(q) is q
    copies = []
    real = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous",
                        lambda t, *a, **kw: (t.is_contiguous() or copies.append(t.shape)) and real(t, *a, **kw))
    out = fastkern.flash_attn_func(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert copies == []
    monkeypatch.undo()
    assert dq.shape == q.shape and dk.shape == k.shape
    check(q, k, v, causal=True)
    # a last dim that is not contiguous is copied first, and still right
    wide = torch.randn(1, 30, 2, 64)
    check(wide[..., ::2], wide[..., 1::2], wide[..., ::2].flip(1), window=(4, 4))


@pytest.mark.parametrize("case", [(1, 5, 7, 2, 1, 8, True, (-1, -1)), (2, 6, 4, 2, 2, 4, False, (2, 1)),
                                  (1, 7, 3, 1, 1, 8, True, (1, -1))], ids=str)
def test_gradcheck_float64(case):
    b, sq, sk, h, hkv, d, causal, window = case
    inputs = tuple(t.requires_grad_() for t in qkv(b, sq, sk, h, hkv, d, torch.float64))
    assert torch.autograd.gradcheck(
        lambda q, k, v: fastkern.flash_attn_func(q, k, v, causal=causal, window_size=window), inputs)
    assert torch.autograd.gradcheck(
        lambda q, k, v: fastkern.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
        tuple(t.detach().transpose(1, 2).requires_grad_() for t in inputs))


def test_gradcheck_varlen_float64():
    q = torch.randn(9, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(8, 1, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(8, 1, 8, dtype=torch.float64, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 1, 5, 9], dtype=torch.int32), torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    assert torch.autograd.gradcheck(
        lambda q, k, v: fastkern.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 4, causal=True), (q, k, v))


def test_backward_saves_inputs_output_and_lse_only():
    q, k, v = (t.requires_grad_() for t in qkv(1, 100, 120, 2, 2, 16, torch.float32))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fastkern.flash_attn_func(q, k, v)
    assert saved[0] is q and saved[1] is k and saved[2] is v
    assert max(t.numel() for t in saved if t is not None) < 100 * 120  # never the probabilities


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = (t.requires_grad_() for t in qkv(2, 37, 45, 4, 2, 16, dtype, device))
    for options in [(0.25, -1, -1, False, False), (0.25, -1, 0, True, False), (0.5, 8, 0, False, True)]:
        torch.library.opcheck(torch.ops.fastkern.attention.default, (q, k, v, None, None, 0, 0, *options))
    out, lse = torch.ops.fastkern.attention.default(q.detach(), k.detach(), v.detach(), None, None, 0, 0,
                                                    0.25, -1, 0, False, False)
    torch.library.opcheck(torch.ops.fastkern.attention_backward.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, None, None,
                           0, 0, 0.25, -1, 0, False, False))
    cu = torch.tensor([0, 10, 37], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.fastkern.attention.default,
                          (q[0], k[0, :37], v[0, :37], cu, cu, 27, 27, 0.25, -1, 0, False, False))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16

    def block(x, w):
        qkv_ = (x @ w).view(x.shape[0], x.shape[1], 3, 2, 16)
        q, k, v = qkv_.unbind(2)
        a = fastkern.flash_attn_func(q, k, v, causal=True)
        b = fastkern.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True).transpose(1, 2)
        return a + b

    x = torch.randn(2, 40, 32, dtype=dtype, device=device)
    w = torch.randn(32, 96, dtype=dtype, device=device, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True)
    y_eager, y_compiled = block(x, w), compiled(x, w)
    torch.testing.assert_close(y_compiled, y_eager, atol=1e-5, rtol=1e-5)
    (g_eager,) = torch.autograd.grad(y_eager.square().sum(), w)
    (g_compiled,) = torch.autograd.grad(y_compiled.square().sum(), w)
    torch.testing.assert_close(g_compiled, g_eager, rtol=1e-3, atol=1e-4 * g_eager.abs().max().item())


def test_cpu_backward_is_bitwise_deterministic_for_any_thread_count(poison):
    q, k, v = qkv(1, 300, 260, 4, 2, 64, torch.float32)
    g = torch.randn_like(q)

    def run():
        out, lse = torch.ops.fastkern.attention.default(q, k, v, None, None, 0, 0, 0.125, -1, 0, False, False)
        return (out, lse, *torch.ops.fastkern.attention_backward.default(
            g, q, k, v, out, lse, None, None, 0, 0, 0.125, -1, 0, False, False))
    first, again, one, many = run(), run(), on_cpu_threads(1, run), on_cpu_threads(5, run)
    for a, b, c, d in zip(first, again, one, many):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)


def _cpu_isas():
    """The FASTKERN_CPU_ISA values this machine runs (csrc/cpu/attention.c: pick_kernels)."""
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        flags = []
    return ["generic"] + (["avx2"] if "avx2" in flags and "fma" in flags else []) + (
        ["avx512"] if "avx512f" in flags and "avx512dq" in flags else [])


@pytest.mark.parametrize("isa", _cpu_isas())
def test_cpu_isa_paths(isa, monkeypatch, poison):
    monkeypatch.setenv("FASTKERN_CPU_ISA", isa)
    check(*qkv(1, 70, 90, 4, 2, 40, torch.float32), causal=True)
    check(*qkv(2, 3, 130, 2, 1, 24, torch.bfloat16), window=(50, 10))


def test_fallbacks_are_counted_or_refused():
    query, key, value = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    mask = torch.rand(8, 10) > 0.3
    fastkern.stats(reset=True)
    out = fastkern.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(query, key, value, attn_mask=mask))
    fastkern.scaled_dot_product_attention(query, key, value, dropout_p=0.5)
    fastkern.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    fastkern.scaled_dot_product_attention(query, key, value)  # runs fastkern's kernel: not counted
    wide = query.expand(3, -1, -1, -1)  # batch dims broadcast against key / value's: torch's semantics
    torch.testing.assert_close(fastkern.scaled_dot_product_attention(wide, key, value),
                               F.scaled_dot_product_attention(wide, key, value))
    assert fastkern.stats() == {"fallback.scaled_dot_product_attention.attn_mask": 2,
                                "fallback.scaled_dot_product_attention.dropout_p": 1,
                                "fallback.scaled_dot_product_attention.shapes": 1}
    assert fastkern.set_fallback(False) is True
    try:
        for kwargs, name in (({"attn_mask": mask}, "attn_mask"), ({"dropout_p": 0.1}, "dropout_p")):
            with pytest.raises(NotImplementedError, match=re.escape(
                    f"fastkern.scaled_dot_product_attention: {name} is not supported by fastkern's kernels")):
                fastkern.scaled_dot_product_attention(query, key, value, **kwargs)
    finally:
        fastkern.set_fallback(True)
    assert fastkern.stats(reset=True)["fallback.scaled_dot_product_attention.attn_mask"] == 2
    assert fastkern.stats() == {}


def test_fallback_under_compile_compiles_once():
    """A fallback inside torch.compile'd code (transformers' GPT-2 trains with attention dropout)
    is one graph: no recompile per call, so no count read back from fastkern.stats()."""
    query = torch.randn(1, 2, 8, 16)
    mask = torch.rand(8, 8) > 0.3
    fn = torch.compile(lambda q: fastkern.scaled_dot_product_attention(q, q, q, attn_mask=mask), fullgraph=True)
    fastkern.stats(reset=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            torch.testing.assert_close(fn(query), F.scaled_dot_product_attention(query, query, query, attn_mask=mask))
    assert fastkern.stats() == {}


def test_bad_input():
    q, k, v = qkv(2, 5, 6, 4, 2, 8, torch.float32)
    f = fastkern.flash_attn_func

    def raises(exc, message, fn, *args, **kwargs):
        with pytest.raises(exc, match=re.escape(message)):
            fn(*args, **kwargs)
    raises(TypeError, "fastkern.flash_attn_func: q must be a floating-point tensor of dtype float64, float32, "
           "float16, bfloat16 on cpu, got torch.int64", f, q.long(), k, v)
    raises(TypeError, "fastkern.flash_attn_func: k has dtype torch.float64 but q has torch.float32", f, q, k.double(), v)
    raises(TypeError, "fastkern.flash_attn_func: v must be a torch.Tensor, got list", f, q, k, [1.0])
    raises(ValueError, "fastkern.flash_attn_func: q must have 4 dims (batch, seqlen, heads, head_dim), got shape "
           "(2, 5, 32)", f, q.flatten(2), k, v)
    raises(ValueError, "fastkern.flash_attn_func: k and v must have the same shape, got (2, 6, 2, 8) and "
           "(2, 7, 2, 8)", f, q, k, torch.randn(2, 7, 2, 8))
    raises(ValueError, "fastkern.flash_attn_func: head dims differ: q has 8 and k / v have 16", f, q,
           torch.randn(2, 6, 2, 16), torch.randn(2, 6, 2, 16))
    raises(ValueError, "fastkern.flash_attn_func: q's 4 heads are not a multiple of k / v's 3 heads", f, q,
           torch.randn(2, 6, 3, 8), torch.randn(2, 6, 3, 8))
    raises(ValueError, "fastkern.flash_attn_func: batch sizes differ: q has 2 and k / v have 1", f, q, k[:1], v[:1])
    raises(ValueError, "fastkern.flash_attn_func: window_size entries must be >= -1 (-1: unbounded), got (-2, 0)",
           f, q, k, v, window_size=(-2, 0))
    raises(TypeError, "fastkern.flash_attn_func: window_size must be a pair of ints (left, right), got 3", f, q, k,
           v, window_size=3)
    raises(TypeError, "fastkern.flash_attn_func: softmax_scale must be a float or None, got str", f, q, k, v,
           softmax_scale="0.1")
    raises(ValueError, "fastkern.flash_attn_func: head_dim must be at least 1, got 0", f, q[..., :0], k[..., :0],
           v[..., :0])
    raises(ValueError, "fastkern.scaled_dot_product_attention: query has 4 heads and key / value 2: pass "
           "enable_gqa=True for grouped-query attention", fastkern.scaled_dot_product_attention,
           q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    # varlen
    g = fastkern.flash_attn_varlen_func
    qp, kp, vp = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    cu_q, cu_k = torch.tensor([0, 5, 10], dtype=torch.int32), torch.tensor([0, 6, 12], dtype=torch.int32)
    raises(ValueError, "fastkern.flash_attn_varlen_func: q must have 3 dims (total, heads, head_dim), got shape "
           "(2, 5, 4, 8)", g, q, kp, vp, cu_q, cu_k, 5, 6)
    raises(ValueError, "fastkern.flash_attn_varlen_func: cu_seqlens_q must be a 1-d int32 tensor of batch + 1 "
           "offsets, got torch.int64 of shape (3,)", g, qp, kp, vp, cu_q.long(), cu_k, 5, 6)
    raises(ValueError, "fastkern.flash_attn_varlen_func: cu_seqlens_q has 3 entries and cu_seqlens_k 2: both "
           "must be batch + 1", g, qp, kp, vp, cu_q, cu_k[:2], 5, 6)
    raises(ValueError, "fastkern.flash_attn_varlen_func: cu_seqlens_q must rise from 0 to q's 10 rows, got "
           "[0, 5, 9]", g, qp, kp, vp, torch.tensor([0, 5, 9], dtype=torch.int32), cu_k, 5, 6)
    raises(ValueError, "fastkern.flash_attn_varlen_func: cu_seqlens_k must rise from 0 to k's 12 rows, got "
           "[0, 7, 6, 12]", g, qp, kp, vp, torch.tensor([0, 3, 4, 10], dtype=torch.int32),
           torch.tensor([0, 7, 6, 12], dtype=torch.int32), 6, 7)
    raises(ValueError, "fastkern.flash_attn_varlen_func: cu_seqlens_k holds a sequence of 6 rows, longer than "
           "max_seqlen_k=5", g, qp, kp, vp, cu_q, cu_k, 5, 5)
    raises(ValueError, "fastkern.flash_attn_varlen_func: max_seqlen_q must be >= 0, got -1", g, qp, kp, vp, cu_q,
           cu_k, -1, 6)


@needs_cuda
def test_bad_input_cuda():
    q, k, v = qkv(1, 4, 4, 2, 2, 16, torch.bfloat16, "cuda")
    with pytest.raises(TypeError, match=re.escape("fastkern.flash_attn_func: q must be float16 or bfloat16 on "
                                                  "cuda, got torch.float32")):
        fastkern.flash_attn_func(q.float(), k.float(), v.float())
    for d in (20, 264):
        with pytest.raises(ValueError, match=re.escape(f"fastkern.flash_attn_func: head_dim must be a multiple "
                                                       f"of 8 and at most 256 on cuda, got {d}")):
            fastkern.flash_attn_func(*qkv(1, 4, 4, 2, 2, d, torch.bfloat16, "cuda"))
    with pytest.raises(ValueError, match=re.escape("fastkern.flash_attn_func: k is on cpu but q is on cuda:0")):
        fastkern.flash_attn_func(q, k.cpu(), v)
    # the SDPA drop-in takes what torch's takes: fp32 and other head dims run torch's, counted
    fastkern.stats(reset=True)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    for args in ((qt.float(), kt.float(), vt.float()), tuple(t[..., :12] for t in (qt, kt, vt))):
        torch.testing.assert_close(fastkern.scaled_dot_product_attention(*args),
                                   F.scaled_dot_product_attention(*args))
    assert fastkern.stats(reset=True) == {"fallback.scaled_dot_product_attention.dtype": 1,
                                          "fallback.scaled_dot_product_attention.head_dim": 1}


# ---- CUDA: the shapes, the default path and the general (sm_80) kernel forced ---------------

CUDA_PAIRS = [(1, 4097), (113, 203), (128, 217), (108, 256), (256, 512), (512, 256), (1023, 1024),
              (1024, 1023), (2048, 2048)]
CUDA_HEAD_DIMS = [32, 40, 64, 80, 96, 128, 256]


@pytest.fixture(params=["default", "force_general"])
def cuda_path(request, monkeypatch):
    if request.param == "force_general":
        monkeypatch.setenv("FASTKERN_ATTENTION_FORCE_GENERAL", "1")
    return request.param


@needs_cuda
def test_cuda_first_cuda_work_of_a_thread():
    # the Hopper kernels' tensor maps failed on a thread without a current context (a backward's
    # first op on torch's autograd thread): forward and backward each on a fresh thread
    q, k, v = qkv(2, 256, 200, 4, 2, 128, torch.bfloat16, "cuda")
    scale = 128 ** -0.5
    out, lse = in_fresh_thread(lambda: torch.ops.fastkern.attention.default(q, k, v, None, None, 0, 0, scale, -1, -1,
                                                                            False, False))
    g = torch.randn_like(out)
    grads = in_fresh_thread(lambda: torch.ops.fastkern.attention_backward.default(
        g, q, k, v, out, lse, None, None, 0, 0, scale, -1, -1, False, False))
    mask = visible(256, 200, device="cuda")
    tq, tk, tv = (t.detach().requires_grad_() for t in (q, k, v))
    rq, rk, rv = (t.detach().double().requires_grad_() for t in (q, k, v))
    tout, rout = torch_attention(tq, tk, tv, scale, mask), torch_attention(rq, rk, rv, scale, mask)
    assert_within_torch_error(out, tout, rout, "out")
    theirs = torch.autograd.grad(tout, (tq, tk, tv), g)
    refs = torch.autograd.grad(rout, (rq, rk, rv), g.double())
    for name, a, b, r in zip(("dq", "dk", "dv"), grads, theirs, refs):
        assert_within_torch_error(a, b, r, name, factor=GRAD_FACTOR)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", CUDA_PAIRS, ids=str)
def test_cuda_values_and_gradients(sq, sk, causal, dtype, cuda_path, poison):
    index = CUDA_PAIRS.index((sq, sk))
    d = CUDA_HEAD_DIMS[index % len(CUDA_HEAD_DIMS)]
    h, hkv = [(6, 6), (6, 2), (6, 1)][index % 3]
    check(*qkv(1 if sq > 1000 else 4, sq, sk, h, hkv, d, dtype, "cuda"), causal=causal)


@needs_cuda
@pytest.mark.parametrize("d", CUDA_HEAD_DIMS + [8, 16, 24, 136, 200, 248])
def test_cuda_head_dims(d, cuda_path, poison):
    check(*qkv(2, 130, 77, 4, 2, d, torch.bfloat16, "cuda"), causal=True)
    check(*qkv(1, 1, 300, 4, 1, d, torch.float16, "cuda"))


@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", [(65, 127), (127, 129), (129, 300), (257, 256)], ids=str)
def test_cuda_backward_tile_edges(sq, sk, d, poison):
    """Hopper's backward query tile (128 queries at d 64, 64 at d 128) and key tile (128) edges."""
    check(*qkv(2, sq, sk, 4, 2, d, torch.bfloat16, "cuda"), causal=True)
    check(*qkv(1, sq, sk, 4, 4, d, torch.float16, "cuda"), window=(40, 7))


@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_forward_walks_many_tiles(d, poison):
    """The Hopper forward's persistent walk with ~2-4 query tiles a CTA (100-150 SMs), tiles whose
    rows see no key among them (bottom-right causal with sq > sk leaves rows 0..383 without keys; a
    window): its ping-pong turns, Q ring and output staging carry on from tile to tile."""
    check(*qkv(4, 1024, 640, 8, 4, d, torch.bfloat16, "cuda"), causal=True, grad=False)
    check(*qkv(4, 1100, 1100, 8, 8, d, torch.float16, "cuda"), window=(200, 50), grad=False)


# (batch, sq, sk, heads, kv_heads, causal, window): mask edges inside the Hopper forward's key tiles
# (written for D-142's half tiles, not landed), >= 132 query tiles of 128 rows (or sk < 193), so that
# the plan is fwd_wgmma_sm90, not the split kernel
MASK_EDGE_CASES = [
    (4, 512, 512, 16, 8, True, (-1, -1)),    # the diagonal tile, aligned: rows 0-63 of a tile see 64 keys
    (3, 449, 449, 12, 12, True, (-1, -1)),   # a last query tile of 65 rows, its second 64 past the end
    (1, 1023, 1023, 20, 5, True, (-1, -1)),
    (2, 449, 513, 20, 10, True, (-1, -1)),   # bottom-right shift 64: rows 64-127 see 64 keys of the last tile
    (2, 576, 512, 16, 16, True, (-1, -1)),   # shift -64: rows 0-63 see no key
    (2, 1023, 1024, 10, 10, True, (-1, -1)),  # shift 1: no key tile is half
    (2, 300, 300, 24, 12, False, (-1, -1)),  # sequences ending 44 keys into a tile: half for every row
    (2, 200, 64, 4, 4, False, (-1, -1)),     # a query tile's only key tile half
    (2, 512, 512, 20, 10, False, (100, 0)),  # windows: left edge inside, right edge on the diagonal
    (2, 640, 640, 16, 16, False, (-1, 17)),
    (8, 512, 512, 8, 4, True, (-1, -1)),     # 256 query tiles: CTAs walk several
]


@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", MASK_EDGE_CASES, ids=str)
def test_cuda_forward_mask_edges_in_tiles(case, d, poison):
    """Key tiles of which a warpgroup's 64 rows see only the first 64 keys (the causal diagonal's
    upper half for rows 0-63 of a 128-row tile, the last tile of a sequence ending 1-64 keys into it),
    diagonals shifted by Sq != Sk, windows: every mask edge a tile can hold, at d 64 and 128."""
    b, sq, sk, h, hkv, causal, window = case
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = qkv(b, sq, sk, h, hkv, d, dtype, "cuda")
        if _hopper():
            assert attention_ops._plan(q, k, v, causal=causal, window_size=window) == "fwd_wgmma_sm90"
        check(q, k, v, causal=causal, window=window, grad=dtype == torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("sk", [8192, 32768])
def test_cuda_decoding(sk, cuda_path, poison):
    check(*qkv(8, 1, sk, 32, 8, 128, torch.bfloat16, "cuda"), grad=sk == 8192)


# fwd_decode_mma_sm80 (sq x group <= 16 rows a kv head; splits for a GPU of ~132 SMs): (b, sq, sk, h,
# hkv, d, causal, window, dtype)
DECODE_CASES = [
    (3, 1, 1000, 8, 2, 64, False, (-1, -1), torch.bfloat16),   # 2 splits: a cluster of 2 on Hopper
    (2, 2, 2000, 8, 8, 96, False, (-1, -1), torch.float16),    # MHA, 7 splits, d under its bucket (128)
    (1, 4, 3000, 16, 4, 128, True, (-1, -1), torch.bfloat16),  # 16 rows, causal; 11 splits: the combine kernel
    (2, 3, 5000, 10, 2, 128, False, (100, 0), torch.float16),  # 15 rows; 19 splits, most without a visible key
    (1, 1, 37, 4, 1, 40, False, (-1, -1), torch.bfloat16),     # one split of one partial key tile
]


def _forward_workspace(q, k, v, causal):
    """The forward's workspace bytes for these inputs (fk_cuda_attention_workspace)."""
    plan = attention_ops._check(q, k, v, None, None, 0, 0, "attention")
    window = attention_ops._window((-1, -1), causal, "attention")
    tensors = (q, k, v, q, None, None, None, None, None, None, None)
    args = attention_ops._args(plan, tensors, None, 0, plan[5] ** -0.5, window, attention_ops._flags(q, False, False))
    return attention_ops._C.attention_workspace(False, *args, q.get_device())


@needs_cuda
@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_cuda_decode_rows(case, cuda_path, poison):
    """fwd_decode_mma_sm80: splits merged in a cluster (Hopper) or by the combine kernel (forced
    general: no cluster), one split, empty splits, masks over a few queries of a GQA group."""
    b, sq, sk, h, hkv, d, causal, window, dtype = case
    q, k, v = qkv(b, sq, sk, h, hkv, d, dtype, "cuda")
    assert attention_ops._plan(q, k, v, causal=causal) == "fwd_decode_mma_sm80"
    if case is DECODE_CASES[0] and 100 <= _sms() <= 150:  # 2 splits: a cluster needs no workspace
        assert (_forward_workspace(q, k, v, causal) == 0) == (_hopper() and cuda_path == "default")
    check(q, k, v, causal=causal, window=window)


@needs_cuda
def test_cuda_decode_rows_misaligned_and_varlen(cuda_path, poison):
    """fwd_decode_mma_sm80 with rows that are not 16-byte aligned (element loads), and varlen with
    an empty query sequence and a one-key one (max_seqlen_q 4 x group 4 = 16 rows)."""
    b, sk, h, hkv, d = 2, 1500, 8, 2, 64
    flat = [torch.randn(n + 1, device="cuda", dtype=torch.bfloat16)[1:] for n in (b * h * d, 2 * b * sk * hkv * d)]
    q = flat[0].view(b, 1, h, d)
    k, v = flat[1].view(b, sk, 2, hkv, d).unbind(2)  # 2-byte offset bases, rows 2 hkv d apart
    assert attention_ops._plan(q, k, v) == "fwd_decode_mma_sm80"
    check(q, k, v)
    varlen_check([1, 4, 0, 2], [700, 1, 5, 3000], 16, 4, 64, torch.bfloat16, causal=True, device="cuda")


@needs_cuda
@pytest.mark.parametrize("window", [(64, 0), (100, 30), (-1, 17)], ids=str)
def test_cuda_windows_and_varlen(window, cuda_path, poison):
    check(*qkv(2, 300, 400, 4, 2, 64, torch.bfloat16, "cuda"), window=window)
    varlen_check([1, 300, 17, 129, 1], [1, 257, 400, 64, 3], 4, 2, 64, torch.bfloat16, causal=True, device="cuda")
    varlen_check([64, 1, 200], [100, 90, 1], 6, 6, 128, torch.float16, window=window, device="cuda")


@needs_cuda
def test_cuda_sdpa_and_packed_qkv(cuda_path, poison):
    x = torch.randn(2, 333, 3 * 8 * 64, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.detach().requires_grad_() for t in x.view(2, 333, 3, 8, 64).unbind(2))
    check(q, k, v, causal=True)
    query, key, value = (torch.randn(2, 8, 200, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = fastkern.scaled_dot_product_attention(query, key[:, :, :150], value[:, :, :150], is_causal=True)
    ref = F.scaled_dot_product_attention(query.double(), key[:, :, :150].double(), value[:, :, :150].double(),
                                         is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        theirs = F.scaled_dot_product_attention(query, key[:, :, :150], value[:, :, :150], is_causal=True)
    assert_within_torch_error(out, theirs, ref, "sdpa out")


def assert_bitwise_deterministic(q, k, v, repeats):
    """deterministic=True's causal gradients of (q, k, v) equal bit for bit over `repeats` more runs."""
    g = torch.randn_like(q)

    def grads():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = fastkern.flash_attn_func(qq, kk, vv, causal=True, deterministic=True)
        return torch.autograd.grad(out, (qq, kk, vv), g)
    first = grads()
    for _ in range(repeats):
        for a, b in zip(first, grads()):
            assert torch.equal(a, b)


@needs_cuda
def test_cuda_deterministic_backward_is_bitwise(cuda_path):
    assert_bitwise_deterministic(*qkv(2, 1000, 1000, 8, 2, 128, torch.bfloat16, "cuda"), repeats=3)


@needs_cuda
def test_cuda_graph_capture_and_replay(cuda_path):
    q, k, v = (t.requires_grad_() for t in qkv(2, 256, 300, 4, 2, 64, torch.bfloat16, "cuda"))
    g = torch.randn_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fastkern.flash_attn_func(q, k, v, causal=True).backward(g)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for t in (q, k, v):
        t.grad = None
    with torch.cuda.graph(graph):
        out = fastkern.flash_attn_func(q, k, v, causal=True)
        out.backward(g)
    for _ in range(2):
        with torch.no_grad():
            for t in (q, k, v, g):
                t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        ref = fastkern.flash_attn_func(qq, kk, vv, causal=True)
        ref.backward(g)
        assert torch.equal(out, ref)
        for t, r in zip((q, k, v), (qq, kk, vv)):
            torch.testing.assert_close(t.grad, r.grad, atol=2e-2, rtol=2e-2)


def _hopper():
    return (torch.cuda.is_available() and fastkern.cuda_available()
            and torch.cuda.get_device_capability() == (9, 0) and "sm_90a" in fastkern.BUILD_INFO["archs"])


def _sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


# csrc/cuda/attention/dispatch.cu's table, row by row (shapes sized for a GPU of 100-150 SMs):
# (id, qkv(b, sq, sk, h, hkv, d), causal, forced general) -> forward strategy. Backward: bwd_wgmma_sm90
# on Hopper at d 64 / 128 unless forced, else bwd_atomic_mma_sm80 at d <= 128, bwd_mma_sm80 above
# (_bwd_strategy; deterministic mode: tests/test_attention_bwd.py).
ATTENTION_ROWS = [
    ("decode", (1, 1, 4096, 8, 2, 128), False, False, lambda: "fwd_decode_mma_sm80"),
    ("decode-forced", (2, 4, 300, 8, 2, 64), True, True, lambda: "fwd_decode_mma_sm80"),
    ("split", (1, 5, 4096, 8, 2, 128), False, False, lambda: "fwd_split_mma_sm80"),
    ("split-d256", (1, 1, 4096, 8, 2, 256), False, False, lambda: "fwd_split_mma_sm80"),
    ("split-forced", (2, 100, 2048, 4, 4, 64), True, True, lambda: "fwd_split_mma_sm80"),
    ("hopper-d128-causal", (2, 1000, 1100, 16, 16, 128), True, False,
     lambda: "fwd_wgmma_sm90" if _hopper() else "fwd_mma_sm80"),
    ("hopper-d64-gqa", (4, 333, 333, 32, 8, 64), False, False,
     lambda: "fwd_wgmma_sm90" if _hopper() else "fwd_mma_sm80"),
    ("d96", (2, 1000, 1100, 16, 16, 96), False, False, lambda: "fwd_mma_sm80"),
    ("forced", (2, 1000, 1100, 16, 16, 128), True, True, lambda: "fwd_mma_sm80"),
    ("gqa-packed", (40, 16, 200, 32, 4, 128), False, False, lambda: "fwd_mma_sm80"),
    ("d256-forced", (2, 700, 700, 8, 4, 256), True, True, lambda: "fwd_mma_sm80"),
]


def _bwd_strategy(shape, forced):
    if _hopper() and not forced and shape[5] in (64, 128):
        return "bwd_wgmma_sm90"
    return "bwd_atomic_mma_sm80" if shape[5] <= 128 else "bwd_mma_sm80"


@needs_cuda
@pytest.mark.parametrize("shape,causal,forced,strategy", [r[1:] for r in ATTENTION_ROWS],
                         ids=["cuda-" + r[0] for r in ATTENTION_ROWS])
def test_dispatch_table(shape, causal, forced, strategy, monkeypatch, poison):
    """Each row of the table: the plan names its strategy, and its output and gradients hold the error
    rule (check)."""
    if not 100 <= _sms() <= 150:
        pytest.skip("the rows' shapes are sized for 100-150 SMs")
    if forced:
        monkeypatch.setenv("FASTKERN_ATTENTION_FORCE_GENERAL", "1")
    q, k, v = qkv(*shape, torch.bfloat16, "cuda")
    assert attention_ops._plan(q, k, v, causal=causal) == strategy()
    assert attention_ops._plan(q, k, v, causal=causal, backward=True) == _bwd_strategy(shape, forced)
    check(q, k, v, causal=causal)


def test_plan_on_cpu():
    assert attention_ops._plan(*qkv(1, 4, 4, 1, 1, 8, torch.float32)) == "cpu"


@needs_cuda
def test_cuda_general_and_default_kernels_agree_on_the_same_inputs(monkeypatch):
    """The sm_80 kernel forced (FASTKERN_ATTENTION_FORCE_GENERAL) and the default (Hopper where it
    runs) on the same inputs: both within the error rule, and close to each other."""
    q, k, v = (t.requires_grad_() for t in qkv(2, 1000, 1100, 8, 2, 128, torch.bfloat16, "cuda"))
    g = torch.randn_like(q)
    results = {}
    for path in ("default", "force_general"):
        if path == "force_general":
            monkeypatch.setenv("FASTKERN_ATTENTION_FORCE_GENERAL", "1")
        out = fastkern.flash_attn_func(q, k, v, causal=True)
        results[path] = (out, *torch.autograd.grad(out, (q, k, v), g))
    for a, b in zip(results["default"], results["force_general"]):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


@needs_cuda
def test_cuda_keys_over_2_pow_31_elements():
    """k / v of more than 2^31 elements (64-bit offsets): one decoding query whose only strong key is
    the last one reads that key's value."""
    sk = 2**31 // 128 + 3
    try:
        k = torch.zeros(1, sk, 1, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.zeros(1, sk, 1, 128, device="cuda", dtype=torch.bfloat16)
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory")
    q = torch.zeros(1, 1, 4, 128, device="cuda", dtype=torch.bfloat16)
    q[..., 0] = 1.0
    k[0, -1, 0, 0] = 2000.0  # score ~177 against 0 for the other 2^24 keys: the last key takes it all
    v[0, -1, 0] = torch.arange(128, device="cuda", dtype=torch.bfloat16)
    out = fastkern.flash_attn_func(q, k, v)
    torch.testing.assert_close(out[0, 0].float(), v[0, -1, 0].float().expand(4, 128), atol=0.5, rtol=1e-2)
    del k, v
    torch.cuda.empty_cache()
