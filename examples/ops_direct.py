"""Calls the moeblaze ops directly: dispatch, expert_up, expert_down, and their backward.

    python examples/ops_direct.py                      # 4096 tokens, 8 experts, top-2, on CPU
    python examples/ops_direct.py --device cuda --dtype bfloat16

Builds a random SwiGLU experts layer, runs forward and backward through
``torch.ops.moeblaze.*``, and prints the shapes and the relative error of the output and
of every gradient against a plain float64 loop over experts.
"""

import argparse

import torch
import torch.nn.functional as F

import moeblaze_ops  # noqa: F401  (registers torch.ops.moeblaze)


def loop_over_experts(x, topk_ids, topk_weights, w_gate_up, w_down):
    """The obvious implementation: for each expert, its tokens, one at a time."""
    out = torch.zeros_like(x)
    for e in range(w_gate_up.shape[0]):
        token, k = (topk_ids == e).nonzero(as_tuple=True)
        gate, up = (x[token] @ w_gate_up[e].t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w_down[e].t()
        out = out.index_add(0, token, y * topk_weights[token, k, None])
    return out


def rel(a, b):
    a, b = a.detach().double(), b.detach()
    return f"{float((a - b).norm() / b.norm()):.2e}"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and shows every flag's default."""


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument("--tokens", type=_positive_int, default=4096, help="tokens L routed through the layer")
    p.add_argument("--hidden", type=_positive_int, default=256, help="model dimension d")
    p.add_argument("--intermediate", type=_positive_int, default=512, help="expert intermediate size I")
    p.add_argument("--experts", type=_positive_int, default=8, help="number of experts E")
    p.add_argument("--topk", type=_positive_int, default=2, help="experts per token K (at most --experts)")
    p.add_argument("--device", default="cpu",
                   help="cpu (the portable PyTorch kernels) or cuda / cuda:N (the Triton kernels)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of x and the expert weights (the reference runs in float64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random layer and routing")
    return p


def parse_args(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    if a.topk > a.experts:
        p.error(f"--topk ({a.topk}) must be at most --experts ({a.experts})")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {a.device}: this torch sees no CUDA GPU; use --device cpu")
    return a


def main(argv=None):
    """Runs the example with command-line arguments ``argv`` (default: ``sys.argv[1:]``);
    returns ``{"out": rel_err, "grad x": rel_err, ...}`` against the float64 loop."""
    a = parse_args(argv)
    torch.manual_seed(a.seed)
    dtype, dev = getattr(torch, a.dtype), torch.device(a.device)
    L, d, I, E, K = a.tokens, a.hidden, a.intermediate, a.experts, a.topk

    x = torch.randn(L, d, device=dev, dtype=dtype, requires_grad=True)
    router_logits = torch.randn(L, E, device=dev)
    topk_weights, topk_ids = router_logits.softmax(-1).topk(K, dim=-1)
    topk_weights.requires_grad_(True)
    w_gate_up = (torch.randn(E, 2 * I, d, device=dev) * d ** -0.5).to(dtype).requires_grad_(True)
    w_down = (torch.randn(E, d, I, device=dev) * I ** -0.5).to(dtype).requires_grad_(True)

    ops = torch.ops.moeblaze
    eti, offsets, tim = ops.dispatch(topk_ids, E)
    h = ops.expert_up(x, w_gate_up, eti, offsets, tim)
    out = ops.expert_down(h, w_down, eti, offsets, tim, topk_weights, activation="swiglu")
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    print(f"dispatch: expert_token_indices {tuple(eti.shape)}, expert_offsets {tuple(offsets.shape)}, "
          f"token_index_map {tuple(tim.shape)}; rows per expert {offsets.diff().tolist()}")
    print(f"expert_up: h {tuple(h.shape)} {h.dtype} (what backward keeps, with x and the index arrays)")
    print(f"expert_down: out {tuple(out.shape)} {out.dtype}")

    leaves = {"x": x, "topk_weights": topk_weights, "w_gate_up": w_gate_up, "w_down": w_down}
    ref_leaves = {k: v.detach().double().requires_grad_(True) for k, v in leaves.items()}
    ref = loop_over_experts(ref_leaves["x"], topk_ids, ref_leaves["topk_weights"], ref_leaves["w_gate_up"],
                            ref_leaves["w_down"])
    ref.backward(grad_out.double())
    errors = {"out": rel(out, ref), **{f"grad {k}": rel(leaves[k].grad, ref_leaves[k].grad) for k in leaves}}
    print("relative error vs float64 loop: " + ", ".join(f"{k} {v}" for k, v in errors.items()))
    return {k: float(v) for k, v in errors.items()}


if __name__ == "__main__":
    main()
