"""Post-import hooks: run a callback right after a module is first imported.

The package registers its transformers experts backends this way, so the import order of
``moeblaze_ops`` and transformers does not matter and ``import moeblaze_ops`` never imports
transformers itself.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings

__all__ = ["PostImportHook", "when_imported"]


class PostImportHook(importlib.abc.MetaPathFinder):
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


def when_imported(name, callback):
    """Runs ``callback(module)`` now if the module ``name`` is already imported, else right
    after its first import. Idempotent per (name, callback): a second call while a hook is
    pending adds none."""
    with _hook_lock:
        module = sys.modules.get(name)
        if module is None:
            if not any(isinstance(f, PostImportHook) and f.name == name and f.callback == callback
                       for f in sys.meta_path):
                # First: ahead of the finders that would load the module.
                sys.meta_path.insert(0, PostImportHook(name, callback))
            return
    callback(module)
