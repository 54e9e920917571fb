"""Triton launches that skip the JIT's per-call work once a kernel is compiled for the
kind of arguments at hand.

``kernel[grid](*args, **kwargs)`` binds every argument, specialises each one (its type,
a pointer's 16-byte alignment, an int equal to 1 or divisible by 16), turns that and the
options into a cache key, finds the compiled kernel, then calls its launcher. On the
host that is tens of microseconds a launch beyond the launcher, and small layers, whose
GPU work is shorter than their host time, pay it on every launch of every step.

``launch`` keeps each compiled kernel under a key of its own that refines Triton's
specialisation: two calls with equal keys have equal specialisations (the tests check
this against Triton's own), so they run the same compiled kernel. A key not seen yet
goes through the JIT once, which compiles or finds the kernel, launches it, and hands it
over. Interpreted kernels (``TRITON_INTERPRET=1``), launch hooks (profilers such as
Proton), argument kinds the key does not know, and ``settings.launch_plans`` off take
the JIT's path every time. Triton's own debug switches (``triton.knobs``, ``TRITON_DEBUG``)
are part of the JIT's key, not of a plan's: set them before the first launch.
"""

from __future__ import annotations

import inspect

import torch

from .. import settings

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
#: Past this many keys a kernel's plans start over (token counts that keep changing).
_MAX_PLANS = 512


class _Unplannable(Exception):
    """An argument whose specialisation the key does not model."""


def argument_kind(value):
    """What Triton's specialisation of a non-constexpr argument depends on, as a hashable
    key: equal kinds specialise equally. Raises ``_Unplannable`` for anything else."""
    kind = type(value)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        return value.dtype, value.data_ptr() % 16 == 0
    if kind is int:
        width = 0 if _I32_MIN <= value <= _I32_MAX else 1 if _I64_MIN <= value <= _I64_MAX else 2
        return value == 1, value % 16 == 0, width
    if kind is float or kind is bool or value is None:
        return kind
    base = getattr(value, "base", None)
    if type(base) is torch.Tensor and kind.__name__ == "TensorDescriptor":
        # Descriptors specialise on dtype, block shape and layout; shapes and strides are
        # runtime values the launcher encodes.
        return (kind, base.dtype, tuple(value.block_shape), getattr(value, "layout", None),
                getattr(value, "padding", None))
    raise _Unplannable(kind.__name__)


class _Signature:
    """One kernel's parameters, as the launch path needs them."""

    def __init__(self, kernel):
        params = list(inspect.signature(kernel.fn).parameters.values())
        self.names = [p.name for p in params]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.constexpr = [p.is_constexpr for p in kernel.params]
        self.defaults = [p.default for p in params]
        self.plans = {}


_signatures: dict = {}
_triton = {}


def _runtime():
    """Triton's current-device and current-stream functions and its knobs, looked up once."""
    if not _triton:
        from triton import knobs
        from triton.runtime import driver

        _triton.update(device=driver.active.get_current_device, stream=driver.active.get_current_stream,
                       knobs=knobs)
    return _triton


def _hooks_idle(knobs) -> bool:
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # a HookChain with no calls is idle
            return False
    return True


def kernel_signature(kernel):
    """The parameters and plans of a ``triton.jit`` kernel; None for the interpreter's
    kernels (and any other launcher), which take the JIT's path."""
    sig = _signatures.get(kernel, False)
    if sig is False:
        from triton.runtime.jit import JITFunction

        sig = _Signature(kernel) if isinstance(kernel, JITFunction) else None
        _signatures[kernel] = sig
    return sig


def plan_key(sig: _Signature, device: int, args, kwargs):
    """``(key, values)``: the key of a call's plan and its arguments in the kernel's
    parameter order (defaults filled in), as the launcher takes them."""
    if len(args) > len(sig.names):
        raise _Unplannable("too many arguments")  # the JIT's path says so properly
    values = list(args)
    values.extend(sig.defaults[len(args):])
    options = []
    for name, value in kwargs.items():
        i = sig.index.get(name)
        if i is None:
            options.append((name, value))  # num_warps, num_stages, ...
        elif i < len(args):
            raise _Unplannable(f"{name} given twice")
        else:
            values[i] = value
    kinds = [v if const else argument_kind(v) for v, const in zip(values, sig.constexpr)]
    return (device, tuple(options), *kinds), values


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, the JIT's work skipped where this call's key has
    a compiled kernel already (see the module's doc). ``grid`` is a tuple of ints."""
    sig = kernel_signature(kernel)
    if sig is None or not settings.current().launch_plans:
        kernel[grid](*args, **kwargs)
        return
    runtime = _runtime()
    device = runtime["device"]()
    try:
        key, values = plan_key(sig, device, args, kwargs)
        compiled = sig.plans.get(key)
    except (_Unplannable, TypeError):  # an argument kind not modelled, an unhashable constexpr
        kernel[grid](*args, **kwargs)
        return
    if compiled is None or not _hooks_idle(runtime["knobs"]):
        compiled = kernel[grid](*args, **kwargs)
        if len(sig.plans) >= _MAX_PLANS:
            sig.plans.clear()
        if hasattr(compiled, "packed_metadata"):
            sig.plans[key] = compiled
        return
    g0, g1, g2 = (*grid, 1, 1)[:3]
    compiled.run(g0, g1, g2, runtime["stream"](device), compiled.function, compiled.packed_metadata, None, None, None,
                 *values)
