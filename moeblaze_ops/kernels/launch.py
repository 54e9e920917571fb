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
Proton) and argument kinds the key does not know take the JIT's path every time. Triton's own debug switches (``triton.knobs``, ``TRITON_DEBUG``)
are part of the JIT's key, not of a plan's: set them before the first launch.
"""

from __future__ import annotations

import inspect

import torch

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
    """One kernel's parameters, as the launch path needs them: ``bind`` (``_binder``) and
    the plans made so far."""

    def __init__(self, kernel):
        params = list(inspect.signature(kernel.fn).parameters.values())
        self.bind = _binder([p.name for p in params], [p.is_constexpr for p in kernel.params],
                            [p.default for p in params])
        self.plans = {}


#: What the generated binders' code names beside the kernel's parameters, under names no
#: kernel parameter has (a parameter named ``type`` must not hide the builtin).
_BINDER_SCOPE = {"_plan_kind": argument_kind, "_plan_tensor": torch.Tensor, "_plan_type": type, "_plan_int": int,
                 "_plan_tuple": tuple}


def _binder(names, constexpr, defaults):
    """A function ``bind(device, *args, **kwargs) -> (key, values)`` for a kernel with these
    parameters, made once per kernel (as Triton's JIT makes its own binder): Python binds
    the call's arguments to the parameters (a keyword that is none of them is a launch
    option, such as num_warps), then one expression builds the plan's key (the device,
    the options, each constexpr's value and each other parameter's kind,
    ``_inline_kind``) and the values in parameter order. A call Python cannot bind
    (missing, repeated or surplus arguments) raises TypeError."""
    reserved = set(_BINDER_SCOPE) | {"_plan_device", "_plan_options", "_plan_defaults"}
    if reserved & set(names):
        raise _Unplannable(f"parameter names {sorted(reserved & set(names))}")
    params = [name if default is inspect.Parameter.empty else f"{name}=_plan_defaults[{i}]"
              for i, (name, default) in enumerate(zip(names, defaults))]
    kinds = [name if const else _inline_kind(name) for name, const in zip(names, constexpr)]
    source = (f"def bind(_plan_device, /, {', '.join(params + ['**_plan_options'])}):\n"
              f"    return (_plan_device, _plan_tuple(_plan_options.items()), {', '.join(kinds)}), "
              f"[{', '.join(names)}]\n")
    scope = dict(_BINDER_SCOPE, _plan_defaults=tuple(defaults))
    exec(source, scope)  # noqa: S102 - the source is built from the kernel's parameter names alone
    return scope["bind"]


def _inline_kind(name):
    """An expression for parameter ``name``'s kind, as ``argument_kind`` gives it, without
    its call for the common arguments: a plain tensor, and an int in 32 bits (whose key
    leaves out the width; every wider int keeps ``argument_kind``'s three-part key)."""
    return (f"(({name}.dtype, {name}.data_ptr() % 16 == 0) if _plan_type({name}) is _plan_tensor else "
            f"({name} == 1, {name} % 16 == 0) if _plan_type({name}) is _plan_int and "
            f"{_I32_MIN} <= {name} <= {_I32_MAX} else _plan_kind({name}))")


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

        try:
            sig = _Signature(kernel) if isinstance(kernel, JITFunction) else None
        except _Unplannable:  # parameter names the binder cannot take
            sig = None
        _signatures[kernel] = sig
    return sig


def plan_key(sig: _Signature, device: int, args, kwargs):
    """``(key, values)``: the key of a call's plan and its arguments in the kernel's
    parameter order (defaults filled in), as the launcher takes them."""
    try:
        return sig.bind(device, *args, **kwargs)
    except TypeError as e:  # missing, repeated or surplus arguments: the JIT's path says so properly
        raise _Unplannable(str(e)) from None


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, the JIT's work skipped where this call's key has
    a compiled kernel already (see the module's doc). ``grid`` is a tuple of ints."""
    sig = kernel_signature(kernel)
    if sig is None:
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
