"""Probe (temporary): which factor makes the down GEMM wrong with weights through TMA."""
import sys
sys.path[:0] = ["tests"]
import torch
from moeblaze_ops.kernels import triton_experts as te
from kernel_cases import check_forward

te.POISON = True
for d, I in [(2880, 1408), (256, 192), (1024, 512)]:
    for tile in [(128, 256, 32, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (64, 256, 64, 4, 3)]:
        for slab in [None, 512]:
            for h_tma in [True, False]:
                for layout in ["concatenated", "transposed_interleaved"]:
                    te.CONFIG_OVERRIDE = {"down": tile}
                    te.D_SLAB, te.H_TMA = slab, h_tma
                    te.W_TMA = {**te.W_TMA, "down": True}
                    try:
                        err = check_forward(777, d, I, 8, 2, dtype=torch.bfloat16, device="cuda", seed=1, layout=layout,
                                            bias=True, tw_dtype=torch.float32)
                        res = f"ok {err:.1e}"
                    except AssertionError as e:
                        res = f"FAIL {str(e)[:40]}"
                    print(d, I, tile, "slab", slab, "h_tma", h_tma, layout, res, flush=True)
