"""The moeblaze ops: schemas, kernels, fake functions and autograd formulas.

Every op is defined once, through the low-level ``torch.library`` API (``define`` and
``impl``), which costs a call the dispatcher alone, not the Python wrappers of
``torch.library.custom_op`` (small layers pay host time on every op of every step):

- ``ops/dispatch.py``: ``dispatch``, the routing as three small int32 index arrays;
- ``ops/experts.py``: ``expert_up``, ``expert_down``, ``expert_layer`` (both projections,
  h never made) and the backward ops, with their fake functions;
- ``ops/formulas.py``: the autograd formulas, each written once and registered on its op.

``moeblaze_ops.moe_experts`` (``functional.py``) is made of these ops in every mode.
"""

from __future__ import annotations

import inspect

import torch

#: The library every moeblaze op is defined in.
LIB = torch.library.Library("moeblaze", "FRAGMENT")


def define(schema: str, kernel, fake, doc: str):
    """Defines op ``schema`` (``"name(args) -> returns"``) in the ``moeblaze`` namespace,
    ``kernel`` as its implementation for every backend and ``fake`` as its fake function;
    returns the ``torch.ops.moeblaze`` op, whose ``help()`` shows the schema and ``doc``."""
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"moeblaze::{name}", fake, lib=LIB)
    packet = getattr(torch.ops.moeblaze, name)
    packet.__doc__ = f"{packet.default._schema}\n\n{inspect.cleandoc(doc)}"
    return packet
