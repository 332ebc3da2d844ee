"""The development tools' own promises (benchmarks/ab.py)."""
import importlib.util
import os
import shutil
import sys

from fastkern import _backend

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def test_ab_build_replaces_the_kernels_of_every_module_that_calls_them(tmp_path):
    # ab.py once swapped softmax's and GELU's `_C` only: its attention A/Bs timed one build under
    # every name. Every fastkern module holding the extension as `_C` must call the build under test.
    spec = importlib.util.spec_from_file_location("fastkern_ab", os.path.join(ROOT, "benchmarks", "ab.py"))
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    imported = _backend._C
    callers = [name for name, m in sys.modules.items()
               if name.startswith("fastkern.") and name != "fastkern._C" and getattr(m, "_C", None) is imported]
    assert {"fastkern._backend", "fastkern.ops.attention", "fastkern.ops.softmax"} <= set(callers)
    other = tmp_path / os.path.basename(imported.__file__)  # another file: another module, as a second build
    shutil.copy(imported.__file__, other)
    build = ab.Build(f"other={other}")
    assert build.module is not imported  # loaded beside the imported one
    try:
        with build:
            left = [name for name in callers if sys.modules[name]._C is not build.module]
            assert left == []
    finally:
        for name in callers:
            sys.modules[name]._C = imported


def test_mm_stamps_phases_and_per_call_figures_from_synthetic_stamps():
    # benchmarks/mm_stamps.py (D-133) reads a timestamp build's stamps; its arithmetic, on stamps
    # made here: 3 calls of 2 CTAs, a clock of 2 cycles a ns, every phase a known length
    import torch
    spec = importlib.util.spec_from_file_location("fastkern_mm_stamps",
                                                  os.path.join(ROOT, "benchmarks", "mm_stamps.py"))
    mm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mm)
    lengths = {"init": 100, "synced": 50, "waited": 900, "issued": 200, "ready": 0, "full0": 600,
               "full_last": 2000, "mma_done": 300, "stored": 400, "end": 500, "end1": 0}  # ns after the previous
    s = torch.zeros(3, 4, len(mm.EVENTS), 2, dtype=torch.int64)  # CTAs 2 and 3 did not run
    for call in range(3):
        for cta in range(2):
            t = 10_000 + 6_000 * call + 10 * cta  # entry
            for event in mm.EVENTS:
                t += lengths.get(event, 0)
                s[call, cta, mm.E[event]] = torch.tensor([t, 2 * t])
    phases, calls, per_ns, step = mm.analyse([s])
    assert per_ns == 2.0
    assert statistics_median(phases["wait"]) == 2 * 900 and statistics_median(phases["k-loop"]) == 2 * 2000
    assert statistics_median(phases["drain"]) == 2 * 500 and len(phases["drain"]) == 4  # calls 1 and 2
    assert statistics_median(phases["after-wait"]) == 2 * (200 + 600 + 2000 + 300 + 400 + 500)
    end = 100 + 50 + 900 + 200 + 600 + 2000 + 300 + 400 + 500  # a CTA's entry -> exit
    first_wait = 100 + 50 + 900
    assert calls["period"] == [6_000, 6_000]
    assert calls["gap"] == [6_000 + first_wait - (end + 10)] * 2
    assert calls["kernel"] == [end + 10 - first_wait] * 2
    assert step == 10


def statistics_median(values):
    import statistics
    return statistics.median(values)
