import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    # CPU machines run the Triton kernels in Triton's interpreter (tests/test_triton_interpret.py).
    # Set before any kernel module is imported: @triton.jit reads it then.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import moeblaze_ops  # noqa: E402,F401  (registers the ops)
from moeblaze_ops import is_gated  # noqa: E402


def fresh_seed():
    """A new seed each call (fresh inputs every check); failures print it to reproduce."""
    return int(os.environ.get("MOEBLAZE_TEST_SEED", random.SystemRandom().randrange(2**31)))


def make_topk_ids(L, K, E, routing="uniform", *, sentinel_frac=0.0, generator=None, dtype=torch.int64):
    """[L, K] distinct expert ids per row. routings: uniform, skewed (Zipf-like), first (experts 0..K-1),
    no_last (expert E-1 never chosen). A fraction of entries becomes sentinel ids (>= E)."""
    g = generator
    if routing == "first":
        ids = torch.arange(K).expand(L, K).clone()
    else:
        E_eff = E - 1 if routing == "no_last" else E
        assert K <= E_eff
        if routing == "skewed":
            logits = -1.2 * torch.log(torch.arange(1, E_eff + 1, dtype=torch.float64))
            u = torch.rand(L, E_eff, generator=g, dtype=torch.float64).clamp_min(1e-12)
            scores = logits - torch.log(-torch.log(u))  # Gumbel top-k: sampling without replacement
        else:
            scores = torch.rand(L, E_eff, generator=g)
        ids = scores.topk(K, dim=1).indices
    if sentinel_frac > 0:
        mask = torch.rand(L, K, generator=g) < sentinel_frac
        ids = torch.where(mask, torch.full_like(ids, E) + torch.randint(0, 3, ids.shape, generator=g), ids)
    return ids.to(dtype)


def make_layer(L, d, I, E, K, *, dtype=torch.float32, activation="swiglu", transposed=False, interleaved=False,
               bias=False,
               routing="uniform", sentinel_frac=0.0, seed=None, requires_grad=False, tw_dtype=None):
    """Random inputs of an experts layer, as a dict of moe_experts keyword arguments."""
    g = torch.Generator().manual_seed(fresh_seed() if seed is None else seed)
    N = 2 * I if is_gated(activation) else I

    def rnd(*shape, scale=1.0):
        t = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)
        return t.requires_grad_(requires_grad)

    w_gate_up = rnd(E, d, N, scale=d ** -0.5) if transposed else rnd(E, N, d, scale=d ** -0.5)
    w_down = rnd(E, I, d, scale=I ** -0.5) if transposed else rnd(E, d, I, scale=I ** -0.5)
    tw = torch.rand(L, K, generator=g, dtype=torch.float64).softmax(-1).to(tw_dtype or dtype)
    return dict(
        x=rnd(L, d),
        topk_ids=make_topk_ids(L, K, E, routing, sentinel_frac=sentinel_frac, generator=g),
        topk_weights=tw.requires_grad_(requires_grad),
        w_gate_up=w_gate_up,
        w_down=w_down,
        activation=activation,
        b_gate_up=rnd(E, N, scale=0.1) if bias else None,
        b_down=rnd(E, d, scale=0.1) if bias else None,
        transposed=transposed,
        interleaved=interleaved,
    )


def rel_err(out, ref):
    ref = ref.detach().double()
    denom = ref.norm()
    err = (out.detach().double() - ref.detach()).norm()
    return float(err / denom) if denom > 0 else float(err)


@pytest.fixture
def seed():
    return fresh_seed()
