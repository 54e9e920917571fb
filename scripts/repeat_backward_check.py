"""Repeats one backward check of tests/test_gpu.py over seeds, with the TMA reads on and off,
and reports per gradient whether two runs were bitwise equal (a determinism hunt, GPU).

    python scripts/repeat_backward_check.py [--seeds 8] [--L 2048 --E 16 --K 2 --routing skewed]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make_layer  # noqa: E402

from moeblaze_ops import moe_experts  # noqa: E402
from moeblaze_ops.kernels import triton_experts  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--L", type=int, default=2048)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--I", type=int, default=128)
    p.add_argument("--E", type=int, default=16)
    p.add_argument("--K", type=int, default=2)
    p.add_argument("--routing", default="skewed")
    a = p.parse_args()
    names = ("x", "topk_weights", "w_gate_up", "w_down", "b_gate_up", "b_down")
    for tma in (True, False):
        triton_experts.H_TMA = tma
        differ = {n: 0 for n in names}
        for seed in range(a.seeds):
            layer = make_layer(a.L, a.d, a.I, a.E, a.K, dtype=torch.bfloat16, bias=True, routing=a.routing,
                               seed=seed)
            inputs = {k: (v.cuda().requires_grad_(k in names) if torch.is_tensor(v) and v.is_floating_point()
                          else (v.cuda() if torch.is_tensor(v) else v)) for k, v in layer.items()}
            g = torch.randn(a.L, a.d, device="cuda", dtype=torch.bfloat16)
            runs = [torch.autograd.grad(moe_experts(**inputs), [inputs[n] for n in names], g) for _ in range(3)]
            for i, n in enumerate(names):
                differ[n] += any(not torch.equal(runs[0][i], r[i]) for r in runs[1:])
        print(f"H_TMA={tma}: seeds with differing runs out of {a.seeds}: {differ}", flush=True)


if __name__ == "__main__":
    main()
