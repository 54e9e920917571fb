"""Kernel settings: every choice that varies a kernel, in one frozen object.

The kernels read ``current()`` when they launch; tests, the benchmark and the tuning
scripts change it for a block of code with ``override``::

    with moeblaze_ops.settings.override(column_slab=None, poison=True):
        out = moeblaze_ops.moe_experts(...)

Nothing else changes what a kernel does: no module global is flipped from outside and
no environment variable is read, except the one escape hatch below.

Compiled graphs (``torch.compile``, ``moeblaze_ops.lowerings``) read the settings when
they compile, and keep them: Dynamo does not guard on them, and Inductor's graph caches
(in the process and on disk) do not key on them. Set them before the first compile, or
compile again after ``torch._dynamo.reset()`` with the FX graph cache off
(``TORCHINDUCTOR_FX_GRAPH_CACHE=0``) to compare settings in compiled code.

Escape hatch: ``MOEBLAZE_BACKEND=torch`` runs every op on the portable PyTorch kernels
(read once, on the first kernel launch of the process, not at import), for ruling the
Triton kernels out when a result looks wrong.

Tile shapes come from ``TILE_TABLE``, keyed by (GEMM kind, dtype class, architecture),
each entry a list in order of preference; ``pick_tile`` takes the first one whose
pipelined operand tiles fit in the device's shared memory (the arithmetic prune of
Inductor's grouped-mm configs: no launch is tried and caught).
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
from typing import Iterator, Mapping, Optional

import torch

__all__ = [
    "GemmTile",
    "KernelSettings",
    "GEMM_KINDS",
    "GLUON_KINDS",
    "BACKWARD_TEMPLATE_KINDS",
    "TILE_TABLE",
    "candidate_tiles",
    "current",
    "override",
    "pick_tile",
    "tile_fits",
]

#: The GEMMs of the layer: the forward up and down projections, the backward's dH
#: (activation gradient; "dh_wide" is dH on the `tl` kernel with a tile of its own for wide layers,
#: ``KernelSettings.dh_wide_min_columns``), dX rows, and the two weight gradients.
GEMM_KINDS = ("up", "down", "dh", "dh_wide", "dx", "wgrad_down", "wgrad_up")
#: The kinds that have a Gluon kernel for Hopper besides their ``tl`` one.
GLUON_KINDS = ("up", "down", "dh", "dx", "wgrad_down", "wgrad_up")
#: The parts of the backward that compiled graphs can run as Inductor templates.
BACKWARD_TEMPLATE_KINDS = ("dx",)
#: The most rows ``KernelSettings.dispatch_one_program_max_rows`` may send to one program:
#: a sorted chunk of that many keys in one program's registers.
MAX_ONE_PROGRAM_ROWS = 8192


@dataclass(frozen=True)
class GemmTile:
    """One launch config of a grouped GEMM.

    For the row-tiled GEMMs (up, down, dh, dx) ``block_m`` tiles the routed rows,
    ``block_n`` the output columns and ``block_k`` the reduction. For the weight
    gradients ``block_m`` and ``block_n`` tile the [P, Q] gradient of one expert and
    ``block_k`` the expert's rows (the reduction).
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 1

    def smem_bytes(self, element_size: int) -> int:
        """Shared memory of the pipelined A and B tiles (the prune's estimate)."""
        return (self.block_m + self.block_n) * self.block_k * self.num_stages * element_size


#: (kind, dtype class, architecture) -> tiles in order of preference. dtype class is
#: "16bit" (bf16, fp16) or "fp32"; architecture "sm90" (Hopper) or "any". The sm90
#: entries are the best of the H200 sweeps (docs/perf-notes.md).
TILE_TABLE: Mapping[tuple, tuple] = {
    ("up", "16bit", "sm90"): (GemmTile(128, 256, 64, 8, 3),),
    ("down", "16bit", "sm90"): (GemmTile(128, 256, 64, 8, 3),),
    ("dh", "16bit", "sm90"): (GemmTile(128, 128, 64, 8, 4),),
    ("dh_wide", "16bit", "sm90"): (GemmTile(128, 256, 64, 8, 3),),
    ("dx", "16bit", "sm90"): (GemmTile(128, 256, 64, 8, 4),),
    ("wgrad_down", "16bit", "sm90"): (GemmTile(256, 128, 64, 8, 3),),
    ("wgrad_up", "16bit", "sm90"): (GemmTile(256, 128, 64, 8, 3),),
    **{(kind, "16bit", "any"): (GemmTile(128, 256, 64, 8, 3), GemmTile(128, 128, 64, 8, 3), GemmTile(64, 64, 32, 4, 3))
       for kind in GEMM_KINDS},
    **{(kind, "fp32", "any"): (GemmTile(64, 64, 32, 4, 3), GemmTile(32, 32, 32, 4, 2)) for kind in GEMM_KINDS},
}

#: Triton's interpreter (CPU tensors): small tiles keep the CPU tests quick.
INTERPRETER_TILE = GemmTile(16, 16, 16, 4, 1)


@dataclass(frozen=True)
class KernelSettings:
    """What the kernels do, beyond their arguments. Change it with ``override``.

    Attributes:
        backend: "auto" (Triton kernels for CUDA tensors, PyTorch ones otherwise),
            "triton" (Triton everywhere; CPU tensors then need ``TRITON_INTERPRET=1``)
            or "torch" (the portable PyTorch kernels everywhere).
        triton_backward: whether the backward ops use their Triton kernels where the
            forward's run; False falls back to the PyTorch backward (a debugging aid:
            it reads the expert offsets to the host).
        poison: fill every buffer the kernels allocate with NaN first, so an element a
            kernel forgets to write shows (tests).
        tiles: per GEMM kind, a ``GemmTile`` used instead of the table's (tuning).
        weight_tma: the GEMM kinds that read weight tiles through TMA descriptors where
            they can ("up", "dh", "dx" have the option).
        gluon: the GEMM kinds (of ``GLUON_KINDS``) that run their Gluon kernel, an
            asynchronous cp.async/TMA and wgmma pipeline for Hopper (``kernels.gluon_wgrad``,
            ``kernels.gluon_row_gemm``; ``kernels.gluon_dh`` for "dh", without a down
            bias or an interleaved h),
            where it applies:
            16-bit CUDA tensors on capability 9 with column counts and row strides that are
            multiples of 16. The other kinds, and every other case, run the portable
            ``tl`` kernels; compiled graphs then call the op's kernels where a Gluon one
            would run (the Inductor templates are ``tl``). By default every kind, the
            kernels measured faster.
        small_gemm_flop: GEMMs of fewer operations (2 x rows x columns x reduction) are
            host-bound, their launches rather than the GPU setting the step's time, and
            run the kernel forms that cost the host least to launch: the ``tl`` kernel
            where ``gluon`` names their kind, weight tiles read by pointer where
            ``weight_tma`` names it (a TMA descriptor is made on the host, and encoded
            again by every launch). The default is chosen by measurement
            (docs/perf-notes.md).
        gluon_warp_specialize: per GEMM kind (of ``GLUON_KINDS``), the average routed rows
            per expert (L*K / E, known on the host) from which its Gluon kernel, where
            ``gluon`` runs it, is the warp-specialised one: copy warps fill the ring and the
            MMA warpgroups only wait, multiply and store (``_row_gemm_ws_kernel``,
            ``_wgrad_rows_tma_ws_kernel``, ``_wgrad_ws_kernel``). Kinds not named never
            are; a set of kinds means from 0 rows. By default the row GEMMs (up, down, dX)
            from 1024 rows per expert, the weight gradients from 0 (docs/perf-notes.md).
        row_band: the row GEMMs' output tiles (up, down, dX, dH; eager kernels and
            templates) go in bands of this many row tiles, rows fastest inside a band
            (``grouped_gemm.banded``): the tiles in flight at once then read fewer
            weight tiles, each from L2 for the whole band, instead of every row tile
            streaming its expert's whole weight. 1: columns fastest along each row tile.
            The default is chosen by measurement (docs/perf-notes.md).
        wgrad_band: the same for the Gluon weight gradients' [P, Q] tiles, in bands of
            P-tiles (``gluon_wgrad._wgrad_tile``).
        wgrad_rows_tma: per weight-gradient kind, the average routed rows per expert (L*K /
            E, known on the host) from which its Gluon kernel (where ``gluon`` runs it)
            reads the row-ordered operand by TMA as the MMA's wide side, the gathered rows
            being the narrow one (``gluon_wgrad._wgrad_rows_tma_kernel``, or its
            warp-specialised form ``_wgrad_rows_tma_ws_kernel`` where
            ``gluon_warp_specialize`` applies too). Kinds not named never do; a set of
            kinds means from 0 rows. The defaults are chosen by measurement
            (docs/perf-notes.md).
        wgrad_tma_store: the Gluon weight gradients (all but ``_wgrad_ws_kernel``) write
            each output tile through shared memory by TMA copies, which run on while they
            start the next tile (where TMA can write the gradient and a program has more
            than one tile), instead of storing from registers.
        wgrad_split_mma: the weight-gradient kinds whose warp-specialised Gluon kernel with
            the row-ordered operand by TMA (``gluon_wgrad._wgrad_rows_tma_ws_kernel``) runs
            its two MMA warpgroups as partitions of their own, each over half of every
            tile: each releases a ring slot when its own wgmma is done, where one partition
            of both waits at a CTA barrier every step for the slower warpgroup.
        row_tma_store: the Gluon row GEMMs (up, down, dX, where ``gluon`` runs them) write
            each output tile whose rows are all inside its expert through shared memory
            by TMA copies, which run on while the warps start the next tile, instead of
            storing from registers (``gluon_row_gemm._store_tile``).
        up_epilogue_activation: where ``moe_experts`` with a gated activation needs no
            h after the forward (nothing to differentiate, or ``recompute=True``), the up
            projection writes act(h) instead of h (the op ``expert_layer``), for the
            down GEMM to read, no activation pass run: on Hopper in the
            Gluon up GEMM's epilogue (``gluon_row_gemm.GatedEpilogue``) where it
            applies, elsewhere as the GEMM then the pass. h is not made at all. (The
            default mode's backward needs h: see ``activation_beside_h_max_columns``.)
        activation_beside_h_max_columns: where eager ``moe_experts`` with a gated
            activation keeps h for backward, in layers of at most this many intermediate
            columns (I) and at least ``activation_beside_h_min_rows`` routed rows per
            expert on average, the up GEMM's epilogue writes act(h) beside h (on Hopper,
            where ``gluon_row_gemm.GatedEpilogue`` applies), and the down projection
            reads it instead of running the activation pass; compiled training graphs the
            same (the lowerings decide by the size hints when the graph compiles); in
            other layers and elsewhere, h alone and the pass. None: never.
        activation_beside_h_min_rows: see ``activation_beside_h_max_columns``. (Few rows
            per expert make many tiles that run past their expert's end, whose three
            stores go from registers.)
        fast_activation: the approximate-tanh sigmoid for 16-bit CUDA tensors in the
            activation pass and the up GEMM's gated epilogue.
        dh_fast_activation: the same in the dH epilogue.
        dh_epilogue_columns: the dH epilogue (h in, dH and w * act(h) out) works through
            its tile in slices of this many columns (a power of two), one after the
            other, so that only a slice's registers are live at once: a tile of
            ``block_n`` columns takes ``block_n // dh_epilogue_columns`` slices, at most
            4, at least 1. None: the whole tile at once. The default is chosen by
            measurement (docs/perf-notes.md).
        dh_wide_min_columns: dH on the ``tl`` kernel, of layers with at least this many
            intermediate columns (I), runs the "dh_wide" tile of the table instead of
            the "dh" one; None: never.
            A ``tiles`` override of "dh" without one of "dh_wide" applies at every width.
            The default is chosen by measurement (docs/perf-notes.md).
        column_slab: width of the column slabs in which the [L*K, d] scratch (expert
            outputs before the combine, dX rows before their sum) is made; None: all d
            columns at once.
        column_slab_widen: make the slabs wider, in whole multiples of ``column_slab``,
            as far as the memory the layer's weight gradients take bounds them
            (``triton_combine.widest_slab``): the forward's scratch and act(h) within
            both weight gradients' bytes (three times the down weights' for a gated
            activation, twice for another), the dX rows' scratch within the up weights'
            bytes (their gradient is made once the scratch is gone); the fewest slabs
            that fit, each as narrow as their count allows. Training then peaks where it
            did with narrow slabs: in the backward, which holds the weight gradients.
            False: always ``column_slab``. The default is chosen by measurement
            (docs/perf-notes.md).
        dispatch_sorted_min_bins: dispatch ranks rows by sorted chunks from this many
            bins (E rounded up to a power of two); None: always by one-hot tiles. The
            default is chosen by measurement (docs/perf-notes.md).
        dispatch_sort_chunk: rows per sorted chunk (measured, as above).
        dispatch_one_program_max_rows: routings of at most this many rows (L*K) are
            dispatched by one program, in one launch instead of three (their rows one
            sorted chunk; at most 8192); None: never. For small layers, whose time is the
            host's launches.
        backward_templates: the parts of the backward (of ``BACKWARD_TEMPLATE_KINDS``)
            that compiled graphs run as Inductor templates instead of the ops' kernels:
            "dx", the input gradient of the up projection (a ``row_gemm`` on dH and an
            unweighted ``combine``, as the forward's down projection and combine); the
            op's kernels then make the weight gradients alone. Empty: the op makes all.
        lean_graph_calls: compiled graphs call the kernels the lowerings keep as extern
            calls (``dispatch``, the forward ops on Gluon, the backward ops) through
            internal ops defined with the low-level ``torch.library`` API
            (``ops.graph_calls``), which cost the host a dispatcher call, not the public
            custom ops' Python wrappers, and skip the argument checks the traced graph
            already passed (a forward op's twin, also the index arrays' value check: only
            for arrays the graph's own ``dispatch`` made).
        launch_plans: repeated Triton launches skip the JIT's argument binding and cache
            lookup (``kernels.launch``): the compiled kernel found for the first call of
            a kind of arguments is launched directly from then on.
    """

    backend: str = "auto"
    triton_backward: bool = True
    poison: bool = False
    tiles: Mapping[str, GemmTile] = field(default_factory=dict)
    weight_tma: frozenset = frozenset({"up", "dh", "dx"})
    gluon: frozenset = frozenset(GLUON_KINDS)
    small_gemm_flop: int = 10**11
    gluon_warp_specialize: Mapping[str, int] = field(
        default_factory=lambda: {"up": 1024, "down": 1024, "dx": 1024, "wgrad_down": 0, "wgrad_up": 0})
    wgrad_band: int = 1
    wgrad_rows_tma: Mapping[str, int] = field(default_factory=lambda: {"wgrad_down": 0, "wgrad_up": 0})
    wgrad_tma_store: bool = True
    wgrad_split_mma: frozenset = frozenset({"wgrad_up"})
    row_tma_store: bool = True
    row_band: int = 4
    up_epilogue_activation: bool = True
    activation_beside_h_max_columns: Optional[int] = 8192
    activation_beside_h_min_rows: int = 2048
    fast_activation: bool = True
    dh_fast_activation: bool = True
    dh_epilogue_columns: Optional[int] = 64
    dh_wide_min_columns: Optional[int] = 12288
    column_slab: Optional[int] = 512
    column_slab_widen: bool = True
    dispatch_sorted_min_bins: Optional[int] = 16
    dispatch_sort_chunk: int = 512
    dispatch_one_program_max_rows: Optional[int] = 4096
    backward_templates: frozenset = frozenset({"dx"})
    launch_plans: bool = True
    lean_graph_calls: bool = True

    def from_rows(self, name: str, kind: str, rows: int, experts: int) -> bool:
        """Whether ``kind`` is on in ``name`` (``gluon_warp_specialize``, ``wgrad_rows_tma``:
        kinds mapped to the average routed rows per expert from which they are) for a GEMM
        over ``rows`` routed rows of ``experts`` experts."""
        min_rows = getattr(self, name).get(kind)
        return min_rows is not None and rows >= min_rows * experts

    def activation_beside_h(self, columns: int, rows: int, experts: int) -> bool:
        """Whether a gated layer of ``columns`` intermediate columns (I) and ``rows``
        routed rows over ``experts`` experts keeps act(h) beside h
        (``activation_beside_h_max_columns``)."""
        limit = self.activation_beside_h_max_columns
        return limit is not None and columns <= limit and rows >= self.activation_beside_h_min_rows * experts

    def __post_init__(self):
        if self.backend not in ("auto", "triton", "torch"):
            raise ValueError(f"moeblaze settings: backend must be 'auto', 'triton' or 'torch', got {self.backend!r}")
        unknown = set(self.tiles) - set(GEMM_KINDS)
        if unknown:
            raise ValueError(f"moeblaze settings: tiles has unknown GEMM kinds {sorted(unknown)}; known: {GEMM_KINDS}")
        for kind, tile in self.tiles.items():
            if not isinstance(tile, GemmTile):
                object.__setattr__(self, "tiles", {**self.tiles, kind: GemmTile(*tile)})
        object.__setattr__(self, "weight_tma", frozenset(self.weight_tma))
        object.__setattr__(self, "gluon", frozenset(self.gluon))
        if not self.gluon <= set(GLUON_KINDS):
            raise ValueError(f"moeblaze settings: gluon has GEMM kinds without a Gluon kernel "
                             f"{sorted(self.gluon - set(GLUON_KINDS))}; those with one: {GLUON_KINDS}")
        for name, kinds in (("gluon_warp_specialize", GLUON_KINDS), ("wgrad_rows_tma", ("wgrad_down", "wgrad_up"))):
            rows = getattr(self, name)
            rows = dict(rows) if isinstance(rows, Mapping) else dict.fromkeys(rows, 0)
            object.__setattr__(self, name, rows)
            if not set(rows) <= set(kinds):
                raise ValueError(f"moeblaze settings: {name} names the kinds {', '.join(kinds)} only, "
                                 f"got {sorted(rows)}")
            if not all(isinstance(n, int) and n >= 0 for n in rows.values()):
                raise ValueError(f"moeblaze settings: {name} maps kinds to rows per expert (ints >= 0), got {rows}")
        limit = self.activation_beside_h_max_columns
        if limit is not None and not (isinstance(limit, int) and limit >= 0):
            raise ValueError(f"moeblaze settings: activation_beside_h_max_columns must be None or an int >= 0, "
                             f"got {limit!r}")
        if not (isinstance(self.activation_beside_h_min_rows, int) and self.activation_beside_h_min_rows >= 0):
            raise ValueError(f"moeblaze settings: activation_beside_h_min_rows must be an int >= 0, "
                             f"got {self.activation_beside_h_min_rows!r}")
        columns = self.dh_epilogue_columns
        if columns is not None and not (isinstance(columns, int) and columns >= 1 and columns & (columns - 1) == 0):
            raise ValueError(f"moeblaze settings: dh_epilogue_columns must be None or a power of two, got {columns!r}")
        object.__setattr__(self, "wgrad_split_mma", frozenset(self.wgrad_split_mma))
        if not self.wgrad_split_mma <= {"wgrad_down", "wgrad_up"}:
            raise ValueError(f"moeblaze settings: wgrad_split_mma names the kinds wgrad_down, wgrad_up only, "
                             f"got {sorted(self.wgrad_split_mma)}")
        object.__setattr__(self, "backward_templates", frozenset(self.backward_templates))
        if not self.backward_templates <= set(BACKWARD_TEMPLATE_KINDS):
            raise ValueError(f"moeblaze settings: backward_templates has unknown parts "
                             f"{sorted(self.backward_templates - set(BACKWARD_TEMPLATE_KINDS))}; "
                             f"known: {BACKWARD_TEMPLATE_KINDS}")
        for name in ("wgrad_band", "row_band"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"moeblaze settings: {name} must be a positive int, got {value!r}")
        if not isinstance(self.small_gemm_flop, int) or self.small_gemm_flop < 0:
            raise ValueError(f"moeblaze settings: small_gemm_flop must be an int >= 0, got {self.small_gemm_flop!r}")
        if self.column_slab is not None and self.column_slab < 1:
            raise ValueError(f"moeblaze settings: column_slab must be positive or None, got {self.column_slab}")
        one = self.dispatch_one_program_max_rows
        if one is not None and not (isinstance(one, int) and 0 <= one <= MAX_ONE_PROGRAM_ROWS):
            raise ValueError("moeblaze settings: dispatch_one_program_max_rows must be None or an int in "
                             f"[0, {MAX_ONE_PROGRAM_ROWS}], got {one!r}")
        if self.dispatch_sort_chunk < 16 or self.dispatch_sort_chunk & (self.dispatch_sort_chunk - 1):
            raise ValueError("moeblaze settings: dispatch_sort_chunk must be a power of two >= 16, got "
                             f"{self.dispatch_sort_chunk}")

    def replace(self, **changes) -> "KernelSettings":
        """A copy with ``changes`` (field names as keywords); unknown names raise."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = set(changes) - names
        if unknown:
            raise ValueError(f"moeblaze settings: no setting named {sorted(unknown)}; known: {sorted(names)}")
        return dataclasses.replace(self, **changes)


# One stack for the process, not one per thread: autograd runs the backward of CUDA ops
# on its own device threads, and those kernels must see the override in force where the
# forward ran.
_overrides: list = []
_overrides_lock = threading.Lock()
_process_default: Optional[KernelSettings] = None


def _default() -> KernelSettings:
    global _process_default
    if _process_default is None:
        backend = os.environ.get("MOEBLAZE_BACKEND", "auto") or "auto"
        _process_default = KernelSettings(backend="torch" if backend == "torch" else "auto")
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
        text = repr([(name, sorted(value) if isinstance(value, frozenset) else value) for name, value in fields])
        kept = (code, hashlib.sha1((code + text).encode()).hexdigest()[:12])
        object.__setattr__(config, "_fingerprint", kept)
    return kept[1]


def _tag_compile_caches() -> None:
    """Puts the settings in force and the package's code into the key of torch.compile's caches.

    Inductor's FX graph cache and AOTAutograd's cache key a graph by its FX code and
    Inductor's own configuration, not by these settings, which the lowerings read (tile
    order, column slabs, grad_x templates, which op a graph calls), nor by the lowerings'
    code: a graph compiled under other settings, or by another version of the package,
    would be reused, in this process or from the disk cache. ``torch.compiler.config.cache_key_tag``
    is part of both keys, so its end carries a digest of both (the user's own tag, before
    it, is kept). Set when Inductor is imported and whenever ``override`` changes the
    settings."""
    import torch.compiler.config as compiler_config

    if not hasattr(compiler_config, "cache_key_tag"):
        return
    user_tag = compiler_config.cache_key_tag.split(_CACHE_TAG)[0]
    compiler_config.cache_key_tag = user_tag + _CACHE_TAG + _fingerprint(current())


def _dtype_class(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "16bit"


@functools.lru_cache(maxsize=None)
def _device_traits(index: int) -> tuple[str, int]:
    """(architecture key, shared memory a block may opt into) of CUDA device ``index``."""
    props = torch.cuda.get_device_properties(index)
    arch = "sm90" if props.major == 9 else "any"
    return arch, getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024


def _traits(device: torch.device) -> tuple[str, int]:
    return _device_traits(device.index if device.index is not None else torch.cuda.current_device())


def shared_memory_per_block(device: torch.device) -> int:
    """The bytes of shared memory a block of CUDA ``device`` may opt into."""
    return _traits(device)[1]


def tile_fits(tile: GemmTile, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``tile``'s pipelined operand tiles of ``dtype`` fit the shared memory a block
    of CUDA ``device`` may use (the prune of the tile table)."""
    return tile.smem_bytes(dtype.itemsize) <= shared_memory_per_block(device)


def candidate_tiles(kinds, dtype: torch.dtype, device: torch.device) -> list:
    """Every table tile of the GEMM ``kinds`` for ``dtype`` (any architecture) that fits
    ``device``, without repeats, in table order: what autotuning may try."""
    cls = _dtype_class(dtype)
    tiles = []
    for (kind, tile_cls, _), entries in TILE_TABLE.items():
        if kind in kinds and tile_cls == cls:
            tiles += [t for t in entries if t not in tiles and tile_fits(t, dtype, device)]
    return tiles


def pick_tile(kind: str, dtype: torch.dtype, device: torch.device) -> GemmTile:
    """The tile of GEMM ``kind`` for tensors of ``dtype`` on ``device``: the override in
    ``current().tiles``, else the first table entry that fits the shared memory."""
    override_tile = current().tiles.get(kind)
    if override_tile is not None:
        return override_tile
    if device.type != "cuda":
        return INTERPRETER_TILE
    return _table_tile(kind, dtype, device)


@functools.lru_cache(maxsize=None)
def _table_tile(kind: str, dtype: torch.dtype, device: torch.device) -> GemmTile:
    """``pick_tile`` without an override: a function of the (constant) table and the device,
    so each kernel launch after the first looks it up."""
    cls = _dtype_class(dtype)
    candidates = TILE_TABLE.get((kind, cls, _traits(device)[0])) or TILE_TABLE[(kind, cls, "any")]
    return next((tile for tile in candidates if tile_fits(tile, dtype, device)), candidates[-1])
