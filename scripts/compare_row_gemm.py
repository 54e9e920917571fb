"""Times the row GEMMs (up: gathered x @ W_gate_up; down: act(h) @ W_down; dx: dH @ W_gate_up^T)
through the
Gluon kernel and the portable ``tl`` kernel on the same inputs, and checks they agree.

    python3 scripts/compare_row_gemm.py [--configs olmoe mixtral]
"""

import argparse

import torch
import triton.testing

from moeblaze_ops.bench.configs import CONFIGS, make_inputs
from moeblaze_ops.kernels import gluon_row_gemm, triton_experts
from moeblaze_ops.testing import rel_err


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="*", default=["olmoe", "mixtral"], choices=sorted(CONFIGS))
    args = parser.parse_args()
    print("| config | GEMM | gluon ms | TFLOP/s | tl ms | TFLOP/s | rel diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
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
            outs, times = [], []
            for launch in (gluon_row_gemm.launch_row_gemm, triton_experts.launch_gathered_gemm):
                out = torch.empty(LK, n, device="cuda", dtype=x.dtype)
                extra = () if launch is gluon_row_gemm.launch_row_gemm else (kind,)
                run = lambda: launch(a, row_ids, w, None, offsets, out, transposed, *extra)  # noqa: E731
                times.append(triton.testing.do_bench(run, warmup=10, rep=50))
                outs.append(out)
            flops = 2 * LK * n * a.shape[1]
            print(f"| {name} | {kind} | {times[0]:.3f} | {flops / times[0] / 1e9:.0f} | {times[1]:.3f} | "
                  f"{flops / times[1] / 1e9:.0f} | {rel_err(outs[0], outs[1].double()):.1e} |")


if __name__ == "__main__":
    main()
