"""Train a GPT-2-style language model on the Python standard library's own source, with torch's
kernels or fastkern's.

    python examples/train_gpt.py --kernels fastkern --compile --steps 200
    torchrun --nproc-per-node 2 examples/train_gpt.py --dist fsdp --kernels fastkern
    python examples/train_gpt.py --n-layer 2 --n-embd 64 --n-head 4 --block-size 64 --batch-size 4 \\
        --steps 10 --device cpu                                                      # a smoke run

The model is GPT-2 small by default (12 layers, 768 wide, 12 heads, context 1024, vocabulary 50257),
written with plain torch modules: nn.Embedding, nn.LayerNorm, nn.MultiheadAttention (causal, no
weights returned: torch runs it as SDPA), an MLP of nn.Sequential(Linear, GELU(tanh), Linear), a
tied LM head and nn.CrossEntropyLoss. `--kernels fastkern` hands the model to fastkern.patch, which
swaps in fastkern's modules (fused linear + GELU, cross-entropy whose backward writes the logits'
gradient over the logits, attention once fastkern has it) and prints what it changed.

Text: every .py file under the running Python's standard library (sysconfig's "stdlib" path),
read as UTF-8 bytes, so it exists offline on every machine. Tokens are those bytes (0-255): no
tokenizer to download. The vocabulary stays GPT-2's 50257 by default (--vocab-size) so the LM head
and the cross-entropy have GPT-2's shapes and cost; ids above 255 never occur in the data, and the
loss starts near ln(50257) = 10.8 and falls fast towards byte-level entropy (~1-2 nats).
bf16 autocast on CUDA (--amp), AdamW (fused on CUDA), linear warm-up then cosine decay.
Output: a progress line (loss, tokens/s, peak memory), and with --out-dir a JSON of the run and a
loss-curve PNG (when matplotlib is importable).
Distributed: run under torchrun with --dist ddp (DistributedDataParallel) or --dist fsdp (FSDP2's
fully_shard on each block, then the root); each rank draws its own batches, --batch-size is per rank.
"""
import argparse
import glob
import json
import math
import os
import sys
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---- model ------------------------------------------------------------------------------------------

class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, dropout=0.0, batch_first=True)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x, causal_mask):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=causal_mask, need_weights=False, is_causal=True)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=50257, block_size=1024, n_layer=12, n_embd=768, n_head=12):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2
        self.loss_fn = nn.CrossEntropyLoss()
        self.register_buffer("causal_mask", torch.ones(block_size, block_size, dtype=torch.bool).triu(1),
                             persistent=False)
        self.apply(self._init)
        for block in self.blocks:  # GPT-2's scaled init of the residual projections
            for proj in (block.attn.out_proj.weight, block.mlp[2].weight):
                nn.init.normal_(proj, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
        if isinstance(m, nn.MultiheadAttention):
            nn.init.normal_(m.in_proj_weight, std=0.02)
            nn.init.zeros_(m.in_proj_bias)

    def forward(self, idx, targets=None):
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        mask = self.causal_mask[:t, :t]
        for block in self.blocks:
            x = block(x, mask)
        x = self.ln_f(x)
        # (b * t, vocab) straight from the head: no view of the logits is kept, so fastkern's
        # cross-entropy may write their gradient over them
        logits = self.lm_head(x.reshape(b * t, -1))
        if targets is None:
            return logits.view(b, t, -1), None
        return None, self.loss_fn(logits, targets.reshape(-1))


# ---- data -------------------------------------------------------------------------------------------

def stdlib_bytes(limit_mb):
    """The standard library's .py files, concatenated as bytes (sorted paths: the same corpus on
    every run of one Python), up to limit_mb MiB."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        if "site-packages" in path:
            continue
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= limit_mb * 2**20:
            break
    if total == 0:
        raise RuntimeError(f"no .py files under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


class Batches:
    """Random (B, T) windows of the token stream and their next-token targets, from a generator of
    its own (the same batches for the same seed, whichever kernels run)."""

    def __init__(self, tokens, batch_size, block_size, seed, device):
        self.tokens, self.b, self.t, self.device = tokens, batch_size, block_size, device
        self.gen = torch.Generator().manual_seed(seed)

    def next(self):
        starts = torch.randint(0, len(self.tokens) - self.t - 1, (self.b,), generator=self.gen)
        rows = torch.stack([self.tokens[s:s + self.t + 1] for s in starts.tolist()])
        rows = rows.to(self.device, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]


# ---- training ---------------------------------------------------------------------------------------

def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def progress(step, total, text, width=30):
    done = int(width * step / max(total, 1))
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} {text}")
    sys.stderr.flush()


def setup_dist(kind, device):
    """(rank, world, device) after init_process_group under torchrun, or (0, 1, device)."""
    if kind == "none":
        return 0, 1, device
    import torch.distributed as dist
    if "RANK" not in os.environ:
        raise SystemExit(f"--dist {kind} needs torchrun (RANK / WORLD_SIZE / LOCAL_RANK unset)")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def wrap_dist(model, kind, device):
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if kind == "fsdp":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh
        # The mesh names the device type: left to itself, FSDP2 picks CUDA whenever a GPU exists,
        # also for CPU ranks (and then sets an ordinal that may not exist).
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", choices=["torch", "fastkern"], default="torch")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--dist", choices=["none", "ddp", "fsdp"], default="none", help="under torchrun")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=50257, help=">= 256 (byte tokens)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step and rank")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr", type=float, default=6e-5)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--amp", choices=["auto", "bf16", "off"], default="auto",
                   help="bf16 autocast (auto: on CUDA, off on the CPU)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--data-mb", type=float, default=32, help="MiB of stdlib source to read")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out-dir", default=None, help="write train.json and loss.png here")
    p.add_argument("--patch", default="", help="fastkern.patch keywords to turn off, e.g. linear,attention")
    args = p.parse_args(argv)
    if args.vocab_size < 256:
        p.error("--vocab-size must be >= 256: tokens are bytes")
    return args


def main(argv=None):
    args = parse(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rank, world, device = setup_dist(args.dist, device)
    amp = args.amp == "bf16" or (args.amp == "auto" and device.type == "cuda")
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    model = GPT(args.vocab_size, args.block_size, args.n_layer, args.n_embd, args.n_head).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    report = None
    if args.kernels == "fastkern":
        import fastkern
        off = {k.strip(): False for k in args.patch.split(",") if k.strip()}
        report = fastkern.patch(model, **off)
        if rank == 0:
            print(report, file=sys.stderr)
    model = wrap_dist(model, args.dist, device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    step_fn = torch.compile(model) if args.compile else model

    tokens = stdlib_bytes(args.data_mb)
    batches = Batches(tokens, args.batch_size, args.block_size, args.seed + rank, device)
    tokens_per_step = args.batch_size * args.block_size * world
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    log, losses, timed_tokens, timed_s = [], [], 0, 0.0
    skip = min(3, args.steps - 1)  # warm-up steps (compilation, allocator) left out of tokens/s
    for step in range(args.steps):
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = batches.next()
        with torch.autocast(device.type, torch.bfloat16, enabled=amp):
            _, loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach().float()
        if world > 1:
            import torch.distributed as dist
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        loss = loss.item()  # also waits for the GPU: the step's time is complete
        dt = time.perf_counter() - t0
        if step >= skip:
            timed_tokens, timed_s = timed_tokens + tokens_per_step, timed_s + dt
        losses.append(loss)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        tps = timed_tokens / timed_s if timed_s else tokens_per_step / dt
        if step % args.log_every == 0 or step == args.steps - 1:
            log.append({"step": step, "loss": loss, "tokens_per_s": tps, "peak_gib": peak})
        if rank == 0:
            progress(step + 1, args.steps, f"loss {loss:.4f}  {tps / 1e3:.1f}k tok/s  peak {peak:.2f} GiB")
        if not math.isfinite(loss):
            raise SystemExit(f"\nloss is {loss} at step {step}")
    result = {
        "args": vars(args), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "world": world, "params": n_params, "amp_bf16": amp,
        "tokens_per_step": tokens_per_step, "tokens_per_s": timed_tokens / timed_s if timed_s else None,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "losses": losses, "log": log, "patch": report.as_dict() if report else None,
        "data": {"tokens": len(tokens), "tokenizer": "bytes (ids 0-255) in a vocabulary of "
                 f"{args.vocab_size}"},
    }
    if rank == 0:
        sys.stderr.write("\n")
        print(json.dumps({k: result[k] for k in ("device", "world", "tokens_per_s", "peak_gib")}
                         | {"final_loss": losses[-1]}))
        if args.out_dir:
            write_outputs(result, args.out_dir)
    if args.dist != "none":
        import torch.distributed as dist
        dist.barrier()  # no rank tears its connections down while another still uses them (gloo aborts)
        dist.destroy_process_group()
    return result


def write_outputs(result, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    a = result["args"]
    tag = f"{a['kernels']}{'-compile' if a['compile'] else ''}{'' if a['dist'] == 'none' else '-' + a['dist']}"
    with open(os.path.join(out_dir, f"train-{tag}.json"), "w") as f:
        json.dump(result, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no loss-curve PNG", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(len(result["losses"])), result["losses"], label=tag)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(f"GPT ({result['params'] / 1e6:.0f}M params) on stdlib bytes, {result['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"loss-{tag}.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    result = main()
    if result["world"] > 1:
        # Under torchrun, leave without the interpreter's teardown: after destroy_process_group, a
        # rank still aborted there now and then ("terminate called without an active exception",
        # SIGABRT; gloo on the CPU, once in ~12 runs of the test), a torch shutdown race, not the training.
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
