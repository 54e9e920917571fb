"""The private Inductor APIs the lowerings use, in one place.

They move between torch releases (2.11 on the GPU machine, 2.13 and 2.14 in CI and for
users); everything version-dependent is decided here, once, and the other modules of the
package call these names only.
"""

from __future__ import annotations

import torch
from torch._inductor import ir
from torch._inductor import lowering as _lowering
from torch._inductor import select_algorithm as _select
from torch._inductor.virtualized import V

__all__ = [
    "DonatedBuffer",
    "SymbolicGridFn",
    "TritonTemplate",
    "contiguous",
    "fallback",
    "fixed_layout",
    "hint",
    "known_zero",
    "lowerings",
    "register_lowering",
    "select_algorithm",
    "slice_view",
    "static_int",
    "concat",
]

TritonTemplate = _select.TritonTemplate
SymbolicGridFn = _select.SymbolicGridFn
DonatedBuffer = ir.DonatedBuffer
register_lowering = _lowering.register_lowering
lowerings = _lowering.lowerings


def select_algorithm(name, choices, input_nodes, layout, input_gen_fns=None):
    """The node of the fastest choice (the only one without max-autotune). torch 2.11
    returns the node; later releases return (node, extra)."""
    result = _select.autotune_select_algorithm(name, choices, input_nodes, layout, input_gen_fns=input_gen_fns)
    return result[0] if isinstance(result, tuple) else result


def fallback(op_overload, *args, **kwargs):
    """The op's own kernel as an extern call in the compiled graph (what Inductor does for
    an op with no lowering), for the cases a template does not cover."""
    return _lowering.fallback_handler(op_overload, add_to_fallback_set=False)(*args, **kwargs)


def contiguous(node):
    """``node`` realized as a buffer with a row-major layout."""
    return ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(node))


def realized(node):
    """``node`` realized as a buffer (or a view of one) with a unit stride somewhere."""
    return ir.ExternKernel.require_stride1(ir.ExternKernel.realize_input(node))


def fixed_layout(device, dtype, size):
    """A row-major layout the template writes its output in."""
    return ir.FixedLayout(device, dtype, list(size), ir.FlexibleLayout.contiguous_strides(list(size)))


def hint(expr) -> int:
    """The concrete value Inductor assumes for a (possibly symbolic) size."""
    return int(V.graph.sizevars.optimization_hint(expr))


def static_int(expr) -> int:
    """A size the kernel is specialised to (its tile count, a constexpr): its value, with a
    guard that recompiles the graph if it changes (under ``dynamic=True`` weight shapes are
    symbols too)."""
    return int(V.graph.sizevars.guard_int(expr))


def known_zero(expr) -> bool:
    """Whether a size is 0 for certain, without a guard (a symbolic token count is never
    0: Dynamo specialises the sizes 0 and 1)."""
    return V.graph.sizevars.statically_known_equals(expr, 0)


def slice_view(node, dim, start, end):
    """``node[..., start:end, ...]`` along ``dim`` as a view (no copy)."""
    return lowerings[torch.ops.aten.slice.Tensor](node, dim, start, end)


def concat(nodes, dim):
    """``torch.cat(nodes, dim)`` through Inductor's own lowering.

    That lowering reads the graph's current node as the ``aten.cat`` it lowers (its first
    argument, the list of inputs, for their memory format; some torch versions assert it
    is a list). Called from inside another op's lowering, the current node is that op, so
    the concat runs under a stand-in ``cat`` node whose inputs carry no metadata (every
    input here is a row-major buffer)."""
    stand_in = torch.fx.Graph().call_function(torch.ops.aten.cat.default, ([], dim))
    with V.graph.set_current_node(stand_in):
        return lowerings[torch.ops.aten.cat.default](list(nodes), dim)
