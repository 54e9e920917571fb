"""The kernels behind the ops, and the one place that picks them per device.

Two backends implement every op:

- ``TORCH``: portable vectorised PyTorch (``torch_backend.dispatch``, ``torch_backend.experts``): CPU
  tensors, float64, and anywhere ``settings.backend == "torch"``.
- ``TRITON``: Triton kernels (``triton_backend.dispatch``, ``triton_backend.experts``,
  ``triton_backend.experts_backward``, built on the grouped-GEMM core ``triton_backend.grouped_gemm``): CUDA
  tensors, and CPU tensors under ``TRITON_INTERPRET=1`` when ``settings.backend ==
  "triton"``. Triton is imported the first time this backend is chosen, never before:
  ``import moeblaze_ops`` and the CPU path run without Triton installed (it is a
  dependency only on Linux x86_64 and aarch64, where it publishes wheels). Choosing
  this backend without it raises ``TritonUnavailableError`` (an ``ImportError``) naming
  the fixes; choosing it for CPU tensors outside Triton's interpreter raises
  ``TritonDeviceError``, naming them too.

``forward_backend(t)`` and ``backward_backend(t)`` say which one runs for tensors like ``t``
(the same one: the backward runs where the forward ran). Which kernel, tile and variant a
backend runs is ``kernels.config``'s rules.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from .. import checks, settings
from .torch_backend import dispatch as torch_dispatch
from .torch_backend import experts as torch_experts


@dataclass(frozen=True)
class Backend:
    """The functions of one kernel backend, one per op family (signatures of the ops,
    see ``moeblaze_ops.ops``)."""

    name: str
    dispatch: Callable
    expert_up: Callable
    #: act(h) of ``expert_up``'s rows, h never kept where the kernels allow (the up
    #: GEMM's epilogue activates): ``expert_layer``'s up projection.
    expert_up_activated: Callable
    #: ``(h, act(h))``: ``expert_up``'s h and act(h) beside it (the activation's arguments
    #: follow ``transposed``), for ``expert_down_activated``.
    expert_up_with_activation: Callable
    expert_down: Callable
    #: ``expert_down`` of rows ``expert_up_activated`` activated (no activation arguments).
    expert_down_activated: Callable
    expert_up_backward: Callable
    expert_down_backward: Callable
    #: ``expert_layer`` on FP8 weights: ``(x, w_gate_up, w_gate_up_scale, w_down,
    #: w_down_scale, <index arrays>, topk_weights, b_gate_up, b_down, activation, transposed,
    #: interleaved, alpha, limit)``.
    expert_layer_fp8: Callable
    #: ``(op, expert_token_indices, expert_offsets, token_index_map, num_tokens)``: checks the
    #: index arrays' values (on the host for the portable backend, on the device for Triton).
    check_index_values: Callable
    #: The same for the backward ops. The Triton backend checks nothing there: its backward
    #: ops get the arrays autograd saved from a forward that checked them, and each device
    #: check costs a launch on the host-bound small layers.
    check_backward_index_values: Callable


TORCH = Backend(
    name="torch",
    dispatch=torch_dispatch.dispatch,
    expert_up=torch_experts.expert_up,
    expert_up_activated=torch_experts.expert_up_activated,
    expert_up_with_activation=torch_experts.expert_up_with_activation,
    expert_down=torch_experts.expert_down,
    expert_down_activated=torch_experts.expert_down_activated,
    expert_up_backward=torch_experts.expert_up_backward,
    expert_down_backward=torch_experts.expert_down_backward,
    expert_layer_fp8=torch_experts.expert_layer_fp8,
    check_index_values=checks.check_index_values,
    check_backward_index_values=checks.check_index_values,
)


class TritonUnavailableError(ImportError):
    """The Triton backend was chosen but Triton cannot be imported."""


class TritonDeviceError(RuntimeError):
    """The Triton backend was chosen for tensors no Triton kernel can run on here: CPU
    tensors outside Triton's interpreter."""


def _import_triton() -> None:
    """Imports Triton, or raises ``TritonUnavailableError`` saying how to go on without it."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        backend = settings.current().backend
        why = ("settings.backend is 'triton'" if backend == "triton"
               else "CUDA tensors run the Triton kernels under settings.backend 'auto'")
        raise TritonUnavailableError(
            f"moeblaze_ops: the Triton backend was chosen ({why}), but triton cannot be imported "
            f"({type(error).__name__}: {error}). Install it with `pip install triton` (wheels exist for "
            "Linux x86_64 and aarch64), or run the portable PyTorch kernels: set MOEBLAZE_BACKEND=torch "
            "before the first op runs, or wrap the calls in moeblaze_ops.settings.override(backend=\"torch\")."
        ) from error


def _trusted(op, expert_token_indices, expert_offsets, token_index_map, num_tokens) -> None:
    """No check (see ``Backend.check_backward_index_values``)."""


@functools.lru_cache(maxsize=None)
def load_triton_backend() -> Backend:
    """The Triton backend (imports Triton on the first call; raises ``TritonUnavailableError``,
    an ``ImportError``, when it is not installed)."""
    _import_triton()  # a clear error first, not a ModuleNotFoundError from inside a kernel module
    from .triton_backend import dispatch as triton_dispatch
    from .triton_backend import experts as triton_experts
    from .triton_backend import experts_backward as triton_experts_backward
    from .triton_backend import fp8_gemm as triton_fp8_gemm

    return Backend(
        name="triton",
        dispatch=triton_dispatch.dispatch_checked,
        expert_up=triton_experts.expert_up,
        expert_up_activated=triton_experts.expert_up_activated,
        expert_up_with_activation=triton_experts.expert_up_with_activation,
        expert_down=triton_experts.expert_down,
        expert_down_activated=triton_experts.expert_down_activated,
        expert_up_backward=triton_experts_backward.expert_up_backward,
        expert_down_backward=triton_experts_backward.expert_down_backward,
        expert_layer_fp8=triton_fp8_gemm.expert_layer_fp8,
        check_index_values=triton_dispatch.assert_index_arrays,
        check_backward_index_values=_trusted,
    )


@functools.lru_cache(maxsize=None)
def _interpreting() -> bool:
    """Whether Triton runs its kernels in its interpreter (``TRITON_INTERPRET=1``), which
    takes CPU tensors. Asked once: the kernels were made for one or the other when their
    modules loaded."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


def _check_triton_device(t: torch.Tensor) -> None:
    """Raises ``TritonDeviceError`` where the Triton backend cannot run on ``t``'s device."""
    if t.device.type != "cuda" and not _interpreting():
        raise TritonDeviceError(
            f"moeblaze_ops: settings.backend is 'triton', but the tensors are on {t.device.type}, and Triton runs "
            "kernels on CPU tensors only in its interpreter. Set TRITON_INTERPRET=1 in the environment before the "
            "process starts (slow: for tests), or run the portable PyTorch kernels: "
            "moeblaze_ops.settings.override(backend=\"torch\"), or backend \"auto\" (the default), which runs "
            "them for CPU tensors and Triton for CUDA ones.")


def _triton_for(t: torch.Tensor) -> Backend:
    """The Triton backend, checked for tensors like ``t``."""
    backend = load_triton_backend()
    _check_triton_device(t)
    return backend


def _uses_triton(t: torch.Tensor) -> bool:
    if t.dtype == torch.float64:
        return False  # Triton's dot has no float64 path; float64 is for gradcheck on CPU
    backend = settings.current().backend
    return backend == "triton" or (backend == "auto" and t.device.type == "cuda")


def forward_backend(t: torch.Tensor) -> Backend:
    """The backend of the forward ops (dispatch, expert_up, expert_down) for tensors like ``t``."""
    return _triton_for(t) if _uses_triton(t) else TORCH


def backward_backend(t: torch.Tensor) -> Backend:
    """The backend of the backward ops for tensors like ``t``: the forward's."""
    return forward_backend(t)
