"""examples/train_gpt.py: a tiny CPU run of a few steps with torch's kernels and fastkern's (loss
finite and falling, the same batches and start), its JSON; fastkern.patch on its model (the fused MLP
linear, the cross-entropy), and nn.Linear under autocast."""
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

import fastkern

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"


def load():
    spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = ["--device", "cpu", "--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--block-size", "64",
        "--vocab-size", "320", "--batch-size", "4", "--steps", "12", "--warmup", "2", "--lr", "3e-3",
        "--data-mb", "1", "--log-every", "4"]


@pytest.mark.parametrize("kernels", ["torch", "fastkern"])
def test_tiny_cpu_run_learns(kernels, tmp_path):
    result = load().main(TINY + ["--kernels", kernels, "--out-dir", str(tmp_path)])
    losses = result["losses"]
    assert len(losses) == 12 and all(math.isfinite(l) for l in losses)
    assert abs(losses[0] - math.log(320)) < 0.3  # starts at the uniform guess
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0
    saved = json.loads((tmp_path / f"train-{kernels}.json").read_text())
    assert saved["losses"] == losses and saved["tokens_per_s"] > 0
    if kernels == "fastkern":
        text = json.dumps(saved["patch"])
        assert "fastkern.Linear(activation='gelu_tanh')" in text and "fastkern.CrossEntropyLoss" in text


def test_same_seed_same_start_for_both_kernels():
    train = load()
    a = train.main(TINY + ["--steps", "3", "--kernels", "torch"])["losses"]
    b = train.main(TINY + ["--steps", "3", "--kernels", "fastkern"])["losses"]
    for x, y in zip(a, b):
        assert abs(x - y) < 2e-2 * abs(x)


def test_patched_linear_follows_autocast():
    lin = torch.nn.Sequential(torch.nn.Linear(16, 32))
    fastkern.patch(lin)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", torch.bfloat16):
        y = lin(x)
        ref = torch.nn.functional.linear(x, lin[0].weight, lin[0].bias)
    assert y.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_lm_head_logits_take_their_own_gradient(monkeypatch):
    """The script's LM head gives (B * T, vocab) logits no one else holds: fastkern's cross-entropy
    backward writes dlogits over them (the one call that bumps their version), with and without
    bf16 autocast."""
    train = load()
    bumped = []
    real = torch.autograd.graph.increment_version
    monkeypatch.setattr(torch.autograd.graph, "increment_version", lambda t: (bumped.append(t.shape), real(t)))
    model = train.GPT(320, 64, 2, 64, 4)
    fastkern.patch(model)
    x = torch.randint(0, 320, (2, 64))
    for amp in (False, True):
        with torch.autocast("cpu", torch.bfloat16, enabled=amp):
            _, loss = model(x, x)
        assert loss.dtype == torch.float32
        loss.backward()
    assert bumped == [torch.Size([128, 320])] * 2


@pytest.mark.parametrize("dist", ["ddp", "fsdp"])
def test_two_cpu_ranks_under_torchrun(dist, tmp_path):
    """--dist ddp / fsdp (FSDP2's fully_shard) on two CPU ranks (gloo) with fastkern's kernels: the
    run finishes, the loss falls, and both wrappers give the same curve (the same data and init)."""
    import os
    import shutil
    import subprocess
    import sys
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("no torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(SCRIPT.parent.parent / "python"), os.environ.get("PYTHONPATH", "")]))
    args = list(TINY)
    args[args.index("--steps") + 1] = "6"
    out = subprocess.run([torchrun, "--nproc-per-node", "2", str(SCRIPT), "--dist", dist, "--kernels", "fastkern",
                          "--out-dir", str(tmp_path), *args], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = json.loads((tmp_path / f"train-fastkern-{dist}.json").read_text())["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3
    test_two_cpu_ranks_under_torchrun.curves[dist] = losses
    if len(test_two_cpu_ranks_under_torchrun.curves) == 2:
        ddp, fsdp = test_two_cpu_ranks_under_torchrun.curves.values()
        for a, b in zip(ddp, fsdp):
            assert abs(a - b) < 1e-3 * abs(a)


test_two_cpu_ranks_under_torchrun.curves = {}
