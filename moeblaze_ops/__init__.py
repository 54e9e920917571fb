"""moeblaze_ops: the experts of a Mixture-of-Experts layer as ``torch.library`` custom ops.

Importing the package registers the ops in the ``moeblaze`` namespace:
``torch.ops.moeblaze.dispatch`` (three int32 index arrays that group the routed
(token, k) pairs by expert, with no copy of the tokens), ``expert_up`` (the up
projection, gathering token rows on the fly), ``expert_down`` (activation, down
projection and the weighted combine of each token's K outputs), and their backward ops
``expert_up_backward``, ``expert_down_backward``, ``expert_down_backward_`` (writes dH
over its ``h``) and ``expert_down_backward_recompute`` (recomputes ``h``), and
``expert_layer`` (the up and down projections in one op that never makes ``h``: the
activation comes from the up GEMM's epilogue; its backward recomputes h). Each has a fake
function, so ``torch.compile(fullgraph=True)`` captures it. CUDA tensors run Triton
kernels; CPU and float64 tensors run vectorised PyTorch.

- ``moe_experts``: the differentiable experts layer composed of those ops, the front door.
- ``dispatch``, ``expert_up``, ``expert_down``, ``expert_up_backward``,
  ``expert_down_backward``, ``expert_layer``: the ops themselves (their
  ``torch.ops.moeblaze`` packets), callable from Python.
- ``ACTIVATIONS``, ``GATED_ACTIVATIONS``, ``is_gated``: the activations the kernels fuse.
- ``settings``: the kernel settings (backend choice, tiles, ...), changed for a block with
  ``settings.override``.
- ``moeblaze_ops.hf`` (not imported here): the transformers (v5) experts backends
  ``experts_implementation="moeblaze"`` and ``"moeblaze_recompute"``. They are registered
  whatever the import order: ``import moeblaze_ops.hf`` registers them; importing
  ``moeblaze_ops`` registers them as soon as transformers loads its experts interface
  (``transformers.integrations.moe``), or at once if it already has. ``import moeblaze_ops``
  alone never imports transformers.
- ``moeblaze_ops.lowerings`` (not imported here): Inductor lowerings of the GEMM ops to
  Triton templates, registered as soon as Inductor's lowering table is imported.
- ``moeblaze_ops.testing`` (not imported here): random layers, seeds and a float64
  reference MoE for tests and scripts.
- ``fp8``: the FP8 (e4m3) formats, 1 x 128 tiles of rows and 128 x 128 blocks of weights
  with fp32 scales: quantize and dequantize (``moe_experts(..., precision="fp8")`` and its
  FP8 weights use them).
"""

from . import fp8, settings
from .import_hooks import when_imported
from .activations import ACTIVATIONS, GATED_ACTIVATIONS, is_gated
from .functional import moe_experts
from .ops.dispatch import dispatch
from .ops.experts import expert_down, expert_down_backward, expert_layer, expert_up, expert_up_backward
from .ops import formulas as _formulas  # noqa: F401  (registers the autograd formulas)

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
    "expert_layer",
    "settings",
    "fp8",
]

__version__ = "0.1.0"

#: The transformers module that defines ``ExpertsInterface``; the HF backends are
#: registered once it has been executed.
_HF_EXPERTS_MODULE = "transformers.integrations.moe"
#: transformers' expert-parallel module (5.19 and later), where EP implementations register.
_HF_EXPERT_PARALLEL_MODULE = "transformers.distributed.expert_parallel"


def _register_hf_backends(_module=None):
    """Registers the transformers experts backends (``import moeblaze_ops.hf`` does it)."""
    from . import hf  # noqa: F401  (registers on import)

    hf.register()  # idempotent; also covers a reload of transformers' module


def _register_hf_fp8_backend(_module=None):
    """Registers the FP8 experts backend (``hf.register_fp8``) in transformers'
    ``FP8ExpertsInterface``."""
    from . import hf

    hf.register_fp8()


def _register_hf_expert_parallel(_module=None):
    """Registers ``DistributedConfig(ep_implementation="moeblaze")`` (transformers >= 5.19)."""
    from . import hf_expert_parallel

    hf_expert_parallel.register()


def _register_lowerings(_module=None):
    """Registers the Inductor lowerings (``moeblaze_ops.lowerings``), and puts the settings
    and the package's code into the key of the compile caches (``settings``)."""
    from . import lowerings

    lowerings.register()
    settings._tag_compile_caches()


when_imported(_HF_EXPERTS_MODULE, _register_hf_backends)
when_imported("torch._inductor.lowering", _register_lowerings)
when_imported(_HF_EXPERT_PARALLEL_MODULE, _register_hf_expert_parallel)
when_imported("transformers.integrations.finegrained_fp8", _register_hf_fp8_backend)
