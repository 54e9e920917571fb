"""moeblaze_ops: the experts of a Mixture-of-Experts layer as ``torch.library`` custom ops.

Importing the package registers the ops in the ``moeblaze`` namespace:
``torch.ops.moeblaze.dispatch`` (three int32 index arrays that group the routed
(token, k) pairs by expert, with no copy of the tokens), ``expert_up`` (the up
projection, gathering token rows on the fly), ``expert_down`` (activation, down
projection and the weighted combine of each token's K outputs), and their backward ops
``expert_up_backward``, ``expert_down_backward``, ``expert_down_backward_`` (writes dH
over its ``h``) and ``expert_down_backward_recompute`` (recomputes ``h``). Each has a fake
function, so ``torch.compile(fullgraph=True)`` captures it. CUDA tensors run Triton
kernels; CPU and float64 tensors run vectorised PyTorch.

- ``moe_experts``: the differentiable experts layer composed of those ops, the front door.
- ``dispatch``, ``expert_up``, ``expert_down``, ``expert_up_backward``,
  ``expert_down_backward``: the ops themselves (``torch.library.custom_op`` objects),
  callable from Python.
- ``ACTIVATIONS``, ``GATED_ACTIVATIONS``, ``is_gated``: the activations the kernels fuse.
- ``settings``: the kernel settings (backend choice, tiles, ...), changed for a block with
  ``settings.override``.
- ``moeblaze_ops.hf`` (not imported here): the transformers (v5) experts backends
  ``experts_implementation="moeblaze"`` and ``"moeblaze_recompute"``. They are registered
  whatever the import order: ``import moeblaze_ops.hf`` registers them; importing
  ``moeblaze_ops`` registers them as soon as transformers loads its experts interface
  (``transformers.integrations.moe``), or at once if it already has. ``import moeblaze_ops``
  alone never imports transformers.
- ``moeblaze_ops.testing`` (not imported here): random layers, seeds and a float64
  reference MoE for tests and scripts.
"""

import importlib.abc
import sys
import threading
import warnings

from . import settings
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
    "settings",
]

__version__ = "0.1.0"

#: The transformers module that defines ``ExpertsInterface``; the HF backends are
#: registered once it has been executed.
_HF_EXPERTS_MODULE = "transformers.integrations.moe"


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Calls ``callback(module)`` once, right after the module ``name`` is first executed.

    A ``sys.meta_path`` finder that finds nothing itself: on the import of ``name`` it asks
    the finders after it for the real spec and wraps that spec's ``loader.exec_module``, so
    the module is loaded exactly as without the hook. After the callback it removes itself
    from ``sys.meta_path`` and restores the loader; nothing remains. If ``name`` is never
    imported, it only costs one string comparison per import.
    """

    def __init__(self, name, callback):
        self.name = name
        self.callback = callback
        self._lock = threading.Lock()
        self._done = False

    def find_spec(self, fullname, path=None, target=None):
        """The real spec of ``name`` with its loader's ``exec_module`` wrapped; None for any
        other module (the next finders then look)."""
        if fullname != self.name or self._done:
            return None
        spec = None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec  # not found, or a loader we cannot wrap: import as usual, without the callback
        # An instance attribute, so only this loader (one per module spec for source files)
        # sees the wrapper; remember any instance attribute it had, to put it back.
        had_own = "exec_module" in vars(loader)
        original = loader.exec_module

        def exec_module(module):
            if getattr(module, "__name__", None) != fullname:
                return original(module)  # a loader shared with other modules (a zip archive's)
            try:
                original(module)
            finally:
                if had_own:
                    loader.exec_module = original
                else:
                    del loader.exec_module
            self._fire(module)  # only reached when the module executed without error

        loader.exec_module = exec_module
        return spec

    def _fire(self, module):
        with self._lock:
            if self._done:
                return
            self._done = True
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        try:
            self.callback(module)
        except Exception as error:  # never break the user's import of the module
            warnings.warn(f"moeblaze_ops: {getattr(self.callback, '__name__', self.callback)} failed after the "
                          f"import of {self.name}: {error!r}", RuntimeWarning)


_hook_lock = threading.Lock()


def _when_imported(name, callback):
    """Runs ``callback(module)`` now if the module ``name`` is already imported, else right
    after its first import. Idempotent per (name, callback): a second call while a hook is
    pending adds none."""
    with _hook_lock:
        module = sys.modules.get(name)
        if module is None:
            if not any(isinstance(f, _PostImportHook) and f.name == name and f.callback == callback
                       for f in sys.meta_path):
                # First: ahead of the finders that would load the module.
                sys.meta_path.insert(0, _PostImportHook(name, callback))
            return
    callback(module)


def _register_hf_backends(_module=None):
    """Registers the transformers experts backends (``import moeblaze_ops.hf`` does it)."""
    from . import hf  # noqa: F401  (registers on import)

    hf.register()  # idempotent; also covers a reload of transformers' module


_when_imported(_HF_EXPERTS_MODULE, _register_hf_backends)
