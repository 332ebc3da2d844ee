"""fastkern quickstart (`make demo`): checks every op against float64, swaps fastkern into a small
model (eager and torch.compile), and times one case per op and direction against torch eager and
torch.compile on the device at hand. A minute or two: one torch.compile per timed case, at one
shape each. The full benchmark suites: python -m fastkern.bench all --out results.json"""
import time

import torch
import torch.nn.functional as F

import fastkern
from fastkern import bench

start = time.time()
device = torch.device("cuda" if fastkern.cuda_available() and torch.cuda.is_available() else "cpu")
info = fastkern.BUILD_INFO
print(f"fastkern {fastkern.__version__}, torch {torch.__version__}: CUDA compiled in: {info['cuda']} "
      f"({info['archs'] or 'none'}); running on "
      f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
torch.manual_seed(0)


# ---- 1. every op against float64: fastkern's error next to torch's own in the same dtype ---------

def rel_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def masked(x, scale, causal):
    """The unfused reference for scale + causal: -inf above the diagonal."""
    x = x * scale
    if causal:
        x = x.masked_fill(torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    return x


# name, fastkern function, the torch function it replaces (also run in float64), input shape
OPS = [
    ("gelu", fastkern.gelu, F.gelu, (256, 1000)),
    ("gelu tanh + bias", lambda x, b: fastkern.gelu(x, approximate="tanh", bias=b),
     lambda x, b: F.gelu(x + b, approximate="tanh"), (256, 1000)),
    ("softmax", lambda x: fastkern.softmax(x, -1), lambda x: torch.softmax(x, -1), (256, 1000)),
    ("log_softmax dim=1", lambda x: fastkern.log_softmax(x, 1), lambda x: torch.log_softmax(x, 1), (8, 300, 33)),
    ("softmax scale+causal", lambda x: fastkern.softmax(x, -1, scale=0.125, causal=True),
     lambda x: torch.softmax(masked(x, 0.125, True), -1), (4, 128, 128)),
    ("linear + bias + gelu", lambda x, w, b: fastkern.linear(x, w, b, activation="gelu_tanh"),
     lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"), (256, 1000)),
]


dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if device.type == "cuda" else [])
lines, all_ok = [], True
for name, ours, theirs, shape in OPS:
    for dtype in dtypes:
        inputs = [torch.randn(shape, device=device, dtype=dtype) * 3]
        if name.startswith("linear"):  # x (256, 1000) @ w (384, 1000)^T + b
            inputs += [torch.randn(384, shape[-1], device=device, dtype=dtype) * shape[-1] ** -0.5,
                       torch.randn(384, device=device, dtype=dtype)]
        elif "bias" in name:
            inputs.append(torch.randn(shape[-1], device=device, dtype=dtype))
        g = torch.randn(theirs(*inputs).shape, device=device, dtype=dtype)
        results = []  # (output, gradients) of fastkern, torch, torch in float64
        for fn, xs in ((ours, inputs), (theirs, inputs), (theirs, [t.double() for t in inputs])):
            xs = [t.detach().requires_grad_() for t in xs]
            y = fn(*xs)
            y.backward(g.to(y.dtype))
            results.append((y, [t.grad for t in xs]))
        (y, grads), (ty, tgrads), (ry, rgrads) = results
        # the gradient shown is the input's (x, or bias) whose error is furthest from torch's
        grad = max(((rel_error(a, r), rel_error(t, r)) for a, t, r in zip(grads, tgrads, rgrads)),
                   key=lambda e: e[0] / max(e[1], 1e-30))
        errs = [rel_error(y, ry), rel_error(ty, ry), *grad]
        eps = 1e-7 if dtype == torch.float32 else 1e-5  # the tests' epsilon (tests/conftest.py)
        ok = errs[0] <= 2 * errs[1] + eps and errs[2] <= 2 * errs[3] + eps
        all_ok &= ok
        lines.append(f"{name:22s} {str(dtype)[6:]:9s} {errs[0]:9.1e} {errs[1]:9.1e} {errs[2]:9.1e} "
                     f"{errs[3]:9.1e}  {'ok' if ok else 'OVER 2x TORCH'}")
print("\nerrors against float64 (relative, whole tensor), fastkern next to torch in the same dtype")
print(f"{'op':22s} {'dtype':9s} {'out':>9s} {'torch':>9s} {'grad':>9s} {'torch':>9s}  within 2x torch")
print("\n".join(lines))

# ---- 2. a model with torch modules swapped for fastkern's, eager and compiled --------------------

model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(approximate="tanh"),
                            torch.nn.Linear(256, 64), torch.nn.LogSoftmax(dim=-1)).to(device)
x = torch.randn(32, 64, device=device)
before = model(x)
fastkern.nn.swap_modules(model)
compiled_model = torch.compile(model, fullgraph=True)
print(f"\nswapped model: {' -> '.join(type(m).__module__.split('.')[0] + '.' + type(m).__name__ for m in model)}"
      f"\nmax |swapped - torch| = {(model(x) - before).abs().max().item():.1e}, "
      f"max |compiled - eager| = {(compiled_model(x) - model(x)).abs().max().item():.1e}")

# ---- 3. one case per op and direction against torch eager and torch.compile ----------------------

dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
big = device.type == "cuda"
n = 1 << (24 if big else 20)
rows, cols = (8192, 4096) if big else (1024, 1024)
heads, seq = (16, 2048) if big else (4, 512)
size = dtype.itemsize


def randn(*shape):
    return torch.randn(*shape, device=device, dtype=dtype)


def softmax_bwd_inputs():
    """(dy, what fastkern's autograd saves: x and the row max on CUDA, y and None on the CPU, torch's y)"""
    x = randn(rows, cols) * 3
    saved = fastkern.ops.softmax._saved(x, torch.ops.fastkern.softmax.default(x, -1, 1.0, False, False))
    return torch.randn_like(x), *saved, torch.softmax(x, -1)


def bias_gelu_inputs():
    return randn(rows, cols).requires_grad_(), randn(cols).requires_grad_(), randn(rows, cols)


def bias_gelu_step(f):
    return lambda x, b, g: torch.autograd.grad(f(x, b), (x, b), g)


def compiled(f):
    return torch.compile(f, dynamic=False)  # compiled at its first call, for that one shape


causal_unfused = lambda x: torch.softmax(masked(x, 0.125, True), -1)  # noqa: E731
bias_gelu = lambda x, b: F.gelu(x + b, approximate="tanh")  # noqa: E731
linear_gelu = lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh")  # noqa: E731
mm = (4096, 4096) if big else (512, 512)  # x (mm[0], mm[1]) @ w (mm[1], mm[1])^T
# name, bytes the op must move, make_inputs, fastkern, torch eager, torch.compile (made when timed)
CASES = [
    (f"gelu tanh fwd ({n})", 2 * n * size, lambda: (randn(n),),
     lambda x: fastkern.gelu(x, approximate="tanh"), lambda x: F.gelu(x, approximate="tanh"),
     lambda: compiled(lambda x: F.gelu(x, approximate="tanh"))),
    (f"gelu tanh bwd ({n})", 3 * n * size, lambda: (randn(n), randn(n)),
     lambda g, x: torch.ops.fastkern.gelu_backward.default(g, x, None, "tanh", False),
     lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
     lambda: compiled(bench.gelu_tanh_manual_grad)),
    (f"bias+gelu fwd+bwd ({rows},{cols})", 5 * rows * cols * size, bias_gelu_inputs,
     bias_gelu_step(lambda x, b: fastkern.gelu(x, approximate="tanh", bias=b)), bias_gelu_step(bias_gelu),
     lambda: bias_gelu_step(compiled(bias_gelu))),
    (f"softmax fwd ({rows},{cols})", 2 * rows * cols * size, lambda: (randn(rows, cols) * 3,),
     lambda x: fastkern.softmax(x, -1), lambda x: torch.softmax(x, -1),
     lambda: compiled(lambda x: torch.softmax(x, -1))),
    (f"softmax bwd ({rows},{cols})", 3 * rows * cols * size, softmax_bwd_inputs,
     lambda g, s, m, y: torch.ops.fastkern.softmax_backward.default(g, s, m, -1, 1.0, False, False),
     lambda g, s, m, y: torch._softmax_backward_data(g, y, -1, y.dtype),
     lambda: (lambda f: lambda g, s, m, y: f(g, y))(compiled(bench.softmax_backward_from_output))),
    (f"softmax scale+causal fwd (1,{heads},{seq},{seq})", 2 * heads * seq * seq * size,
     lambda: (randn(1, heads, seq, seq) * 3,), lambda x: fastkern.softmax(x, -1, scale=0.125, causal=True),
     causal_unfused, lambda: compiled(causal_unfused)),
    (f"linear+bias+gelu fwd ({mm[0]},{mm[1]})x({mm[1]},{mm[1]})^T", (2 * mm[0] + mm[1]) * mm[1] * size,
     lambda: (randn(*mm), randn(mm[1], mm[1]) * mm[1] ** -0.5, randn(mm[1])),
     lambda x, w, b: fastkern.linear(x, w, b, activation="gelu_tanh"), linear_gelu,
     lambda: compiled(linear_gelu)),
]

print(f"\ntimes in {str(dtype)[6:]} on {device.type}: ms per call (median of 5"
      f"{', CUDA-graph replays' if big else ''}); x peer = peer's time / fastkern's (> 1: fastkern faster)")
print(f"{'case':40s} {'fastkern ms':>11s} {'GB/s':>7s} {'x torch':>8s} {'x compile':>10s} {'compile s':>10s}")
t_timing = time.time()
for name, nbytes, make_inputs, ours, eager, make_compiled in CASES:
    sets = bench.input_sets(make_inputs, device, nbytes)
    t0 = time.time()
    peer = make_compiled()
    peer(*sets[0])  # compiles here
    compile_s = time.time() - t0
    ms = [bench.time_ms(fn, sets, device, repeats=5)[0] for fn in (ours, eager, peer)]
    print(f"{name:40s} {ms[0]:11.4g} {nbytes / ms[0] / 1e6:7.3g} {ms[1] / ms[0]:7.3g}x {ms[2] / ms[0]:9.3g}x "
          f"{compile_s:10.1f}")
    del sets
print(f"\n{'all checks within 2x torch' if all_ok else 'SOME CHECKS OVER 2x TORCH'}; "
      f"{time.time() - start:.0f} s in all, {time.time() - t_timing:.0f} s of it timing (torch.compile "
      f"included). The full suites: python -m fastkern.bench all --out results.json")
