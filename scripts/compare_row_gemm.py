"""Times the row GEMMs (up: gathered x @ W_gate_up; down: act(h) @ W_down; dx: dH @ W_gate_up^T)
through the Gluon kernels (the warp-specialised one and the other, each with tiles stored
from registers or by TMA) and the portable ``tl`` kernel on the same inputs, and checks
they agree with ``tl``.

    python3 scripts/compare_row_gemm.py [--configs olmoe mixtral] [--kinds up down dx]
"""

import argparse
import contextlib

import torch
import triton.testing

from moeblaze_ops import settings
from moeblaze_ops.bench.configs import CONFIGS, make_inputs
from moeblaze_ops.kernels import gluon_row_gemm, triton_experts
from moeblaze_ops.testing import rel_err


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="*", default=["olmoe", "mixtral"], choices=sorted(CONFIGS))
    parser.add_argument("--kinds", nargs="*", default=["up", "down", "dx"], choices=["up", "down", "dx"])
    args = parser.parse_args()
    print("| config | GEMM | kernel | ms | TFLOP/s | rel diff to tl |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.configs:
        T, d, I, E, K = CONFIGS[name]
        x, ids, _, w_gate_up, w_down = make_inputs(T, d, I, E, K)
        eti, offsets, _ = torch.ops.moeblaze.dispatch(ids, E)
        LK = eti.shape[0]
        act = torch.randn(LK, I, device="cuda", dtype=x.dtype)
        grad_h = torch.randn(LK, 2 * I, device="cuda", dtype=x.dtype)
        for kind, a, row_ids, w, n, transposed in (("up", x, eti, w_gate_up, 2 * I, False),
                                                   ("down", act, None, w_down, d, False),
                                                   ("dx", grad_h, None, w_gate_up, d, True)):
            if kind not in args.kinds:
                continue

            def gluon(**variant):
                return lambda out: gluon_row_gemm.launch_row_gemm(a, row_ids, w, None, offsets, out, transposed,
                                                                  **variant)

            def tl(out):  # the portable kernel: timed with settings.gluon empty (below)
                triton_experts.launch_gathered_gemm(a, row_ids, w, None, offsets, out, transposed, kind)

            kernels = {"tl": tl,
                       "gluon": gluon(warp_specialize=False, tma_store=False),
                       "gluon_tma_store": gluon(warp_specialize=False, tma_store=True),
                       "gluon_ws": gluon(warp_specialize=True, tma_store=False),
                       "gluon_ws_tma_store": gluon(warp_specialize=True, tma_store=True)}
            flops = 2 * LK * n * a.shape[1]
            reference = None
            for label, launch in kernels.items():
                out = torch.empty(LK, n, device="cuda", dtype=x.dtype)
                with settings.override(gluon=()) if label == "tl" else contextlib.nullcontext():
                    ms = triton.testing.do_bench(lambda: launch(out), warmup=10, rep=50)
                reference = out.double() if reference is None else reference
                print(f"| {name} | {kind} | {label} | {ms:.3f} | {flops / ms / 1e9:.0f} | "
                      f"{rel_err(out, reference):.1e} |")

if __name__ == "__main__":
    main()
