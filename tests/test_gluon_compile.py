"""The Gluon kernels compile for Hopper on any machine (no GPU needed): Triton's own
compiler and ptxas build them for an sm_90 target, so an API change in the installed
Triton shows here, on CPU CI, before a GPU run. What they compute is checked on the GPU
(tests/test_gpu.py)."""

import dataclasses
import re

import pytest

gluon_runtime = pytest.importorskip("triton.experimental.gluon._runtime")

from moeblaze_ops.kernels import config  # noqa: E402
from moeblaze_ops.kernels.config import GemmTile  # noqa: E402


#: The shared memory a block may opt into on an H100 / H200 (sm_90).
HOPPER_SHARED = 227 * 1024
#: An H100's L2 cache.
HOPPER_L2 = 50 * 1024 * 1024


def _compile_for_hopper(fn, signature, constexprs, num_warps, aligned):
    """Compiles ``fn`` as the JIT would for an sm_90 device, with ``aligned`` arguments
    known divisible by 16 (the JIT's specialisation of such pointers and integers)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from conftest import restore_triton_language

    restore_triton_language()  # the builtins as compiled kernels take them, after interpreted ones ran

    names = list(fn.arg_names)
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    source = gluon_runtime.GluonASTSource(
        fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


@pytest.mark.parametrize("offsets_32", [True, False], ids=["offsets_32", "offsets_64"])
@pytest.mark.parametrize("variant", ["registers", "store_mn", "store_nm", "split", "split_store_mn", "split_store_nm",
                                     "store_mn_whole", "store_nm_whole", "one_warpgroup_store_mn"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_weight_gradient_kernel_compiles_for_hopper(dtype, variant, offsets_32, tmp_path):
    """The Gluon weight gradient (``gluon_wgrad._wgrad_rows_tma_ws_kernel``) in each of its
    compiled forms: its tiles stored from registers or by TMA (in the accumulator's order
    "mn" or transposed "nm", in halves or whole), its MMA warpgroups one partition or two
    ("split"), or a tile of one MMA warpgroup; the gathered rows' offsets in 32 or 64 bits."""
    from test_gluon_row_gemm_compile import MAX_SHARED, _descriptor_type, _spill_bytes

    from moeblaze_ops.kernels.triton_backend.gluon import wgrad as gluon_wgrad

    tma_store = "store" in variant
    groups = 2 if variant.startswith("split") else 1  # the MMA warpgroups in partitions of their own
    tile = gluon_wgrad.TILE
    # "whole": three stages leave room for a whole tile's output buffer (one store a tile).
    pieces = 1 if variant.endswith("_whole") else 2
    if pieces == 1:
        tile = dataclasses.replace(tile, num_stages=3)
    if variant.startswith("one_warpgroup"):
        tile = dataclasses.replace(tile, block_n=64, num_warps=4)
    ints = ["E", "P", "Q", "LONG_ROWS", "stride_rm", "stride_gm", "stride_oe", "stride_op", "stride_oq"]
    signature = {"rows_desc": _descriptor_type(dtype, [tile.block_k, tile.block_m]), "rows_ptr": f"*{dtype}",
                 "gathered_ptr": f"*{dtype}", "row_ids_ptr": "*i32", "offsets_ptr": "*i32", "out_ptr": f"*{dtype}",
                 **{name: "i32" for name in ints}}
    constexprs = dict(BLOCK_P=tile.block_m, BLOCK_Q=tile.block_n, BLOCK_R=tile.block_k, NUM_STAGES=tile.num_stages,
                      num_warps=tile.num_warps // groups, G_OFFSETS_32=offsets_32, MMA_GROUPS=groups,
                      MMA_REGS=gluon_wgrad.MMA_GROUP_REGS, BAND=config.WGRAD_LONG_BAND)
    constexprs.update(zip(("PRODUCER_WARPS", "PRODUCER_REGS"), gluon_wgrad.PRODUCER))
    # The output descriptor's box: half a [Q, P] accumulator tile or all of it (of an MMA
    # group's Q rows), in its order ("mn") or transposed ("nm": Q contiguous in the gradient).
    m, n = tile.block_n // groups, tile.block_m
    transposed = "_nm" in variant
    signature["out_desc"] = _descriptor_type(dtype, [1, n // pieces, m] if transposed else [1, m, n // pieces])
    constexprs.update(TMA_STORE=tma_store, OUT_TRANSPOSED=transposed, STORE_PIECES=pieces)
    if not tma_store:
        constexprs["out_desc"] = None
    try:
        kernel = _compile_for_hopper(gluon_wgrad._wgrad_rows_tma_ws_kernel, signature, constexprs,
                                     tile.num_warps // groups,
                                     aligned=["rows_ptr", "gathered_ptr", "row_ids_ptr", "offsets_ptr", "out_ptr", "P",
                                              "Q", "stride_rm", "stride_gm", "stride_oe", "stride_op"])
    except FileNotFoundError as error:  # a Triton wheel without its bundled ptxas
        pytest.skip(f"no ptxas: {error}")
    ptx = kernel.asm["ptx"]
    # The pipeline it is written for: the gathered rows by 16-byte cp.async copies from the
    # copy warpgroup, each thread arriving on the slot's barrier when they land; the
    # row-ordered operand by 2-D TMA; asynchronous wgmma reading the gathered rows
    # transposed from shared memory, as wide as the row-ordered operand's tile; the copy
    # warps' registers cut back and the MMA warpgroups' raised.
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global\.mbarrier::complete_tx::bytes", ptx)
    assert re.search(r"cp\.async\.mbarrier\.arrive\.noinc", ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+\d+", ptx)
    ptx_type = {"bf16": "bf16", "fp16": "f16"}[dtype]
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile.block_m}k16\.f32\.{ptx_type}\.{ptx_type}", ptx)
    if tma_store:  # each piece by 3-D TMA copies from shared memory, waited for before its buffer is reused
        assert re.search(r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta\.bulk_group", ptx)
        waits = re.findall(r"cp\.async\.bulk\.wait_group\.read\s+0;", ptx)
        # One wait before each piece's buffer is written, and the program's last (in each MMA group).
        assert len(waits) == (pieces + 1) * groups
    else:
        assert not re.search(r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta", ptx)
    ring = tile.num_stages * (tile.block_m + tile.block_n) * tile.block_k * 2
    out_buffer = tile.block_m * tile.block_n * 2 // pieces if tma_store else 0
    assert ring + out_buffer <= kernel.metadata.shared <= MAX_SHARED
    assert _spill_bytes(ptx, tmp_path) == 0


@pytest.mark.parametrize("q_contiguous", [True, False])
def test_weight_gradient_output_descriptor(q_contiguous):
    """The TMA-store epilogue's descriptor (``gluon_wgrad._output_descriptor``) describes the
    gradient's own memory with its contiguous dimension last: in the [E, Q, P] order of the
    kernel's accumulator tiles where P is contiguous, else transposed ([E, P, Q]); half a
    tile per box; and no descriptor where TMA cannot write (a row stride that is not
    16-byte aligned)."""
    import torch

    from moeblaze_ops.kernels.triton_backend.gluon import wgrad as gluon_wgrad

    E, P, Q = 3, 192, 2880
    storage = torch.empty(E, P, Q, dtype=torch.bfloat16) if q_contiguous else torch.empty(E, Q, P, dtype=torch.bfloat16)
    grad_w_pq = storage if q_contiguous else storage.transpose(1, 2)  # [E, P, Q] either way
    tile = gluon_wgrad.TILE
    desc, transposed = gluon_wgrad._output_descriptor(grad_w_pq, tile)
    m, n = tile.block_n, tile.block_m  # the accumulator is [Q, P]
    assert transposed == q_contiguous  # the accumulator's M is the contiguous side
    assert tuple(desc.shape) == tuple(storage.shape) and tuple(desc.strides) == storage.stride()
    assert desc.base.data_ptr() == storage.data_ptr()
    assert list(desc.block_shape) == ([1, n // 2, m] if transposed else [1, m, n // 2])
    unaligned = torch.empty(E, P, Q + 1, dtype=torch.bfloat16)[:, :, :Q]
    assert gluon_wgrad._output_descriptor(unaligned, tile)[0] is None


class _RecordedKernel:
    """Stands in for a ``gluon.jit`` kernel: records each launch's (args, meta)."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launches.append((args, meta))


def _stand_in_wgrad_operands(monkeypatch, programs=4, q_contiguous=True):
    """CPU stand-ins for a weight gradient's launch (3 experts of 256 rows, P=512, Q=1024:
    48 tiles, a Q- or P-contiguous [E, P, Q] gradient) as ``launch_wgrad`` sees them on an
    H200 with ``programs`` programs (at most one a tile), a Hopper's shared memory, and its
    kernel a stand-in that records the launch (no GPU)."""
    import torch

    from moeblaze_ops.kernels import config
    from moeblaze_ops.kernels.triton_backend.gluon import wgrad as gluon_wgrad
    from moeblaze_ops.kernels.triton_backend import grouped_gemm

    kernel = _RecordedKernel()
    monkeypatch.setattr(gluon_wgrad, "_wgrad_rows_tma_ws_kernel", kernel)
    monkeypatch.setattr(grouped_gemm, "num_programs", lambda device, tiles, per_sm=1: min(programs, tiles))
    monkeypatch.setattr(config, "shared_memory_per_block", lambda device: HOPPER_SHARED)
    monkeypatch.setattr(config, "l2_bytes", lambda device: HOPPER_L2)
    E, P, Q, rows_per_expert = 3, 512, 1024, 256
    storage = torch.empty(E, P, Q, dtype=torch.bfloat16) if q_contiguous else torch.empty(E, Q, P, dtype=torch.bfloat16)
    rows = torch.empty(E * rows_per_expert, P, dtype=torch.bfloat16)
    gathered = torch.empty(16, Q, dtype=torch.bfloat16)
    ids = torch.zeros(rows.shape[0], dtype=torch.int32)
    offsets = torch.arange(E + 1, dtype=torch.int32) * rows_per_expert
    grad_w_pq = storage if q_contiguous else storage.transpose(1, 2)
    return kernel, (rows, gathered, ids, offsets, grad_w_pq)


@pytest.mark.parametrize("q_contiguous", [True, False])
@pytest.mark.parametrize("programs", [4, 1000])
def test_weight_gradient_store_choice(q_contiguous, programs, monkeypatch):
    """``launch_wgrad`` stores by TMA only where a program has a next tile to run the store
    beside (more tiles than programs), in the orientation of the gradient's memory; the
    copy warpgroup and the row-ordered operand's TMA descriptor are there either way."""
    from moeblaze_ops.kernels.triton_backend.gluon import wgrad as gluon_wgrad

    kernel, operands = _stand_in_wgrad_operands(monkeypatch, programs, q_contiguous)
    gluon_wgrad.launch_wgrad(*operands)
    [(args, meta)] = kernel.launches
    expected = programs < 12
    assert meta["TMA_STORE"] == expected and (args[6] is not None) == expected
    assert meta["OUT_TRANSPOSED"] == (expected and q_contiguous)
    assert meta["PRODUCER_WARPS"] == gluon_wgrad.PRODUCER[0]
    tile = gluon_wgrad.TILE
    assert list(args[0].block_shape) == [tile.block_k, tile.block_m] and args[1] is operands[0]
    # The rows above which an expert's tiles go in bands: what a wave reads Q-tile fastest
    # within L2, bf16 gathered rows 1024 wide beside the 256-wide P-tiles the wave spans
    # (8 Q-tiles: one P-tile for 4 programs, six for 48, one program a tile).
    assert args[10] == HOPPER_L2 // ((1024 + (256 if programs == 4 else 6 * 256)) * 2)
    assert meta["BAND"] == config.WGRAD_LONG_BAND


def test_weight_gradient_without_rows_is_zero(monkeypatch):
    """No routed rows at all: nothing for a TMA descriptor to describe, no launch, and every
    expert's gradient zero."""
    import torch

    from moeblaze_ops.kernels.triton_backend.gluon import wgrad as gluon_wgrad

    kernel, (rows, gathered, ids, offsets, grad_w_pq) = _stand_in_wgrad_operands(monkeypatch)
    grad_w_pq.fill_(float("nan"))
    gluon_wgrad.launch_wgrad(rows[:0], gathered, ids[:0], torch.zeros_like(offsets), grad_w_pq)
    assert not kernel.launches and grad_w_pq.eq(0).all()


@pytest.mark.parametrize("stages,pieces", [(4, 2), (3, 1)])
def test_weight_gradient_tile_stored_whole_where_it_fits(stages, pieces, monkeypatch):
    """``launch_wgrad`` stages the whole output tile for its TMA store where the tile's
    buffer fits beside the ring (three 48 KB stages and 64 KB: one store a tile), else half
    of it (four stages): the launch's ``STORE_PIECES`` and the descriptor's box agree."""
    from moeblaze_ops.kernels.triton_backend.gluon import wgrad as gluon_wgrad

    kernel, operands = _stand_in_wgrad_operands(monkeypatch)
    tile = dataclasses.replace(gluon_wgrad.TILE, num_stages=stages)
    gluon_wgrad.launch_wgrad(*operands, tile)
    [(args, meta)] = kernel.launches
    assert meta["TMA_STORE"] and meta["STORE_PIECES"] == pieces
    out_desc = args[6]  # the gradient is Q-contiguous: the [Q, P] accumulator's tiles stored transposed
    assert meta["OUT_TRANSPOSED"] and list(out_desc.block_shape) == [1, tile.block_m // pieces, tile.block_n]


@pytest.mark.parametrize("split,warps", [(True, 8), (False, 8), (True, 4)])
def test_weight_gradient_split_mma_launch(split, warps, monkeypatch):
    """``split_mma`` runs the kernel with two MMA partitions of a warpgroup each (4 warps a
    partition, ``MMA_GROUPS`` 2) and a TMA box of half a tile's Q rows for each; the flag
    off, or a tile of one MMA warpgroup, keeps one MMA partition of all its warps."""
    from moeblaze_ops.kernels.triton_backend.gluon import wgrad as gluon_wgrad

    kernel, operands = _stand_in_wgrad_operands(monkeypatch)
    tile = gluon_wgrad.TILE if warps == 8 else GemmTile(256, 64, 64, 4, 4)
    gluon_wgrad.launch_wgrad(*operands, tile, split_mma=split)
    [(args, meta)] = kernel.launches
    groups = 2 if split and warps == 8 else 1
    assert meta["num_warps"] == warps // groups and meta["MMA_GROUPS"] == groups
    # Q-contiguous gradient: [Q, P] tiles stored transposed, half P a box.
    assert list(args[6].block_shape) == [1, tile.block_m // meta["STORE_PIECES"], tile.block_n // groups]


def test_weight_gradient_refuses_tiles_the_kernel_cannot_run(monkeypatch):
    """A tile whose Q block is not 16 rows a warp (the MMA's M), or of fewer than three
    stages, is refused by name before any launch."""
    from moeblaze_ops.kernels.triton_backend.gluon import wgrad as gluon_wgrad

    kernel, operands = _stand_in_wgrad_operands(monkeypatch)
    for tile in (GemmTile(256, 256, 64, 8, 4), GemmTile(256, 128, 64, 8, 2)):
        with pytest.raises(ValueError, match="block_n must be 16 \\* num_warps and num_stages at least 3"):
            gluon_wgrad.launch_wgrad(*operands, tile)
    assert not kernel.launches


def test_row_offsets_fit_32_bounds_views_by_their_row_stride():
    """The 32-bit offsets the Gluon kernels take for gathered rows: a view whose rows lie
    wider apart than its columns (a column slice) reaches offsets its element count does
    not bound, and must get 64-bit ones."""
    import torch

    from moeblaze_ops.kernels.triton_backend.gluon.common import row_offsets_fit_32

    whole = torch.empty(2**20, 4096, device="meta")
    assert not row_offsets_fit_32(whole)
    view = whole[:, :64]
    assert view.numel() < 2**31 and not row_offsets_fit_32(view)
    assert row_offsets_fit_32(torch.empty(2**20, 2047, device="meta"))
