"""Loads fastkern._C and holds the device / stream / dtype plumbing every op shares.

Nothing above this module touches pointers; nothing below ops/ touches torch.
"""
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _C

BUILD_INFO = _C.build_info()
CUDA_COMPILED = BUILD_INFO["cuda"]

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
_CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CPU_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

try:  # the raw stream handle without building a torch.cuda.Stream object (inductor uses the same)
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - older or CPU-only torch builds
    def _raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream


def plain_eager(*tensors):
    """True when an op may skip the torch dispatcher: plain tensors (None allowed) in plain eager
    mode, with no compile or tracing, no dispatch mode and no functorch transform active. The
    dispatcher round trip and the custom-op autograd wrapper cost more host time (~10-20 us) than a
    small kernel runs, so eager calls go straight to the kernel (or a torch.autograd.Function)."""
    for t in tensors:
        if t is not None and type(t) is not torch.Tensor:
            return False
    return (not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and torch._C._functorch.peek_interpreter_stack() is None)


def needs_grad(*tensors):
    """True when autograd must record an op on these tensors."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def dtype_code(t, op, name):
    """The waist's dtype code for tensor `t`, or TypeError naming the argument."""
    allowed = _CUDA_DTYPES if t.device.type == "cuda" else _CPU_DTYPES
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"fastkern.{op}: {name} must be a floating-point tensor of dtype {names} on "
                        f"{t.device.type}, got {t.dtype}")
    return _DTYPE_CODES[t.dtype]


def check_tensor(t, op, name):
    """TypeError unless `t` is a tensor on a device fastkern runs on."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fastkern.{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"fastkern.{op}: {name} is on {t.device}, fastkern runs on cpu and cuda")


def check_same(t, ref, op, name, ref_name):
    """ValueError / TypeError unless `t` shares `ref`'s device and dtype."""
    if t.device != ref.device:
        raise ValueError(f"fastkern.{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")
    if t.dtype != ref.dtype:
        raise TypeError(f"fastkern.{op}: {name} has dtype {t.dtype} but {ref_name} has {ref.dtype}")


def launch_args(t):
    """(device index, stream handle) for a kernel on t's device: -1 and 0 on CPU, else the index
    and the raw handle of the stream torch is using there now."""
    if t.device.type == "cpu":
        return -1, 0
    if not CUDA_COMPILED:
        raise RuntimeError("fastkern: this build has no CUDA support (rebuild with nvcc on the PATH "
                           "or FASTKERN_CUDA=1); CPU tensors still work")
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return index, _raw_stream(index)


def ptr(t):
    """Data pointer of `t`, or 0 for None."""
    return 0 if t is None else t.data_ptr()


def dense(t):
    """`t` itself when its elements are dense and row-major, else a contiguous copy."""
    return t if t.is_contiguous() else t.contiguous()


def register_op(name, impl, fake, backward_impl, backward_fake, backward, setup_context):
    """Registers the CPU / CUDA kernels and fake kernels of fastkern::<name> and
    fastkern::<name>_backward (both already defined), and autograd for the forward op; returns the
    two OpOverloads."""
    for qualname, kernel, fake_kernel in ((name, impl, fake), (name + "_backward", backward_impl, backward_fake)):
        torch.library.impl(f"fastkern::{qualname}", ("cpu", "cuda"), kernel)
        torch.library.register_fake(f"fastkern::{qualname}", fake_kernel)
    torch.library.register_autograd(f"fastkern::{name}", backward, setup_context=setup_context)
    return getattr(torch.ops.fastkern, name).default, getattr(torch.ops.fastkern, name + "_backward").default


def call(op, function, impl, tensors, *args):
    """Runs an op the cheapest correct way: through the dispatcher when compiling, tracing or under
    a mode (`op`); through the eager torch.autograd.Function when autograd must record it
    (`function`); else straight into the kernel (`impl`)."""
    if not plain_eager(*tensors):
        return op(*args)
    if needs_grad(*tensors):
        return function.apply(*args)
    return impl(*args)
