"""fastkern quickstart: checks and times every fastkern op against torch and torch.compile on the
device at hand, and prints a table. Run with `make demo`."""
import time

import torch
import torch.nn.functional as F

import fastkern
from fastkern import bench

device = torch.device("cuda" if fastkern.cuda_available() and torch.cuda.is_available() else "cpu")
info = fastkern.BUILD_INFO
print(f"fastkern {fastkern.__version__}: CUDA compiled in: {info['cuda']} ({info['archs'] or 'none'}); "
      f"devices: {[d[0] for d in info['devices']] or 'none'}; running on {device}")

# 1. correctness: outputs and gradients against float64 references
checks = []


def relative_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


for dtype in ([torch.float32, torch.bfloat16] if device.type == "cuda" else [torch.float32, torch.float64]):
    x = torch.randn(256, 1024, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(1024, device=device, dtype=dtype, requires_grad=True)
    y = fastkern.gelu(x, approximate="tanh", bias=b)
    y.sum().backward()
    xr, br = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    yr = F.gelu(xr + br, approximate="tanh")
    yr.sum().backward()
    checks.append((f"gelu+bias {str(dtype)[6:]}", relative_error(y, yr), relative_error(x.grad, xr.grad)))

    s = torch.randn(8, 128, 128, device=device, dtype=dtype, requires_grad=True)
    p = fastkern.softmax(s, scale=0.125, causal=True)
    g = torch.randn_like(p)
    p.backward(g)
    sr = s.detach().double().requires_grad_()
    mask = torch.ones(128, 128, dtype=torch.bool, device=device).triu(1)
    pr = torch.softmax((sr * 0.125).masked_fill(mask, float("-inf")), -1)
    pr.backward(g.double())
    checks.append((f"causal softmax {str(dtype)[6:]}", relative_error(p, pr), relative_error(s.grad, sr.grad)))

print(f"\n{'check':28s} {'output rel err':>15s} {'grad rel err':>13s}")
for name, e_out, e_grad in checks:
    print(f"{name:28s} {e_out:15.2e} {e_grad:13.2e}")

# 2. a model with torch modules swapped for fastkern's, eager and compiled
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(approximate="tanh"),
                            torch.nn.Linear(256, 64), torch.nn.LogSoftmax(dim=-1)).to(device)
x = torch.randn(32, 64, device=device)
before = model(x)
fastkern.nn.swap_modules(model)
compiled = torch.compile(model, fullgraph=True)
print(f"\nswapped model: {model}\nmax |eager - torch| = {(model(x) - before).abs().max().item():.2e}, "
      f"max |compiled - eager| = {(compiled(x) - model(x)).abs().max().item():.2e}")

# 3. timings against torch eager and torch.compile
t0 = time.time()
report = bench.run(list(bench.SUITES), device, quick=True)  # small sizes: a demo, not the record
print()
print(bench.format_table(report))
print(f"({time.time() - t0:.0f} s at demo sizes; the full suites: python -m fastkern.bench all --out results.json)")
