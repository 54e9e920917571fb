"""The Gluon row GEMM (``kernels.triton_backend.gluon.row_gemm``) and the dH on its warp-specialised
ring (``kernels.triton_backend.gluon.dh``) compile for Hopper on any machine, as
tests/test_gluon_compile.py checks for the weight gradients: both weight layouts, both
16-bit dtypes, with and without the gather and the bias. What it computes is checked on
the GPU (tests/test_gpu.py)."""

import re
import subprocess

import pytest

from test_gluon_compile import _compile_for_hopper

#: The shared memory one sm_90 block can use (227 KB).
MAX_SHARED = 232448


def _descriptor_type(dtype, block):
    """The signature type of a tensor-descriptor argument, as the JIT writes it."""
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout.get_default_for(block, {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype])
    return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout!r}>"


def _spill_bytes(ptx, tmp_path):
    """Bytes that ptxas (Triton's own, for sm_90) spills compiling ``ptx``."""
    from triton.backends.nvidia.compiler import get_ptxas

    source = tmp_path / "kernel.ptx"
    source.write_text(ptx)
    report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(source), "-o",
                             str(tmp_path / "kernel.cubin")], capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill", report))


def _assert_row_gemm_pipeline(kernel, dtype, tile, tmp_path):
    """What both row GEMM kernels are written for: B tiles by TMA from the 3-D weight
    descriptor, asynchronous wgmma over the whole N tile, the ring within the block's
    shared memory, and no register spills."""
    ptx = kernel.asm["ptx"]
    assert re.search(r"cp\.async\.bulk\.tensor\.3d\.shared::\w+\.global\.mbarrier::complete_tx::bytes", ptx)
    ptx_type = {"bf16": "bf16", "fp16": "f16"}[dtype]
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile.block_n}k16\.f32\.{ptx_type}\.{ptx_type}", ptx)
    ring = tile.num_stages * (tile.block_m + tile.block_n) * tile.block_k * 2
    assert ring <= kernel.metadata.shared <= MAX_SHARED
    assert _spill_bytes(ptx, tmp_path) == 0


def _output_tiles(signature, constexprs, dtype, tile):
    """The output's TMA descriptor argument ([1, LK, N], a column half of a tile per copy);
    no activation in the epilogue (``_ACTIVATED_SCRIPT`` has one)."""
    signature["out_desc"] = _descriptor_type(dtype, [1, tile.block_m, tile.block_n // 2])
    signature.update(alpha="fp32", limit="fp32", stride_hm="i32")
    constexprs.update(GATED=None, ACT=-1, STORE_H=False, h_ptr=None, h_desc=None)


def _assert_tile_stores(ptx):
    """Tiles inside their expert by TMA (two column halves), the others from registers."""
    stores = len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta", ptx))
    assert stores == 2
    assert re.search(r"st\.global(\.\w+)*\.b32", ptx)


@pytest.mark.parametrize("gather,bias", [(True, True), (False, False), (True, False), (False, True)])
@pytest.mark.parametrize("k_contiguous", [True, False], ids=["k_contiguous", "n_contiguous"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_row_gemm_kernel_compiles_for_hopper(dtype, k_contiguous, gather, bias, tmp_path):
    from moeblaze_ops.kernels import config
    from moeblaze_ops.kernels.triton_backend.gluon import row_gemm as gluon_row_gemm

    tile = gluon_row_gemm.TILE
    block = [1, tile.block_n, tile.block_k] if k_contiguous else [1, tile.block_k, tile.block_n]
    signature = {"a_ptr": f"*{dtype}", "b_desc": _descriptor_type(dtype, block), "bias_ptr": f"*{dtype}",
                 "a_row_ids_ptr": "*i32", "offsets_ptr": "*i32", "out_ptr": f"*{dtype}",
                 **{name: "i32" for name in ["LK", "E", "N", "K", "stride_am", "stride_bias", "stride_om"]}}
    constexprs = dict(GATHER_A=gather, HAS_BIAS=bias, B_KMAJOR=k_contiguous, GROUPS=16, BAND=config.ROW_BAND,
                      BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, NUM_STAGES=tile.num_stages,
                      num_warps=tile.num_warps)
    _output_tiles(signature, constexprs, dtype, tile)
    if not gather:
        constexprs["a_row_ids_ptr"] = None
    if not bias:
        constexprs["bias_ptr"] = None
    aligned = ["a_ptr", "bias_ptr", "a_row_ids_ptr", "offsets_ptr", "out_ptr", "N", "K", "stride_am", "stride_bias",
               "stride_om"]
    try:
        kernel = _compile_for_hopper(gluon_row_gemm._row_gemm_kernel, signature, constexprs, tile.num_warps,
                                     aligned=[name for name in aligned if name not in constexprs])
    except FileNotFoundError as error:  # a Triton wheel without its bundled ptxas
        pytest.skip(f"no ptxas: {error}")
    ptx = kernel.asm["ptx"]
    # A rows by 16-byte cp.async, then the pipeline both kernels share.
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)
    _assert_tile_stores(ptx)
    _assert_row_gemm_pipeline(kernel, dtype, tile, tmp_path)


@pytest.mark.parametrize("gather,bias,offsets_32", [
    (True, True, True), (True, False, False), (False, True, False), (False, False, False)])
@pytest.mark.parametrize("k_contiguous", [True, False], ids=["k_contiguous", "n_contiguous"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_warp_specialized_row_gemm_compiles_for_hopper(dtype, k_contiguous, gather, bias, offsets_32, tmp_path):
    from moeblaze_ops.kernels import config
    from moeblaze_ops.kernels.triton_backend.gluon import row_gemm as gluon_row_gemm

    tile = gluon_row_gemm.TILE
    block = [1, tile.block_n, tile.block_k] if k_contiguous else [1, tile.block_k, tile.block_n]
    warps, regs = gluon_row_gemm.PRODUCER_GATHER if gather else gluon_row_gemm.PRODUCER_TMA
    signature = {"a_src": f"*{dtype}" if gather else _descriptor_type(dtype, [tile.block_m, tile.block_k]),
                 "b_desc": _descriptor_type(dtype, block), "bias_ptr": f"*{dtype}", "a_row_ids_ptr": "*i32",
                 "offsets_ptr": "*i32", "out_ptr": f"*{dtype}",
                 **{name: "i32" for name in ["LK", "E", "N", "K", "stride_am", "stride_bias", "stride_om"]}}
    constexprs = dict(GATHER_A=gather, HAS_BIAS=bias, B_KMAJOR=k_contiguous, GROUPS=16, BAND=config.ROW_BAND,
                      BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, NUM_STAGES=tile.num_stages,
                      PRODUCER_WARPS=warps, PRODUCER_REGS=regs, A_OFFSETS_32=offsets_32, num_warps=tile.num_warps)
    _output_tiles(signature, constexprs, dtype, tile)
    if not gather:
        constexprs["a_row_ids_ptr"] = None
    if not bias:
        constexprs["bias_ptr"] = None
    aligned = ["a_src", "bias_ptr", "a_row_ids_ptr", "offsets_ptr", "out_ptr", "N", "K", "stride_am", "stride_bias",
               "stride_om"]
    try:
        kernel = _compile_for_hopper(gluon_row_gemm._row_gemm_ws_kernel, signature, constexprs, tile.num_warps,
                                     aligned=[name for name in aligned if name not in constexprs
                                              and not (name == "a_src" and not gather)])
    except FileNotFoundError as error:  # a Triton wheel without its bundled ptxas
        pytest.skip(f"no ptxas: {error}")
    ptx = kernel.asm["ptx"]
    # A gathered by 16-byte cp.async, each copy thread arriving on the slot's barrier when
    # they land, or by TMA from a 2-D descriptor; the copy warps' registers cut back and the
    # MMA warpgroups' raised; then the pipeline both kernels share.
    if gather:
        assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)
        assert re.search(r"cp\.async\.mbarrier\.arrive\.noinc", ptx)
    else:
        assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global\.mbarrier::complete_tx::bytes", ptx)
        assert "cp.async.cg" not in ptx
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+\d+", ptx)
    _assert_tile_stores(ptx)
    _assert_row_gemm_pipeline(kernel, dtype, tile, tmp_path)


def _compile_in_subprocess(script, args, tmp_path):
    """``{"ptx", "shared"}`` of the kernel that ``script`` compiles from JSON ``args`` (plus
    the output file's path) in a Python without ``TRITON_INTERPRET``; skips where the
    Triton wheel has no ptxas (the script exits with 3)."""
    import json
    import os
    import sys

    out = tmp_path / "kernel.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script, json.dumps([*args, str(out)]), os.path.dirname(__file__)],
                            env=env, capture_output=True, text=True)
    if result.returncode == 3:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


#: Compiles the Gluon dH kernel in a subprocess: it
#: calls ``tl`` functions (the activation's backward, the combine weights), which under
#: ``TRITON_INTERPRET=1`` (set for this test session) are interpreter functions that
#: Gluon's compiler does not take.
_DH_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from test_gluon_compile import _compile_for_hopper
from test_gluon_row_gemm_compile import MAX_SHARED, _descriptor_type
from moeblaze_ops.activations import activation_code, is_gated
from moeblaze_ops.kernels import config
from moeblaze_ops.kernels.triton_backend.gluon import dh as gluon_dh

dtype, k_contiguous, act, slots, out = json.loads(sys.argv[1])
gated = is_gated(act)
tile = gluon_dh.TILE
block = [1, tile.block_n, tile.block_k] if k_contiguous else [1, tile.block_k, tile.block_n]
warps, regs = gluon_dh.PRODUCER
ints = ["LK", "E", "D", "I", "n_parts", "stride_gm", "stride_dhm", "stride_wam", "stride_tw0", "stride_tw1"]
signature = {"go_ptr": f"*{dtype}", "w_desc": _descriptor_type(dtype, block),
             "h_desc": _descriptor_type(dtype, [2 if gated else 1, gluon_dh.CHUNK, gluon_dh.PART_COLUMNS]),
             "eti_ptr": "*i32", "tw_ptr": "*fp32", "tim_ptr": "*i32", "offsets_ptr": "*i32", "dh_ptr": f"*{dtype}",
             "wact_ptr": f"*{dtype}", "part_ptr": "*fp32", "alpha": "fp32", "limit": "fp32",
             **{name: "i32" for name in ints}}
constexprs = dict(K=8, ACT=int(activation_code(act)), WRITE_WACT=True, W_KMAJOR=k_contiguous,
                  GROUPS=128, BAND=config.ROW_BAND, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                  NUM_STAGES=tile.num_stages, PART_COLUMNS=gluon_dh.PART_COLUMNS,
                  CHUNK=gluon_dh.CHUNK, H_SLOTS=slots or gluon_dh.h_slots(tile, MAX_SHARED),
                  STAGE_IN_RING=gluon_dh.stage_in_ring(tile),
                  PRODUCER_WARPS=warps, PRODUCER_REGS=regs, A_OFFSETS_32=True, num_warps=tile.num_warps)
aligned = ["go_ptr", "eti_ptr", "tim_ptr", "offsets_ptr", "dh_ptr", "wact_ptr", "part_ptr", "D", "I",
           "stride_gm", "stride_dhm", "stride_wam"]
try:
    kernel = _compile_for_hopper(gluon_dh._dh_kernel, signature, constexprs, tile.num_warps, aligned)
except FileNotFoundError as error:  # a Triton wheel without its bundled ptxas
    print("no ptxas:", error)
    sys.exit(3)
with open(out, "w") as f:
    json.dump({"ptx": kernel.asm["ptx"], "shared": kernel.metadata.shared}, f)
"""

_DH_CASES = [("bf16", True, "swiglu"), ("bf16", False, "swiglu"), ("fp16", True, "gelu"), ("fp16", False, "geglu")]


def _assert_dh_pipeline(ptx, dtype, tile):
    """What the Gluon dH kernel is written for: the output-gradient rows gathered by
    16-byte cp.async (each copy thread arriving on the slot's barrier), W_down by 3-D TMA,
    asynchronous wgmma over the tile's columns."""
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)
    assert re.search(r"cp\.async\.mbarrier\.arrive\.noinc", ptx)
    # W_down's boxes and the epilogue's h chunks (gate and up in one box): 3-D TMA landing
    # on the slots' barriers; no cp.async groups.
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::\w+\.global\.mbarrier::complete_tx::bytes", ptx)) >= 2
    assert not re.search(r"cp\.async\.bulk\.tensor\.2d", ptx)
    assert not re.search(r"cp\.async\.wait_group", ptx)
    ptx_type = {"bf16": "bf16", "fp16": "f16"}[dtype]
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile.block_n}k16\.f32\.{ptx_type}\.{ptx_type}", ptx)


@pytest.mark.parametrize("dtype,k_contiguous,act", _DH_CASES)
def test_dh_compiles_for_hopper(dtype, k_contiguous, act, tmp_path):
    """The Gluon dH (``kernels.triton_backend.gluon.dh._dh_kernel``): one copy warpgroup for both operands,
    the two MMA warpgroups' wgmma 256 columns wide, the ring and the h chunks within the
    block's shared memory (the fp32 stage in a ring slot), and (almost) no spills."""
    from moeblaze_ops.activations import is_gated
    from moeblaze_ops.kernels.triton_backend.gluon import dh as gluon_dh

    compiled = _compile_in_subprocess(_DH_SCRIPT, [dtype, k_contiguous, act, None], tmp_path)
    ptx = compiled["ptx"]
    tile, (_, regs) = gluon_dh.TILE, gluon_dh.PRODUCER
    _assert_dh_pipeline(ptx, dtype, tile)
    assert re.search(rf"setmaxnreg\.\w+\.sync\.aligned\.u32\s+{regs}\b", ptx)  # the copy warps' registers
    slots = gluon_dh.h_slots(tile, MAX_SHARED)
    ring = tile.num_stages * (tile.block_m + tile.block_n) * tile.block_k * 2
    assert gluon_dh.stage_in_ring(tile) and slots >= 2
    gates = 2 if is_gated(act) else 1
    assert ring + slots * gates * gluon_dh.CHUNK * gluon_dh.PART_COLUMNS * 2 <= compiled["shared"] <= MAX_SHARED
    # h loaded into registers ahead of its chunk spilled 84 to 128 bytes (and 8 for fp16
    # GeGLU with N-contiguous weights); the whole-tile epilogue spilled kilobytes.
    assert _spill_bytes(ptx, tmp_path) <= 64


@pytest.mark.parametrize("act", ["swiglu", "gelu"])
@pytest.mark.parametrize("slots", [1, 3, 10])
def test_dh_compiles_with_any_count_of_h_slots(slots, act, tmp_path):
    """A ring of h chunks whose slot count is no power of two (a caller's ``slots``, or
    what a 3-stage tile leaves room for) compiles: each slot is read through a view of its
    own box, where a view of the whole ring would have a shape no shared layout takes."""
    compiled = _compile_in_subprocess(_DH_SCRIPT, ["bf16", True, act, slots], tmp_path)
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.3d", compiled["ptx"])) >= 2


#: Compiles a row GEMM with the activation in its epilogue in a subprocess, for the reason
#: above: it calls the activation's ``tl`` function.
_ACTIVATED_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from test_gluon_compile import _compile_for_hopper
from test_gluon_row_gemm_compile import MAX_SHARED, _descriptor_type
from moeblaze_ops.activations import activation_code
from moeblaze_ops.kernels import config
from moeblaze_ops.kernels.triton_backend.gluon import row_gemm as gluon_row_gemm
from moeblaze_ops.kernels.triton_backend import activations as triton_activations

dtype, warp_specialize, act, store_h, out = json.loads(sys.argv[1])
tile = gluon_row_gemm.TILE
a_name = "a_src" if warp_specialize else "a_ptr"
ints = ["LK", "E", "N", "K", "stride_am", "stride_bias", "stride_om", "stride_hm"]
signature = {a_name: f"*{dtype}", "b_desc": _descriptor_type(dtype, [1, tile.block_n // 2, tile.block_k]),
             "a_row_ids_ptr": "*i32", "offsets_ptr": "*i32", "out_ptr": f"*{dtype}",
             "alpha": "fp32", "limit": "fp32", **{name: "i32" for name in ints}}
constexprs = dict(bias_ptr=None, GATHER_A=True, HAS_BIAS=False, B_KMAJOR=True, GROUPS=16, BAND=config.ROW_BAND,
                  BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, NUM_STAGES=tile.num_stages,
                  GATED=triton_activations.gated, ACT=int(activation_code(act)), STORE_H=store_h,
                  num_warps=tile.num_warps)
box = [1, tile.block_m, tile.block_n // 2]
signature["out_desc"] = _descriptor_type(dtype, box)
if store_h:
    signature["h_ptr"] = f"*{dtype}"
    signature["h_desc"] = _descriptor_type(dtype, box)
else:
    constexprs.update(h_ptr=None, h_desc=None)
kernel_fn = gluon_row_gemm._row_gemm_kernel
if warp_specialize:
    warps, regs = gluon_row_gemm.PRODUCER_GATHER
    constexprs.update(PRODUCER_WARPS=warps, PRODUCER_REGS=regs, A_OFFSETS_32=True)
    kernel_fn = gluon_row_gemm._row_gemm_ws_kernel
aligned = [a_name, "a_row_ids_ptr", "offsets_ptr", "out_ptr", "N", "K", "stride_am", "stride_om"]
aligned += ["h_ptr", "stride_hm"] if store_h else []
try:
    kernel = _compile_for_hopper(kernel_fn, signature, constexprs, tile.num_warps, aligned)
except FileNotFoundError as error:  # a Triton wheel without its bundled ptxas
    print("no ptxas:", error)
    sys.exit(3)
with open(out, "w") as f:
    json.dump({"ptx": kernel.asm["ptx"], "shared": kernel.metadata.shared}, f)
"""


@pytest.mark.parametrize("dtype,warp_specialize,act,store_h", [
    ("bf16", True, "swiglu", False), ("fp16", True, "clamped_swiglu", False), ("bf16", False, "geglu", False),
    ("bf16", True, "swiglu", True), ("fp16", False, "swiglu", True), ("bf16", True, "geglu", True),
    ("fp16", True, "clamped_swiglu", True)])
def test_row_gemm_with_gated_epilogue_compiles_for_hopper(dtype, warp_specialize, act, store_h, tmp_path):
    """Both row GEMM kernels with a gated activation in the epilogue
    (``gluon_row_gemm.GatedEpilogue``): each B tile by two TMA boxes (gate columns and
    up columns), one wgmma over both, and per tile the activation (the approximate
    sigmoid), with ``store_h`` h's gate and up halves before it, by TMA (from registers
    for tiles past their expert's end), with no spills: the activation goes to 16 bits at
    once beside the accumulator."""
    from moeblaze_ops.kernels.triton_backend.gluon import row_gemm as gluon_row_gemm

    compiled = _compile_in_subprocess(_ACTIVATED_SCRIPT, [dtype, warp_specialize, act, store_h], tmp_path)
    ptx = compiled["ptx"]
    tile = gluon_row_gemm.TILE
    loads = re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::\w+\.global\.mbarrier::complete_tx::bytes", ptx)
    assert loads and len(loads) % 2 == 0  # two boxes at every place a B tile is copied
    ptx_type = {"bf16": "bf16", "fp16": "f16"}[dtype]
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile.block_n}k16\.f32\.{ptx_type}\.{ptx_type}", ptx)
    stores = len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta", ptx))
    assert stores == (3 if store_h else 1)  # act(h)'s half tile, after h's two halves
    if store_h and warp_specialize:  # h's up half through the held ring slot
        assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+1;", ptx)
    assert re.search(r"st\.global(\.\w+)*\.b32", ptx)  # tiles past their expert's end, from registers
    if act != "geglu":
        assert "tanh.approx.f32" in ptx
    ring = tile.num_stages * (tile.block_m + tile.block_n) * tile.block_k * 2
    assert ring <= compiled["shared"] <= MAX_SHARED
    # GeGLU's erf beside h's stores in the warp-specialised kernel spills a few bytes a
    # thread (8 on triton 3.9).
    assert _spill_bytes(ptx, tmp_path) <= (16 if act == "geglu" and store_h else 0)


@pytest.mark.parametrize("warp_specialize", [True, False], ids=["warp_specialized", "pipelined"])
def test_gated_epilogue_launch_arguments(warp_specialize, monkeypatch):
    """What ``launch_row_gemm`` hands the kernel for a ``GatedEpilogue``, by the kernel's own
    argument names: weight boxes of half a tile (two per paired tile), N the 2I columns of
    h, the activation's output [LK, I] as the output (its stride and its half-tile TMA
    boxes), the activation's code and function. The launch is recorded, not run (no
    GPU)."""
    pytest.importorskip("triton.experimental.gluon")
    import torch

    from moeblaze_ops.activations import ActivationCode
    from moeblaze_ops.kernels import config
    from moeblaze_ops.kernels.triton_backend.gluon import row_gemm as gluon_row_gemm
    from moeblaze_ops.kernels.triton_backend import activations as triton_activations

    launches = []
    monkeypatch.setattr(gluon_row_gemm, "launch", lambda kernel, grid, *args, **kwargs: launches.append(
        (kernel, args, kwargs)))
    # A descriptor stands for (the described tensor's last dimension, the box).
    monkeypatch.setattr(gluon_row_gemm, "host_descriptor", lambda t, block: ("descriptor", t.shape[-1], tuple(block)))
    LK, d, I, E = 96, 256, 384, 4
    meta = dict(device="meta", dtype=torch.bfloat16)
    x, w = torch.empty(50, d, **meta), torch.empty(E, 2 * I, d, **meta)
    ids, offsets = torch.empty(LK, dtype=torch.int32, device="meta"), torch.empty(E + 1, dtype=torch.int32,
                                                                                device="meta")
    a = torch.empty(LK, I, **meta)
    epilogue = gluon_row_gemm.GatedEpilogue(int(ActivationCode.CLAMPED_SWIGLU), 1.702, 7.0)
    gluon_row_gemm.launch_row_gemm(x, ids, w, None, offsets, a, False, warp_specialize=warp_specialize,
                                   epilogue=epilogue)

    (kernel, args, kwargs), = launches
    assert kernel is (gluon_row_gemm._row_gemm_ws_kernel if warp_specialize else gluon_row_gemm._row_gemm_kernel)
    bound = dict(zip(kernel.arg_names, args), **kwargs)
    assert set(kernel.arg_names) <= set(bound) and not set(kernel.arg_names[:len(args)]) & set(kwargs)
    tile = gluon_row_gemm.TILE
    assert bound["b_desc"] == ("descriptor", d, (1, tile.block_n // 2, tile.block_k))
    assert (bound["N"], bound["K"], bound["LK"], bound["E"]) == (2 * I, d, LK, E)
    assert bound["out_ptr"] is a and bound["stride_om"] == I
    assert (bound["alpha"], bound["limit"]) == (1.702, 7.0)
    assert bound["ACT"] == int(ActivationCode.CLAMPED_SWIGLU) and bound["GATED"] is triton_activations.gated
    assert "FAST_ACT" not in bound and "TMA_STORE" not in bound  # the approximate sigmoid, TMA stores: always
    assert bound["BAND"] == config.ROW_BAND
    assert bound["num_warps"] == tile.num_warps
    half_box = (1, tile.block_m, tile.block_n // 2)
    assert bound["out_desc"] == ("descriptor", I, half_box)
    assert bound["STORE_H"] is False and bound["h_ptr"] is None and bound["h_desc"] is None
    # h beside act(h): its pointer, row stride and half-tile boxes over all 2I columns.
    launches.clear()
    h = torch.empty(LK, 2 * I, **meta)
    gluon_row_gemm.launch_row_gemm(x, ids, w, None, offsets, a, False, warp_specialize=warp_specialize,
                                   epilogue=epilogue, h=h)
    (_, args, kwargs), = launches
    bound = dict(zip(kernel.arg_names, args), **kwargs)
    assert bound["STORE_H"] is True and bound["h_ptr"] is h and bound["stride_hm"] == 2 * I
    assert bound["h_desc"] == ("descriptor", 2 * I, half_box)
    assert bound["out_ptr"] is a and bound["stride_om"] == I
    with pytest.raises(ValueError, match="gated epilogue"):
        gluon_row_gemm.launch_row_gemm(x, ids, w, None, offsets, h, False, h=h)
    # Without an epilogue the same launcher runs the plain GEMM: whole boxes, no activation.
    launches.clear()
    gluon_row_gemm.launch_row_gemm(x, ids, w, None, offsets, torch.empty(LK, 2 * I, **meta), False,
                                   warp_specialize=warp_specialize)
    (_, args, kwargs), = launches
    bound = dict(zip(kernel.arg_names, args), **kwargs)
    assert bound["b_desc"] == ("descriptor", d, (1, tile.block_n, tile.block_k))
    assert bound["ACT"] == -1 and bound["GATED"] is None
