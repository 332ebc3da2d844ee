"""A/B of builds: `python benchmarks/ab.py NAME=SO[:VAR=V,...] ... [--only TEXT ...] [--rounds R]`.

Times several builds of fastkern._C (each an .so, optionally with environment variables set while
it runs) against each other and against torch.compile in one process, on the same inputs, in
alternating rounds, so that a difference of a point or two is not the GPU's drift between two runs.
Cases come from a `fastkern.bench` suite (--suite softmax, gelu or attention; selected by name with --only),
or --suite matmul (GEMMs, linear + bias + GELU, fp32 / TF32, against cuBLAS); every implementation is timed as
the benchmark times it (CUDA graph replays, inputs rotated past L2). With --margin it also reports,
for each build, fastkern's worst error over fresh fp32 / bf16 draws as a fraction of the tests'
"2x torch's error" bound (1.0 = at the bound).
"""
import argparse
import importlib.machinery
import importlib.util
import json
import os
import pkgutil
import statistics
import sys

import torch

import fastkern
import fastkern.ops
from fastkern import _backend, bench

# every module that calls the kernels through its own `_C` name, found rather than listed: a build
# under test replaces each (one left out timed the imported build for every "build" name)
OP_MODULES = [_backend] + [importlib.import_module(f"fastkern.ops.{m.name}")
                           for m in pkgutil.iter_modules(fastkern.ops.__path__)]

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def load_build(path, _cache={}):
    """fastkern._C from `path`, loaded beside the imported one (each .so has its own CUDA runtime
    state; the kernels run on torch's stream either way)."""
    path = os.path.abspath(path)
    if path not in _cache:
        loader = importlib.machinery.ExtensionFileLoader("fastkern._C", path)
        spec = importlib.util.spec_from_file_location("fastkern._C", path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        _cache[path] = module
    return _cache[path]


class Build:
    def __init__(self, spec):
        name, _, rest = spec.partition("=")
        path, _, env = rest.partition(":")
        self.name, self.module = name, load_build(path)
        self.env = dict(kv.split("=", 1) for kv in env.split(",") if kv)

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        for m in OP_MODULES:
            if hasattr(m, "_C"):
                m._C = self.module
        return self

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def matmul_cases(device, quick=False):
    """bench_matmul's bf16 shapes, linear + bias + GELU at two short-K training shapes and with the
    pre-activation written (FusedMLP's first linear), FusedMLP forward + backward against the eager
    nn.Sequential, the LM head's linear (C rows not 16-byte aligned) and fp32 4096^3 under TF32 (x @ w
    and linear) and exact; the peer is cuBLAS (torch.matmul, F.linear, F.linear then F.gelu)."""
    from fastkern import bench_matmul
    bf16 = dict(device=device, dtype=torch.bfloat16)
    # rows 16-byte but not 128-byte aligned (a's: k; b's: n), read in place (D-144)
    misaligned = [(1800,) * 3, (2040,) * 3, (2056,) * 3, (4104,) * 3, (8192, 1800, 8192), (8192, 8192, 1800),
                  (8192, 3072, 776), (16384, 4096, 1000)]
    for m, n, k in ([(s, s, s) for s in bench_matmul.SQUARE] + list(bench_matmul.TRAINING) + [(1793,) * 3] + misaligned):
        make = lambda m=m, n=n, k=k: (torch.randn(m, k, **bf16), torch.randn(k, n, **bf16))
        yield (f"bf16 ({m},{n},{k})", 2 * (m * k + k * n), make,
               {"fastkern": fastkern.matmul, "compile": torch.matmul}, {"flops": 2 * m * n * k})
    # bench_matmul's headline linear + GELU, and that shape's plain linear (the epilogue's share)
    m, n, k = 16384, 16384, 4096
    make = lambda m=m, n=n, k=k: (torch.randn(m, k, **bf16), torch.randn(n, k, **bf16) * k ** -0.5)
    yield (f"linear bf16 ({m},{n},{k})", 2 * (m * k + k * n), make,
           {"fastkern": fastkern.linear, "compile": torch.nn.functional.linear}, {"flops": 2 * m * n * k})
    for m, n, k in ((8192, 3072, 768), (16384, 8192, 1280), (16384, 16384, 4096)):
        make = lambda m=m, n=n, k=k: (torch.randn(m, k, **bf16), torch.randn(n, k, **bf16) * k ** -0.5,
                                      torch.randn(n, **bf16))
        yield (f"linear+gelu bf16 ({m},{n},{k})", 2 * (m * k + k * n), make,
               {"fastkern": lambda x, w, b: fastkern.linear(x, w, b, activation="gelu_tanh"),
                "compile": lambda x, w, b: torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b),
                                                                    approximate="tanh")},
               {"flops": 2 * m * n * k})
    # the training forward's linear + GELU, which also writes the pre-activation autograd saves
    from fastkern.ops import matmul as matmul_op
    m, n, k = 16384, 4096, 1024
    make = lambda: (torch.randn(m, k, **bf16), torch.randn(n, k, **bf16) * k ** -0.5, torch.randn(n, **bf16))
    yield (f"linear+gelu+pre bf16 ({m},{n},{k})", 2 * (m * k + k * n), make,
           {"fastkern": lambda x, w, b: matmul_op._mm(x, w.t(), b, "gelu_tanh")[0],
            "compile": lambda x, w, b: torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b),
                                                                approximate="tanh")},
           {"flops": 2 * m * n * k})
    # bench_matmul's FusedMLP forward + backward (x (16384, 1024), hidden 4096) against the eager
    # nn.Sequential: 6 GEMMs of 2 * 16384 * 1024 * 4096 FLOPs
    ours = fastkern.nn.FusedMLP(1024, 4096, 1024, approximate="tanh").to(device, torch.bfloat16)
    ref = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(approximate="tanh"),
                              torch.nn.Linear(4096, 1024)).to(device, torch.bfloat16)
    ref.load_state_dict(ours.state_dict())

    def step(module):
        return lambda x, g: torch.autograd.grad(module(x), (x, *module.parameters()), g)
    make = lambda: (torch.randn(16384, 1024, **bf16, requires_grad=True), torch.randn(16384, 1024, **bf16))
    yield ("FusedMLP fwd+bwd bf16 (16384,1024,4096)", 2 * 2 * 16384 * 1024, make,
           {"fastkern": step(ours), "compile": step(ref)}, {"flops": 6 * 2 * 16384 * 1024 * 4096})
    # its backward's four GEMMs in the layouts it calls them with (dW2 = dY^T gelu(h), dg = dY W2,
    # dW1 = dh^T x, dx = dh W1: A column-major where transposed, B row-major), and a square long-K
    # GEMM of one wave of 128 x 256 tiles
    for name, (m, n, k), a_t in (("dW2", (1024, 4096, 16384), True), ("dg", (16384, 4096, 1024), False),
                                 ("dW1", (4096, 1024, 16384), True), ("dx", (16384, 1024, 4096), False),
                                 ("wave", (2048, 2048, 8192), False)):
        make = lambda m=m, n=n, k=k, a_t=a_t: (torch.randn(k, m, **bf16).t() if a_t else torch.randn(m, k, **bf16),
                                               torch.randn(k, n, **bf16))
        yield (f"mlp-{name} bf16 ({m},{n},{k})", 2 * (m * k + k * n), make,
               {"fastkern": fastkern.matmul, "compile": torch.matmul}, {"flops": 2 * m * n * k})
    make = lambda: (torch.randn(8192, 768, **bf16), torch.randn(50257, 768, **bf16) * 768 ** -0.5)
    yield ("linear lm-head bf16 (8192,50257,768)", 2 * (8192 + 50257) * 768, make,  # C rows not 16-byte aligned
           {"fastkern": fastkern.linear, "compile": torch.nn.functional.linear}, {"flops": 2 * 8192 * 50257 * 768})
    for tf32 in (True, False):  # fp32 4096^3 under TF32 and exact, torch's flag set around each call
        def flagged(fn, tf32=tf32):
            def run(a, b):
                previous = torch.backends.cuda.matmul.allow_tf32
                torch.backends.cuda.matmul.allow_tf32 = tf32
                try:
                    return fn(a, b)
                finally:
                    torch.backends.cuda.matmul.allow_tf32 = previous
            return run
        make = lambda: (torch.randn(4096, 4096, device=device), torch.randn(4096, 4096, device=device))
        yield (f"fp32 {'tf32' if tf32 else 'exact'} (4096,4096,4096)", 2 * 4 * 4096 ** 2, make,
               {"fastkern": flagged(fastkern.matmul), "compile": flagged(torch.matmul)}, {"flops": 2 * 4096 ** 3})
        # F.linear's weight is K-major as it is (x @ w's row-major w is N-major, D-132)
        yield (f"linear fp32 {'tf32' if tf32 else 'exact'} (4096,4096,4096)", 2 * 4 * 4096 ** 2, make,
               {"fastkern": flagged(fastkern.linear), "compile": flagged(torch.nn.functional.linear)},
               {"flops": 2 * 4096 ** 3})
        if not tf32:  # exact fp32 where simt_fp32 keeps 128 x 128 tiles (grids under 2 x SMs 128 x 256 tiles)
            for m, n, k in ((8192, 768, 3072), (1000, 1000, 1000)):
                make = lambda m=m, n=n, k=k: (torch.randn(m, k, device=device), torch.randn(k, n, device=device))
                yield (f"fp32 exact ({m},{n},{k})", 4 * (m * k + k * n), make,
                       {"fastkern": flagged(fastkern.matmul), "compile": flagged(torch.matmul)},
                       {"flops": 2 * m * n * k})


SUITES = dict(bench.SUITES, matmul=matmul_cases)


def time_cases(builds, suite, only, rounds):
    """Per case, each build's times and the peer's ("compile": torch.compile, or cuBLAS for matmul)."""
    device = torch.device("cuda")
    results = []
    for case in SUITES[suite](device):
        name, nbytes, make_inputs, impls = case[:4]  # (attention and matmul cases add an extra dict)
        if only and not any(o in name for o in only):
            continue
        with builds[0]:
            sets = bench.input_sets(make_inputs, device, nbytes)
        times = {b.name: [] for b in builds}
        if "compile" in impls:  # the GELU erf backward has no torch.compile peer
            times["compile"] = []
        for r in range(rounds):  # the peer takes its turn in the order, which reverses each round
            order = [None, *builds] if r % 2 == 0 else [*builds[::-1], None]
            for b in order:
                if b is None:
                    if "compile" in impls:
                        times["compile"].append(bench.time_ms(impls["compile"], sets, device)[0])
                    continue
                with b:
                    times[b.name].append(bench.time_ms(impls["fastkern"], sets, device)[0])
        del sets
        flops = case[4].get("flops") if len(case) > 4 else None
        results.append({"case": name, "bytes": nbytes, "ms": times, **({"flops": flops} if flops else {})})
    return results


def margins(builds, draws):
    """Worst fastkern error / the tests' bound (conftest.torch_error_bound) per build over fresh draws."""
    from conftest import torch_error_bound

    shapes = [(1, 31), (1, 128), (1, 1000), (8, 1000), (1, 4096), (4, 4096), (2, 16384), (64, 1000)]
    out = {}
    for b in builds:
        worst = {}
        with b:
            for dtype in (torch.float32, torch.bfloat16):
                for rows, n in shapes:
                    for _ in range(draws):
                        x = (torch.randn(rows, n, device="cuda") * 4).to(dtype).requires_grad_()
                        rx = x.detach().double().requires_grad_()
                        tx = x.detach().clone().requires_grad_()
                        y, ty, ry = fastkern.softmax(x, -1), torch.softmax(tx, -1), torch.softmax(rx, -1)
                        g = torch.randn_like(y)
                        (dx,) = torch.autograd.grad(y, x, g)
                        (tdx,) = torch.autograd.grad(ty, tx, g)
                        (rdx,) = torch.autograd.grad(ry, rx, g.double())
                        for what, ours, theirs, ref in (("fwd", y, ty, ry), ("bwd", dx, tdx, rdx)):
                            error, _, bound = torch_error_bound(ours, theirs, ref)
                            m = error / bound
                            key = f"{str(dtype)[6:]} {what}"
                            if m > worst.get(key, (0,))[0]:
                                worst[key] = (round(m, 3), f"({rows},{n})")
        out[b.name] = worst
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", help="NAME=PATH_TO_SO[:VAR=VALUE,...]")
    parser.add_argument("--suite", choices=sorted(SUITES), default="softmax")
    parser.add_argument("--only", nargs="*", default=None, help="case-name substrings (any matches)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--margin", type=int, default=0, help="draws per shape for the error margin")
    parser.add_argument("--shapes", nargs="*", default=None,
                        help="ROWSxN shapes instead of the benchmark's (e.g. 32768x2048)")
    parser.add_argument("--dims", nargs="*", default=None,
                        help="SHAPE:DIM layouts instead of the benchmark's other-dim ones (e.g. 64x1024x512:1)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.shapes:
        bench.SOFTMAX_SHAPES = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
        bench.SOFTMAX_RAGGED_SHAPES = []
        bench.SOFTMAX_DIM_SHAPES = []
    if args.dims is not None:
        bench.SOFTMAX_DIM_SHAPES = [(tuple(int(v) for v in shape.split("x")), int(dim))
                                    for shape, dim in (s.split(":") for s in args.dims)]
    builds = [Build(s) for s in args.builds]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_gbs": round(bench.copy_bandwidth_gbs(torch.device("cuda")), 1)}
    if args.margin:
        report["margin"] = margins(builds, args.margin)
    if args.only is None or args.only:
        report["cases"] = time_cases(builds, args.suite, args.only, args.rounds)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    copy = report["copy_gbs"]
    print(f"{report['device']}  copy {copy} GB/s")
    for name, worst in report.get("margin", {}).items():
        print(f"margin {name:10s} " + "  ".join(f"{k} {v[0]:.3f}{v[1]}" for k, v in sorted(worst.items())))
    names = [b.name for b in builds]
    unit = "TFLOP/s" if args.suite in ("matmul", "attention") else "% of copy"
    print(f"{'case':34s} {'peer (' + unit + ')':>14s} " + " ".join(f"{n:>20s}" for n in names))
    for c in report.get("cases", []):
        if "flops" in c:  # TFLOP/s where the case counts FLOPs (matmul, attention), else % of copy
            pct = lambda ms: c["flops"] / ms / 1e9
        else:
            pct = lambda ms: 100 * c["bytes"] / ms / 1e6 / copy
        comp = c["ms"].get("compile")
        cells = []
        for n in names:
            ts = c["ms"][n]
            ratio = f"{statistics.median(a / b for a, b in zip(comp, ts)):6.3f}x" if comp else "      -"
            cells.append(f"{min(map(pct, ts)):5.1f}-{max(map(pct, ts)):5.1f} {ratio}")
        peer = f"{min(map(pct, comp)):6.1f}-{max(map(pct, comp)):5.1f}" if comp else f"{'-':>12s}"
        print(f"{c['case']:34s} {peer} " + " ".join(f"{x:>20s}" for x in cells))


if __name__ == "__main__":
    main()
