"""Per-row error tails: `python benchmarks/row_tails.py [--rows R] [--lengths N ...] [--fp32-only]`.

The tests hold a tensor's error to at most 2x torch's own (plus a small epsilon), and a one-row call
faces that rule alone. This draws R rows of each length (x ~ 4 N(0, 1), dy ~ N(0, 1)), runs
fastkern, torch and float64 torch on the whole batch (the kernels take rows independently), and
prints, for the output and the gradient, the worst row's error as a fraction of its own bound, the
99.9th percentile, and how many rows are over it (> 1). `same` counts 20 rows whose one-row calls
equal the batch's rows bit for bit (rows whose 16-byte frames start elsewhere in a one-row call
sum in another order). The worst rows are saved to $OUT/worst.pt where OUT is set.
"""
import argparse
import os
import sys

import torch

import fastkern

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from conftest import error_eps, row_errors  # noqa: E402


def tails(rows, n, dtype, log):
    torch_fn = torch.log_softmax if log else torch.softmax
    ours_fn = fastkern.log_softmax if log else fastkern.softmax
    x = (torch.randn(rows, n, device="cuda") * 4).to(dtype).requires_grad_(True)
    g = torch.randn(rows, n, device="cuda").to(dtype)
    y = ours_fn(x, -1)
    (dx,) = torch.autograd.grad(y, x, g)
    tx = x.detach().requires_grad_(True)
    ty = torch_fn(tx, -1)
    (tdx,) = torch.autograd.grad(ty, tx, g)
    rx = x.detach().double().requires_grad_(True)
    ry = torch_fn(rx, -1)
    (rdx,) = torch.autograd.grad(ry, rx, g.double())
    eps = error_eps(dtype, n)
    ratios = {what: row_errors(o, r.detach()) / (2 * row_errors(t, r.detach()) + eps)
              for what, o, t, r in (("out", y, ty, ry), ("grad", dx, tdx, rdx))}
    same = 0
    for i in range(20):
        xi = x[i:i + 1].detach().requires_grad_(True)
        yi = ours_fn(xi, -1)
        (dxi,) = torch.autograd.grad(yi, xi, g[i:i + 1])
        same += int(torch.equal(yi, y[i:i + 1]) and torch.equal(dxi, dx[i:i + 1]))
    return x.detach(), g, ratios, same


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--lengths", type=int, nargs="*",
                        default=[2, 31, 32, 33, 64, 96, 127, 128, 197, 257, 1000, 4096])
    parser.add_argument("--fp32-only", action="store_true")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    print(torch.cuda.get_device_name())
    print(f"{'case':24s} {'out max':>8s} {'>1':>5s} {'grad max':>9s} {'p99.9':>7s} {'>1':>5s} same")
    worst = {}
    dtypes = [torch.float32] if args.fp32_only else [torch.float32, torch.bfloat16, torch.float16]
    for dtype in dtypes:
        for n in args.lengths:
            for log in (False, True):
                x, g, ratios, same = tails(args.rows, n, dtype, log)
                out, grad = ratios["out"], ratios["grad"]
                name = f"{str(dtype)[6:]} {n} {'log' if log else 'softmax'}"
                print(f"{name:24s} {out.max().item():8.3f} {int((out > 1).sum()):5d} {grad.max().item():9.3f} "
                      f"{grad.quantile(0.999).item():7.3f} {int((grad > 1).sum()):5d} {same}/20", flush=True)
                i = int(grad.argmax())
                worst[name] = (x[i].cpu(), g[i].cpu(), grad[i].item())
    if os.environ.get("OUT"):
        torch.save(worst, os.path.join(os.environ["OUT"], "worst.pt"))


if __name__ == "__main__":
    main()
