"""The sm_80 path's atomic backward (csrc/cuda/attention/bwd_atomic_mma_sm80.cu), forced on Hopper by
FASTKERN_ATTENTION_FORCE_GENERAL: its tile edges (128 keys a CTA; 128 queries a step at d <= 64, 64 at
d <= 128), GQA summed in a CTA, causal (bottom-right), windows, varlen, every head dim it takes,
misaligned inputs (element loads); deterministic mode keeps the bitwise bwd_mma_sm80. Error rule:
test_attention.check (float64 reference, at most GRAD_FACTOR x torch's own error)."""
import pytest
import torch

from fastkern.ops import attention as attention_ops
from conftest import misaligned, needs_cuda
from test_attention import assert_bitwise_deterministic, check, qkv, varlen_check

ATOMIC_PAIRS = [(1, 129), (65, 127), (127, 129), (129, 300), (257, 256), (300, 130)]


@pytest.fixture
def forced(monkeypatch):  # the sm_80 path
    monkeypatch.setenv("FASTKERN_ATTENTION_FORCE_GENERAL", "1")


@needs_cuda
@pytest.mark.parametrize("d", [32, 64, 96, 128])
@pytest.mark.parametrize("sq,sk", ATOMIC_PAIRS, ids=str)
def test_cuda_atomic_backward_tile_edges(sq, sk, d, forced, poison):
    q, k, v = qkv(2, sq, sk, 4, 2, d, torch.bfloat16, "cuda")
    assert attention_ops._plan(q, k, v, causal=True, backward=True) == "bwd_atomic_mma_sm80"
    check(q, k, v, causal=True)
    check(*qkv(1, sq, sk, 6, 1, d, torch.float16, "cuda"), window=(40, 7))


@needs_cuda
@pytest.mark.parametrize("d", [32, 64, 96, 128])
def test_cuda_atomic_backward_varlen(d, forced, poison):
    varlen_check([1, 300, 17, 129, 0, 130], [1, 257, 400, 64, 5, 128], 4, 2, d, torch.bfloat16, causal=True,
                 device="cuda")
    varlen_check([64, 1, 200], [100, 90, 1], 6, 3, d, torch.float16, window=(30, 10), device="cuda")


@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_atomic_backward_misaligned_and_top_left(d, forced, poison):
    q, k, v = (misaligned((2, 200, 4, d), torch.bfloat16, "cuda"), misaligned((2, 150, 2, d), torch.bfloat16, "cuda"),
               misaligned((2, 150, 2, d), torch.bfloat16, "cuda"))
    check(q, k, v, causal=True)
    check(*qkv(1, 70, 300, 8, 8, d, torch.bfloat16, "cuda"), window=(-1, 0))  # sq < sk: bottom-right causal


@needs_cuda
@pytest.mark.parametrize("d", [64, 128, 256])
def test_cuda_deterministic_backward_keeps_bwd_mma_sm80(d, forced, monkeypatch):
    q, k, v = qkv(2, 300, 333, 4, 2, d, torch.bfloat16, "cuda")
    want = "bwd_atomic_mma_sm80" if d <= 128 else "bwd_mma_sm80"
    assert attention_ops._plan(q, k, v, causal=True, backward=True) == want
    with monkeypatch.context() as m:  # _plan's flags follow torch's deterministic switch
        m.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
        assert attention_ops._plan(q, k, v, causal=True, backward=True) == "bwd_mma_sm80"
    assert_bitwise_deterministic(q, k, v, repeats=1)
