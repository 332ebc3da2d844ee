"""Regression guard over the benchmark suites (`pytest benchmarks`), and the timing order.

Each suite case fails only if fastkern is slower than half the best peer measured in the same run
(GPU only): a guard against regressions, not a noisy gate. The tables and JSON come from
`python -m fastkern.bench`; this file only checks them.
"""
import pytest
import torch

import fastkern
from fastkern import bench

needs_gpu = pytest.mark.skipif(not (fastkern.cuda_available() and torch.cuda.is_available()),
                               reason="benchmarks time CUDA kernels")


@needs_gpu
@pytest.mark.parametrize("suite", sorted(bench.SUITES))
def test_not_slower_than_half_the_best_peer(suite):
    report = bench.run([suite])
    print(bench.format_table(report))
    slow = [c["case"] for c in report["cases"] if c["speedup_vs"][c["best_peer"]] < 0.5]
    assert not slow, f"fastkern below half the best peer: {slow}"


def test_each_impl_timed_in_both_orders_keeps_its_faster_time(monkeypatch):
    """time_impls times a, b, c, then c, b, a; an impl timed later runs slower here, so the first
    half's times must win for a and the second half's for c."""
    calls = []

    def fake_time_ms(fn, sets, device):
        calls.append(fn())
        return 1.0 + len(calls) * (1 if calls[-1] != "c" else -1) / 10, "graph"

    monkeypatch.setattr(bench, "time_ms", fake_time_ms)
    timed = bench.time_impls({k: (lambda k=k: k) for k in "abc"}, [()], torch.device("cpu"))
    assert calls == ["a", "b", "c", "c", "b", "a"]
    assert timed["a"] == (pytest.approx(1.1), "graph", [pytest.approx(1.1), pytest.approx(1.6)])
    assert timed["b"][0] == pytest.approx(1.2) and timed["b"][2] == [pytest.approx(1.2), pytest.approx(1.5)]
    assert timed["c"][0] == pytest.approx(0.6) and timed["c"][2] == [pytest.approx(0.7), pytest.approx(0.6)]


def test_every_sample_starts_with_kept_l2_lines_released(monkeypatch):
    """time_ms releases kept L2 lines before its warm-up and before each timed sample, so no
    sample inherits lines an earlier kernel kept (CPU: the eager path, the same calls)."""
    events = []
    monkeypatch.setattr(bench, "release_kept_l2_lines", lambda device: events.append("release"))
    bench.time_ms(lambda: events.append("call"), [()], torch.device("cpu"), repeats=3)
    samples = "".join("r" if e == "release" else "c" for e in events)
    assert samples == "r" + "c" + ("r" + "c" * 10) * 3
