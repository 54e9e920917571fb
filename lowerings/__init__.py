"""Inductor lowerings of the moeblaze GEMM ops to Triton templates (installed as
``moeblaze_ops.lowerings``).

``import moeblaze_ops`` registers them as soon as Inductor's lowering table is imported
(or at once if it already is), without importing Inductor itself. From then on a graph
compiled by Inductor runs ``moeblaze::expert_up`` and ``moeblaze::expert_down`` as
template kernels (``expert_ops``) built from the eager kernels' own tile functions
(``templates``), with their pointwise consumers fused into the epilogue; the cases the
templates do not cover call the ops' own kernels. ``compat`` holds the private Inductor
APIs they use, which move between torch releases.
"""

from __future__ import annotations

__all__ = ["register"]


def register(_module=None) -> bool:
    """Registers the lowerings (idempotent). False, registering nothing, where Triton is
    not installed: Inductor then calls the ops' own kernels."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    from . import expert_ops  # noqa: F401  (registers on import)

    return True


# Inductor's lowering table first: its import runs ``register`` through moeblaze_ops' import
# hook (once the table's module has finished importing), so a direct import of a submodule
# (``templates``, ``compat``) finds the lowerings registered, and the registration never
# meets ``compat`` half-imported (compat imports the table itself).
import torch._inductor.lowering  # noqa: E402,F401
