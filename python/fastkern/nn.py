"""Drop-in modules for the torch.nn ones fastkern replaces, and a helper that swaps them in."""
import torch

from .ops.gelu import gelu
from .ops.softmax import log_softmax, softmax


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


def _legacy_dim(dim, input):
    # torch.nn.Softmax(dim=None) reduces dim 0 of 0-, 1- and 3-d inputs and dim 1 otherwise
    if dim is not None:
        return dim
    return 0 if input.dim() in (0, 1, 3) else 1


def _replacement(module):
    kind = type(module)
    if kind is torch.nn.GELU:
        return GELU(module.approximate)
    if kind is torch.nn.Softmax:
        return Softmax(module.dim)
    if kind is torch.nn.LogSoftmax:
        return LogSoftmax(module.dim)
    return None


def swap_modules(model: torch.nn.Module) -> torch.nn.Module:
    """Replaces, in place, every torch.nn module that fastkern has a drop-in for; returns model."""
    for name, child in model.named_children():
        new = _replacement(child)
        if new is not None:
            setattr(model, name, new)
        else:
            swap_modules(child)
    return model
