"""Times the row GEMMs (up: gathered x @ W_gate_up; down: act(h) @ W_down; dx: dH @ W_gate_up^T)
through the Gluon kernels (the warp-specialised one and the other, each with tiles stored
from registers or by TMA) and the portable ``tl`` kernel on the same inputs, and checks
they agree with the first one timed (``tl`` by default).

``--routing balanced`` gives every expert exactly L*K/E rows: no tile runs past its
expert's end (what the part-filled tiles cost, against ``random``).

``up_act`` times the up projection and its SwiGLU together: the Gluon GEMM then the
activation pass (what the layer runs), against the GEMM with the activation in its
epilogue (``gluon_row_gemm.GatedEpilogue``: act(h) alone, h never stored, or beside h:
``settings.activation_beside_h``'s kernel, rows ``epilogue_h``); the differences are to
the first's act(h).

    python3 scripts/compare_row_gemm.py [--configs olmoe mixtral] [--kinds up down dx up_act]
        [--kernels gluon_tma_store ...] [--routing random balanced]
"""

import argparse
import contextlib

import torch
import triton.testing

from moeblaze_ops import settings
from moeblaze_ops.activations import ActivationCode
from moeblaze_ops.bench.configs import CONFIGS, make_inputs
from moeblaze_ops.kernels import gluon_row_gemm, triton_experts
from moeblaze_ops.testing import rel_err
from tile_padding import balanced_ids  # this script's folder is on the path

#: The kernels timed (``--kernels``): the portable one, and the Gluon ones by
#: ``launch_row_gemm``'s variant arguments.
KERNELS = {"tl": None,
           "gluon": dict(warp_specialize=False, tma_store=False),
           "gluon_tma_store": dict(warp_specialize=False, tma_store=True),
           "gluon_ws": dict(warp_specialize=True, tma_store=False),
           "gluon_ws_tma_store": dict(warp_specialize=True, tma_store=True)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="*", default=["olmoe", "mixtral"], choices=sorted(CONFIGS))
    parser.add_argument("--kinds", nargs="*", default=["up", "down", "dx"], choices=["up", "down", "dx", "up_act"])
    parser.add_argument("--kernels", nargs="*", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--routing", nargs="*", default=["random"], choices=["random", "balanced"])
    args = parser.parse_args()
    print("| config | routing | GEMM | kernel | ms | TFLOP/s | rel diff to the first |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, routing in [(n, r) for n in args.configs for r in args.routing]:
        T, d, I, E, K = CONFIGS[name]
        x, ids, _, w_gate_up, w_down = make_inputs(T, d, I, E, K)
        if routing == "balanced":
            ids = balanced_ids(T, K, E, ids.device)
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

            kernels = {label: tl if KERNELS[label] is None else gluon(**KERNELS[label]) for label in args.kernels}
            flops = 2 * LK * n * a.shape[1]
            reference = None
            for label, launch in kernels.items():
                out = torch.empty(LK, n, device="cuda", dtype=x.dtype)
                with settings.override(gluon=()) if label == "tl" else contextlib.nullcontext():
                    ms = triton.testing.do_bench(lambda: launch(out), warmup=10, rep=50)
                reference = out.double() if reference is None else reference
                print(f"| {name} | {routing} | {kind} | {label} | {ms:.3f} | {flops / ms / 1e9:.0f} | "
                      f"{rel_err(out, reference):.1e} |")
        if "up_act" in args.kinds:
            _up_and_activation(name, routing, x, eti, offsets, w_gate_up, I)


def _up_and_activation(name, routing, x, eti, offsets, w_gate_up, I):
    """The ``up_act`` rows: the up GEMM and SwiGLU, as two kernels or as one (each Gluon
    kernel: warp-specialised or not)."""
    LK = eti.shape[0]
    swiglu = int(ActivationCode.SWIGLU)
    ws = settings.current().from_rows("gluon_warp_specialize", "up", LK, w_gate_up.shape[0])
    h = torch.empty(LK, 2 * I, device="cuda", dtype=x.dtype)

    def separate(a):
        gluon_row_gemm.launch_row_gemm(x, eti, w_gate_up, None, offsets, h, False, warp_specialize=ws)
        triton_experts.launch_activation(h, a, swiglu, False, 0.0, 0.0, True)

    def fused(warp_specialize, h_beside=None):
        epilogue = gluon_row_gemm.GatedEpilogue(swiglu, 0.0, 0.0, True)
        return lambda a: gluon_row_gemm.launch_row_gemm(x, eti, w_gate_up, None, offsets, a, False,
                                                        warp_specialize=warp_specialize, epilogue=epilogue,
                                                        h=h_beside)

    a_probe = torch.empty(LK, I, device="cuda", dtype=x.dtype)
    if not gluon_row_gemm.applies_gated_epilogue(x, w_gate_up, None, a_probe, False, swiglu, False):
        print(f"| {name} | {routing} | up_act | (the epilogue does not apply here) | | | |")
        return
    flops = 2 * LK * 2 * I * x.shape[1]
    a_ref = None
    for label, run in {f"gluon{'_ws' if ws else ''} + activation pass": separate,
                       f"epilogue{'_ws' if ws else ''}": fused(ws),
                       f"epilogue{'' if ws else '_ws'}": fused(not ws),
                       f"epilogue_h{'_ws' if ws else ''}": fused(ws, h_beside=h)}.items():
        a = torch.full((LK, I), float("nan"), device="cuda", dtype=x.dtype)
        ms = triton.testing.do_bench(lambda: run(a), warmup=10, rep=50)
        a_ref = a.double() if a_ref is None else a_ref
        print(f"| {name} | {routing} | up_act | {label} | {ms:.3f} | {flops / ms / 1e9:.0f} | "
              f"{rel_err(a, a_ref):.1e} |")


if __name__ == "__main__":
    main()
