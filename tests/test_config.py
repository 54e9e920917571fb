"""``moeblaze_ops.kernels.config``: the kernel configuration's rules and tile table, and
the launch decisions they drive."""

import pytest
import torch

from moeblaze_ops import settings


# --------------------------------------------------------------------------- the kernel configuration's rules


def test_rule_small_gemms():
    """GEMMs of fewer than ``SMALL_GEMM_FLOP`` operations are small: they run the ``tl``
    kernel (every kind with a Gluon kernel runs it from that count on) and read their
    weights by pointer (up, dH, dX read them by TMA from that count on, down never)."""
    from moeblaze_ops.kernels import config

    limit = config.SMALL_GEMM_FLOP
    assert limit == 10**11
    assert config.is_small_gemm(limit - 1) and not config.is_small_gemm(limit)
    for kind in config.GEMM_KINDS:
        assert not config.runs_gluon(kind, limit - 1)
        assert config.runs_gluon(kind, limit) == (kind in config.GLUON_KINDS)
        assert not config.reads_weight_by_tma(kind, limit - 1)
        assert config.reads_weight_by_tma(kind, limit) == (kind in ("up", "dh", "dx"))
    assert "dh_wide" not in config.GLUON_KINDS


def test_rule_warp_specialization_and_mma_partitions():
    """The Gluon row GEMMs are warp-specialised from 1024 routed rows per expert on average;
    the weight gradient splits its MMA warpgroups for "wgrad_up" only."""
    from moeblaze_ops.kernels import config

    assert config.row_gemm_warp_specialized(1024 * 8, 8) and not config.row_gemm_warp_specialized(1024 * 8 - 1, 8)
    assert config.wgrad_split_mma("wgrad_up") and not config.wgrad_split_mma("wgrad_down")
    assert config.ROW_BAND == 4


def test_rule_activation_beside_h():
    """act(h) is written beside h in layers of at most 8192 intermediate columns and at
    least 2048 routed rows per expert, never with interleaved halves or an up bias (the
    epilogue that writes both cannot); the rule's signature is what eager ``moe_experts``
    and the lowerings both call."""
    import inspect

    from moeblaze_ops.kernels import config

    assert list(inspect.signature(config.activation_beside_h).parameters) == [
        "columns", "rows", "experts", "interleaved", "up_bias"]
    assert config.activation_beside_h(8192, 2048 * 16, 16)
    assert not config.activation_beside_h(8192, 2048 * 16, 16, interleaved=True)
    assert not config.activation_beside_h(8192, 2048 * 16, 16, up_bias=True)
    assert not config.activation_beside_h(8193, 2048 * 16, 16)
    assert not config.activation_beside_h(8192, 2048 * 16 - 1, 16)


def test_rule_dh_epilogue_and_wide_tile():
    """The ``tl`` dH epilogue goes in slices of 64 columns (1, 2 or 4 a tile), and the
    "dh_wide" tile runs from 12288 intermediate columns."""
    from moeblaze_ops.kernels import config

    assert [config.dh_epilogue_slices(n) for n in (16, 64, 128, 256, 512)] == [1, 1, 2, 4, 4]
    assert config.dh_tile_kind(12287) == "dh" and config.dh_tile_kind(12288) == "dh_wide"


@pytest.mark.parametrize("rows,bins,family", [
    (0, 1, "one_program"), (1024, 256, "one_program"), (1025, 8, "one_hot"), (1025, 16, "sorted"),
    (10**6, 15, "one_hot"), (10**6, 256, "sorted")])
def test_rule_dispatch_family(rows, bins, family):
    """Routings of up to 1024 rows go to one program; larger ones are ranked by sorted
    chunks of 512 rows from 16 bins, by one-hot tiles below; one program never takes more
    than it can sort (``MAX_ONE_PROGRAM_ROWS``)."""
    from moeblaze_ops.kernels import config

    assert config.dispatch_family(rows, bins) == family
    assert config.DISPATCH_SORT_CHUNK == 512
    assert config.DISPATCH_ONE_PROGRAM_MAX_ROWS <= config.MAX_ONE_PROGRAM_ROWS == 8192


def test_tiles_are_pruned_by_shared_memory(monkeypatch):
    """The tile table's prune: a device with 64 KB of shared memory per block gets the first
    16-bit tile that fits, and autotuning's candidates are exactly the fitting tiles, once
    each (device traits stubbed: no GPU needed)."""
    from moeblaze_ops.kernels import config

    limit = 64 * 1024
    monkeypatch.setattr(config, "_device_traits", lambda index: ("any", limit))
    cuda = torch.device("cuda", 0)
    config._table_tile.cache_clear()  # picks cached for a real device (or for this stub, after)
    try:
        tile = config.pick_tile("up", torch.bfloat16, cuda)
    finally:
        config._table_tile.cache_clear()
    table = config.TILE_TABLE[("up", "16bit", "any")]
    assert tile == next(t for t in table if t.smem_bytes(2) <= limit)
    candidates = config.candidate_tiles(("up", "down", "dx"), torch.bfloat16, cuda)
    assert len(candidates) == len(set(candidates)) > 0
    assert all(t.smem_bytes(2) <= limit for t in candidates)
    every = {t for (kind, cls, *_), tiles in config.TILE_TABLE.items()
             if kind in ("up", "down", "dx") and cls == "16bit" for t in tiles}
    assert set(candidates) == {t for t in every if t.smem_bytes(2) <= limit}


def test_forward_tiles_by_rows_per_expert(monkeypatch):
    """The up and down GEMMs of a decode step (at most 8 routed rows per expert on average,
    from the shapes) take the table's "few_rows" tile, of 8 to 24 rows its "some_rows" one,
    of more the general Hopper tile; kinds without rows classes (dX) keep theirs at any
    rows, and a ``tiles`` override wins everywhere (an H100's traits stubbed: no GPU needed)."""
    from moeblaze_ops.kernels import config

    monkeypatch.setattr(config, "_device_traits", lambda index: ("sm90", 227 * 1024))
    cuda = torch.device("cuda", 0)
    assert [config.rows_class(rows, 8) for rows in (0, 2, 64, 65, 192, 193)] == [
        "few_rows", "few_rows", "few_rows", "some_rows", "some_rows", None]
    config._table_tile.cache_clear()
    try:
        for kind in ("up", "down"):
            few, some, general = (config.TILE_TABLE[key][0] for key in (
                (kind, "16bit", "sm90", "few_rows"), (kind, "16bit", "sm90", "some_rows"), (kind, "16bit", "sm90")))
            assert len({few, some, general}) == 3 and few.block_m < some.block_m < general.block_m
            # T = 1, 8, 64, 512 tokens of a Mixtral-like layer (K = 2 of E = 8)
            picks = [config.pick_tile(kind, torch.bfloat16, cuda, 2 * T, 8) for T in (1, 8, 64, 512)]
            assert picks == [few, few, some, general]
            assert config.pick_tile(kind, torch.bfloat16, cuda) == general  # rows unknown
            tuned = config.GemmTile(64, 64, 32, 4, 2)
            with settings.override(tiles={kind: tuned}):
                assert config.pick_tile(kind, torch.bfloat16, cuda, 2, 8) == tuned
        assert config.pick_tile("dx", torch.bfloat16, cuda, 2, 8) == config.TILE_TABLE[("dx", "16bit", "sm90")][0]
    finally:
        config._table_tile.cache_clear()


def test_dh_tile_by_layer_width(monkeypatch):
    """dH takes the "dh_wide" tile from ``config.DH_WIDE_MIN_COLUMNS`` intermediate columns
    and the "dh" tile below; an override of the "dh" tile alone applies at every width, one
    of "dh_wide" too above the threshold (an H200's traits stubbed: no GPU needed)."""
    from types import SimpleNamespace

    from moeblaze_ops.kernels import config
    from moeblaze_ops.kernels.triton_backend import experts_backward as tb

    monkeypatch.setattr(config, "_device_traits", lambda index: ("sm90", 227 * 1024))
    h = SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cuda", 0))
    narrow, wide = (config.TILE_TABLE[(kind, "16bit", "sm90")][0] for kind in ("dh", "dh_wide"))
    assert narrow != wide
    tuned, tuned_wide = config.GemmTile(64, 64, 32, 4, 2), config.GemmTile(64, 128, 32, 4, 2)
    config._table_tile.cache_clear()
    try:
        wide_from = config.DH_WIDE_MIN_COLUMNS
        assert (tb.dh_tile(h, wide_from - 1), tb.dh_tile(h, wide_from)) == (narrow, wide)
        with settings.override(tiles={"dh": tuned}):
            assert (tb.dh_tile(h, wide_from - 1), tb.dh_tile(h, wide_from)) == (tuned, tuned)
        with settings.override(tiles={"dh": tuned, "dh_wide": tuned_wide}):
            assert (tb.dh_tile(h, wide_from - 1), tb.dh_tile(h, wide_from)) == (tuned, tuned_wide)
    finally:
        config._table_tile.cache_clear()


def test_dh_kernel_choice_sizes_the_router_partials(monkeypatch):
    """Where the Gluon dH module is given (``config.runs_gluon``) and applies (at any
    width), ``launch_dh`` hands it the operands and the "dh" tile override (else None: the
    kernel's own), and the router partials are sized by its columns per partial; where it
    does not apply or none is given, by the tl kernel's tile. The Gluon module is a
    stand-in that records its launch (no GPU)."""
    from types import SimpleNamespace

    from moeblaze_ops.kernels import config
    from moeblaze_ops.kernels.triton_backend import grouped_gemm as gg
    from moeblaze_ops.kernels.triton_backend import experts_backward as tb

    launches = []
    fake = SimpleNamespace(PART_COLUMNS=64, applies=lambda *a: True,
                           launch_dh=lambda *args, **kwargs: launches.append((args, kwargs)))
    given = {"module": None}
    monkeypatch.setattr(gg, "gluon_kernels", lambda kind, t, flop: given["module"] if kind == "dh" else None)
    L, d, I, E, K = 6, 32, 320, 4, 2
    h = torch.randn(L * K, 2 * I)
    w_down = torch.randn(E, d, I)
    grad_out = torch.randn(L, d)
    operands = dict(act=0, transposed=False, interleaved=False, has_bias=False)

    def part_columns():
        return tb.dh_part_columns(tb.dh_gluon_module(grad_out, h, w_down, **operands), h, I)

    tl_columns = tb.dh_tile(h, I).block_n
    assert tl_columns != 64
    assert part_columns() == tl_columns
    given["module"] = fake
    assert part_columns() == 64
    monkeypatch.setattr(config, "DH_WIDE_MIN_COLUMNS", I)  # a wide layer: the Gluon kernel too
    assert part_columns() == 64
    tuned = config.GemmTile(128, 128, 64, 4, 5)
    gluon = tb.dh_gluon_module(grad_out, h, w_down, **operands)
    assert gluon is fake
    parts = torch.empty(L * K, gg.cdiv(I, 64))
    args = (gluon, grad_out, h, w_down, None, torch.rand(L, K), None, None, None, h, None, parts, None)
    for tiles in [{}, {"dh": tuned}]:
        with settings.override(tiles=tiles):
            tb.launch_dh(*args, act=0, transposed=False, interleaved=False, alpha=1.0, limit=7.0)
    fake.applies = lambda *a: False
    assert part_columns() == tl_columns
    assert [kwargs["tile"] for _, kwargs in launches] == [None, tuned]
    assert all(args[9] is parts and set(kwargs) == {"act", "transposed", "alpha", "limit", "tile"}
               for args, kwargs in launches)


@pytest.mark.parametrize("rows,offsets_32", [(1024, True), (2**28 + 1, False)], ids=["small", "past_int32"])
def test_gathered_copies_use_32_bit_offsets_only_where_they_fit(rows, offsets_32, monkeypatch):
    """The warp-specialised Gluon copies (the dH kernel's and the row GEMM's) gather A's
    rows with 32-bit element offsets only where A has fewer than 2^31 elements; past that,
    64-bit ones (a wrong choice would address other rows without a fault). Meta tensors
    stand in for an A that large; the launch is recorded, not run (no GPU)."""
    pytest.importorskip("triton.experimental.gluon")
    from moeblaze_ops.kernels.triton_backend.gluon import dh as gluon_dh
    from moeblaze_ops.kernels.triton_backend.gluon import row_gemm as gluon_row_gemm

    launches = []
    for module in (gluon_dh, gluon_row_gemm):
        monkeypatch.setattr(module, "launch", lambda kernel, grid, *args, **kwargs: launches.append(kwargs))
        monkeypatch.setattr(module, "host_descriptor", lambda t, block: object())
    # An H200's shared memory a block, which the dH launch sizes its ring of h from.
    from moeblaze_ops.kernels import config

    monkeypatch.setattr(config, "shared_memory_per_block", lambda device: 232448)
    d, I, E, K = 128, 64, 4, 2
    meta = dict(device="meta", dtype=torch.bfloat16)
    grad_out = torch.empty(rows, d, **meta)  # A of both GEMMs, [L, d]: 2^35 elements in the large case
    LK = 64
    h, w_down = torch.empty(LK, 2 * I, **meta), torch.empty(E, d, I, **meta)
    ids = torch.empty(LK, dtype=torch.int32, device="meta")
    parts = torch.empty(LK, I // gluon_dh.PART_COLUMNS, dtype=torch.float32, device="meta")
    gluon_dh.launch_dh(grad_out, h, w_down, ids, torch.empty(LK // K, K, device="meta"), ids, ids, h, None, parts,
                       act=0, transposed=False, alpha=1.0, limit=7.0)
    out = torch.empty(LK, 2 * I, **meta)
    gluon_row_gemm.launch_row_gemm(grad_out, ids, torch.empty(E, 2 * I, d, **meta), None, ids, out, False,
                                   warp_specialize=True)
    assert [kwargs["A_OFFSETS_32"] for kwargs in launches] == [offsets_32, offsets_32]
