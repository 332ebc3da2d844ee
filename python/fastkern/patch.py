"""fastkern.patch(model): swaps, in place, every module of a model that fastkern has a kernel for,
torch.nn's and Hugging Face transformers', and returns a report of what changed and what was left.

    report = fastkern.patch(model)          # or patch(model, linear=False, ...)
    print(report)

What it takes over (each group behind its keyword):
  gelu           torch.nn.GELU; transformers' NewGELUActivation, GELUActivation, GELUTanh /
                 PytorchGELUTanh, FastGELUActivation (the tanh form). QuickGELU and the clipped /
                 "accurate" variants compute other functions: left, and said so.
  softmax        torch.nn.Softmax, LogSoftmax.
  linear         torch.nn.Linear (exact type; subclasses may change forward: left); transformers'
                 Conv1D (GPT-2's layer, weight (in, out): read in place, no transposed copy). With
                 gelu too, a linear followed by a GELU becomes one linear with the GELU fused in its
                 epilogue: consecutive members of an nn.Sequential, and the known transformers
                 pairs (GPT2MLP c_fc + act, Bert / Roberta / ViT *Intermediate dense + act).
                 The new modules run fastkern's matmul only where it is faster than torch's today
                 (kernel="auto": eager 16-bit CUDA calls with rows cuBLAS cannot align) and
                 torch's kernels elsewhere, under torch.compile and on the CPU included.
  attention      torch.nn.MultiheadAttention (its fastkern subclass runs calls that need no weights
                 in fastkern.scaled_dot_product_attention, others in torch's forward); transformers
                 models that route attention through AttentionInterface get the "fastkern"
                 implementation (registered here with the SDPA mask format; from_pretrained(...,
                 attn_implementation="fastkern") works after `import fastkern` when transformers
                 was imported first, else after fastkern.register_transformers() or a patch call).
  cross_entropy  torch.nn.CrossEntropyLoss modules; a transformers causal LM's loss_function (the
                 shifted-label loss, on the 16-bit logits as they are, without the fp32 copy).
Parameters are shared, never copied: state_dicts, optimizers and hooks on parameters keep working.
Modules with forward hooks are left alone (a hook may rely on the exact module).
transformers is optional: nothing here imports it unless it is installed, and classes are matched
by name and module (transformers.*), so the code needs no particular version.
"""
import collections
import sys

import torch

from . import nn as fnn

_HF_GELU = {"NewGELUActivation": "tanh", "GELUActivation": "none", "GELUTanh": "tanh",
            "PytorchGELUTanh": "tanh", "FastGELUActivation": "tanh"}
_HF_OTHER_GELU = {"QuickGELUActivation": "x * sigmoid(1.702 x), not the GELU fastkern computes",
                  "ClippedGELUActivation": "a clipped GELU: no fastkern kernel",
                  "AccurateGELUActivation": "a different tanh constant: no fastkern kernel",
                  "GELUActivationCompat": "unknown variant"}
# transformers parents whose forward runs linear -> activation on these children, back to back
_HF_FUSED_PAIRS = {"GPT2MLP": ("c_fc", "act"), "BertIntermediate": ("dense", "intermediate_act_fn"),
                   "RobertaIntermediate": ("dense", "intermediate_act_fn"),
                   "ViTIntermediate": ("dense", "intermediate_act_fn")}
_ACTIVATION = {"none": "gelu", "tanh": "gelu_tanh"}


def _hf(module, *names):
    """The transformers class name of `module` when it is one of `names` (exact class)."""
    kind = type(module)
    if kind.__module__.startswith("transformers") and kind.__name__ in names:
        return kind.__name__
    return None


def _gelu_form(module):
    """'none' / 'tanh' for a GELU module fastkern computes, else None."""
    if type(module) in (torch.nn.GELU, fnn.GELU):
        return module.approximate
    name = _hf(module, *_HF_GELU)
    return _HF_GELU[name] if name else None


def _hooked(module):
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)


def _describe(module):
    kind = type(module)
    extra = ""
    if isinstance(module, torch.nn.GELU):
        extra = f"({module.approximate})"
    return f"{kind.__module__.split('.')[0]}.{kind.__name__}{extra}"


class PatchReport:
    """What fastkern.patch did: `replaced` counts (before, after) pairs, `left` counts (module,
    reason) pairs, `notes` holds model-wide decisions (attention, loss). str() prints a table."""

    def __init__(self):
        self.replaced = collections.Counter()
        self.left = collections.Counter()
        self.notes = []

    def add(self, before, after, count=1):
        self.replaced[(before, after)] += count

    def leave(self, what, why):
        self.left[(what, why)] += 1

    @property
    def total(self):
        return sum(self.replaced.values())

    def as_dict(self):
        return {"replaced": [{"from": b, "to": a, "count": n} for (b, a), n in self.replaced.items()],
                "left": [{"module": m, "why": w, "count": n} for (m, w), n in self.left.items()],
                "notes": list(self.notes)}

    def __str__(self):
        lines = [f"fastkern.patch: {self.total} module(s) replaced"]
        for (before, after), n in sorted(self.replaced.items()):
            lines.append(f"  {n:5d} x {before} -> {after}")
        if self.left:
            lines.append("left as they are:")
            for (what, why), n in sorted(self.left.items()):
                lines.append(f"  {n:5d} x {what}: {why}")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def __repr__(self):
        return f"<PatchReport: {self.total} replaced, {sum(self.left.values())} left>"


# ---- transformers integration -------------------------------------------------------------------

def _sdpa():
    import fastkern
    return fastkern.scaled_dot_product_attention  # looked up at call time (tests replace it)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """transformers' attention-function signature (AttentionInterface), (B, H, S, D) in, (B, S, H, D)
    out, as its sdpa_attention_forward, computed by fastkern.scaled_dot_product_attention (torch's
    until fastkern has one). The mask comes in SDPA's format (causal_or_sdpa_mask)."""
    sdpa = _sdpa()
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    extra = {"enable_gqa": True} if getattr(module, "num_key_value_groups", 1) > 1 else {}
    out = sdpa(query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal, scale=scaling,
               **extra)
    return out.transpose(1, 2).contiguous(), None


def register_transformers():
    """Registers the "fastkern" attention implementation (and its mask format, SDPA's) with
    transformers; True when transformers is there to take it."""
    if "transformers" not in sys.modules:
        try:
            import transformers  # noqa: F401
        except ImportError:
            return False
    transformers = sys.modules["transformers"]
    interface = getattr(transformers, "AttentionInterface", None)
    if interface is None:
        return False
    interface.register("fastkern", attention_forward)
    masks = getattr(transformers, "AttentionMaskInterface", None)
    if masks is not None:
        try:
            from transformers import masking_utils
        except ImportError:
            masking_utils = None
        if getattr(masking_utils, "sdpa_mask", None) is not None:  # without one transformers passes no mask
            _MASKING[0] = masking_utils  # imported here: dynamo cannot trace transformers' lazy import
            masks.register("fastkern", causal_or_sdpa_mask)
    return True


_MASKING = [None]  # transformers.masking_utils, set by register_transformers


def causal_or_sdpa_mask(**kwargs):
    """The "fastkern" mask (transformers calls mask functions by keyword): None (is_causal in the
    kernel) for a plain causal mask without padding, also under torch.compile; anything else as
    transformers' sdpa_mask builds it. sdpa_mask materialises even the plain causal mask while
    dynamo traces (on torch < 2.14: its guard against torch.export baking is_causal in), and a mask
    sends every call to torch's masked SDPA. The query length is q_length (transformers >= 5.2x) or
    cache_position's; torch.compile guards on it, so a new length recompiles."""
    masking_utils = _MASKING[0]
    q_length = kwargs["q_length"] if "q_length" in kwargs else kwargs["cache_position"].shape[0]
    if (kwargs.get("allow_is_causal_skip", True) and kwargs.get("attention_mask") is None
            and kwargs.get("local_size") is None
            and kwargs.get("mask_function", masking_utils.causal_mask_function) is masking_utils.causal_mask_function
            and (q_length == 1 or q_length == kwargs["kv_length"])):
        return None
    return masking_utils.sdpa_mask(**kwargs)


def causal_lm_loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                   **kwargs):
    """transformers' ForCausalLMLoss (shifted labels, a sum over num_items_in_batch when given, else
    the mean) on fastkern.cross_entropy, reading the logits in their own dtype (transformers makes an
    fp32 copy of them first); the loss is fp32 like transformers'."""
    from .ops.cross_entropy import _call
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    logits = logits.reshape(-1, logits.shape[-1])
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = _call(logits, shift_labels, ignore_index, reduction, 0.0, True).float()
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _patch_hf_model(model, attention, cross_entropy, report):
    config = getattr(model, "config", None)
    if attention and config is not None and hasattr(config, "_attn_implementation"):
        name = type(model).__name__
        if getattr(type(model), "_supports_attention_backend", True) is False:
            report.notes.append(f"attention: {name} does not route attention through AttentionInterface: left")
        elif not register_transformers():
            report.notes.append("attention: this transformers has no AttentionInterface: left")
        else:
            before = config._attn_implementation
            setter = getattr(model, "set_attn_implementation", None)
            try:
                setter("fastkern") if setter else setattr(config, "_attn_implementation", "fastkern")
            except Exception:  # noqa: BLE001 - older versions validate names: set the config directly
                config._attn_implementation = "fastkern"
            report.notes.append(f"attention: {name} attn_implementation {before!r} -> 'fastkern'")
    if cross_entropy and hasattr(model, "loss_function"):
        name = type(model).__name__
        if name.endswith(("LMHeadModel", "ForCausalLM")):
            try:
                model.loss_function = causal_lm_loss
                report.notes.append(f"loss: {name}.loss_function -> fastkern.patch.causal_lm_loss "
                                    "(fastkern.cross_entropy on the logits as they are)")
            except AttributeError:
                report.notes.append(f"loss: {name}.loss_function cannot be set in this transformers: left")


# ---- the walk ------------------------------------------------------------------------------------

def _fused_linear(lin, form):
    """`lin` (torch.nn.Linear / fastkern Linear without activation / transformers Conv1D) with the
    GELU `form` fused, sharing its parameters; None when it is not one of those."""
    if type(lin) in (torch.nn.Linear, fnn.Linear) and getattr(lin, "activation", None) is None:
        new = fnn._replacement(lin) if type(lin) is torch.nn.Linear else lin
        new.activation = _ACTIVATION[form]
        return new
    if _hf(lin, "Conv1D") or (type(lin) is fnn.Conv1D and lin.activation is None):
        return fnn.Conv1D.sharing(lin, _ACTIVATION[form])
    return None


def _fuse(parent, first, second, report):
    lin, act = parent._modules[first], parent._modules[second]
    form = _gelu_form(act) if isinstance(act, torch.nn.Module) else None
    if form is None or lin is None or _hooked(lin) or _hooked(act):
        return False
    new = _fused_linear(lin, form)
    if new is None:
        return False
    report.add(f"{_describe(lin)} + {_describe(act)}", f"fastkern.{type(new).__name__}(activation="
               f"{new.activation!r})")
    parent._modules[first], parent._modules[second] = new, torch.nn.Identity()
    return True


def _replace(child, flags, report):
    """The fastkern module for `child`, or None (reasons for leaving it go to the report)."""
    kind = type(child)
    if _hooked(child):
        if kind in (torch.nn.Linear, torch.nn.GELU, torch.nn.Softmax, torch.nn.LogSoftmax) or _gelu_form(child):
            report.leave(_describe(child), "has forward hooks")
        return None
    if flags["gelu"]:
        form = _gelu_form(child)
        if form is not None and kind is not fnn.GELU:
            return fnn.GELU(form)
        name = _hf(child, *_HF_OTHER_GELU)
        if name:
            report.leave(_describe(child), _HF_OTHER_GELU[name])
    if flags["softmax"] and kind in (torch.nn.Softmax, torch.nn.LogSoftmax):
        return fnn._replacement(child)
    if flags["linear"]:
        if kind is torch.nn.Linear:
            return fnn._replacement(child)
        if _hf(child, "Conv1D"):
            return fnn.Conv1D.sharing(child)
        if isinstance(child, torch.nn.Linear) and not isinstance(child, fnn.Linear) and kind.__name__ != "NonDynamicallyQuantizableLinear":
            report.leave(_describe(child), "a Linear subclass (its forward may differ)")
    if flags["attention"] and kind is torch.nn.MultiheadAttention:
        child.__class__ = fnn.MultiheadAttention  # same state, a forward that calls fastkern where it can
        report.add("torch.MultiheadAttention", "fastkern.MultiheadAttention")
        return None
    if flags["cross_entropy"] and kind is torch.nn.CrossEntropyLoss:
        new = fnn.CrossEntropyLoss(weight=child.weight, ignore_index=child.ignore_index,
                                   reduction=child.reduction, label_smoothing=child.label_smoothing)
        return new
    return None


def _walk(module, flags, report):
    if flags["linear"] and flags["gelu"]:
        if isinstance(module, torch.nn.Sequential):
            names = list(module._modules)
            for first, second in zip(names, names[1:]):
                _fuse(module, first, second, report)
        pair = _HF_FUSED_PAIRS.get(_hf(module, *_HF_FUSED_PAIRS) or "")
        if pair and all(isinstance(module._modules.get(n), torch.nn.Module) for n in pair):
            if not _fuse(module, *pair, report):
                report.leave(_describe(module), "its linear + activation are not a pair fastkern fuses")
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        new = _replace(child, flags, report)
        if new is not None:
            report.add(_describe(child), f"fastkern.{type(new).__name__}"
                       + (f"({new.approximate})" if isinstance(new, fnn.GELU) else ""))
            module._modules[name] = new
        elif not isinstance(child, (fnn.GELU, fnn.Softmax, fnn.Linear, fnn.Conv1D)):
            _walk(child, flags, report)


def patch(model, *, gelu=True, softmax=True, linear=True, attention=True, cross_entropy=True):
    """Swaps, in place, every module of `model` fastkern has a kernel for (module docstring) and
    returns a PatchReport. Call it before torch.compile and DDP / FSDP wrapping; the optimizer may
    be made before or after (parameters stay the same objects)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fastkern.patch: model must be a torch.nn.Module, got {type(model).__name__}")
    flags = {"gelu": gelu, "softmax": softmax, "linear": linear, "attention": attention,
             "cross_entropy": cross_entropy}
    report = PatchReport()
    before = {id(m) for m in model.modules() if type(m) in (fnn.Linear, fnn.Conv1D)}
    _walk(model, flags, report)
    linears = [m for m in model.modules() if type(m) in (fnn.Linear, fnn.Conv1D) and id(m) not in before]
    for m in linears:
        m.kernel = "auto"
    if linears:
        report.notes.append("linear: fastkern's matmul runs where it beats torch's (eager 16-bit CUDA calls "
                            "whose rows cuBLAS cannot align, e.g. an LM head of 50257); torch's elsewhere "
                            "(fastkern.nn.torch_linear_is_faster; kernel='fastkern' on a module forces ours)")
    if type(model).__module__.startswith("transformers"):
        _patch_hf_model(model, attention, cross_entropy, report)
    for flag, on in flags.items():
        if not on:
            report.notes.append(f"{flag}=False: left as it was")
    return report


if "transformers" in sys.modules:  # a model may ask for attn_implementation="fastkern" right away
    register_transformers()
