"""moeblaze_ops: Mixture-of-Experts primitives as ``torch.library`` custom ops.

Importing the package registers the ops in the ``moeblaze`` namespace
(``torch.ops.moeblaze.dispatch``, ``expert_up``, ``expert_down``,
``expert_up_backward``, ``expert_down_backward``, its in-place form ``expert_down_backward_``
and ``expert_down_backward_recompute``).
``moe_experts`` composes them into a differentiable experts layer. ``import moeblaze_ops.hf``
registers the transformers (v5) experts backends ``experts_implementation="moeblaze"`` and
``"moeblaze_recompute"``; importing ``moeblaze_ops`` after transformers does too.
"""

from .activations import ACTIVATIONS, GATED_ACTIVATIONS, is_gated
from .functional import moe_experts
from .ops.dispatch import dispatch
from .ops.experts import expert_down, expert_down_backward, expert_up, expert_up_backward

__all__ = [
    "ACTIVATIONS",
    "GATED_ACTIVATIONS",
    "is_gated",
    "moe_experts",
    "dispatch",
    "expert_up",
    "expert_down",
    "expert_up_backward",
    "expert_down_backward",
]

__version__ = "0.1.0"


def _register_hf_backend():
    """Registers ``experts_implementation="moeblaze"`` if transformers is already imported.

    Importing transformers' experts interface costs seconds, so a program that has not
    imported transformers does not pay for it here: ``import moeblaze_ops.hf`` registers
    the backend in every case.
    """
    import sys

    if "transformers" in sys.modules:
        from . import hf  # noqa: F401  (registers on import)


_register_hf_backend()
