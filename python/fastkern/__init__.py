"""fastkern: fused GELU, matmul / linear, softmax and attention kernels for PyTorch, in C and
CUDA C.

    import fastkern
    y = fastkern.gelu(x, approximate="tanh", bias=b)
    p = fastkern.softmax(scores, dim=-1, scale=0.125, causal=True)
    h = fastkern.linear(x, w, b, activation="gelu_tanh")
    o = fastkern.flash_attn_func(q, k, v, causal=True)      # q (B, S, H, D), flash-attn's layout
    o = fastkern.scaled_dot_product_attention(q, k, v, is_causal=True)   # torch's (B, H, S, D)
    loss = fastkern.cross_entropy(logits, labels, ignore_index=-100)

Each function matches the torch one it replaces; fastkern.nn has drop-in modules.
"""
from ._backend import BUILD_INFO, set_fallback, stats
from .ops.attention import flash_attn_func, flash_attn_varlen_func, scaled_dot_product_attention
from .ops.cross_entropy import cross_entropy
from .ops.gelu import gelu
from .ops.matmul import linear, matmul
from .ops.softmax import log_softmax, softmax
from . import nn
from .patch import PatchReport, patch, register_transformers

__version__ = BUILD_INFO["version"]


def cuda_available():
    """True when this build has CUDA kernels and a CUDA device is visible."""
    return BUILD_INFO["cuda"] and len(BUILD_INFO["devices"]) > 0


__all__ = ["gelu", "cross_entropy", "matmul", "linear", "softmax", "log_softmax", "flash_attn_func",
           "flash_attn_varlen_func", "scaled_dot_product_attention", "nn", "patch", "PatchReport",
           "register_transformers", "cuda_available", "stats", "set_fallback", "BUILD_INFO",
           "__version__"]
