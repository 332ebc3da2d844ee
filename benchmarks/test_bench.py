"""Regression guard over the benchmark suites (`pytest benchmarks`), and the timing order.

Each suite case fails only if fastkern is slower than half the best peer measured in the same run
(GPU only): a guard against regressions, not a noisy gate. The tables and JSON come from
`python -m fastkern.bench`; this file only checks them.
"""
import json
from pathlib import Path

import pytest
import torch

import fastkern
from fastkern import bench, bench_report

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

    def fake_time_ms(fn, sets, device, *counts):
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


KEPT_RUNS = sorted((Path(__file__).parent / "results").glob("bench-*.json"))


@pytest.mark.parametrize("path", KEPT_RUNS, ids=lambda p: p.name)
def test_markdown_table_of_a_saved_run(path, capsys):
    """--markdown FILE.json prints the README's headline table from the file, timing nothing: one
    row per op, dtype and direction at the headline shapes, figures as the JSON has them."""
    report = json.loads(path.read_text())
    bench.main(["--markdown", str(path)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith(report["device"]) and path.name in lines[0]
    rows = [line for line in lines[4:] if line.startswith("| ")]
    cases = bench_report.headline_cases(report)
    cpu = report["device"] == "cpu"  # the CPU suite: torch eager the only peer
    headline = bench_report.HEADLINE_CPU if cpu else bench_report.HEADLINE
    want = len(headline) * 2 - 2  # bias+GELU, causal: bf16 only
    if not any(bench_report.parse_case(c["case"])[0] in dict(headline) for c in report["cases"]):
        want = len(report["cases"])  # a run of a suite without headline rows (attention): every case
    assert len(rows) == len(cases) == want
    assert len({(c["case"]) for c in cases}) == len(cases)
    header = [cell.strip() for cell in lines[2].strip("|").split("|")]
    vs, pct = header.index("vs eager"), header.index("% of copy")
    for row, case in zip(rows, cases):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[0] in case["case"] and cells[2] in case["case"]
        assert cells[3] == f"{case['ms']['fastkern'] * 1e3:.1f}"
        assert cells[vs] == f"{case['speedup_vs']['torch']:.3f}x"
        assert cells[pct] == f"{case['pct_of_copy']:.1f}"


def test_markdown_of_a_fresh_run(monkeypatch, capsys):
    """--markdown without a file prints the table of the run it makes (here a saved report stands in
    for the run)."""
    report = json.loads(next(p for p in KEPT_RUNS if "cpu" not in p.name).read_text())
    monkeypatch.setattr(bench, "run", lambda suites, *args, **kwargs: {**report, "cases": [
        c for c in report["cases"] if c["suite"] in suites]})
    bench.main(["gelu", "--markdown"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| gelu")]
    assert len(rows) == 4


@pytest.mark.parametrize("path", sorted((Path(__file__).parent / "results").glob("matmul-*.json")),
                         ids=lambda p: p.name)
def test_matmul_markdown_of_a_saved_run(path, capsys):
    """bench_matmul --markdown FILE.json prints the README's matmul table: a row per case with the
    JSON's TFLOP/s and ratios, and the sweep's summary line."""
    from fastkern import bench_matmul
    report = json.loads(path.read_text())
    assert bench_matmul.main(["--markdown", str(path)]) is None  # timed nothing
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith(report["device"]) and path.name in lines[0]
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| case")]
    assert len(rows) == len(report["cases"])
    for row, case in zip(rows, report["cases"]):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[0] == case["case"] and cells[1] == f"{case['tflops']['fastkern']:.1f}"
        assert cells[3] == f"{case['speedup_vs']['torch']:.3f}x"
    assert lines[-1].startswith("sweep 1536..2304") == ("sweep" in report)
