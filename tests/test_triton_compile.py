"""The ``tl`` kernels whose GPU runs are the default compile for a Hopper (sm_90) target on
any machine, with Triton's own compiler and ptxas: the dispatch kernels with the id checks
folded in (both families and the one-program kernel, int32 and int64 ids; the sorted
histogram's flags read off its runs or from the ids again), the column scan in blocks,
the backward kernels that read each row's combine weight in place (dH's epilogue whole
and in column slices), and the row GEMMs with their tiles in bands
(``config.ROW_BAND``). CPU machines run these kernels in the interpreter, which does
not lower them; this catches what only the real compiler rejects.

Compiled in a subprocess: under ``TRITON_INTERPRET=1`` (set for this test session)
``@triton.jit`` makes interpreter functions, which the compiler does not take."""

import os
import subprocess
import sys

import pytest

SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moeblaze_ops.kernels import config
from moeblaze_ops.kernels.triton_backend import dispatch as td
from moeblaze_ops.kernels.triton_backend import experts as te
from moeblaze_ops.kernels.triton_backend import experts_backward as tb


def compile_for_hopper(fn, types, constexprs, num_warps=4):
    """``fn`` compiled for sm_90; arguments not in ``types`` or ``constexprs`` are i32."""
    names = list(fn.arg_names)
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    source = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


for ids in ("*i32", "*i64"):
    tables = dict(ids_ptr=ids, **{n: "*i32" for n in ("counts_ptr", "starts_ptr", "totals_ptr", "offsets_ptr",
                                                      "ok_ptr", "eti_ptr", "tim_ptr", "ranked_ptr")})
    compile_for_hopper(td._chunk_histogram, tables, dict(BINS=16, SUB=64, K=3, CHECK_IDS=True, TOKENS=32))
    compile_for_hopper(td._chunk_scatter, tables, dict(BINS=16, SUB=64, CHECK_IDS=True))
    for K in (8, 3):  # flags off the sorted runs (whole tokens in a chunk), or from the ids again
        compile_for_hopper(td._chunk_histogram_sorted, tables, dict(CHUNK=512, BINS=256, K=K, CHECK_IDS=True,
                                                                     TOKENS=128), num_warps=8)
    compile_for_hopper(td._chunk_scatter_ranked, tables, dict(CHUNK=1024, BINS=128, CHECK_IDS=True), num_warps=8)
    for chunk in (config.DISPATCH_ONE_PROGRAM_MAX_ROWS, config.MAX_ONE_PROGRAM_ROWS):  # the rule's bound, the largest
        compile_for_hopper(td._one_program_dispatch, tables, dict(K=8, CHUNK=chunk, BINS=256, HIST=512, CHECK_IDS=True),
                           num_warps=8)
scan = {n: "*i32" for n in ("counts_ptr", "totals_ptr", "sums_ptr")}
compile_for_hopper(td._column_block_sums, scan, dict(COLS=4, ROWS=1024), num_warps=8)
compile_for_hopper(td._column_scan, scan, dict(COLS=8, ROWS=512, BLOCKS=64), num_warps=8)
rows = {n: "*bf16" for n in ("go_ptr", "w_src", "h_ptr", "bias_ptr", "dh_ptr", "wact_ptr", "rows_ptr", "out_ptr")}
rows.update({n: "*i32" for n in ("eti_ptr", "tim_ptr", "offsets_ptr", "row_ids_ptr")}, tw_ptr="*fp32",
            part_ptr="*fp32", bdot_ptr="*fp32", alpha="fp32", limit="fp32")
for block_n, interleaved in ((64, False), (128, False), (128, True), (256, True)):  # 1, 2 and 4 epilogue slices
    compile_for_hopper(tb._dh_kernel, rows, dict(K=8, ACT=0, INTERLEAVED=interleaved, HAS_BIAS=True, WRITE_WACT=True,
                                                 W_TMA=False, W_KMAJOR=True, FAST_ACT=True,
                                                 EPILOGUE_SPLIT=config.dh_epilogue_slices(block_n), GROUPS=16,
                                                 BAND=config.ROW_BAND, PRECISION="tf32", BLOCK_M=128, BLOCK_N=block_n,
                                                 BLOCK_K=64), num_warps=8)
gemm = {n: "*bf16" for n in ("a_ptr", "b_src", "bias_ptr", "out_ptr")}
gemm.update({n: "*i32" for n in ("a_row_ids_ptr", "offsets_ptr")})
compile_for_hopper(te._gathered_gemm_kernel, gemm, dict(GATHER_A=True, HAS_BIAS=True, B_TMA=False, B_KMAJOR=False,
                                                        GROUPS=16, BAND=config.ROW_BAND, PRECISION="tf32", BLOCK_M=128,
                                                        BLOCK_N=256, BLOCK_K=64), num_warps=8)
compile_for_hopper(tb._expert_row_sum_kernel, rows, dict(K=8, GATHER=True, WEIGHTED=True, BLOCK_R=64, BLOCK_D=128))
print("compiled")
'''


def test_changed_kernels_compile_for_hopper():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    if run.returncode != 0 and "ptxas" in run.stderr and "FileNotFoundError" in run.stderr:
        pytest.skip("a Triton wheel without its bundled ptxas")
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]
