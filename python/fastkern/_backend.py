"""Loads fastkern._C and holds the device / stream / dtype plumbing every op shares.

Nothing above this module touches pointers; nothing below ops/ touches torch.
"""
import torch

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


_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter  # a plain tensor to the dispatcher (its torch_function is disabled)
_is_compiling = torch.compiler.is_compiling
_functorch_level = torch._C._functorch.peek_interpreter_stack
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_grad_enabled = torch.is_grad_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack  # _get_current_dispatch_mode reads it (infra modes too)


OP, GRAD, DIRECT = 0, 1, 2


def route(*tensors):
    """How a public function runs on these tensors (None allowed): OP through the dispatcher (when
    compiling, tracing, under a mode or a functorch transform, or on tensor subclasses), GRAD
    through the eager autograd function when autograd must record it, else DIRECT into the kernel.
    One pass over the tensors: the host time of a small call is what it costs."""
    if _is_compiling():
        return OP
    grad = False
    for t in tensors:
        if t is not None:
            if (type(t) is not _Tensor and type(t) is not _Parameter) or _is_wrapped(t):
                return OP
            grad = grad or t.requires_grad
    if _dispatch_modes() or _functorch_level() is not None:
        return OP
    return GRAD if grad and _grad_enabled() else DIRECT


def plain_eager(*tensors):
    """True when an op may skip the torch dispatcher (route is not OP): the dispatcher round trip
    and the custom-op autograd wrapper cost more host time (~10-20 us) than a small kernel runs."""
    return route(*tensors) != OP


def function_apply(function):
    """`function.apply` without the Python layer of torch.autograd.Function.apply (~3 us a call):
    that layer only routes functorch transforms and binds setup_context defaults, and the eager
    path reaches here only with no transform active, plain tensors and an old-style forward."""
    return torch._C._FunctionBase.__dict__["apply"].__get__(None, function)


def dtype_code(t, op, name):
    """The waist's dtype code for tensor `t`, or TypeError naming the argument."""
    code = _DTYPE_CODES.get(t.dtype)
    if code is None or (code == 3 and t.is_cuda):
        allowed = _CUDA_DTYPES if t.is_cuda else _CPU_DTYPES
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"fastkern.{op}: {name} must be a floating-point tensor of dtype {names} on "
                        f"{t.device.type}, got {t.dtype}")
    return code


def check_tensor(t, op, name):
    """TypeError unless `t` is a tensor on a device fastkern runs on."""
    if not isinstance(t, _Tensor):
        raise TypeError(f"fastkern.{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not (t.is_cuda or t.is_cpu):
        raise ValueError(f"fastkern.{op}: {name} is on {t.device}, fastkern runs on cpu and cuda")


def check_same(t, ref, op, name, ref_name):
    """ValueError / TypeError unless `t` shares `ref`'s device and dtype."""
    if t.device != ref.device:
        raise ValueError(f"fastkern.{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")
    if t.dtype != ref.dtype:
        raise TypeError(f"fastkern.{op}: {name} has dtype {t.dtype} but {ref_name} has {ref.dtype}")


def launch_args(t):
    """(device index, stream argument) for a kernel on t's device (see `stream`)."""
    index = t.get_device()
    return index, stream(index)


def stream(index):
    """The last argument of a kernel launch on device `index`: on the CPU (-1) the number of threads
    the kernel may use (torch's own setting, torch.get_num_threads()), else the raw handle of the
    stream torch is using on that GPU now."""
    if index < 0:
        return torch.get_num_threads()
    if not CUDA_COMPILED:
        raise RuntimeError("fastkern: this build has no CUDA support (rebuild with nvcc on the PATH "
                           "or FASTKERN_CUDA=1); CPU tensors still work")
    return _raw_stream(index)


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


# ---- fallbacks ---------------------------------------------------------------------------------
# A public function handed an argument fastkern does not implement (an SDPA attn_mask, dropout)
# runs torch's own implementation instead and counts it here; fastkern.set_fallback(False) makes
# that a NotImplementedError naming the argument.

_STATS = {}
_FALLBACK = [True]


def fallback(op, argument):
    """Records one fallback of fastkern.<op> for `argument`, or raises NotImplementedError when
    fallbacks are off."""
    if not _FALLBACK[0]:
        raise NotImplementedError(f"fastkern.{op}: {argument} is not supported by fastkern's kernels "
                                  f"(fastkern.set_fallback(True) runs torch's implementation instead)")
    if torch.compiler.is_compiling():
        # Not counted inside a compiled graph: dynamo would guard on the count it read, and every
        # call would then recompile (transformers' GPT-2 under compile: 8 recompiles, then eager).
        return
    key = f"fallback.{op}.{argument}"
    _STATS[key] = _STATS.get(key, 0) + 1


def stats(reset=False):
    """Counters of what ran where, e.g. {"fallback.scaled_dot_product_attention.attn_mask": 3}: calls
    that fell back to torch, by function and argument (eager calls: torch.compile'd code does not count).
    reset=True clears them (returns the old ones)."""
    out = dict(_STATS)
    if reset:
        _STATS.clear()
    return out


def set_fallback(enabled):
    """Whether unsupported arguments fall back to torch (default True) or raise NotImplementedError;
    returns the previous setting."""
    previous = _FALLBACK[0]
    _FALLBACK[0] = bool(enabled)
    return previous
