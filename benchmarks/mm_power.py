"""SM clock and board power while a GEMM runs back to back: fastkern against cuBLAS (D-139).

    python benchmarks/mm_power.py [NAME=PATH/_C.abi3.so ...] [--sizes 4096,16384x1024x8192] [--seconds 1.5]

For each bf16 size (M = N = K, or MxNxK: a (M, K) @ b (K, N), as bench_matmul draws them) and each
build (none: the imported fastkern) and torch.matmul (cuBLAS), replays a CUDA graph of calls for
`seconds` while `nvidia-smi -lms 20` samples the SM clock and the power draw; prints the median clock
and power of the window's second half (settled) and the graph's time a call there. A GEMM whose
clock drops more than its peer's spends more energy a FLOP (power cap): more bytes moved through L2
and shared memory, not a slower loop.
"""
import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab import Build  # noqa: E402

import fastkern  # noqa: E402
from fastkern import bench  # noqa: E402

FIELDS = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"


def sampler(path):
    """nvidia-smi writing a sample every 20 ms (falls back to fewer fields on an older driver)."""
    for fields in (FIELDS, FIELDS.rsplit(",", 1)[0]):
        out = open(path, "w")
        proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                                 "-lms", "20"], stdout=out, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        if proc.poll() is None:
            return proc
    raise SystemExit("mm_power: nvidia-smi did not start")


def samples(path, t0, t1):
    rows = []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        try:
            t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            if t0 <= t <= t1:
                rows.append((float(parts[1]), float(parts[2]), parts[3] if len(parts) > 3 else "?"))
        except (ValueError, IndexError):
            continue
    return rows


def window(fn, sets, seconds):
    """Replays a graph of fn over `sets` for `seconds`; (start, end, us a call in the second half)."""
    calls = 2 * len(sets)
    graph = torch.cuda.CUDAGraph()
    for inputs in sets:
        fn(*inputs)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*sets[i % len(sets)])
    t0 = time.time()
    half, times = t0 + seconds / 2, []
    while time.time() < t0 + seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if time.time() > half:
            times.append(start.elapsed_time(end) * 1e3 / calls)
    return t0 + seconds / 2, time.time(), statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("builds", nargs="*", help="NAME=PATH of a fastkern._C (default: the imported one)")
    parser.add_argument("--sizes", default="4096,8192,16384x1024x8192")
    parser.add_argument("--seconds", type=float, default=1.5)
    args = parser.parse_args(argv)
    builds = [Build(spec) for spec in args.builds] or [None]
    device = torch.device("cuda")
    log = os.path.join(tempfile.mkdtemp(), "smi.csv")
    proc = sampler(log)
    results = []
    try:
        for text in args.sizes.split(","):
            m, n, k = tuple(int(v) for v in text.split("x")) if "x" in text else (int(text),) * 3
            make = lambda: (torch.randn(m, k, device=device, dtype=torch.bfloat16),
                            torch.randn(k, n, device=device, dtype=torch.bfloat16))
            sets = bench.input_sets(make, device, 2 * (m * k + k * n))
            for build in builds:
                name = build.name if build else "fastkern"
                if build:
                    with build:
                        results.append((text, name, 2 * m * n * k) + window(fastkern.matmul, sets, args.seconds))
                else:
                    results.append((text, name, 2 * m * n * k) + window(fastkern.matmul, sets, args.seconds))
                time.sleep(0.3)
            results.append((text, "cublas", 2 * m * n * k) + window(torch.matmul, sets, args.seconds))
            time.sleep(0.3)
            del sets
    finally:
        time.sleep(0.2)
        proc.terminate()
    print(f"device: {torch.cuda.get_device_name()}")
    print(f"{'size':16s} {'impl':10s} {'us/call':>8s} {'TFLOP/s':>8s} {'MHz':>6s} {'W':>6s} {'TFLOP/J':>8s} reasons")
    for text, name, flops, t0, t1, us in results:
        rows = samples(log, t0, t1)
        mhz = statistics.median(r[0] for r in rows) if rows else float("nan")
        watts = statistics.median(r[1] for r in rows) if rows else float("nan")
        reasons = sorted({r[2] for r in rows})
        tflops = flops / us / 1e6
        print(f"{text:16s} {name:10s} {us:8.1f} {tflops:8.1f} {mhz:6.0f} {watts:6.0f} {tflops / watts:8.3f} "
              f"{' '.join(reasons)} ({len(rows)} samples)")


if __name__ == "__main__":
    main()
