"""`python -m fastkern.bench train [--quick] [--models gpt,hf] [--steps N] [--out FILE]`: the
end-to-end training step, torch against fastkern, in one process.

Models: examples/train_gpt.py's GPT (GPT-2 small: 12 x 768, 12 heads, context 1024, vocabulary
50257; B 16, T 1024) and, when transformers is importable, its GPT2LMHeadModel with GPT-2 small's
config, random init (B 8, T 1024). Each runs four ways: torch eager, torch.compile, fastkern eager
(fastkern.patch) and fastkern + torch.compile. A step is bf16 autocast forward, backward, gradient
clipping and a fused AdamW step, on random token ids (the speed does not depend on the text). Each
way starts from the same seed, runs `--warmup` steps untimed (compilation, allocator), then times
`--steps` steps with the GPU synchronized once at the end; tokens/s = B x T x steps / time. Peak
memory is torch.cuda.max_memory_allocated over the timed steps, parameters and optimizer state
included. `--patch-off linear` (comma list) passes those keywords as False to fastkern.patch, e.g. to
see the step without fastkern's matmul. --quick: a tiny model (CPU works) for a smoke run.
"""
import argparse
import datetime
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

import fastkern

WAYS = [("torch", False), ("torch", True), ("fastkern", False), ("fastkern", True)]


def _train_gpt():
    path = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
    if not path.exists():
        raise SystemExit(f"fastkern.bench train: {path} not found (run from a source checkout)")
    spec = importlib.util.spec_from_file_location("train_gpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _models(names, quick):
    """{name: (make_model(), batch, seq, vocab, forward(model, ids) -> loss)}."""
    out = {}
    if "gpt" in names:
        train = _train_gpt()
        cfg = dict(vocab_size=50257, block_size=1024, n_layer=12, n_embd=768, n_head=12)
        batch, seq = 16, 1024
        if quick:
            cfg, batch, seq = dict(vocab_size=50257, block_size=128, n_layer=2, n_embd=128, n_head=4), 4, 128
        out["train_gpt.py GPT"] = (lambda cfg=cfg: train.GPT(**cfg), batch, seq, cfg["vocab_size"],
                                   lambda m, ids: m(ids[:, :-1], ids[:, 1:])[1])
    if "hf" in names:
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError:
            print("fastkern.bench train: transformers is not importable: its GPT-2 is skipped", file=sys.stderr)
        else:
            cfg = dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
            batch, seq = 8, 1024
            if quick:
                cfg, batch, seq = dict(n_layer=2, n_embd=128, n_head=4, n_positions=128, vocab_size=50257), 4, 128
            out["transformers GPT2LMHeadModel"] = (
                lambda cfg=cfg: GPT2LMHeadModel(GPT2Config(**cfg, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
                batch, seq, cfg["vocab_size"], lambda m, ids: m(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss)
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_way(make, batch, seq, vocab, forward, kernels, compiled, device, steps, warmup, patch_off):
    """{tokens_per_s, peak_gib, ms_per_step, loss, patch} of one way to train one model."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make().to(device).train()
    report = None
    if kernels == "fastkern":
        report = fastkern.patch(model, **{k: False for k in patch_off})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    step_model = torch.compile(model) if compiled else model
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = [torch.randint(0, min(vocab, 50257), (batch, seq + 1), generator=gen).to(device) for _ in range(4)]
    amp = device.type == "cuda"

    def step(i):
        with torch.autocast(device.type, torch.bfloat16, enabled=amp):
            loss = forward(step_model, ids[i % len(ids)])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for i in range(warmup):
        step(i)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for i in range(steps):
        loss = step(i)
    _sync(device)
    seconds = time.perf_counter() - t0
    result = {"tokens_per_s": round(batch * seq * steps / seconds, 1), "ms_per_step": round(1e3 * seconds / steps, 2),
              "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None,
              "loss": round(loss.item(), 4), "patch": report.as_dict() if report else None}
    del model, opt, step_model, ids
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def run(models=("gpt", "hf"), device=None, quick=False, steps=None, warmup=None, patch_off=()):
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    steps = steps or (3 if quick or device.type == "cpu" else 20)
    warmup = warmup or (2 if quick or device.type == "cpu" else 5)
    report = {"suite": "train", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "fastkern": fastkern.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "steps": steps, "warmup": warmup, "patch_off": list(patch_off), "cases": []}
    for name, (make, batch, seq, vocab, forward) in _models(models, quick).items():
        case = {"model": name, "batch": batch, "seq": seq, "ways": {}}
        for kernels, compiled in WAYS:
            way = kernels + (" + compile" if compiled else "")
            print(f"fastkern.bench train: {name} {way} ...", file=sys.stderr, flush=True)
            try:
                case["ways"][way] = run_way(make, batch, seq, vocab, forward, kernels, compiled, device, steps, warmup,
                                            patch_off)
            except Exception as e:  # noqa: BLE001 - one way failing must not lose the others
                case["ways"][way] = {"error": f"{type(e).__name__}: {e}"}
        t = {w: r.get("tokens_per_s") for w, r in case["ways"].items()}
        if t.get("torch") and t.get("torch + compile"):
            case["ratios"] = {
                "fastkern eager / torch eager": _ratio(t.get("fastkern"), t["torch"]),
                "fastkern eager / torch.compile": _ratio(t.get("fastkern"), t["torch + compile"]),
                "fastkern + compile / torch.compile": _ratio(t.get("fastkern + compile"), t["torch + compile"]),
            }
        report["cases"].append(case)
    return report


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def format_table(report):
    lines = [f"device: {report['device']}   torch {report['torch']}   "
             f"{report['steps']} timed steps after {report['warmup']}",
             f"{'model':30s} {'way':20s} {'tokens/s':>10s} {'ms/step':>9s} {'peak GiB':>9s} {'loss':>8s}"]
    for case in report["cases"]:
        for way, r in case["ways"].items():
            if "error" in r:
                lines.append(f"{case['model']:30s} {way:20s} error: {r['error'][:80]}")
                continue
            peak = f"{r['peak_gib']:9.2f}" if r["peak_gib"] is not None else f"{'-':>9s}"
            lines.append(f"{case['model']:30s} {way:20s} {r['tokens_per_s']:10.0f} {r['ms_per_step']:9.1f} {peak} "
                         f"{r['loss']:8.4f}")
        for k, v in case.get("ratios", {}).items():
            lines.append(f"{'':30s} {k}: {v}x")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fastkern.bench train", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt,hf", help="comma list of gpt (examples/train_gpt.py), hf (transformers)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--quick", action="store_true", help="a tiny model, a few steps (a smoke run; CPU works)")
    p.add_argument("--steps", type=int, help="timed steps (default 20; --quick / CPU: 3)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 5; --quick / CPU: 2)")
    p.add_argument("--patch-off", default="", help="fastkern.patch keywords set False, e.g. linear,attention")
    p.add_argument("--out", help="write the JSON report here")
    args = p.parse_args(argv)
    report = run([m.strip() for m in args.models.split(",")], args.device, args.quick, args.steps, args.warmup,
                 [k.strip() for k in args.patch_off.split(",") if k.strip()])
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(format_table(report))
    return report
