"""The Gluon kernels compile for Hopper on any machine (no GPU needed): Triton's own
compiler and ptxas build them for an sm_90 target, so an API change in the installed
Triton shows here, on CPU CI, before a GPU run. What they compute is checked on the GPU
(tests/test_gpu.py)."""

import dataclasses
import re

import pytest

gluon_runtime = pytest.importorskip("triton.experimental.gluon._runtime")


#: The shared memory a block may opt into on an H100 / H200 (sm_90).
HOPPER_SHARED = 227 * 1024


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


@pytest.mark.parametrize("band", [1, 4])
@pytest.mark.parametrize("variant", ["one_partition", "one_partition_store_mn", "one_partition_store_nm",
                                     "warp_specialized", "rows_tma", "rows_tma_store_mn", "rows_tma_store_nm",
                                     "rows_tma_ws", "rows_tma_ws_store_mn", "rows_tma_ws_store_nm",
                                     "rows_tma_ws_split", "rows_tma_ws_split_store_mn", "rows_tma_ws_split_store_nm",
                                     "rows_tma_store_mn_whole", "rows_tma_ws_store_mn_whole",
                                     "rows_tma_ws_store_nm_whole"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_weight_gradient_kernels_compile_for_hopper(dtype, variant, band, tmp_path):
    from test_gluon_row_gemm_compile import MAX_SHARED, _descriptor_type, _spill_bytes

    from moeblaze_ops.kernels import gluon_wgrad

    rows_tma, warp_specialize = variant.startswith("rows_tma"), variant == "warp_specialized" or "_ws" in variant
    tma_store = "store" in variant
    groups = 2 if "_split" in variant else 1  # the MMA warpgroups in partitions of their own
    tile = gluon_wgrad.ROWS_TMA_TILE if rows_tma else gluon_wgrad.TILE
    # "whole": three stages leave room for a whole tile's output buffer (one store a tile).
    pieces = 1 if variant.endswith("_whole") else 2
    if pieces == 1:
        tile = dataclasses.replace(tile, num_stages=3)
    ints = ["E", "P", "Q", "stride_rm", "stride_gm", "stride_oe", "stride_op", "stride_oq"]
    signature = {"rows_ptr": f"*{dtype}", "gathered_ptr": f"*{dtype}", "row_ids_ptr": "*i32", "offsets_ptr": "*i32",
                 "out_ptr": f"*{dtype}", **{name: "i32" for name in ints}}
    constexprs = dict(BLOCK_P=tile.block_m, BLOCK_Q=tile.block_n, BLOCK_R=tile.block_k, NUM_STAGES=tile.num_stages,
                      BAND=band, num_warps=tile.num_warps // groups)
    if not warp_specialize or rows_tma:
        # The output descriptor's box: half an [M, N] accumulator tile or all of it (of an
        # MMA group's M rows), in its order ("mn") or transposed ("nm": M contiguous in the
        # gradient).
        m, n = (tile.block_n // groups, tile.block_m) if rows_tma else (tile.block_m, tile.block_n)
        transposed = "_nm" in variant
        signature["out_desc"] = _descriptor_type(dtype, [1, n // pieces, m] if transposed else [1, m, n // pieces])
        constexprs.update(TMA_STORE=tma_store, OUT_TRANSPOSED=transposed, STORE_PIECES=pieces)
        if not tma_store:
            constexprs["out_desc"] = None
    if rows_tma:
        signature = {"rows_desc": _descriptor_type(dtype, [tile.block_k, tile.block_m]), **signature}
        constexprs["G_OFFSETS_32"] = band == 1  # both widths of the gathered rows' offsets
        kernel_fn = gluon_wgrad._wgrad_rows_tma_kernel
        if warp_specialize:
            constexprs.update(zip(("PRODUCER_WARPS", "PRODUCER_REGS"), gluon_wgrad.PRODUCER), MMA_GROUPS=groups,
                              MMA_REGS=gluon_wgrad.MMA_GROUP_REGS)
            kernel_fn = gluon_wgrad._wgrad_rows_tma_ws_kernel
    elif warp_specialize:
        constexprs.update(zip(("PRODUCER_WARPS", "PRODUCER_REGS"), gluon_wgrad.PRODUCER))
        kernel_fn = gluon_wgrad._wgrad_ws_kernel
    else:
        kernel_fn = gluon_wgrad._wgrad_kernel
    try:
        kernel = _compile_for_hopper(kernel_fn, signature, constexprs, tile.num_warps // groups,
                                     aligned=["rows_ptr", "gathered_ptr", "row_ids_ptr", "offsets_ptr", "out_ptr", "P",
                                              "Q", "stride_rm", "stride_gm", "stride_oe", "stride_op"])
    except FileNotFoundError as error:  # a Triton wheel without its bundled ptxas
        pytest.skip(f"no ptxas: {error}")
    ptx = kernel.asm["ptx"]
    # The pipeline they are written for: 16-byte cp.async copies into shared memory and
    # asynchronous wgmma reading the left operand transposed from there, as wide as the
    # operand on the right (the gathered rows', or with rows_tma the row-ordered operand's,
    # which then comes by 2-D TMA). Warp-specialised, the copies come from the copy
    # warpgroup, each thread arriving on the slot's barrier when they land, its registers
    # cut back and the MMA warpgroups' raised.
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)
    if rows_tma:
        assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global\.mbarrier::complete_tx::bytes", ptx)
    if warp_specialize:
        assert re.search(r"cp\.async\.mbarrier\.arrive\.noinc", ptx)
        assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+\d+", ptx)
    ptx_type = {"bf16": "bf16", "fp16": "f16"}[dtype]
    wide = tile.block_m if rows_tma else tile.block_n
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{wide}k16\.f32\.{ptx_type}\.{ptx_type}", ptx)
    if tma_store:  # each piece by 3-D TMA copies from shared memory, waited for before its buffer is reused
        assert re.search(r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta\.bulk_group", ptx)
        waits = re.findall(r"cp\.async\.bulk\.wait_group\.read\s+0;", ptx)
        # One wait before each piece's buffer is written, and the program's last (in each MMA group).
        assert len(waits) == (pieces + 1) * groups
    ring = tile.num_stages * (tile.block_m + tile.block_n) * tile.block_k * 2
    out_buffer = tile.block_m * tile.block_n * 2 // pieces if tma_store else 0
    assert ring + out_buffer <= kernel.metadata.shared <= MAX_SHARED
    if warp_specialize or rows_tma:
        assert _spill_bytes(ptx, tmp_path) == 0


@pytest.mark.parametrize("rows_tma", [False, True], ids=["one_partition", "rows_tma"])
@pytest.mark.parametrize("q_contiguous", [True, False])
def test_weight_gradient_output_descriptor(rows_tma, q_contiguous):
    """The TMA-store epilogue's descriptor (``gluon_wgrad._output_descriptor``) describes the
    gradient's own memory with its contiguous dimension last: in the accumulator's [E, M,
    N] order where N is contiguous, else transposed ([E, N, M]); half a tile per box; and
    no descriptor where TMA cannot write (a row stride that is not 16-byte aligned)."""
    import torch

    from moeblaze_ops.kernels import gluon_wgrad

    E, P, Q = 3, 192, 2880
    storage = torch.empty(E, P, Q, dtype=torch.bfloat16) if q_contiguous else torch.empty(E, Q, P, dtype=torch.bfloat16)
    grad_w_pq = storage if q_contiguous else storage.transpose(1, 2)  # [E, P, Q] either way
    tile = gluon_wgrad.ROWS_TMA_TILE if rows_tma else gluon_wgrad.TILE
    desc, transposed = gluon_wgrad._output_descriptor(grad_w_pq, tile, rows_tma)
    # The accumulator is [Q, P] for the rows-TMA kernel, [P, Q] for the other.
    m, n = (tile.block_n, tile.block_m) if rows_tma else (tile.block_m, tile.block_n)
    assert transposed == (q_contiguous == rows_tma)  # the accumulator's M is the contiguous side
    assert tuple(desc.shape) == tuple(storage.shape) and tuple(desc.strides) == storage.stride()
    assert desc.base.data_ptr() == storage.data_ptr()
    assert list(desc.block_shape) == ([1, n // 2, m] if transposed else [1, m, n // 2])
    unaligned = torch.empty(E, P, Q + 1, dtype=torch.bfloat16)[:, :, :Q]
    assert gluon_wgrad._output_descriptor(unaligned, tile, rows_tma)[0] is None


@pytest.mark.parametrize("rows_tma", [False, True], ids=["one_partition", "rows_tma"])
@pytest.mark.parametrize("q_contiguous", [True, False])
@pytest.mark.parametrize("programs", [4, 1000])
def test_weight_gradient_store_choice(rows_tma, q_contiguous, programs, monkeypatch):
    """``launch_wgrad`` stores by TMA only where a program has a next tile to run the store
    beside (more tiles than programs), in the orientation of the gradient's memory. The
    kernels are stand-ins that record their launch (no GPU)."""
    import torch

    from moeblaze_ops import settings
    from moeblaze_ops.kernels import gluon_wgrad, grouped_gemm

    launches = []

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append(meta)

    monkeypatch.setattr(gluon_wgrad, "_wgrad_kernel", FakeKernel())
    monkeypatch.setattr(gluon_wgrad, "_wgrad_rows_tma_kernel", FakeKernel())
    monkeypatch.setattr(grouped_gemm, "num_programs", lambda device, tiles, per_sm=1: min(programs, tiles))
    monkeypatch.setattr(settings, "shared_memory_per_block", lambda device: HOPPER_SHARED)
    E, P, Q, rows_per_expert = 3, 512, 1024, 256  # 12 to 24 tiles
    storage = torch.empty(E, P, Q, dtype=torch.bfloat16) if q_contiguous else torch.empty(E, Q, P, dtype=torch.bfloat16)
    grad_w_pq = storage if q_contiguous else storage.transpose(1, 2)
    rows = torch.empty(E * rows_per_expert, P, dtype=torch.bfloat16)
    gathered = torch.empty(16, Q, dtype=torch.bfloat16)
    ids = torch.zeros(rows.shape[0], dtype=torch.int32)
    offsets = torch.arange(E + 1, dtype=torch.int32) * rows_per_expert
    for store in (False, True):
        gluon_wgrad.launch_wgrad(rows, gathered, ids, offsets, grad_w_pq, rows_tma=rows_tma, tma_store=store)
    expected = programs < 12
    assert [meta["TMA_STORE"] for meta in launches] == [False, expected]
    assert launches[1]["OUT_TRANSPOSED"] == (expected and q_contiguous == rows_tma)


def _stand_in_wgrad_operands(monkeypatch):
    """CPU stand-ins for a weight gradient's launch (3 experts of 256 rows, P=512, Q=1024,
    a Q-contiguous [E, P, Q] gradient) as ``launch_wgrad`` sees them on an H200: 4
    programs, a Hopper's shared memory."""
    import torch

    from moeblaze_ops import settings
    from moeblaze_ops.kernels import grouped_gemm

    monkeypatch.setattr(grouped_gemm, "num_programs", lambda device, tiles, per_sm=1: 4)
    monkeypatch.setattr(settings, "shared_memory_per_block", lambda device: HOPPER_SHARED)
    E, P, Q, rows_per_expert = 3, 512, 1024, 256
    rows = torch.empty(E * rows_per_expert, P, dtype=torch.bfloat16)
    gathered = torch.empty(16, Q, dtype=torch.bfloat16)
    ids = torch.zeros(rows.shape[0], dtype=torch.int32)
    offsets = torch.arange(E + 1, dtype=torch.int32) * rows_per_expert
    return rows, gathered, ids, offsets, torch.empty(E, P, Q, dtype=torch.bfloat16)


@pytest.mark.parametrize("rows_tma,warp_specialize,expected", [
    (False, False, "_wgrad_kernel"), (False, True, "_wgrad_ws_kernel"), (True, False, "_wgrad_rows_tma_kernel"),
    (True, True, "_wgrad_rows_tma_ws_kernel")])
def test_weight_gradient_kernel_choice(rows_tma, warp_specialize, expected, monkeypatch):
    """``launch_wgrad`` runs one kernel for each choice of the row-ordered operand's copy
    (TMA or not) and warp specialisation; each but ``_wgrad_ws_kernel`` stores its tiles
    by TMA when asked (more tiles than programs here). Stand-in kernels record their
    launch (no GPU)."""
    from moeblaze_ops.kernels import gluon_wgrad

    launches = []

    class FakeKernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append((self.name, meta))

    names = ("_wgrad_kernel", "_wgrad_ws_kernel", "_wgrad_rows_tma_kernel", "_wgrad_rows_tma_ws_kernel")
    for name in names:
        monkeypatch.setattr(gluon_wgrad, name, FakeKernel(name))
    rows, gathered, ids, offsets, grad_w_pq = _stand_in_wgrad_operands(monkeypatch)
    gluon_wgrad.launch_wgrad(rows, gathered, ids, offsets, grad_w_pq, warp_specialize=warp_specialize,
                             rows_tma=rows_tma, tma_store=True)
    [(name, meta)] = launches
    assert name == expected
    assert meta.get("TMA_STORE", False) == (expected != "_wgrad_ws_kernel")
    assert ("PRODUCER_WARPS" in meta) == warp_specialize


@pytest.mark.parametrize("stages,pieces", [(4, 2), (3, 1)])
def test_weight_gradient_tile_stored_whole_where_it_fits(stages, pieces, monkeypatch):
    """``launch_wgrad`` stages the whole output tile for its TMA store where the tile's
    buffer fits beside the ring (three 48 KB stages and 64 KB: one store a tile), else half
    of it (four stages): the launch's ``STORE_PIECES`` and the descriptor's box agree.
    Stand-in kernels record their launch (no GPU)."""
    from moeblaze_ops.kernels import gluon_wgrad

    launches = []

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append((args, meta))

    monkeypatch.setattr(gluon_wgrad, "_wgrad_rows_tma_ws_kernel", FakeKernel())
    rows, gathered, ids, offsets, grad_w_pq = _stand_in_wgrad_operands(monkeypatch)
    tile = dataclasses.replace(gluon_wgrad.ROWS_TMA_TILE, num_stages=stages)
    gluon_wgrad.launch_wgrad(rows, gathered, ids, offsets, grad_w_pq, tile, warp_specialize=True, rows_tma=True,
                             tma_store=True)
    [(args, meta)] = launches
    assert meta["TMA_STORE"] and meta["STORE_PIECES"] == pieces
    out_desc = args[6]  # the gradient is Q-contiguous: the [Q, P] accumulator's tiles stored transposed
    assert meta["OUT_TRANSPOSED"] and list(out_desc.block_shape) == [1, tile.block_m // pieces, tile.block_n]


@pytest.mark.parametrize("split,rows_tma,warp_specialize", [(True, True, True), (False, True, True),
                                                            (True, True, False), (True, False, True)])
def test_weight_gradient_split_mma_launch(split, rows_tma, warp_specialize, monkeypatch):
    """``split_mma`` runs the warp-specialised rows-TMA kernel with two MMA partitions of a
    warpgroup each (4 warps a partition, ``MMA_GROUPS`` 2) and a TMA box of half a tile's
    Q rows for each; every other kernel, and the flag off, keep one MMA partition of all
    8 warps. Stand-in kernels record their launch (no GPU)."""
    from moeblaze_ops.kernels import gluon_wgrad

    launches = []

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append((args, meta))

    for name in ("_wgrad_kernel", "_wgrad_ws_kernel", "_wgrad_rows_tma_kernel", "_wgrad_rows_tma_ws_kernel"):
        monkeypatch.setattr(gluon_wgrad, name, FakeKernel())
    rows, gathered, ids, offsets, grad_w_pq = _stand_in_wgrad_operands(monkeypatch)
    gluon_wgrad.launch_wgrad(rows, gathered, ids, offsets, grad_w_pq, warp_specialize=warp_specialize,
                             rows_tma=rows_tma, tma_store=True, split_mma=split)
    [(args, meta)] = launches
    groups = 2 if split and rows_tma and warp_specialize else 1
    assert meta["num_warps"] == 8 // groups and meta.get("MMA_GROUPS", 1) == groups
    if rows_tma and warp_specialize:
        tile = gluon_wgrad.ROWS_TMA_TILE  # Q-contiguous gradient: [Q, P] tiles stored transposed, half P a box
        assert list(args[6].block_shape) == [1, tile.block_m // meta["STORE_PIECES"], tile.block_n // groups]


def test_row_offsets_fit_32_bounds_views_by_their_row_stride():
    """The 32-bit offsets the Gluon kernels take for gathered rows: a view whose rows lie
    wider apart than its columns (a column slice) reaches offsets its element count does
    not bound, and must get 64-bit ones."""
    import torch

    from moeblaze_ops.kernels.gluon_common import row_offsets_fit_32

    whole = torch.empty(2**20, 4096, device="meta")
    assert not row_offsets_fit_32(whole)
    view = whole[:, :64]
    assert view.numel() < 2**31 and not row_offsets_fit_32(view)
    assert row_offsets_fit_32(torch.empty(2**20, 2047, device="meta"))
