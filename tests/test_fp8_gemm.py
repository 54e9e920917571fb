"""The FP8 grouped GEMM (``kernels.triton_backend.fp8_gemm``): the interpreter on CPU
tensors, the compiled kernel on a GPU, both against the recipe's math in float64."""

import os

import pytest
import torch

from conftest import rel_err
from moeblaze_ops import fp8
from moeblaze_ops.testing import make_topk_ids

ON_CPU_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _case(L, d, N, E, K, transposed, bias, seed, device, routing="uniform", sentinel_frac=0.0):
    """Quantized token rows and weights, the dispatch of random routing, and the float64
    product of the dequantized operands for every routed row (the recipe's math)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, d, generator=g) * torch.exp(torch.randn(L, 1, generator=g))
    w = torch.randn(E, d, N, generator=g) if transposed else torch.randn(E, N, d, generator=g)
    (xq, xs), (wq, ws) = fp8.quantize_rows(x), fp8.quantize_blocks(w)
    b = torch.randn(E, N, generator=g) if bias else None
    ids = make_topk_ids(L, K, E, routing, sentinel_frac=sentinel_frac, generator=g)
    eti, offsets, _ = torch.ops.moeblaze.dispatch(ids.to(device), E)
    x64 = fp8.dequantize_rows(xq, xs, torch.float64)
    w64 = fp8.dequantize_blocks(wq, ws, torch.float64)
    eti_c, offsets_c = eti.cpu().long(), offsets.cpu().tolist()
    ref = torch.zeros(L * K, N, dtype=torch.float64)
    for e in range(E):
        lo, hi = offsets_c[e], offsets_c[e + 1]
        we = w64[e] if transposed else w64[e].T
        ref[lo:hi] = x64[eti_c[lo:hi]] @ we + (b[e].double() if bias else 0)
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    return dict(a=on(xq), a_scale=on(xs), a_row_ids=eti, b=on(wq), b_scale=on(ws), bias=on(b), offsets=offsets,
                transposed=transposed), ref


def _run(args, rows, n, dtype, device):
    from moeblaze_ops.kernels.triton_backend.fp8_gemm import launch_fp8_gathered_gemm

    out = torch.full((rows, n), float("nan"), dtype=dtype, device=device)  # unwritten rows show
    launch_fp8_gathered_gemm(**args, out=out)
    return out


@pytest.mark.skipif(not ON_CPU_INTERPRETED, reason="needs TRITON_INTERPRET=1 (set by conftest without CUDA)")
@pytest.mark.parametrize("transposed,bias,routing,sentinel_frac", [(False, False, "uniform", 0.0),
                                                                   (True, True, "skewed", 0.25),
                                                                   (False, True, "no_last", 0.0)])
def test_fp8_gemm_interpreted(transposed, bias, routing, sentinel_frac, seed):
    """Gathered token rows times each expert's weight, scales applied per 128-wide block of
    the reduction (three blocks), 1 to 2 output blocks, every row written (NaN-poisoned
    output), the sentinel rows zero; against float64 of the dequantized operands."""
    L, d, N, E, K = 13, 384, 256, 4, 2
    args, ref = _case(L, d, N, E, K, transposed, bias, seed, "cpu", routing, sentinel_frac)
    out = _run(args, L * K, N, torch.float32, "cpu")
    real = int(args["offsets"][-1])
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))
    assert rel_err(out[:real], ref[:real]) < 1e-5


def test_fp8_gemm_refuses_bad_operands():
    args, _ = _case(4, 256, 128, 2, 1, False, False, 0, "cpu")
    with pytest.raises(TypeError, match="A must be torch.float8_e4m3fn"):
        _run({**args, "a": args["a"].float()}, 4, 128, torch.float32, "cpu")
    with pytest.raises(TypeError, match="B's scales must be float32"):
        _run({**args, "b_scale": args["b_scale"].double()}, 4, 128, torch.float32, "cpu")
    with pytest.raises(ValueError, match="do not tile"):
        _run({**args, "a_scale": args["a_scale"][:, :1].contiguous()}, 4, 128, torch.float32, "cpu")
    with pytest.raises(ValueError, match="A's rows have 128 columns, B's reduction is 256"):
        _run({**args, "a": args["a"][:, :128]}, 4, 128, torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("transposed,bias", [(False, False), (True, True)])
def test_fp8_gemm_on_gpu(transposed, bias, seed):
    """The compiled kernel (e4m3 tensor-core products on Hopper), bf16 output, at the up
    GEMM's tile: within bf16's rounding of the float64 product."""
    L, d, N, E, K = 200, 512, 384, 8, 2
    args, ref = _case(L, d, N, E, K, transposed, bias, seed, "cuda", "skewed", 0.1)
    out = _run(args, L * K, N, torch.bfloat16, "cuda").double().cpu()
    real = int(args["offsets"][-1])
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))
    assert rel_err(out[:real], ref[:real]) < 1e-2


_COMPILE = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moeblaze_ops.kernels import config
from moeblaze_ops.kernels.triton_backend import fp8_gemm

fn = fp8_gemm._fp8_gathered_gemm_kernel
types = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32", "bias_ptr": "*bf16",
         "out_ptr": "*bf16", "a_row_ids_ptr": "*i32", "offsets_ptr": "*i32"}
names = list(fn.arg_names)
signature = None
ptx = []
# The training-size tile (wgmma) and the decode-size one (16 rows: below a warpgroup's 64).
for block_m, block_n, warps in ((128, 256, 8), (16, 64, 4)):
    constexprs = dict(GATHER_A=True, HAS_BIAS=True, GROUPS=16, BAND=config.ROW_BAND, BLOCK_M=block_m,
                      BLOCK_N=block_n, SCALE_BLOCK=128)
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    source = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})
    ptx.append(kernel.asm["ptx"])
print(json.dumps({"ptx": ptx}))
'''


def test_fp8_gemm_compiles_to_e4m3_wgmma():
    """On a Hopper target the kernel's products are e4m3 tensor-core MMAs (wgmma with e4m3
    operands and fp32 accumulators), not upcasts to 16 bits; at decode's 16-row tiles, f16
    MMAs on operands converted exactly from the e4m3 bytes read: compiled offline with this
    machine's Triton and ptxas, in a subprocess (the interpreter's ``@triton.jit`` functions
    do not compile)."""
    import json
    import re
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=600, env=env)
    if run.returncode != 0 and "ptxas" in run.stderr and "FileNotFoundError" in run.stderr:
        pytest.skip("a Triton wheel without its bundled ptxas")
    assert run.returncode == 0, run.stderr[-3000:]
    wide, narrow = json.loads(run.stdout.strip().splitlines()[-1])["ptx"]
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", wide)
    # 16-row tiles (decode: bound by the weight bytes, which stay e4m3 in memory): below a
    # warpgroup's 64 rows Triton converts the e4m3 operands to f16, exactly, for the warp-level MMA.
    assert re.search(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32", narrow)
    assert re.search(r"cvt\.rn\.f16x2\.e4m3x2", narrow)
