"""The `attention` suite of `python -m fastkern.bench`: fastkern's flash attention against every torch
SDPA backend that takes the case (FLASH, cuDNN, EFFICIENT via torch.nn.attention.sdpa_kernel, the
default choice) and torch.compile of SDPA, forward and forward + backward, in TFLOP/s.

FLOPs as flash-attn counts them: forward 4 B H Sq Sk D (two matmuls), halved when causal; forward +
backward 3.5x that (backward 2.5x forward). Every implementation reads the same tensors: fastkern in
flash layout (B, S, H, D), torch SDPA the (B, H, S, D) transposed views of them (its own flash
kernels' native layout). A backend that refuses a case (e.g. GQA, head dims) is left out of it.
Cases yield (name, bytes, make_inputs, impls, extra) for bench.run; extra holds "flops", on a GPU
the fastkern strategy that ran, and on the CPU fewer timing samples (calls take 10-500 ms).
"""
import os
from unittest import mock

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fastkern
from .ops import attention as attention_ops

# the sweep: batch x seqlen = 16k tokens, hidden 2048 (heads = 2048 / D)
SWEEP_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
SWEEP_HEAD_DIMS = (64, 128)


def _torch_sdpa(backend=None, gqa=False):
    kwargs = {"enable_gqa": True} if gqa else {}

    def run(q, k, v, causal):
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if backend is None:
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **kwargs).transpose(1, 2)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **kwargs).transpose(1, 2)
    return run


def _peers(device, gqa):
    """{name: fn(q, k, v, causal) -> out in flash layout} for the torch peers on this device."""
    if device.type == "cuda":
        peers = {"flash": _torch_sdpa(SDPBackend.FLASH_ATTENTION, gqa),
                 "cudnn": _torch_sdpa(SDPBackend.CUDNN_ATTENTION, gqa),
                 "efficient": _torch_sdpa(SDPBackend.EFFICIENT_ATTENTION, gqa),
                 "torch": _torch_sdpa(None, gqa)}
    else:
        peers = {"torch": _torch_sdpa(None, gqa), "math": _torch_sdpa(SDPBackend.MATH, gqa)}
    torch._dynamo.reset()
    peers["compile"] = torch.compile(_torch_sdpa(None, gqa))
    return peers


def _fastkern(q, k, v, causal):
    return fastkern.flash_attn_func(q, k, v, causal=causal)


def _direction(fn, causal, backward):
    """fn as a timed call: forward under no_grad, or forward + backward (gradients of q, k, v)."""
    if backward:
        def fwd_bwd(q, k, v, g):
            return torch.autograd.grad(fn(q, k, v, causal), (q, k, v), g)
        return fwd_bwd

    def fwd(q, k, v, g):
        with torch.no_grad():
            return fn(q, k, v, causal)
    return fwd


def _forced_sm80(call):
    """`call` (forward, or forward + backward) with FASTKERN_ATTENTION_FORCE_GENERAL=1: fastkern's
    sm_80 kernels on a Hopper GPU (the issue's "sm_80 kernel forced on Hopper" row)."""
    def run(*args):
        with mock.patch.dict(os.environ, {"FASTKERN_ATTENTION_FORCE_GENERAL": "1"}):
            return call(*args)
    return run


def _case(device, b, sq, sk, h, hkv, d, causal, backward, dtype, math=False):
    """One case as bench.run takes it; implementations that fail on it are dropped. math: also torch's
    MATH backend (on a GPU), and every implementation's peak memory."""
    def make_inputs():
        q = torch.randn(b, sq, h, d, device=device, dtype=dtype, requires_grad=backward)
        k = torch.randn(b, sk, hkv, d, device=device, dtype=dtype, requires_grad=backward)
        v = torch.randn(b, sk, hkv, d, device=device, dtype=dtype, requires_grad=backward)
        return q, k, v, torch.randn_like(q)
    fns = {"fastkern": _fastkern, **_peers(device, hkv != h)}
    if math and device.type == "cuda":
        fns["math"] = _torch_sdpa(SDPBackend.MATH, hkv != h)
    impls = {name: _direction(fn, causal, backward) for name, fn in fns.items()}
    probe = make_inputs()
    strategy = attention_ops._plan(*probe[:3], causal=causal, backward=backward) if device.type == "cuda" else None
    if strategy and "sm90" in strategy:
        impls["fastkern_sm80"] = _forced_sm80(impls["fastkern"])
    for name in list(impls):
        try:
            impls[name](*probe)
        except Exception:  # noqa: BLE001 - a backend that does not take this case sits it out
            if name == "fastkern":
                raise
            del impls[name]
    flops = 4 * b * h * sq * sk * d * (0.5 if causal and sq > 1 else 1.0) * (3.5 if backward else 1.0)
    extra = {"flops": flops, "peak": math}
    if device.type == "cpu":  # calls of 10-500 ms: a few eager samples of one call each
        extra.update(repeats=3, calls=1)
    else:  # graph replays of 10 calls of 0.1-10 ms: 7 samples (the sweep's 60 cases x 7 peers in ~15 min)
        extra.update(repeats=7, strategy=strategy)
    nbytes = (2 * b * sq * h + 2 * b * sk * hkv) * d * probe[0].element_size() * (2 if backward else 1)
    tag = "fwd+bwd" if backward else "fwd"
    mask = "causal" if causal else "full"
    shape = f"({b},{sq},{h},{d})" if sq == sk and h == hkv else f"(B{b},Sq{sq},Sk{sk},H{h},Hkv{hkv},D{d})"
    return (f"attention {tag} {mask} {str(dtype)[6:]} {shape}", nbytes, make_inputs, impls, extra)


def attention_cases(device, quick=False):
    """Yields the attention cases: on a GPU the issue's sweep (bf16, 16k tokens, hidden 2048, D 64 /
    128, causal and not, fwd and fwd+bwd, with MATH and peak memory at S 8k fwd+bwd; --quick: S 1k
    and 4k), GQA (B 4, S 4k, H 32, Hkv 8, D 128) and decoding (B 8, Sq 1, Sk 8k / 32k, H 32, Hkv 8,
    D 128); on the CPU the issue's (1, 1024, 8, 64) fp32 target, bf16 and a decoding step."""
    if device.type == "cpu":
        for dtype in (torch.float32, torch.bfloat16):
            for causal in (False, True):
                for backward in (False, True):
                    if dtype == torch.bfloat16 and not (causal and backward):
                        continue
                    yield _case(device, 1, 1024, 1024, 8, 8, 64, causal, backward, dtype)
        yield _case(device, 1, 1, 4096, 8, 8, 64, False, False, torch.float32)
        return
    bf16 = torch.bfloat16
    seqlens = (1024, 4096) if quick else SWEEP_SEQLENS
    for d in SWEEP_HEAD_DIMS:
        for s in seqlens:
            for causal in (False, True):
                for backward in (False, True):
                    yield _case(device, 16384 // s, s, s, 2048 // d, 2048 // d, d, causal, backward, bf16,
                                math=s == 8192 and backward)  # the peak memory against MATH
    for causal in (False, True):  # (4, 4096, 16, 128) is the sweep's S 4k, D 128
        for backward in (False, True):
            yield _case(device, 4, 4096, 4096, 32, 8, 128, causal, backward, bf16)  # GQA
    for sk in (8192, 32768):
        yield _case(device, 8, 1, sk, 32, 8, 128, False, False, bf16)
