"""The Gluon row GEMM (``kernels.gluon_row_gemm``) compiles for Hopper on any machine, as
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


@pytest.mark.parametrize("gather,bias", [(True, True), (False, False)])
@pytest.mark.parametrize("k_contiguous", [True, False], ids=["k_contiguous", "n_contiguous"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_row_gemm_kernel_compiles_for_hopper(dtype, k_contiguous, gather, bias, tmp_path):
    from moeblaze_ops.kernels import gluon_row_gemm

    tile = gluon_row_gemm.TILE
    block = [1, tile.block_n, tile.block_k] if k_contiguous else [1, tile.block_k, tile.block_n]
    signature = {"a_ptr": f"*{dtype}", "b_desc": _descriptor_type(dtype, block), "bias_ptr": f"*{dtype}",
                 "a_row_ids_ptr": "*i32", "offsets_ptr": "*i32", "out_ptr": f"*{dtype}",
                 **{name: "i32" for name in ["LK", "E", "N", "K", "stride_am", "stride_bias", "stride_om"]}}
    # Tiles in bands of 8 m-tiles where A is gathered, columns fastest (bands of 1) where not.
    constexprs = dict(GATHER_A=gather, HAS_BIAS=bias, B_KMAJOR=k_contiguous, GROUPS=16, BAND=8 if gather else 1,
                      BLOCK_M=tile.block_m,
                      BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, NUM_STAGES=tile.num_stages,
                      num_warps=tile.num_warps)
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
    _assert_row_gemm_pipeline(kernel, dtype, tile, tmp_path)


@pytest.mark.parametrize("gather,bias", [(True, True), (False, True), (False, False)])
@pytest.mark.parametrize("k_contiguous", [True, False], ids=["k_contiguous", "n_contiguous"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_warp_specialized_row_gemm_compiles_for_hopper(dtype, k_contiguous, gather, bias, tmp_path):
    from moeblaze_ops.kernels import gluon_row_gemm

    tile = gluon_row_gemm.TILE
    block = [1, tile.block_n, tile.block_k] if k_contiguous else [1, tile.block_k, tile.block_n]
    warps, regs = gluon_row_gemm.PRODUCER_GATHER if gather else gluon_row_gemm.PRODUCER_TMA
    signature = {"a_src": f"*{dtype}" if gather else _descriptor_type(dtype, [tile.block_m, tile.block_k]),
                 "b_desc": _descriptor_type(dtype, block), "bias_ptr": f"*{dtype}", "a_row_ids_ptr": "*i32",
                 "offsets_ptr": "*i32", "out_ptr": f"*{dtype}",
                 **{name: "i32" for name in ["LK", "E", "N", "K", "stride_am", "stride_bias", "stride_om"]}}
    # Tiles in bands of 8 m-tiles where A is gathered, columns fastest (bands of 1) where not.
    constexprs = dict(GATHER_A=gather, HAS_BIAS=bias, B_KMAJOR=k_contiguous, GROUPS=16, BAND=8 if gather else 1,
                      BLOCK_M=tile.block_m,
                      BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, NUM_STAGES=tile.num_stages, PRODUCER_WARPS=warps,
                      PRODUCER_REGS=regs, num_warps=tile.num_warps)
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
    # they land, or by TMA from a 2-D descriptor; the copy warps' registers cut back and
    # the MMA warpgroups' raised; then the pipeline both kernels share.
    if gather:
        assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)
        assert re.search(r"cp\.async\.mbarrier\.arrive\.noinc", ptx)
    else:
        assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global\.mbarrier::complete_tx::bytes", ptx)
        assert "cp.async.cg" not in ptx
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+\d+", ptx)
    _assert_row_gemm_pipeline(kernel, dtype, tile, tmp_path)
