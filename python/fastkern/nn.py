"""Drop-in modules for the torch.nn ones fastkern replaces, and a helper that swaps them in.
fastkern.patch (patch.py) swaps these and the transformers equivalents into a whole model."""
import os

import torch
import torch.nn.functional as F

from . import _backend as B
from .ops.cross_entropy import cross_entropy
from .ops.gelu import _gelu_backward, _gelu_backward_and_gelu, _gelu_backward_op, gelu
from .ops.matmul import _mm, linear, matmul
from .ops.softmax import log_softmax, softmax


def _autocast(x, *params):
    """x and params in autocast's dtype when autocast is on for x's device (as torch's F.linear is
    cast): fastkern's ops are custom ops, which autocast does not see."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return (x, *params)
    dtype = torch.get_autocast_dtype(device)
    return tuple(t if t is None or t.dtype == dtype else t.to(dtype) for t in (x, *params))


class GELU(torch.nn.Module):
    """fastkern's torch.nn.GELU: same constructor, same repr, same numbers."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return gelu(input, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class Softmax(torch.nn.Module):
    """fastkern's torch.nn.Softmax: same constructor (dim=None picks torch's legacy dim), same repr."""

    def __init__(self, dim=None) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return softmax(input, _legacy_dim(self.dim, input))

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class LogSoftmax(Softmax):
    """fastkern's torch.nn.LogSoftmax."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return log_softmax(input, _legacy_dim(self.dim, input))


_TORCH_GELU = {None: None, "gelu": "none", "gelu_tanh": "tanh"}


def torch_linear_is_faster(x, in_features, out_features):
    """Where a linear with kernel="auto" (what fastkern.patch sets) runs torch's kernels, because
    fastkern's matmul is slower there today (D-93, H100, GPT-2 small's training step): on the CPU;
    in fp32; inside torch.compile'd code (inductor pads odd shapes for cuBLAS and fuses the
    epilogue: fastkern's 25 linears took 28 ms of a 56 ms step, cuBLAS ~13); on the GPU wherever
    cuBLAS can align its rows. fastkern's kernel keeps eager 16-bit CUDA calls whose K or N rows are
    not 16-byte multiples, cuBLAS's cliff (GPT-2's LM head, N 50257: 2.1x torch forward)."""
    if torch.compiler.is_compiling() or not x.is_cuda:
        return True
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    if dtype not in (torch.bfloat16, torch.float16):  # (under autocast x may be fp32: the dtype it runs in)
        return True
    return in_features % 8 == 0 and out_features % 8 == 0


def _torch_linear(x, weight_kn, bias, activation):
    """torch's x @ weight_kn + bias, then the GELU `activation`: the kernel="auto" route."""
    out = torch.matmul(x, weight_kn) if bias is None else torch.addmm(
        bias, x.reshape(-1, x.shape[-1]), weight_kn).view(*x.shape[:-1], weight_kn.shape[-1])
    return out if activation is None else F.gelu(out, approximate=_TORCH_GELU[activation])


class Linear(torch.nn.Linear):
    """fastkern's torch.nn.Linear: same constructor, parameters, initialisation, state_dict and
    repr. `activation` (None, 'gelu' or 'gelu_tanh') fuses a GELU after it (swap_modules sets it
    for a Linear followed by a GELU in a Sequential). `kernel`: "fastkern" (default) always runs
    fastkern's matmul; "auto" (fastkern.patch's choice) runs torch's where torch_linear_is_faster."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, *, activation=None, kernel="fastkern") -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.activation, self.kernel = activation, kernel

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.kernel == "auto" and torch_linear_is_faster(input, self.in_features, self.out_features):
            out = F.linear(input, self.weight, self.bias)  # the form the H100 step was measured with
            return out if self.activation is None else F.gelu(out, approximate=_TORCH_GELU[self.activation])
        input, weight, bias = _autocast(input, self.weight, self.bias)
        return linear(input, weight, bias, activation=self.activation)

    def extra_repr(self) -> str:
        base = super().extra_repr()
        return base if self.activation is None else f"{base}, activation={self.activation!r}"


_MLP_ACTIVATIONS = {"none": "gelu", "tanh": "gelu_tanh"}


class _FusedMLPFunction(torch.autograd.Function):
    """y = gelu(x W1^T + b1) W2^T + b2 saving x and h = x W1^T + b1 only (not gelu(h)): the first
    matmul writes gelu(h) and h in one kernel. The backward forms dg = dY W2, then one GELU
    backward pass over h writes d_h = dg * gelu'(h) (and db1) and recomputes gelu(h) (a temporary)
    for dW2 = dY^T gelu(h) (D-131: one read of h, not two). When only W2's or only h's gradients
    are wanted, or under torch.compile / functorch, it runs the two separately as before."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, approximate):
        x2 = x.reshape(-1, x.shape[-1])
        g, h = _mm(x2, w1.t(), b1, _MLP_ACTIVATIONS[approximate])
        y = _mm(g, w2.t(), b2)[0]
        ctx.save_for_backward(x, w1, w2, h)
        ctx.approximate, ctx.has_b1, ctx.has_b2 = approximate, b1 is not None, b2 is not None
        return y.view(*x.shape[:-1], w2.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, h = ctx.saved_tensors
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dx = dw1 = db1 = dw2 = db2 = act = dh = None
        need_h = need_x or need_w1 or need_b1
        need_b1 = need_b1 and ctx.has_b1
        if need_h:
            dg = _mm(dy2, w2)[0]
            zero = h.new_zeros(h.shape[-1]) if need_b1 else None  # makes the kernel sum db1
            # d_h, db1 and gelu(h) in one pass over h; FASTKERN_MLP_SEPARATE_GELU=1 runs the two
            # passes, for a same-process A/B of D-131 (benchmarks/ab.py NAME=SO:VAR=1)
            if (need_w2 and B.plain_eager(dg, h)
                    and os.environ.get("FASTKERN_MLP_SEPARATE_GELU") != "1"):
                dh, db1, act = _gelu_backward_and_gelu(dg, h, zero, ctx.approximate, need_b1)
            else:
                backward = _gelu_backward if B.plain_eager(dg, h) else _gelu_backward_op
                dh, db1 = backward(dg, h, zero, ctx.approximate, need_b1)
            del dg
        if need_w2:
            if act is None:
                act = gelu(h, ctx.approximate)  # recomputed gelu(h): a temporary
            dw2 = _mm(dy2.t(), act)[0]
            del act
        if need_b2 and ctx.has_b2:
            db2 = dy2.sum(0)
        if need_w1:
            dw1 = _mm(dh.t(), x2)[0]
        if need_x:
            dx = _mm(dh, w1)[0].view(x.shape)
        return dx, dw1, (db1 if need_b1 else None), dw2, db2, None


class FusedMLP(torch.nn.Module):
    """Linear -> GELU -> Linear with nn.Sequential(Linear, GELU, Linear)'s parameters, init and
    state_dict keys ("0.weight", "0.bias", "2.weight", "2.bias"); autograd saves the input and the
    pre-activation only."""

    def __init__(self, in_features: int, hidden_features: int, out_features: int, bias: bool = True,
                 approximate: str = "tanh", device=None, dtype=None) -> None:
        super().__init__()
        if approximate not in _MLP_ACTIVATIONS:
            raise ValueError(f"fastkern.nn.FusedMLP: approximate must be 'none' or 'tanh', got "
                             f"{approximate!r}")
        self.approximate = approximate
        # registered as "0", "1", "2" so the state_dict is the Sequential's, created in its order
        self.add_module("0", torch.nn.Linear(in_features, hidden_features, bias, device, dtype))
        self.add_module("1", torch.nn.GELU(approximate))
        self.add_module("2", torch.nn.Linear(hidden_features, out_features, bias, device, dtype))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = self._modules["0"], self._modules["2"]
        args = (input, fc1.weight, fc1.bias, fc2.weight, fc2.bias)
        if B.route(*args) == B.DIRECT:  # no autograd: two fused linears, nothing saved
            h = linear(input, fc1.weight, fc1.bias, activation=_MLP_ACTIVATIONS[self.approximate])
            return linear(h, fc2.weight, fc2.bias)
        return _FusedMLPFunction.apply(*args, self.approximate)


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """fastkern's torch.nn.CrossEntropyLoss: same constructor, buffers and repr. (N, C) logits with
    int64 targets and no class weights go to fastkern.cross_entropy; anything else (a weight, (N, C,
    d1, ...) inputs, class-probability targets) to torch's own F.cross_entropy."""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if (self.weight is None and input.dim() in (1, 2) and target.dtype == torch.int64
                and input.dim() - target.dim() == 1 and input.device.type in ("cpu", "cuda")):
            return cross_entropy(input, target, ignore_index=self.ignore_index, reduction=self.reduction,
                                 label_smoothing=self.label_smoothing)
        return super().forward(input, target)


class Conv1D(torch.nn.Module):
    """fastkern's transformers Conv1D (GPT-2's linear layer, weight stored (in, out)): the same
    parameters and state_dict ("weight" (nx, nf), "bias" (nf,)), read in place as matmul's row-major
    B; `activation` (None, 'gelu', 'gelu_tanh') fuses a GELU after it."""

    def __init__(self, nf: int, nx: int, *, activation=None, device=None, dtype=None, kernel="fastkern") -> None:
        super().__init__()
        self.nf, self.nx, self.activation, self.kernel = nf, nx, activation, kernel
        self.weight = torch.nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(nf, device=device, dtype=dtype))
        torch.nn.init.normal_(self.weight, std=0.02)

    @classmethod
    def sharing(cls, conv, activation=None):
        """A fastkern Conv1D holding `conv`'s own Parameters (no copies, nothing allocated)."""
        new = cls(conv.nf, conv.weight.shape[0], activation=activation, device="meta", dtype=conv.weight.dtype,
                  kernel=getattr(conv, "kernel", "fastkern"))
        new.weight, new.bias = conv.weight, conv.bias
        return new.train(conv.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "auto" and torch_linear_is_faster(x, self.nx, self.nf):
            return _torch_linear(x, self.weight, self.bias, self.activation)
        x, weight, bias = _autocast(x, self.weight, self.bias)
        return matmul(x, weight, bias=bias, activation=self.activation)

    def extra_repr(self) -> str:
        base = f"nf={self.nf}, nx={self.nx}"
        return base if self.activation is None else f"{base}, activation={self.activation!r}"


class MultiheadAttention(torch.nn.MultiheadAttention):
    """torch.nn.MultiheadAttention whose attention runs in fastkern.scaled_dot_product_attention
    where the call allows it: no attention weights asked for (need_weights=False), no key padding
    mask, packed q/k/v projections, no bias_k / bias_v / add_zero_attn, batched 3-d inputs. Any
    other call runs torch's own forward. Same parameters, state_dict and constructor."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        import fastkern
        sdpa = fastkern.scaled_dot_product_attention  # looked up at call time (tests replace it)
        if (need_weights or key_padding_mask is not None or not self._qkv_same_embed_dim
                or self.bias_k is not None or self.add_zero_attn or query.dim() != 3
                or (attn_mask is not None and attn_mask.dim() not in (2, 3))):
            return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                   average_attn_weights, is_causal)
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        b, sq, e = query.shape
        sk, h = key.shape[1], self.num_heads
        w = self.in_proj_weight.chunk(3)
        bias = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3
        q, k, v = (F.linear(t, wi, bi).view(b, -1, h, e // h).transpose(1, 2)
                   for t, wi, bi in zip((query, key, value), w, bias))
        mask = None
        if is_causal and attn_mask is not None:
            attn_mask = None  # torch's hint: the mask given is the causal one
        elif attn_mask is not None:  # torch's bool masks mark what is hidden, SDPA's what is seen
            mask = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask
            mask = mask.view(b, h, sq, sk) if mask.dim() == 3 else mask
        out = sdpa(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                   is_causal=bool(is_causal))
        out = F.linear(out.transpose(1, 2).reshape(b, sq, e), self.out_proj.weight, self.out_proj.bias)
        return (out if self.batch_first else out.transpose(0, 1)), None


def _legacy_dim(dim, input):
    # torch.nn.Softmax(dim=None) reduces dim 0 of 0-, 1- and 3-d inputs and dim 1 otherwise
    if dim is not None:
        return dim
    return 0 if input.dim() in (0, 1, 3) else 1


def _replacement(module):
    kind = type(module)
    if kind is torch.nn.Linear:
        new = Linear(module.in_features, module.out_features, module.bias is not None, "meta",
                     module.weight.dtype)
        new.weight, new.bias = module.weight, module.bias  # the same Parameters, not copies
        return new.train(module.training)
    if kind is torch.nn.GELU:
        return GELU(module.approximate)
    if kind is torch.nn.Softmax:
        return Softmax(module.dim)
    if kind is torch.nn.LogSoftmax:
        return LogSoftmax(module.dim)
    return None


def _hooked(module):
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)


def swap_modules(model: torch.nn.Module, fuse: bool = True) -> torch.nn.Module:
    """Replaces, in place, every torch.nn module that fastkern has a drop-in for; returns model.
    With `fuse`, a Linear directly followed by a GELU inside an nn.Sequential becomes one Linear
    with a fused activation, the GELU an nn.Identity (state_dict keys are unchanged)."""
    for name, child in model.named_children():
        new = _replacement(child)
        if new is not None:
            setattr(model, name, new)
        else:
            swap_modules(child, fuse)
    if fuse and isinstance(model, torch.nn.Sequential):
        names = list(model._modules)
        for first, second in zip(names, names[1:]):
            lin, act = model._modules[first], model._modules[second]
            if (type(lin) is Linear and lin.activation is None and type(act) in (torch.nn.GELU, GELU)
                    and not _hooked(lin) and not _hooked(act)):
                lin.activation = _MLP_ACTIVATIONS[act.approximate]
                model._modules[second] = torch.nn.Identity()
    return model
