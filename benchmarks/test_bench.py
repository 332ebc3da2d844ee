"""Regression guard over the benchmark suites (`pytest benchmarks`, GPU only).

Each case fails only if fastkern is slower than half the best peer measured in the same run: a
guard against regressions, not a noisy gate. The tables and JSON come from
`python -m fastkern.bench`; this file only checks them.
"""
import pytest
import torch

import fastkern
from fastkern import bench

pytestmark = pytest.mark.skipif(not (fastkern.cuda_available() and torch.cuda.is_available()),
                                reason="benchmarks time CUDA kernels")


@pytest.mark.parametrize("suite", sorted(bench.SUITES))
def test_not_slower_than_half_the_best_peer(suite):
    report = bench.run([suite])
    print(bench.format_table(report))
    slow = [c["case"] for c in report["cases"] if c["speedup_vs"][c["best_peer"]] < 0.5]
    assert not slow, f"fastkern below half the best peer: {slow}"
