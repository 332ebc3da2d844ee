"""fastkern.patch: torch modules, transformers' classes (small stand-ins named and placed like
transformers' own when it is not installed; the real models when it is), the report, numbers and
gradients against the unpatched model, compile."""
import copy
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import fastkern
from conftest import DEVICES

HAVE_TRANSFORMERS = False
try:
    import transformers  # noqa: F401
    HAVE_TRANSFORMERS = True
except ImportError:
    pass
needs_transformers = pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed")


# ---- stand-ins for the transformers classes patch.py knows, by name and module ------------------------

def _fake_transformers():
    """A module tree shaped like transformers' where patch.py looks: AttentionInterface /
    AttentionMaskInterface registries, masking_utils.sdpa_mask, the GELU classes, Conv1D and a tiny
    GPT-2 (MLP with Conv1D + NewGELUActivation, attention through the registry, a loss_function)."""
    tf = types.ModuleType("transformers")
    masking = types.ModuleType("transformers.masking_utils")

    class Registry:
        def __init__(self):
            self.functions = {}

        def register(self, name, fn):
            self.functions[name] = fn

        def __getitem__(self, name):
            return self.functions[name]

    tf.AttentionInterface, tf.AttentionMaskInterface = Registry(), Registry()
    masking.sdpa_mask = lambda *a, **k: None
    tf.masking_utils = masking

    def cls(name, module, base=torch.nn.Module, **body):
        return type(name, (base,), {"__module__": module, **body})

    act = "transformers.activations"
    tf.NewGELUActivation = cls("NewGELUActivation", act, forward=lambda self, x: 0.5 * x * (
        1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))))
    tf.GELUActivation = cls("GELUActivation", act, forward=lambda self, x: F.gelu(x))
    tf.QuickGELUActivation = cls("QuickGELUActivation", act, forward=lambda self, x: x * torch.sigmoid(1.702 * x))

    def conv_init(self, nf, nx):
        torch.nn.Module.__init__(self)
        self.nf, self.nx = nf, nx
        self.weight = torch.nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = torch.nn.Parameter(torch.randn(nf) * 0.1)

    def conv_forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], self.nf)
    tf.Conv1D = cls("Conv1D", "transformers.pytorch_utils", __init__=conv_init, forward=conv_forward)

    gpt2 = "transformers.models.gpt2.modeling_gpt2"

    def mlp_init(self, d):
        torch.nn.Module.__init__(self)
        self.c_fc, self.c_proj, self.act = tf.Conv1D(4 * d, d), tf.Conv1D(d, 4 * d), tf.NewGELUActivation()
        self.dropout = torch.nn.Dropout(0.0)

    tf.GPT2MLP = cls("GPT2MLP", gpt2, __init__=mlp_init,
                     forward=lambda self, x: self.dropout(self.c_proj(self.act(self.c_fc(x)))))

    def attn_init(self, config):
        torch.nn.Module.__init__(self)
        self.config, d = config, config.n_embd
        self.c_attn, self.c_proj, self.is_causal = tf.Conv1D(3 * d, d), tf.Conv1D(d, d), True

    def attn_forward(self, x):
        b, s, d = x.shape
        h = self.config.n_head
        q, k, v = (t.view(b, s, h, d // h).transpose(1, 2) for t in self.c_attn(x).split(d, dim=-1))
        if self.config._attn_implementation == "eager":
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // h)
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
            out = (torch.softmax(scores, -1) @ v).transpose(1, 2)
        else:
            out, _ = tf.AttentionInterface[self.config._attn_implementation](self, q, k, v, None, scaling=None)
        return self.c_proj(out.reshape(b, s, d))
    tf.GPT2Attention = cls("GPT2Attention", gpt2, __init__=attn_init, forward=attn_forward)

    def block_init(self, config):
        torch.nn.Module.__init__(self)
        self.ln_1, self.attn = torch.nn.LayerNorm(config.n_embd), tf.GPT2Attention(config)
        self.ln_2, self.mlp = torch.nn.LayerNorm(config.n_embd), tf.GPT2MLP(config.n_embd)

    def block_forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))
    tf.GPT2Block = cls("GPT2Block", gpt2, __init__=block_init, forward=block_forward)

    def model_init(self, config):
        torch.nn.Module.__init__(self)
        self.config = config
        self.wte = torch.nn.Embedding(config.vocab_size, config.n_embd)
        self.h = torch.nn.ModuleList([tf.GPT2Block(config) for _ in range(2)])
        self.lm_head = torch.nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def default_loss(logits, labels, vocab_size, **kwargs):
        logits = logits.float()
        labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(logits.reshape(-1, vocab_size), labels.reshape(-1), ignore_index=-100)

    def loss_get(self):
        return getattr(self, "_loss_function", default_loss)

    def loss_set(self, fn):
        self._loss_function = fn

    def model_forward(self, ids, labels=None):
        x = self.wte(ids)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(x)
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
        return loss, logits
    tf.GPT2LMHeadModel = cls("GPT2LMHeadModel", gpt2, __init__=model_init, forward=model_forward,
                             loss_function=property(loss_get, loss_set))
    return tf


@pytest.fixture
def fake_transformers(monkeypatch):
    if HAVE_TRANSFORMERS:
        pytest.skip("the real transformers is installed: its tests run instead")
    tf = _fake_transformers()
    monkeypatch.setitem(sys.modules, "transformers", tf)
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", tf.masking_utils)
    return tf


def tiny_gpt2(tf, vocab=101):
    config = types.SimpleNamespace(n_embd=32, n_head=4, vocab_size=vocab, _attn_implementation="eager")
    return tf.GPT2LMHeadModel(config)


def _loss_and_grads(model, ids, labels):
    loss, logits = model(ids, labels)
    grads = torch.autograd.grad(loss, [p for p in model.parameters()])
    return loss, logits, grads


def test_fake_gpt2_matches_the_unpatched_model_and_reports(fake_transformers):
    tf = fake_transformers
    model = tiny_gpt2(tf)
    patched = copy.deepcopy(model)
    report = fastkern.patch(patched)
    text = str(report)
    assert "2 x transformers.Conv1D + transformers.NewGELUActivation -> fastkern.Conv1D(activation='gelu_tanh')" in text
    assert "6 x transformers.Conv1D -> fastkern.Conv1D\n" in text  # c_attn, c_proj; each MLP's c_proj
    assert "1 x torch.Linear -> fastkern.Linear" in text  # lm_head
    assert "attention: GPT2LMHeadModel attn_implementation 'eager' -> 'fastkern'" in text
    assert "loss: GPT2LMHeadModel.loss_function" in text
    assert isinstance(patched.h[0].mlp.act, torch.nn.Identity)
    assert patched.h[0].mlp.c_fc.weight is patched.h[0].mlp.c_fc.weight  # shared, not copied
    assert list(patched.state_dict()) == list(model.state_dict())
    ids = torch.randint(0, 101, (3, 17))
    labels = ids.clone()
    labels[0, :4] = -100
    want, want_logits, want_grads = _loss_and_grads(model, ids, labels)
    got, got_logits, got_grads = _loss_and_grads(patched, ids, labels)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())


def test_attention_goes_through_the_registry_when_fastkern_has_sdpa(fake_transformers, monkeypatch):
    tf = fake_transformers
    calls = []

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append(is_causal)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale)
    monkeypatch.setattr(fastkern, "scaled_dot_product_attention", sdpa, raising=False)
    model = tiny_gpt2(tf)
    patched = copy.deepcopy(model)
    report = fastkern.patch(patched)
    assert "attn_implementation 'eager' -> 'fastkern'" in str(report)
    assert tf.AttentionInterface.functions["fastkern"] is sys.modules["fastkern.patch"].attention_forward
    assert "fastkern" in tf.AttentionMaskInterface.functions
    ids = torch.randint(0, 101, (2, 9))
    torch.testing.assert_close(patched(ids)[1], model(ids)[1], rtol=1e-4, atol=1e-5)
    assert calls == [True, True]  # causal, one call a layer


def test_flags_leave_groups_alone(fake_transformers):
    model = tiny_gpt2(fake_transformers)
    report = fastkern.patch(model, linear=False, cross_entropy=False)
    text = str(report)
    assert "Conv1D" not in text.split("left as they are")[0]
    assert "2 x transformers.NewGELUActivation -> fastkern.GELU(tanh)" in text
    assert "linear=False: left as it was" in text and "loss:" not in text
    quick = torch.nn.Sequential(fake_transformers.QuickGELUActivation())
    assert "x * sigmoid(1.702 x)" in str(fastkern.patch(quick))


def test_torch_modules_fused_and_replaced():
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8),
                                torch.nn.LogSoftmax(-1))
    ref = copy.deepcopy(model)
    hooked = torch.nn.Linear(8, 8)
    hooked.register_forward_hook(lambda *a: None)
    holder = torch.nn.ModuleDict({"m": model, "hooked": hooked, "loss": torch.nn.CrossEntropyLoss(label_smoothing=0.1)})
    report = fastkern.patch(holder)
    text = str(report)
    assert "1 x torch.Linear + torch.GELU(none) -> fastkern.Linear(activation='gelu')" in text
    assert "1 x torch.LogSoftmax -> fastkern.LogSoftmax" in text
    assert "1 x torch.CrossEntropyLoss -> fastkern.CrossEntropyLoss" in text
    assert "1 x torch.Linear: has forward hooks" in text
    assert holder["loss"].label_smoothing == 0.1 and type(holder["hooked"]) is torch.nn.Linear
    x = torch.randn(5, 8)
    torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        fastkern.patch("model")


def test_multihead_attention_where_fastkern_has_sdpa(monkeypatch):
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    model = torch.nn.ModuleList([mha])
    calls = []

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append(q.shape)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)
    monkeypatch.setattr(fastkern, "scaled_dot_product_attention", sdpa, raising=False)
    patched = copy.deepcopy(model)
    assert "1 x torch.MultiheadAttention -> fastkern.MultiheadAttention" in str(fastkern.patch(patched))
    x = torch.randn(2, 7, 16)
    causal = torch.ones(7, 7, dtype=torch.bool).triu(1)
    for kwargs in ({}, {"attn_mask": causal}, {"attn_mask": causal, "is_causal": True}):
        want = mha(x, x, x, need_weights=False, **kwargs)[0]
        got = patched[0](x, x, x, need_weights=False, **kwargs)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(calls) == 3
    torch.testing.assert_close(patched[0](x, x, x)[0], mha(x, x, x)[0])  # weights asked: torch's forward
    assert len(calls) == 3


def test_patched_model_compiles_fullgraph(fake_transformers):
    torch._dynamo.reset()
    model = tiny_gpt2(fake_transformers)
    fastkern.patch(model)
    ids = torch.randint(0, 101, (2, 9))
    compiled = torch.compile(model, fullgraph=True)
    want, got = model(ids, ids), compiled(ids, ids)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)


# ---- the real transformers (runs where it is installed) ---------------------------------------------

def _hf_models():
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                              LlamaForCausalLM, ViTConfig, ViTForImageClassification)
    small = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=128)
    return {
        "gpt2": (GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=1000, n_positions=64)), "ids"),
        "bert": (BertForMaskedLM(BertConfig(vocab_size=1000, **small)), "ids"),
        "llama": (LlamaForCausalLM(LlamaConfig(vocab_size=1000, num_key_value_heads=2, **small)), "ids"),
        "vit": (ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, num_labels=10, **small)), "pixels"),
    }


@needs_transformers
@pytest.mark.parametrize("family", ["gpt2", "bert", "llama", "vit"])
@pytest.mark.parametrize("device", DEVICES)
def test_transformers_models_match_unpatched(family, device):
    model, kind = _hf_models()[family]
    model = model.to(device).eval()
    patched = copy.deepcopy(model)
    report = fastkern.patch(patched)
    print(report)
    assert report.total > 0
    if kind == "ids":
        inputs = {"input_ids": torch.randint(0, 1000, (2, 16), device=device)}
        inputs["labels"] = inputs["input_ids"].clone()
    else:
        inputs = {"pixel_values": torch.randn(2, 3, 32, 32, device=device), "labels": torch.randint(0, 10, (2,), device=device)}
    want, got = model(**inputs), patched(**inputs)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-4, atol=1e-4)
    want_g = torch.autograd.grad(want.loss, list(model.parameters()), allow_unused=True)
    got_g = torch.autograd.grad(got.loss, list(patched.parameters()), allow_unused=True)
    for a, b in zip(got_g, want_g):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4 * max(b.abs().max().item(), 1e-3))
    if family == "gpt2":
        assert "NewGELUActivation -> fastkern" in str(report) and "Conv1D" in str(report)


@needs_transformers
def test_fastkern_mask_skips_the_plain_causal_mask_under_compile():
    """The "fastkern" mask is None for a plain causal mask without padding also while torch.compile
    traces (transformers' sdpa_mask materialises it there, and a mask means torch's masked SDPA);
    with padding, or a window, it is sdpa_mask's."""
    import inspect
    from transformers import masking_utils
    assert fastkern.register_transformers()
    mask = sys.modules["fastkern.patch"].causal_or_sdpa_mask
    newer = "q_length" in inspect.signature(masking_utils.sdpa_mask).parameters  # else cache_position

    def query(n):
        return {"q_length": n} if newer else {"cache_position": torch.arange(n)}

    traced = torch.compile(lambda: mask(batch_size=2, kv_length=8, **query(8)), fullgraph=True)
    assert traced() is None and mask(batch_size=2, kv_length=8, **query(1)) is None
    padding = torch.ones(2, 8, dtype=torch.bool)
    padding[1, :3] = False
    window = masking_utils.sliding_window_causal_mask_function(4)
    for kwargs in ({"attention_mask": padding}, {"local_size": 4, "mask_function": window}):
        got = mask(batch_size=2, kv_length=8, **query(8), **kwargs)
        assert got is not None
        assert torch.equal(got, masking_utils.sdpa_mask(batch_size=2, kv_length=8, **query(8), **kwargs))


def test_causal_lm_loss_follows_transformers_semantics():
    """fastkern.patch's loss for transformers' causal LMs: labels shifted by one, -100 ignored, the
    mean, or the sum over num_items_in_batch when given; an fp32 loss from bf16 logits."""
    causal_lm_loss = sys.modules["fastkern.patch"].causal_lm_loss
    logits = torch.randn(2, 9, 50, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, 3] = -100
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    flat = logits.float().reshape(-1, 50)
    want = F.cross_entropy(flat, shifted)
    got = causal_lm_loss(logits, labels, 50)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    want_sum = F.cross_entropy(flat, shifted, reduction="sum") / 13
    torch.testing.assert_close(causal_lm_loss(logits, labels, 50, num_items_in_batch=torch.tensor(13)), want_sum,
                               rtol=1e-5, atol=1e-5)


def test_patched_linears_route_to_the_faster_kernel():
    """fastkern.patch's linears are kernel="auto": torch's kernels where fastkern's matmul is slower
    today (CPU, fp32, under torch.compile, CUDA rows cuBLAS aligns), fastkern's on eager 16-bit CUDA
    calls cuBLAS cannot align; a fastkern Linear the model already had keeps its kernel."""
    mine = fastkern.nn.Linear(16, 24)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(32, 16),
                                mine)
    want = model(x := torch.randn(5, 16))
    report = fastkern.patch(model)
    assert [getattr(m, "kernel", None) for m in model] == ["auto", None, "auto", "fastkern"]
    assert any("torch_linear_is_faster" in note for note in report.notes)
    calls = []
    real = fastkern.nn.linear
    fastkern.nn.linear = lambda *a, **k: calls.append(a[1].shape) or real(*a, **k)
    try:
        got = model(x)
    finally:
        fastkern.nn.linear = real
    assert calls == [torch.Size([24, 16])]  # only the module that forces fastkern's kernel
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    faster = fastkern.nn.torch_linear_is_faster
    assert faster(x, 16, 32) and faster(x.bfloat16(), 768, 50257)  # the CPU: torch's
    assert torch.compile(lambda t: faster(t, 768, 50257), fullgraph=True)(x)
    if torch.cuda.is_available():
        lm_head = torch.randn(4, 768, device="cuda", dtype=torch.bfloat16)
        assert not faster(lm_head, 768, 50257) and faster(lm_head, 768, 3072) and faster(lm_head.float(), 768, 50257)
        with torch.autocast("cuda", torch.bfloat16):  # the dtype autocast runs it in, not the input's
            assert not faster(lm_head.float(), 768, 50257)
