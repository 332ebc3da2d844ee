"""Where a small Hopper GEMM's time goes, from its in-kernel timestamps (D-133).

    python benchmarks/mm_stamps.py NAME=PATH/_C.abi3.so [NAME=PATH ...] [--sizes 512,1000,16384x1024x8192]
                                   [--calls 20] [--replays 30]

Each PATH is a fastkern._C built with -DFK_MM_TIMESTAMPS=1 in FASTKERN_NVCC_FLAGS (other switches
too, e.g. -DFK_MM_LEAN_PROLOGUE=1; tools/mm_variant.py makes one from a built tree): this script
builds nothing. Its stamps are the persistent instances' (wgmma_sm90.cu); sizes that take the small-
problem instances (K split, shared B) need wgmma_sm90_small.cu built with -DFK_MM_STAMP_SMALL=1 too. For each build and bf16 size (M = N = K, or MxNxK: a (M, K) @ b (K, N), as bench_matmul
draws them) it captures `calls` fastkern.matmul calls
in one CUDA graph, as fastkern.bench times them (inputs rotated through 16 copies, programmatic
dependent launch unless FASTKERN_PDL=0), replays it `replays` times and reads the stamps after each
replay (csrc/cuda/matmul/stamps.cuh: each CTA's first tile, %globaltimer ns and clock64 cycles).
Calls after the first of a replay count (each follows a matmul, as in the benchmark). It prints:
  per CTA (clock64 of one SM, in ns at the clock rate the stamps give), medians over CTAs and calls:
    pre-wait   entry -> __syncthreads done (mbarrier init, fence, map prefetch)
    wait       -> griddepcontrol.wait returned (lean: also setmaxnreg and the tile math)
    to-issue   -> the first stage's TMA loads issued
    first-load -> full[0] completed (the first 32 KB landed)
    k-loop     -> the last k-step's stage landed
    mma-tail   -> the last wgmma group retired
    epilogue   -> C staged and its TMA store issued
    drain      -> the bulk stores completed (consumer 0's exit)
  per call (globaltimer), medians over calls:
    gap        the previous call's last CTA exit -> this call's first wait return (grid drain + PDL)
    kernel     first wait return -> last CTA exit
    period     last exit -> next last exit (the steady-state time a call)
  and the graph's time a call for the build and for torch.matmul (cuBLAS) on the same inputs.
globaltimer's step is the card's (printed; 32 ns or coarser makes the per-call rows coarse, not the
per-CTA ones).
"""
import argparse
import ctypes
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab import Build  # noqa: E402  (loads a build's _C into every op module)

import fastkern  # noqa: E402
from fastkern import bench  # noqa: E402

# stamps.cuh's StampEvent, in order
EVENTS = ("entry", "init", "synced", "waited", "issued", "ready", "full0", "full_last", "mma_done",
          "stored", "end", "end1")
E = {name: i for i, name in enumerate(EVENTS)}
PHASES = (("pre-wait", "entry", "synced"), ("wait", "synced", "waited"), ("to-issue", "waited", "issued"),
          ("first-load", "issued", "full0"), ("k-loop", "full0", "full_last"),
          ("mma-tail", "full_last", "mma_done"), ("epilogue", "mma_done", "stored"), ("drain", "stored", "end"))


class Stamps:
    """A timestamp build's stamp buffer, through the functions it exports (ctypes)."""

    def __init__(self, path):
        lib = ctypes.CDLL(os.path.abspath(path))  # the module already loaded: the same handle
        if not hasattr(lib, "fk_mm_stamps_read"):
            raise SystemExit(f"mm_stamps: {path} was not built with -DFK_MM_TIMESTAMPS=1")
        dims = (ctypes.c_int * 3)()
        lib.fk_mm_stamps_shape(dims)
        self.lib, self.slots, self.ctas, self.events = lib, dims[0], dims[1], dims[2]
        if self.events != len(EVENTS):
            raise SystemExit(f"mm_stamps: {path} records {self.events} events, this script knows {len(EVENTS)}")
        self.lib.fk_mm_stamps_read.argtypes = (ctypes.c_void_p, ctypes.c_size_t)

    def reset(self):
        status = self.lib.fk_mm_stamps_reset()
        if status:
            raise RuntimeError(f"fk_mm_stamps_reset: cudaError {status}")

    def read(self, calls):
        """int64 tensor [calls][ctas][events][ns, cycles] of the first `calls` slots."""
        n = calls * self.ctas * self.events * 2
        buf = (ctypes.c_uint64 * n)()
        status = self.lib.fk_mm_stamps_read(buf, ctypes.sizeof(buf))
        if status:
            raise RuntimeError(f"fk_mm_stamps_read: cudaError {status}")
        return torch.frombuffer(buf, dtype=torch.int64).clone().view(calls, self.ctas, self.events, 2)


def analyse(replays):
    """Per-phase and per-call figures from a list of stamp tensors [calls][ctas][events][2] (one per
    replay; CTAs that did not run are all zero). Returns (per-phase cycle lists, per-call ns lists,
    cycles per ns, smallest globaltimer step seen)."""
    phases = {name: [] for name, _, _ in PHASES}
    phases["after-wait"] = []
    calls = {"gap": [], "kernel": [], "period": []}
    cycles_sum = ns_sum = 0
    steps = set()
    for s in replays:
        ran = s[:, :, E["entry"], 0] != 0  # [calls][ctas]
        ends = torch.maximum(s[:, :, E["end"], 0], s[:, :, E["end1"], 0])
        last_end = [int(ends[i][ran[i]].max()) for i in range(s.shape[0])]
        for i in range(1, s.shape[0]):
            cta = s[i][ran[i]]  # [ctas][events][2]
            ns, cyc = cta[..., 0], cta[..., 1]
            for name, a, b in PHASES:
                phases[name] += (cyc[:, E[b]] - cyc[:, E[a]]).tolist()
            end_cyc = torch.maximum(cyc[:, E["end"]], cyc[:, E["end1"]])
            phases["after-wait"] += (end_cyc - cyc[:, E["waited"]]).tolist()
            cycles_sum += int((end_cyc - cyc[:, E["entry"]]).sum())
            ns_sum += int((torch.maximum(ns[:, E["end"]], ns[:, E["end1"]]) - ns[:, E["entry"]]).sum())
            first_wait = int(ns[:, E["waited"]].min())
            calls["gap"].append(first_wait - last_end[i - 1])
            calls["kernel"].append(last_end[i] - first_wait)
            calls["period"].append(last_end[i] - last_end[i - 1])
            values = sorted(set(ns.flatten().tolist()))
            steps.update(b - a for a, b in zip(values, values[1:]) if b > a)
    per_ns = cycles_sum / ns_sum if ns_sum else float("nan")
    return phases, calls, per_ns, (min(steps) if steps else None)


def capture(fn, sets, calls, before=None):
    """A CUDA graph of `calls` calls of fn over `sets` (warmed up first; `before` runs just before
    the capture)."""
    for inputs in sets:
        fn(*inputs)
    torch.cuda.synchronize()
    if before:
        before()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    return graph


def replay_us(graph, calls, replays):
    """Median microseconds a call over `replays` timed replays (bench's method)."""
    samples = []
    for _ in range(replays):
        bench.release_kept_l2_lines(torch.device("cuda"))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def run_size(build, stamps, size, calls, replays):
    device = torch.device("cuda")
    m, n, k = size
    make = lambda: (torch.randn(m, k, device=device, dtype=torch.bfloat16),
                    torch.randn(k, n, device=device, dtype=torch.bfloat16))
    sets = bench.input_sets(make, device, 2 * (m * k + k * n))
    with build:  # the captured launches take stamp slots 0 .. calls - 1
        graph = capture(fastkern.matmul, sets, calls, before=stamps.reset)
    got = []
    for _ in range(replays):
        bench.release_kept_l2_lines(device)
        graph.replay()
        torch.cuda.synchronize()
        got.append(stamps.read(calls))
    ours = replay_us(graph, calls, 15)
    cublas = replay_us(capture(torch.matmul, sets, calls), calls, 15)
    return ours, cublas, analyse(got)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("builds", nargs="+", help="NAME=PATH of a -DFK_MM_TIMESTAMPS=1 build's _C")
    parser.add_argument("--sizes", default="512,1000")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--replays", type=int, default=30)
    args = parser.parse_args(argv)
    builds = [Build(spec) for spec in args.builds]
    rows = []
    print(f"device: {torch.cuda.get_device_name()}, PDL {'off' if os.environ.get('FASTKERN_PDL') == '0' else 'on'}")
    for build, spec in zip(builds, args.builds):
        stamps = Stamps(spec.partition("=")[2].partition(":")[0])
        if args.calls > stamps.slots:
            raise SystemExit(f"mm_stamps: --calls {args.calls} > the build's {stamps.slots} stamp slots")
        for text in args.sizes.split(","):
            size = tuple(int(v) for v in text.split("x")) if "x" in text else (int(text),) * 3
            ours, cublas, (phases, calls, per_ns, step) = run_size(build, stamps, size, args.calls, args.replays)
            med = {k: statistics.median(v) / per_ns for k, v in phases.items()}  # ns
            per_call = {k: statistics.median(v) for k, v in calls.items()}
            print(f"\n{build.name} bf16 {text}: {ours:.2f} us a call (graph), cuBLAS {cublas:.2f} us "
                  f"({cublas / ours:.3f}x); SM clock {per_ns:.3f} GHz; globaltimer step {step} ns")
            for name in [p for p, _, _ in PHASES] + ["after-wait"]:
                v = sorted(phases[name])
                print(f"  {name:11s} {med[name]:8.0f} ns  ({statistics.median(v):7.0f} cycles, "
                      f"p90 {v[int(0.9 * (len(v) - 1))]:7.0f})")
            k_steps = -(-size[2] // 64)  # the first stage landed -> the last wgmma retired: every k-step consumed
            step = (med["k-loop"] + med["mma-tail"]) * per_ns / k_steps
            print(f"  k-step      {step:8.0f} cycles ((k-loop + mma-tail) / {k_steps}; 2 x 128^2 x 64 FLOP: "
                  f"{2 * 128 * 128 * 64 / step:.0f} FLOP a cycle)")
            for name, v in per_call.items():
                print(f"  {name:11s} {v:8.0f} ns  (per call, globaltimer)")
            rows.append((build.name, text, ours, cublas, med, per_call))
    print("\nbuild        size             us/call cuBLAS ratio | wait  issue first k-loop tail  epi drain | gap  kernel period (ns)")
    for name, size, ours, cublas, med, pc in rows:
        print(f"{name:12s} {size:16s} {ours:7.2f} {cublas:6.2f} {cublas / ours:5.3f} | {med['wait']:4.0f} "
              f"{med['to-issue']:5.0f} {med['first-load']:5.0f} {med['k-loop']:6.0f} {med['mma-tail']:4.0f} "
              f"{med['epilogue']:4.0f} {med['drain']:5.0f} | {pc['gap']:4.0f} {pc['kernel']:6.0f} {pc['period']:6.0f}")


if __name__ == "__main__":
    main()
