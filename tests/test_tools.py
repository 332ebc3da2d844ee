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
