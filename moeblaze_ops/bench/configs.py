"""The shapes the benchmark measures and the random inputs of one experts layer."""

from __future__ import annotations

import torch

__all__ = ["BIAS_SEED", "CONFIGS", "DECODE_SHAPES", "DECODE_TOKENS", "DISPATCH_CASES", "VARIANTS", "check_empty",
           "load_imbalance", "make_inputs", "make_variant", "variant_dtype"]

#: name -> (T tokens, d hidden, I intermediate, E experts, K chosen per token).
CONFIGS = {
    "conf1": (65536, 512, 2048, 4, 1),
    "conf3": (65536, 1024, 4096, 16, 4),
    "conf4": (32768, 2048, 8192, 16, 4),
    "conf7": (8192, 2048, 8192, 8, 4),
    "olmoe": (32768, 2048, 1024, 64, 8),
    "qwen3_a3b": (32768, 2048, 768, 128, 8),
    "mixtral": (16384, 4096, 14336, 8, 2),
    "deepseek_v3": (8192, 7168, 2048, 256, 8),
    # one layer of examples/finetune_hf_moe.py --size 100m at 16x512 tokens
    "qwen3_100m": (8192, 512, 256, 32, 4),
    # the same layer at the example's default batch, 8x64 tokens (what EXAMPLE=1 trains)
    "qwen3_100m_b512": (512, 512, 256, 32, 4),
    "smoke": (512, 64, 128, 8, 2),  # a seconds-long check of the benchmark itself
}

#: Decode mode's layer shapes, name -> (d hidden, I intermediate, E experts, K chosen per
#: token); the token counts come from ``--tokens`` (``DECODE_TOKENS`` by default).
DECODE_SHAPES = {
    "mixtral_decode": (4096, 14336, 8, 2),
    "qwen3_a3b_decode": (2048, 768, 128, 8),
    "smoke_decode": (64, 128, 8, 2),  # a seconds-long CPU check of the decode mode itself
}

#: Decode mode's default token counts: one sequence's step up to a large prefill chunk.
DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)

#: The layer variants forward and train modes measure (``--variant``): ``none``, the plain
#: SwiGLU layer without biases (bf16 on CUDA); ``bias``, with random biases ``b_gate_up``
#: [E, 2I] and ``b_down`` [E, d]; ``clamped``, GPT-OSS's layer (``clamped_swiglu`` at its
#: default alpha and limit, gate and up columns interleaved, the biases of ``bias``);
#: ``fp16``, the plain layer in float16 (CUDA only: the CPU computes in fp32).
VARIANTS = ("none", "bias", "clamped", "fp16")

#: The seed of the biases' own generator: ``x``, the weights and the routing are drawn from
#: ``make_inputs``' generator alone, so every variant has the same ones.
BIAS_SEED = 2

#: (L rows, K ids per row, E experts) of the dispatch micro-benchmark.
DISPATCH_CASES = [(65536, 8, 128), (262144, 4, 16), (1048576, 8, 256)]


def check_empty(E, K, empty):
    """Raises ``ValueError`` unless ``empty`` of ``E`` experts can be left without tokens
    while each token still chooses ``K`` distinct ones: ``0 <= empty <= E - K``."""
    if empty < 0:
        raise ValueError(f"empty must be at least 0, got {empty}")
    if E - empty < K:
        raise ValueError(f"empty={empty} leaves {E - empty} of the {E} experts, fewer than the K={K} distinct "
                         f"ones each token chooses: at most {E - K} may be empty")


def make_inputs(T, d, I, E, K, dtype=None, device="cuda", seed=0, tilt=0.0, hot=0.0, empty=0):
    """Random inputs of a SwiGLU experts layer:
    ``(x [T, d], topk_ids [T, K], topk_weights [T, K], w_gate_up [E, 2I, d], w_down [E, d, I])``.

    Routing is the top-K of the softmax of random logits: uniform for ``tilt`` 0, and with
    ``tilt * linspace(1, 0, E)`` added to the logits otherwise, so that the low experts get
    more rows (expert 0 the most for a positive tilt), as a trained router's skew does.
    ``hot`` is added to expert 0's logit for every token: a large one (4, say) puts expert 0
    in nearly every token's top-K, one hot expert. The last ``empty`` experts get no tokens
    at all: their logits are -inf (the softmax and top-K are over the other ``E - empty``),
    so ``E - empty`` must be at least ``K`` (``ValueError`` otherwise, ``check_empty``).
    The three combine, and draw nothing from the generator: ``x``, the weights and the
    random logits stay those of the defaults.

    ``dtype`` defaults to bf16 on CUDA and fp32 elsewhere (CPU matmuls in bf16 are slow
    and would make the smoke check's comparison between peers loose).
    """
    check_empty(E, K, empty)
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, d, device=device, dtype=dtype, generator=g)
    logits = torch.randn(T, E, device=device, generator=g)
    if tilt:
        logits += tilt * torch.linspace(1, 0, E, device=device)
    if hot:
        logits[:, 0] += hot
    # The empty experts' logits as -inf: left out of the softmax and the top-K alike, so no
    # top-K picks them even where a large hot underflows the other experts' shares to 0 too.
    w, ids = logits[:, :E - empty].softmax(-1).topk(K, dim=-1)
    w_gate_up = torch.randn(E, 2 * I, d, device=device, dtype=dtype, generator=g) * d ** -0.5
    w_down = torch.randn(E, d, I, device=device, dtype=dtype, generator=g) * I ** -0.5
    return x, ids, w, w_gate_up, w_down


def variant_dtype(variant):
    """The dtype ``make_inputs`` draws ``variant``'s layer in: float16 for ``fp16``, else
    None (its default: bf16 on CUDA, fp32 elsewhere)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    return torch.float16 if variant == "fp16" else None


def make_variant(variant, w_gate_up, w_down, seed=BIAS_SEED):
    """``moe_experts``' keyword arguments of layer variant ``variant`` (``VARIANTS``) on the
    weights ``w_gate_up`` [E, 2I, d] and ``w_down`` [E, d, I]: none for ``none`` and ``fp16``
    (whose dtype is the inputs', ``variant_dtype``); ``b_gate_up`` [E, 2I] and ``b_down``
    [E, d] (``0.1 * randn`` in the weights' dtype and device, from a generator of their own
    seeded with ``seed``) for ``bias``; those and ``activation="clamped_swiglu"``,
    ``interleaved=True`` for ``clamped`` (GPT-OSS's layer: the same weights, their columns
    read as alternating gate and up; alpha and limit GPT-OSS's defaults)."""
    variant_dtype(variant)  # checks the name
    if variant in ("none", "fp16"):
        return {}
    E, N, _ = w_gate_up.shape
    d = w_down.shape[1]
    g = torch.Generator(device=w_gate_up.device).manual_seed(seed)
    biases = dict(b_gate_up=0.1 * torch.randn(E, N, device=w_gate_up.device, dtype=w_gate_up.dtype, generator=g),
                  b_down=0.1 * torch.randn(E, d, device=w_down.device, dtype=w_down.dtype, generator=g))
    if variant == "bias":
        return biases
    return dict(activation="clamped_swiglu", interleaved=True, **biases)


def load_imbalance(ids, E):
    """The routing's load imbalance: the busiest expert's routed rows over the mean of the
    ``E`` experts', as a 0-dim fp64 tensor on ``ids``' device (1.0 for perfectly even
    routing). Counted with ``index_add_``, not ``bincount``, whose CUDA kernel reads the
    ids' maximum on the host: nothing here waits for the device."""
    flat = ids.reshape(-1)
    ones = torch.ones(flat.numel(), dtype=torch.int64, device=ids.device)
    counts = torch.zeros(E, dtype=torch.int64, device=ids.device).index_add_(0, flat, ones)
    return counts.max() / counts.double().mean()
