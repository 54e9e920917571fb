"""Kernel settings: the choices a user makes about the kernels, in one frozen object.

The kernels read ``current()`` when they launch; tests, the benchmark and the tuning
scripts change it for a block of code with ``override``::

    with moeblaze_ops.settings.override(column_slab=None, poison=True):
        out = moeblaze_ops.moe_experts(...)

Everything else that picks a kernel, a tile or a variant is a rule of the measurements,
not a setting: ``moeblaze_ops.kernels.config``, keyed by GEMM kind, dtype, architecture
and shape.

Compiled graphs (``torch.compile``, ``moeblaze_ops.lowerings``) read the settings when
they compile, and keep them: Dynamo does not guard on them, and Inductor's graph caches
(in the process and on disk) do not key on them. Set them before the first compile, or
compile again after ``torch._dynamo.reset()`` with the FX graph cache off
(``TORCHINDUCTOR_FX_GRAPH_CACHE=0``) to compare settings in compiled code.

The package reads one environment variable: ``MOEBLAZE_BACKEND`` ("auto", "triton" or
"torch"), the default ``backend``, read when the settings are first needed (not at
import). ``MOEBLAZE_BACKEND=torch`` runs every op on the portable PyTorch kernels, for
ruling the Triton kernels out when a result looks wrong.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Mapping, Optional

if TYPE_CHECKING:
    from .kernels.config import GemmTile

__all__ = ["BACKENDS", "KernelSettings", "current", "override"]

#: The values of ``KernelSettings.backend`` (and of ``MOEBLAZE_BACKEND``).
BACKENDS = ("auto", "triton", "torch")

#: Settings that were removed, and what took their place: the default, whose alternative
#: never won, or a rule of ``moeblaze_ops.kernels.config``.
REMOVED = {
    "triton_backward": 'the backward runs on the forward\'s backend; backend="torch" for the portable kernels',
    "weight_tma": "weight tiles come through TMA where it fits, not in small GEMMs: kernels.config.reads_weight_by_tma",
    "gluon": "every GEMM with a Gluon kernel runs it where it applies: kernels.config.runs_gluon",
    "small_gemm_flop": "the rule kernels.config.SMALL_GEMM_FLOP",
    "gluon_warp_specialize": "the rule kernels.config.row_gemm_warp_specialized",
    "wgrad_band": "the weight gradients' tiles always go along each P-tile",
    "wgrad_rows_tma": "the weight gradients always read their row-ordered operand by TMA",
    "wgrad_tma_store": "the weight gradients store by TMA wherever it can",
    "wgrad_split_mma": "the rule kernels.config.wgrad_split_mma",
    "row_tma_store": "the Gluon row GEMMs always store by TMA",
    "row_band": "the rule kernels.config.ROW_BAND",
    "up_epilogue_activation": "the up GEMM's epilogue always activates where no h is kept",
    "activation_beside_h_max_columns": "the rule kernels.config.activation_beside_h",
    "activation_beside_h_min_rows": "the rule kernels.config.activation_beside_h",
    "fast_activation": "16-bit CUDA tensors always take the approximate sigmoid",
    "dh_fast_activation": "16-bit CUDA tensors always take the approximate sigmoid",
    "dh_epilogue_columns": "the rule kernels.config.DH_EPILOGUE_COLUMNS",
    "dh_wide_min_columns": "the rule kernels.config.dh_tile_kind",
    "column_slab_widen": "column slabs are always widened where the weight gradients leave room",
    "dispatch_sorted_min_bins": "the rule kernels.config.dispatch_family",
    "dispatch_sort_chunk": "the rule kernels.config.DISPATCH_SORT_CHUNK",
    "dispatch_one_program_max_rows": "the rule kernels.config.dispatch_family",
    "backward_templates": "the compiled backward runs grad_x as templates wherever they apply",
    "launch_plans": "repeated launches always skip the JIT's binding where a plan can",
    "lean_graph_calls": "compiled graphs call the public ops; the internal graph-call ops are gone",
}


@dataclass(frozen=True)
class KernelSettings:
    """What the kernels do, beyond their arguments. Change it with ``override``.

    Attributes:
        backend: "auto" (Triton kernels for CUDA tensors, PyTorch ones otherwise),
            "triton" (Triton everywhere; CPU tensors then need Triton's interpreter,
            ``TRITON_INTERPRET=1`` set before the process starts) or "torch" (the
            portable PyTorch kernels everywhere, forward and backward: the debugging
            aid). Its default comes from ``MOEBLAZE_BACKEND``, else "auto".
        poison: fill every buffer the kernels allocate with NaN first, so an element a
            kernel forgets to write shows (tests).
        tiles: per GEMM kind (``kernels.config.GEMM_KINDS``), a
            ``kernels.config.GemmTile`` used instead of the tile table's, and instead of
            a Gluon kernel's own tile where one runs (tuning).
        column_slab: width of the column slabs in which the [L*K, d] scratch (expert
            outputs before the combine, dX rows before their sum) is made, widened in
            whole multiples of it as far as the memory the layer's weight gradients take
            allows (``triton_backend.combine.widest_slab``), so that training peaks no higher
            than with narrow slabs; None: all d columns at once (more memory, fewer
            launches).
    """

    backend: str = "auto"
    poison: bool = False
    tiles: Mapping[str, GemmTile] = field(default_factory=dict)
    column_slab: Optional[int] = 512

    def __new__(cls, *args, **changes):
        # Before the generated __init__, whose TypeError would not say what a name became.
        _refuse_unknown_names(changes)
        return super().__new__(cls)

    def __post_init__(self):
        if not isinstance(self.backend, str) or self.backend not in BACKENDS:
            raise ValueError(f"moeblaze settings: backend must be one of {', '.join(map(repr, BACKENDS))}, "
                             f"got {self.backend!r}")
        if not isinstance(self.poison, bool):
            raise ValueError(f"moeblaze settings: poison must be True or False, got {self.poison!r}")
        object.__setattr__(self, "tiles", _checked_tiles(self.tiles))
        slab = self.column_slab
        if slab is not None and (not isinstance(slab, int) or isinstance(slab, bool) or slab < 1):
            raise ValueError(f"moeblaze settings: column_slab must be None or a positive int (columns per slab), "
                             f"got {slab!r}")

    def replace(self, **changes) -> "KernelSettings":
        """A copy with ``changes`` (field names as keywords); unknown names raise."""
        _refuse_unknown_names(changes)
        return dataclasses.replace(self, **changes)


def _field_names() -> tuple:
    return tuple(f.name for f in dataclasses.fields(KernelSettings))


def _refuse_unknown_names(changes) -> None:
    """ValueError for keywords that are no setting, saying what became of removed ones."""
    unknown = [name for name in changes if name not in _field_names()]
    if not unknown:
        return
    why = "; ".join(f"{name!r} was removed (now {REMOVED[name]})" if name in REMOVED else f"no setting named {name!r}"
                    for name in unknown)
    raise ValueError(f"moeblaze settings: {why}; the settings are: {', '.join(_field_names())}")


def _checked_tiles(tiles) -> dict:
    """``tiles`` as a dict of GEMM kind -> ``GemmTile`` (tuples of its fields are taken), or
    ValueError naming what is wrong."""
    from .kernels.config import GEMM_KINDS, GemmTile

    if not isinstance(tiles, Mapping):
        raise ValueError(f"moeblaze settings: tiles must be a mapping of GEMM kind to GemmTile, got {tiles!r}")
    unknown = sorted(set(tiles) - set(GEMM_KINDS))
    if unknown:
        raise ValueError(f"moeblaze settings: tiles has unknown GEMM kinds {unknown}; known: {GEMM_KINDS}")
    checked = {}
    for kind, tile in tiles.items():
        if isinstance(tile, GemmTile):
            checked[kind] = tile
        elif isinstance(tile, (tuple, list)) and 5 <= len(tile) <= 6:
            try:
                checked[kind] = GemmTile(*tile)
            except ValueError as error:
                raise ValueError(f"moeblaze settings: tiles[{kind!r}] = {tile!r}: {error}") from None
        else:
            raise ValueError(f"moeblaze settings: tiles[{kind!r}] must be a GemmTile (block_m, block_n, block_k, "
                             f"num_warps, num_stages[, programs_per_sm]), got {tile!r}")
    return checked


# One stack for the process, not one per thread: autograd runs the backward of CUDA ops
# on its own device threads, and those kernels must see the override in force where the
# forward ran.
_overrides: list = []
_overrides_lock = threading.Lock()
_process_default: Optional[KernelSettings] = None


def _default() -> KernelSettings:
    """The settings without an override: the defaults, ``backend`` from ``MOEBLAZE_BACKEND``."""
    global _process_default
    if _process_default is None:
        backend = os.environ.get("MOEBLAZE_BACKEND", "").strip() or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"moeblaze settings: MOEBLAZE_BACKEND={backend!r} is not a backend; "
                             f"allowed: {', '.join(map(repr, BACKENDS))}")
        _process_default = KernelSettings(backend=backend)
    return _process_default


def current() -> KernelSettings:
    """The settings in force (in every thread of the process)."""
    stack = _overrides
    return stack[-1] if stack else _default()


@contextlib.contextmanager
def override(settings: Optional[KernelSettings] = None, **changes) -> Iterator[KernelSettings]:
    """Runs a block with ``settings`` (or the current ones with ``changes``) in force, for
    the whole process: the autograd threads that run backward kernels see them too. Graphs
    ``torch.compile`` compiles in the block are cached under these settings
    (``_tag_compile_caches``)."""
    new = (settings or current()).replace(**changes) if changes else (settings or current())
    with _overrides_lock:
        _overrides.append(new)
        _tag_compile_caches()
    try:
        yield new
    finally:
        with _overrides_lock:
            # The newest entry that is this one (blocks in other threads may have ended in any order).
            for i in range(len(_overrides) - 1, -1, -1):
                if _overrides[i] is new:
                    del _overrides[i]
                    break
            _tag_compile_caches()


_CACHE_TAG = " moeblaze:"


@functools.lru_cache(maxsize=None)
def _code_digest() -> str:
    """A digest of the package's Python sources, the lowerings' among them (a checkout
    installs them apart from the package's folder)."""
    roots = {os.path.dirname(os.path.abspath(__file__))}
    spec = importlib.util.find_spec(f"{__package__}.lowerings")  # found, not imported
    if spec is not None and spec.submodule_search_locations:
        roots.update(os.path.abspath(p) for p in spec.submodule_search_locations)
    digest = hashlib.sha1()
    for root in sorted(roots):
        for folder, subfolders, files in os.walk(root):
            subfolders.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    with open(os.path.join(folder, name), "rb") as f:
                        digest.update(f.read())
    return digest.hexdigest()[:12]


def _fingerprint(config: KernelSettings) -> str:
    """A short digest of every field of ``config`` and of the package's code, made once
    per settings object (kept on it, outside its fields)."""
    code = _code_digest()
    kept = config.__dict__.get("_fingerprint")
    if kept is None or kept[0] != code:
        fields = [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)]
        text = repr([(name, sorted(value.items()) if isinstance(value, Mapping) else value) for name, value in fields])
        kept = (code, hashlib.sha1((code + text).encode()).hexdigest()[:12])
        object.__setattr__(config, "_fingerprint", kept)
    return kept[1]


def _tag_compile_caches() -> None:
    """Puts the settings in force and the package's code into the key of torch.compile's caches.

    Inductor's FX graph cache and AOTAutograd's cache key a graph by its FX code and
    Inductor's own configuration, not by these settings, which the lowerings read (the
    backend, the tiles, the column slabs), nor by the lowerings' code and the kernel
    configuration's rules (``kernels.config``): a graph compiled under other settings, or
    by another version of the package,
    would be reused, in this process or from the disk cache. ``torch.compiler.config.cache_key_tag``
    is part of both keys, so its end carries a digest of both (the user's own tag, before
    it, is kept). Set when Inductor is imported and whenever ``override`` changes the
    settings."""
    import torch.compiler.config as compiler_config

    if not hasattr(compiler_config, "cache_key_tag"):
        return
    user_tag = compiler_config.cache_key_tag.split(_CACHE_TAG)[0]
    compiler_config.cache_key_tag = user_tag + _CACHE_TAG + _fingerprint(current())
