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
    op.__doc__ = document_packet(packet, op._init_fn.__doc__).__doc__
    return op


def document_packet(packet, docstring):
    """``packet`` (a ``torch.ops`` op) with its schema and ``docstring`` as its help."""
    packet.__doc__ = f"{packet.default._schema}\n\n{inspect.cleandoc(docstring or '')}"
    return packet
