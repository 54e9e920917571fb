"""The moeblaze ops: ``torch.library`` custom ops with fake functions and autograd formulas.

``dispatch`` groups the routed rows by expert (``ops/dispatch.py``); ``expert_up``,
``expert_down``, their backward ops and ``expert_layer`` (both projections, h never made)
run the experts (``ops/experts.py``).
"""

import inspect

import torch


def document(op):
    """Gives ``op`` (a ``CustomOpDef``) and its ``torch.ops.moeblaze`` packet the op's own
    schema and docstring, so ``help()`` shows them instead of the classes' documentation."""
    packet = getattr(getattr(torch.ops, op._namespace), op._name)
    doc = f"{packet.default._schema}\n\n{inspect.cleandoc(op._init_fn.__doc__ or '')}"
    op.__doc__ = doc
    packet.__doc__ = doc
    return op
