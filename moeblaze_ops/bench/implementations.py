"""The experts implementations compared: HF transformers' backends and moeblaze's.

HF's ``eager`` backend (a loop over experts), its ``grouped_mm`` backend eager and under
``torch.compile``, SonicMoE (CuTe DSL kernels for Hopper; on CUDA when ``sonicmoe`` is
importable), and ``moeblaze_ops.moe_experts`` eager and compiled; train mode adds
moeblaze's full-recompute mode and moeblaze compiled with its backward under compiled
autograd (``train_step``: the accumulation of the weights' gradients traced into the
backward graph), forward mode moeblaze in FP8 (``moeblaze_fp8``: the weights quantized once
into 128 x 128 e4m3 blocks, where every width is a multiple of 128; no backward);
``cuda_graphs`` adds ``grouped_mm`` and moeblaze compiled
with ``mode="reduce-overhead"`` (CUDA graphs). Every peer computes the same SwiGLU experts layer on the
same weights, so their outputs can be compared with each other (``moeblaze_fp8``'s differs by
its quantization, a few per cent). A layer variant with biases or
another activation (``peers``' ``variant``, ``configs.make_variant``'s arguments) is moeblaze's
peers' alone: HF's and SonicMoE compute plain SwiGLU without biases, so they are not offered.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

import moeblaze_ops

from .console import note

__all__ = ["CUDA_GRAPH_PEERS", "HFExpertsModule", "INFERENCE_PEERS", "PEER_NAMES", "fp8_fits", "fp8_layer",
           "fp8_weights", "hf_eager_forward", "peers", "train_step"]

#: Every peer ``peers`` may offer, in its order (which ones it offers depends on the mode,
#: ``cuda_graphs``, the device and what is importable): the names ``--skip`` takes.
PEER_NAMES = ("hf_eager", "hf_grouped_mm", "hf_grouped_mm_compiled", "hf_grouped_mm_cudagraphs", "moeblaze",
              "moeblaze_compiled", "moeblaze_cudagraphs", "moeblaze_recompute", "moeblaze_recompute_compiled",
              "moeblaze_compiled_autograd", "moeblaze_fp8", "sonicmoe")

#: The peers that replay CUDA graphs: their memory lives in the graphs' private pool,
#: allocated once, so a call's peak and saved bytes are not measured for them.
CUDA_GRAPH_PEERS = ("hf_grouped_mm_cudagraphs", "moeblaze_cudagraphs")

#: The peers without a backward (forward mode only): no training forward is measured for them.
INFERENCE_PEERS = ("moeblaze_fp8",)


class HFExpertsModule(torch.nn.Module):
    """The attributes HF's experts backends read from an experts module (Qwen3-MoE-like)."""

    def __init__(self, w_gate_up, w_down):
        super().__init__()
        self.num_experts = w_gate_up.shape[0]
        # Plain tensor attributes, not parameters, so the benchmark's requires_grad switch
        # on the input tensors reaches them.
        self.gate_up_proj = w_gate_up
        self.down_proj = w_down
        self.act_fn = F.silu
        self.has_gate, self.has_bias, self.is_transposed, self.is_concatenated = True, False, False, True
        self.has_post_expert_norm, self._is_expert_parallel = False, False

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


def hf_eager_forward(mod, x, ids, w):
    """HF's eager experts loop (as in its Qwen3-MoE experts): the ``hf_eager`` peer."""
    out = torch.zeros_like(x)
    with torch.no_grad():
        mask = F.one_hot(ids, num_classes=mod.num_experts).permute(2, 1, 0)
        hit = (mask.sum(dim=(-1, -2)) > 0).nonzero()
    for e in hit:
        e = e[0]
        k, tok = torch.where(mask[e])
        gate, up = F.linear(x[tok], mod.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, mod.down_proj[e]) * w[tok, k, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def train_step(fn, grad):
    """One training step of peer ``fn``: its forward, then backward of ``grad`` through it,
    under compiled autograd for the peer that asks for it (``moeblaze_compiled_autograd``,
    whose ``backward_context`` makes the context), plainly for every other."""
    with getattr(fn, "backward_context", contextlib.nullcontext)():
        fn().backward(grad)


def _compiled_autograd():
    # Private in torch 2.11: the context PyTorch's own tests use to compile a backward
    # called outside a compiled function.
    return torch._dynamo.compiled_autograd._enable(torch.compile(fullgraph=True))


def _bound(fn, x, ids, w):
    """``fn`` with its inputs bound: a peer is called without arguments."""
    return lambda: fn(x, ids, w)


def _graphed(fn, x, ids, w):
    """``fn`` compiled with CUDA graphs, inputs bound; each call starts a new step, as a
    training loop marks its iterations (a step's outputs are overwritten by the next's)."""
    compiled = torch.compile(fn, fullgraph=True, mode="reduce-overhead")

    def call():
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(x, ids, w)

    return call


def _hf_grouped_mm_forward():
    """transformers' ``grouped_mm`` experts forward, or None (with a note) without transformers."""
    try:
        from transformers.integrations.moe import grouped_mm_experts_forward
    except ImportError as e:
        note(f"bench: hf_grouped_mm peers left out: {e}")
        return None
    return grouped_mm_experts_forward


def _sonicmoe_forward():
    """SonicMoE's experts layer (``moe_general_routing_inputs``), or None where it cannot be
    imported (it is not a dependency: it needs Hopper and its own CuTe DSL wheels)."""
    try:
        from sonicmoe import moe_general_routing_inputs
        from sonicmoe.enums import ActivationType
    except Exception as e:  # noqa: BLE001 - ImportError, or its DSL failing to load
        if not isinstance(e, ModuleNotFoundError):
            note(f"bench: sonicmoe peer left out: {type(e).__name__}: {e}")
        return None

    def forward(x, ids, w, w_gate_up, w_down):
        T, K = ids.shape
        tokens = torch.arange(T, device=x.device, dtype=torch.int32).repeat_interleave(K)
        # Its weights are [2I, d, E] and [d, I, E] views; routing as flat (score, token, expert) triples.
        return moe_general_routing_inputs(
            x, w.reshape(-1).float(), tokens, ids.reshape(-1).int(), w_gate_up.permute(1, 2, 0), None,
            w_down.permute(1, 2, 0), None, w_gate_up.shape[0], torch.cuda.current_stream().cuda_stream,
            ActivationType.SWIGLU, False, True)[0]

    return forward


def fp8_fits(*widths):
    """Whether a layer of these widths can run the FP8 recipe: every one a multiple of its
    128 x 128 blocks."""
    return all(n % moeblaze_ops.fp8.BLOCK == 0 for n in widths)


def fp8_weights(w_gate_up, w_down):
    """``(w_gate_up8, w_down8, w_gate_up_scale, w_down_scale)``: both weights in e4m3 128 x
    128 blocks with their scales (``fp8.quantize_blocks``), made once, before any timed call
    (quantizing in a call reads the bf16 weights: as many bytes as the layer)."""
    (gate_up8, gate_up_scale), (down8, down_scale) = (moeblaze_ops.fp8.quantize_blocks(t) for t in (w_gate_up, w_down))
    return gate_up8, down8, gate_up_scale, down_scale


def fp8_layer(x, ids, w, w_gate_up8, w_down8, w_gate_up_scale, w_down_scale):
    """The FP8 peers' layer: ``moe_experts`` on weights ``fp8_weights`` quantized beforehand."""
    return moeblaze_ops.moe_experts(x, ids, w, w_gate_up8, w_down8, w_gate_up_scale=w_gate_up_scale,
                                    w_down_scale=w_down_scale)


def peers(x, ids, w, w_gate_up, w_down, train=False, cuda_graphs=False, variant=None, fp8=True):
    """name -> callable running the experts' forward on these inputs.

    The first peer is the reference the forward benchmark compares outputs with. Train
    mode adds moeblaze's full-recompute mode (same forward, less kept for backward), eager
    and compiled. Compiled peers compile on their first call.

    ``variant``: the layer variant's further keyword arguments of ``moe_experts``
    (``configs.make_variant``'s: biases, ``activation``, ``interleaved``), which every
    moeblaze peer passes on; None or empty is the plain SwiGLU layer without biases. Only
    that plain layer has the HF peers and SonicMoE (they compute nothing else), so a
    variant that changes the layer offers moeblaze's peers alone.

    ``fp8``: offer ``moeblaze_fp8`` where it applies (it quantizes the weights here, once);
    False for a caller that quantizes its weights itself (decode mode).
    """
    layer = dict(variant or {})
    mod = HFExpertsModule(w_gate_up, w_down)

    def ours(x, ids, w):
        return moeblaze_ops.moe_experts(x, ids, w, w_gate_up, w_down, **layer)

    fns = {}
    if not layer:
        fns["hf_eager"] = lambda: hf_eager_forward(mod, x, ids, w)
    grouped_mm = _hf_grouped_mm_forward() if not layer else None
    if grouped_mm is not None:
        def hf_grouped(x, ids, w):
            return grouped_mm(mod, x, ids, w)

        fns["hf_grouped_mm"] = _bound(hf_grouped, x, ids, w)
        fns["hf_grouped_mm_compiled"] = _bound(torch.compile(hf_grouped, fullgraph=True), x, ids, w)
        if cuda_graphs:
            fns["hf_grouped_mm_cudagraphs"] = _graphed(hf_grouped, x, ids, w)
    fns["moeblaze"] = _bound(ours, x, ids, w)
    fns["moeblaze_compiled"] = _bound(torch.compile(ours, fullgraph=True), x, ids, w)
    if cuda_graphs:
        fns["moeblaze_cudagraphs"] = _graphed(ours, x, ids, w)
    if fp8 and not train and not layer and fp8_fits(*w_gate_up.shape[1:], *w_down.shape[1:]):
        # The FP8 recipe on weights quantized once, here (as a checkpoint stores them).
        weights8 = fp8_weights(w_gate_up.detach(), w_down.detach())
        fns["moeblaze_fp8"] = _bound(lambda x, ids, w: fp8_layer(x, ids, w, *weights8), x, ids, w)
    if train:
        def recompute(x, ids, w):
            return moeblaze_ops.moe_experts(x, ids, w, w_gate_up, w_down, recompute=True, **layer)

        fns["moeblaze_recompute"] = _bound(recompute, x, ids, w)
        fns["moeblaze_recompute_compiled"] = _bound(torch.compile(recompute, fullgraph=True), x, ids, w)
        compiled_autograd = _bound(torch.compile(ours, fullgraph=True), x, ids, w)
        compiled_autograd.backward_context = _compiled_autograd
        fns["moeblaze_compiled_autograd"] = compiled_autograd
    # Last: its kernels compile for minutes on a new shape, and a run cut short by a time
    # limit then still has every other peer's rows.
    sonicmoe = _sonicmoe_forward() if x.is_cuda and not layer else None
    if sonicmoe is not None:
        fns["sonicmoe"] = lambda: sonicmoe(x, ids, w, w_gate_up, w_down)
    return fns
