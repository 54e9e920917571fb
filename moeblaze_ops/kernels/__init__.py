"""Kernels behind the ops, and the choice between them.

- ``torch_dispatch``, ``torch_experts``: portable vectorised PyTorch: CPU and float64.
- ``triton_dispatch``, ``triton_experts``: Triton kernels of the forward ops, used for
  CUDA tensors. Tests can force them on CPU tensors under ``TRITON_INTERPRET=1`` with
  ``force_triton()`` (or ``MOEBLAZE_FORCE_TRITON=1``).
- ``triton_experts_backward``: Triton kernels of the backward ops, used wherever the
  forward's are; ``triton_backward(False)`` (or ``MOEBLAZE_TRITON_BACKWARD=0``) falls back
  to the PyTorch backward (a debugging aid).
"""

from __future__ import annotations

import contextlib
import importlib
import os

import torch

_switches = {
    "force": os.environ.get("MOEBLAZE_FORCE_TRITON", "") == "1",
    "backward": os.environ.get("MOEBLAZE_TRITON_BACKWARD", "1") != "0",
}


@contextlib.contextmanager
def _switched(name, enabled):
    before, _switches[name] = _switches[name], enabled
    try:
        yield
    finally:
        _switches[name] = before


def force_triton(enabled: bool = True):
    """Runs the Triton kernels on any device (CPU tensors need ``TRITON_INTERPRET=1``)."""
    return _switched("force", enabled)


def triton_backward(enabled: bool = True):
    """Whether the backward ops run their Triton kernels where the forward's run (the
    default; ``MOEBLAZE_TRITON_BACKWARD=0`` turns it off for the process)."""
    return _switched("backward", enabled)


def uses_triton(t: torch.Tensor) -> bool:
    """Whether the forward ops run their Triton kernels on tensors like ``t``."""
    if t.dtype == torch.float64:
        return False  # Triton's dot has no float64 path; float64 is for gradcheck on CPU
    return _switches["force"] or t.device.type == "cuda"


def forward_kernels(t: torch.Tensor, family: str):
    """The kernel module of ``family`` ("dispatch" or "experts") for tensors like ``t``."""
    prefix = "triton" if uses_triton(t) else "torch"
    return importlib.import_module(f"{__name__}.{prefix}_{family}")


def backward_kernels(t: torch.Tensor):
    """The kernel module of the backward ops for tensors like ``t``."""
    if _switches["backward"] and uses_triton(t):
        return importlib.import_module(f"{__name__}.triton_experts_backward")
    return importlib.import_module(f"{__name__}.torch_experts")
