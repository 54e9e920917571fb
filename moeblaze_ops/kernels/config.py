"""The kernel configuration: which kernel, tile and variant each GEMM runs, as data and rules.

Every choice between kernel variants that the measurements settle is here, keyed by what
the host knows before a launch: the GEMM kind (``GEMM_KINDS``), the dtype, the
architecture, and the shape class (its operation count, the routed rows per expert, the
layer's widths). A variant that never won is not here: it was deleted. What a user
chooses stays in ``moeblaze_ops.settings``; of it, the rules read only the ``tiles``
override (``pick_tile``). The measurements behind each rule: see docs/performance.md.

The rules read the constants below when they are called, so a test may patch one to put
a small shape on the other side of a rule.

Tile shapes come from ``TILE_TABLE``, keyed by (GEMM kind, dtype class, architecture),
and for the forward GEMMs of few routed rows per expert (decode) also by that rows class
(``rows_class``); each entry a list in order of preference; ``pick_tile`` takes the first one whose
pipelined operand tiles fit in the device's shared memory (the arithmetic prune of
Inductor's grouped-mm configs: no launch is tried and caught).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping

import torch

from .. import settings

#: The GEMMs of the layer: the forward up and down projections, the backward's dH
#: (activation gradient; "dh_wide" is dH on the `tl` kernel with a tile of its own for
#: wide layers, ``dh_tile_kind``), dX rows, and the two weight gradients.
GEMM_KINDS = ("up", "down", "dh", "dh_wide", "dx", "wgrad_down", "wgrad_up")
#: The kinds that have a Gluon kernel for Hopper besides their ``tl`` one: each runs it
#: wherever it applies (``runs_gluon``), since it is faster there.
GLUON_KINDS = ("up", "down", "dh", "dx", "wgrad_down", "wgrad_up")


@dataclass(frozen=True)
class GemmTile:
    """One launch config of a grouped GEMM.

    For the row-tiled GEMMs (up, down, dh, dx) ``block_m`` tiles the routed rows,
    ``block_n`` the output columns and ``block_k`` the reduction. For the weight
    gradients ``block_m`` and ``block_n`` tile the [P, Q] gradient of one expert and
    ``block_k`` the expert's rows (the reduction). ``programs_per_sm``: the ``tl``
    kernels' persistent grid (the Gluon kernels run one program per SM).
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 1

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "num_warps", "num_stages", "programs_per_sm"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"moeblaze GemmTile: {name} must be a positive int, got {value!r}")

    def smem_bytes(self, element_size: int) -> int:
        """Shared memory of the pipelined A and B tiles (the prune's estimate)."""
        return (self.block_m + self.block_n) * self.block_k * self.num_stages * element_size


# --------------------------------------------------------------------------- tiles

#: (kind, dtype class, architecture) -> tiles in order of preference. dtype class is
#: "16bit" (bf16, fp16) or "fp32"; architecture "sm90" (Hopper) or "any". The sm90
#: entries are the best of the H200 sweeps (see docs/performance.md).
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
    # Decode: the up and down GEMMs stream their experts' weights past a few rows each. Tiles
    # of 16 or 32 rows waste less of the MMA, and 64 columns split each expert's weight over
    # more programs (two per SM) that keep more loads in flight (see docs/performance.md).
    **{(kind, "16bit", "sm90", "few_rows"): (GemmTile(16, 64, 128, 4, 4, 2),) for kind in ("up", "down")},
    **{(kind, "16bit", "sm90", "some_rows"): (GemmTile(32, 64, 128, 4, 4, 2),) for kind in ("up", "down")},
}

#: The rows classes of ``TILE_TABLE``: (routed rows per expert at most, class), in order.
#: Past the last bound a GEMM takes its kind's general entry.
ROWS_CLASSES = ((8, "few_rows"), (24, "some_rows"))

#: Triton's interpreter (CPU tensors): small tiles keep the CPU tests quick.
INTERPRETER_TILE = GemmTile(16, 16, 16, 4, 1)


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


@functools.lru_cache(maxsize=None)
def _l2_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).L2_cache_size


def l2_bytes(device: torch.device) -> int:
    """The L2 cache of CUDA device ``device``, in bytes."""
    return _l2_bytes(device.index if device.index is not None else torch.cuda.current_device())


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
    for (kind, tile_cls, *_), entries in TILE_TABLE.items():
        if kind in kinds and tile_cls == cls:
            tiles += [t for t in entries if t not in tiles and tile_fits(t, dtype, device)]
    return tiles


def rows_class(rows: int, experts: int):
    """The rows class (``ROWS_CLASSES``) of a GEMM over ``rows`` routed rows of ``experts``
    experts, from their average per expert (shapes only, never the routing), or None."""
    per_expert = rows / max(experts, 1)
    return next((name for bound, name in ROWS_CLASSES if per_expert <= bound), None)


def pick_tile(kind: str, dtype: torch.dtype, device: torch.device, rows=None, experts=None) -> GemmTile:
    """The tile of GEMM ``kind`` for tensors of ``dtype`` on ``device``, over ``rows`` routed
    rows of ``experts`` experts where known: the override in ``settings.current().tiles``,
    else the first table entry that fits the shared memory (the entry of the rows class
    where the table has one)."""
    override_tile = settings.current().tiles.get(kind)
    if override_tile is not None:
        return override_tile
    if device.type != "cuda":
        return INTERPRETER_TILE
    return _table_tile(kind, dtype, device, None if rows is None else rows_class(rows, experts))


@functools.lru_cache(maxsize=None)
def _table_tile(kind: str, dtype: torch.dtype, device: torch.device, rows_cls=None) -> GemmTile:
    """``pick_tile`` without an override: a function of the (constant) table and the device,
    so each kernel launch after the first looks it up."""
    cls, arch = _dtype_class(dtype), _traits(device)[0]
    candidates = ((rows_cls is not None and TILE_TABLE.get((kind, cls, arch, rows_cls)))
                  or TILE_TABLE.get((kind, cls, arch)) or TILE_TABLE[(kind, cls, "any")])
    return next((tile for tile in candidates if tile_fits(tile, dtype, device)), candidates[-1])


# --------------------------------------------------------------------------- small GEMMs

#: GEMMs of fewer operations (2 x rows x columns x reduction) are host-bound: their
#: launches, not the GPU, set their time, so they run the kernel forms that cost the host
#: least to launch (see docs/performance.md).
SMALL_GEMM_FLOP = 10**11


def is_small_gemm(flop: int) -> bool:
    """Whether a GEMM of ``flop`` operations is host-bound (``SMALL_GEMM_FLOP``)."""
    return flop < SMALL_GEMM_FLOP


def runs_gluon(kind: str, flop: int) -> bool:
    """Whether GEMM ``kind`` of ``flop`` operations runs its Gluon kernel (on Hopper, where
    the kernel applies): every kind that has one, faster than ``tl`` there, unless the GEMM
    is small, where the ``tl`` kernel's launch costs the host less."""
    return kind in GLUON_KINDS and not is_small_gemm(flop)


#: The ``tl`` GEMMs that read their weight tiles through TMA descriptors where TMA allows:
#: faster there; the down GEMM by TMA ran slower (see docs/performance.md).
WEIGHT_TMA_KINDS = ("up", "dh", "dx")


def reads_weight_by_tma(kind: str, flop: int) -> bool:
    """Whether the ``tl`` GEMM ``kind`` of ``flop`` operations reads its weight tiles through
    a TMA descriptor (where TMA allows it): not a small GEMM's, since the host makes each
    descriptor and every launch encodes it again."""
    return kind in WEIGHT_TMA_KINDS and not is_small_gemm(flop)


def activates_in_up_epilogue(flop: int) -> bool:
    """Whether an up GEMM of ``flop`` operations whose h nobody keeps (inference: act(h)
    alone is needed) runs as the ``tl`` kernel that applies the activation in its epilogue
    (``triton_backend.experts.activated_gemm_tile``), where the Gluon gated epilogue does not
    apply: for small GEMMs (decode), which read their weights by pointer as that kernel does.
    Elsewhere the up GEMM writes h and the activation pass reads it (see docs/performance.md)."""
    return is_small_gemm(flop)


# --------------------------------------------------------------------------- Gluon variants

#: The row GEMMs' (up, down, dX) Gluon kernel is the warp-specialised one from this many
#: routed rows per expert on average: below it, the pipelined kernel without copy warps is
#: faster (see docs/performance.md). (dH and the weight gradients have one Gluon kernel
#: each, warp-specialised.)
WARP_SPECIALIZE_MIN_ROWS = 1024


def row_gemm_warp_specialized(rows: int, experts: int) -> bool:
    """Whether a Gluon row GEMM (up, down, dX) over ``rows`` routed rows of ``experts``
    experts (known on the host) runs the warp-specialised kernel."""
    return rows >= WARP_SPECIALIZE_MIN_ROWS * experts


def wgrad_split_mma(kind: str) -> bool:
    """Whether the Gluon weight gradient of ``kind`` runs its two MMA warpgroups as
    partitions of their own, each over half of every tile: "wgrad_up" gained at every
    configuration measured, "wgrad_down" moved both ways (see docs/performance.md)."""
    return kind == "wgrad_up"


#: The weight gradients' output tiles of an expert with more rows than
#: ``wgrad_long_rows`` go in bands of this many P-tiles (256 wide), P fastest inside a
#: band: about as many P as Q columns (128-wide tiles) in a wave of 132 programs.
WGRAD_LONG_BAND = 8


def wgrad_long_rows(q_columns: int, block_p: int, block_q: int, programs: int, element_size: int,
                    device: torch.device) -> int:
    """The most rows an expert may have for its weight-gradient tiles to go Q-tile fastest:
    what a wave of ``programs`` reads in that order, the expert's gathered operand (these
    rows by ``q_columns``) and the P-tiles the wave spans (``block_p`` columns each),
    within L2, so that the gathered rows come from HBM once for all the expert's P-tiles.
    An expert with more rows goes in bands of ``WGRAD_LONG_BAND`` P-tiles (see
    docs/performance.md). The kernel decides by each expert's rows."""
    p_tiles_in_wave = -(-programs // -(-q_columns // block_q))
    return l2_bytes(device) // ((q_columns + p_tiles_in_wave * block_p) * element_size)


#: The row GEMMs' output tiles (up, down, dX, dH; eager kernels and templates) go expert
#: by expert, each expert's in bands of this many row tiles, rows fastest inside a band
#: (``triton_backend.grouped_gemm.row_tile``): the tiles in flight at once read fewer
#: weight tiles, each from L2 for the whole band (see docs/performance.md).
ROW_BAND = 4


# --------------------------------------------------------------------------- the activation

#: act(h) is written beside h by the up GEMM's epilogue in layers of at most this many
#: intermediate columns ...
ACTIVATION_BESIDE_H_MAX_COLUMNS = 8192
#: ... and at least this many routed rows per expert: fewer rows make many tiles that run
#: past their expert's end, whose three stores go from registers (see docs/performance.md).
ACTIVATION_BESIDE_H_MIN_ROWS = 2048


def activation_beside_h(columns: int, rows: int, experts: int, *, interleaved: bool = False,
                        up_bias: bool = False) -> bool:
    """Whether a gated layer of ``columns`` intermediate columns (I) and ``rows`` routed
    rows over ``experts`` experts, which keeps h for backward, has the up GEMM write act(h)
    beside h for the down projection to read instead of running the activation pass;
    eager and compiled alike. Only where the Gluon up GEMM's gated epilogue can write both
    (``triton_backend.gluon.row_gemm.applies_gated_epilogue``: gate and up halves concatenated, not
    ``interleaved``, no ``up_bias``): elsewhere act(h) would come from the same activation
    pass, held longer."""
    return (not interleaved and not up_bias and columns <= ACTIVATION_BESIDE_H_MAX_COLUMNS
            and rows >= ACTIVATION_BESIDE_H_MIN_ROWS * experts)


# --------------------------------------------------------------------------- dH

#: The ``tl`` dH epilogue works through its tile in slices of this many columns, one after
#: the other, so that only a slice's registers are live at once (a tile of 128 columns
#: spills in one piece; see docs/performance.md).
DH_EPILOGUE_COLUMNS = 64
#: dH on the ``tl`` kernel of layers this wide (intermediate columns, I) and wider runs the
#: "dh_wide" tile (see docs/performance.md).
DH_WIDE_MIN_COLUMNS = 12288


def dh_epilogue_slices(block_n: int) -> int:
    """How many column slices of ``DH_EPILOGUE_COLUMNS`` the ``tl`` dH epilogue of a tile
    ``block_n`` wide works through: 1, 2 or 4."""
    return min(4, max(1, block_n // DH_EPILOGUE_COLUMNS))


def dh_tile_kind(columns: int) -> str:
    """The tile kind of dH on the ``tl`` kernel for a layer of ``columns`` intermediate
    columns: "dh_wide" from ``DH_WIDE_MIN_COLUMNS`` on, else "dh". A ``tiles`` override of
    "dh" without one of "dh_wide" applies at every width."""
    tiles = settings.current().tiles
    if columns < DH_WIDE_MIN_COLUMNS or ("dh" in tiles and "dh_wide" not in tiles):
        return "dh"
    return "dh_wide"


# --------------------------------------------------------------------------- dispatch

#: Routings of at most this many rows (L*K) are dispatched by one program, in one launch
#: instead of three: up to where its device time stops beating the three kernels' (one
#: program sorts every row alone, so its time grows faster than the rows), which is what
#: a CUDA graph's replay pays; one launch also costs the host less (see docs/performance.md) ...
DISPATCH_ONE_PROGRAM_MAX_ROWS = 1024
#: ... and never more than one program can sort: a chunk of that many keys in its registers.
MAX_ONE_PROGRAM_ROWS = 8192
#: Dispatch ranks rows by sorted chunks from this many bins (E rounded up to a power of
#: two), by one-hot tiles below: O(log^2 chunk) work a row against O(E) (see docs/performance.md).
DISPATCH_SORTED_MIN_BINS = 16
#: Rows per sorted chunk (measured, as above; a power of two, at least 16).
DISPATCH_SORT_CHUNK = 512


def dispatch_family(rows: int, bins: int) -> str:
    """How the Triton dispatch ranks ``rows`` routed rows into ``bins`` bins:
    "one_program" (one sorted chunk, one launch), "sorted" (sorted chunks) or "one_hot"
    (one-hot tiles)."""
    if rows <= min(DISPATCH_ONE_PROGRAM_MAX_ROWS, MAX_ONE_PROGRAM_ROWS):
        return "one_program"
    return "sorted" if bins >= DISPATCH_SORTED_MIN_BINS else "one_hot"
