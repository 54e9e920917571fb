"""``python -m moeblaze_ops.bench``: moeblaze against its peers, side by side, in one run.

Peers (DESIGN.md §8): HF transformers' experts backends ``eager`` (a loop over experts),
``grouped_mm`` and ``grouped_mm`` under ``torch.compile``; moeblaze eager and compiled.
Forward mode times the experts' forward (bf16, SwiGLU, uniform routing) and measures its
peak memory above the inputs; train mode times forward + backward and measures the
activation memory kept for backward (the unique storages autograd saves, parameters and
the layer input excluded) and the peak memory of one step. A dispatch micro-benchmark
compares ``moeblaze.dispatch`` with the sort + histc + cumsum that ``grouped_mm`` runs.
Writes a markdown table, JSON and PNG bar charts under ``--out``. ``--device cpu`` with
the ``smoke`` config is a quick check of the benchmark itself (no peak memory there).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import moeblaze_ops

# name: (T tokens, d hidden, I intermediate, E experts, K chosen)
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
    "smoke": (512, 64, 128, 8, 2),  # a seconds-long check of the benchmark itself
}
DISPATCH_CASES = [(65536, 8, 128), (262144, 4, 16), (1048576, 8, 256)]


def _progress(items, desc):
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, file=sys.stderr)
    except ImportError:
        return items


class _HFExperts(torch.nn.Module):
    """The attributes HF's experts backends read from an experts module (Qwen3-MoE-like)."""

    def __init__(self, w_gate_up, w_down):
        super().__init__()
        self.num_experts = w_gate_up.shape[0]
        # Plain tensor attributes, so the benchmark's requires_grad switch reaches them.
        self.gate_up_proj = w_gate_up
        self.down_proj = w_down
        self.act_fn = F.silu
        self.has_gate, self.has_bias, self.is_transposed, self.is_concatenated = True, False, False, True
        self.has_post_expert_norm, self._is_expert_parallel = False, False

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


def _hf_eager_forward(mod, x, ids, w):
    """HF's eager experts loop (as in its Qwen3-MoE experts), for the ``eager`` peer."""
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


def make_inputs(T, d, I, E, K, dtype=None, device="cuda", seed=0):
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, d, device=device, dtype=dtype, generator=g)
    logits = torch.randn(T, E, device=device, generator=g)
    w, ids = logits.softmax(-1).topk(K, dim=-1)
    w_gate_up = (torch.randn(E, 2 * I, d, device=device, dtype=dtype, generator=g) * d ** -0.5)
    w_down = (torch.randn(E, d, I, device=device, dtype=dtype, generator=g) * I ** -0.5)
    return x, ids, w, w_gate_up, w_down


def peers(x, ids, w, w_gate_up, w_down, train=False):
    """name -> callable running the experts' forward on these inputs (train mode adds
    moeblaze's full-recompute mode, whose forward is the same, eager and compiled)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    mod = _HFExperts(w_gate_up, w_down)
    hf_grouped = lambda x, ids, w: grouped_mm_experts_forward(mod, x, ids, w)  # noqa: E731
    ours = lambda x, ids, w: moeblaze_ops.moe_experts(x, ids, w, w_gate_up, w_down)  # noqa: E731
    fns = {
        "hf_eager": lambda: _hf_eager_forward(mod, x, ids, w),
        "hf_grouped_mm": lambda: hf_grouped(x, ids, w),
        "hf_grouped_mm_compiled": (lambda f: lambda: f(x, ids, w))(torch.compile(hf_grouped, fullgraph=True)),
        "moeblaze": lambda: ours(x, ids, w),
        "moeblaze_compiled": (lambda f: lambda: f(x, ids, w))(torch.compile(ours, fullgraph=True)),
    }
    if train:
        recompute = lambda x, ids, w: moeblaze_ops.moe_experts(x, ids, w, w_gate_up, w_down,  # noqa: E731
                                                               recompute=True)
        fns["moeblaze_recompute"] = lambda: recompute(x, ids, w)
        fns["moeblaze_recompute_compiled"] = (lambda f: lambda: f(x, ids, w))(
            torch.compile(recompute, fullgraph=True))
    return fns


def time_ms(fn, reps_ms=200):
    if not torch.cuda.is_available() or _DEVICE == "cpu":
        fn()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t0) / 3 * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=50, rep=reps_ms, return_mode="median")


_DEVICE = "cuda"


def peak_bytes(fn):
    """Peak memory one call adds above what is allocated before it (CUDA; NaN on CPU)."""
    if _DEVICE == "cpu":
        fn()
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def _emit(row):
    """Prints one measured row as it lands (a run cut short still shows what it measured)."""
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def bench_forward(names, skip):
    rows = []
    for name in _progress(names, "forward"):
        T, d, I, E, K = CONFIGS[name]
        torch._dynamo.reset()  # each config compiles its peers afresh: no recompile limit across configs
        inputs = make_inputs(T, d, I, E, K)
        flops = 6 * T * K * d * I  # forward: 2*LK*d*2I + 2*LK*I*d
        fns = peers(*inputs)
        ref = None
        for peer, fn in fns.items():
            if peer in skip:
                continue
            with torch.no_grad():
                out = fn()  # warm up / compile
                if ref is None:
                    ref = out.float()
                err = float((out.float() - ref).norm() / ref.norm())
                ms = time_ms(fn)
                mem = peak_bytes(fn)
            # A training forward: the weights require grad, so each peer also keeps what its
            # backward needs. Measured once, after a warm-up (compile) call.
            trainable = [inputs[i] for i in (0, 2, 3, 4)]  # x, topk_weights, w_gate_up, w_down
            for t in trainable:
                t.requires_grad_(True)
            fn()
            train_mem = peak_bytes(fn)
            for t in trainable:
                t.requires_grad_(False)
            rows.append(_emit(dict(config=name, peer=peer, ms=ms, tflops=flops / ms / 1e9, peak_gb=mem / 1e9,
                                   train_fwd_peak_gb=train_mem / 1e9, rel_diff_vs_first=err)))
        del fns, inputs
        torch.cuda.empty_cache()
    return rows


def activation_bytes(fn, exclude):
    """Runs ``fn()`` and returns (its output, the bytes of the unique storages autograd saved
    for backward, those of ``exclude`` (parameters, the layer input) left out)."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(saved.values())


def bench_train(names, skip):
    rows = []
    for name in _progress(names, "train"):
        T, d, I, E, K = CONFIGS[name]
        torch._dynamo.reset()
        inputs = make_inputs(T, d, I, E, K, device=_DEVICE)
        x, ids, w, w_gate_up, w_down = inputs
        for t in (x, w, w_gate_up, w_down):
            t.requires_grad_(True)
        flops = 18 * T * K * d * I  # forward + backward (DESIGN.md §8)
        grad = torch.randn(T, d, device=_DEVICE, dtype=x.dtype, generator=torch.Generator(_DEVICE).manual_seed(1))
        for peer, fn in peers(*inputs, train=True).items():
            if peer in skip:
                continue

            def step(fn=fn):
                fn().backward(grad)

            step()  # warm up / compile
            ms = time_ms(step)
            mem = peak_bytes(step)
            out, act = activation_bytes(fn, exclude=[x, w_gate_up, w_down])
            del out
            for t in (x, w, w_gate_up, w_down):
                t.grad = None
            rows.append(_emit(dict(config=name, peer=peer, ms=ms, tflops=flops / ms / 1e9, peak_gb=mem / 1e9,
                                   activation_gb=act / 1e9, activation_bytes=act)))
        del inputs, x, w, w_gate_up, w_down
        if _DEVICE == "cuda":
            torch.cuda.empty_cache()
    return rows


def _against_base(rows, base_peer="hf_grouped_mm_compiled"):
    """(config, peer, row, the config's base row or None, speed vs base as text), per row."""
    by = {}
    for r in rows:
        by.setdefault(r["config"], {})[r["peer"]] = r
    for cfg, peers_ in by.items():
        base = peers_.get(base_peer)
        for peer, r in peers_.items():
            yield cfg, peer, r, base, (f"{base['ms'] / r['ms']:.2f}x" if base else "-")


def train_table(rows):
    lines = ["| config | peer | fwd+bwd ms | TFLOP/s | activation GB | peak GB | speed vs compiled grouped_mm "
             "| activation vs compiled grouped_mm | peak vs compiled grouped_mm |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for cfg, peer, r, base, speed in _against_base(rows):
        ratio = lambda k: f"{r[k] / base[k]:.2f}x" if base and base[k] > 0 else "-"  # noqa: E731
        lines.append(f"| {cfg} | {peer} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['activation_gb']:.3f} "
                     f"| {r['peak_gb']:.2f} | {speed} | {ratio('activation_gb')} | {ratio('peak_gb')} |")
    return "\n".join(lines)


def bench_dispatch():
    from moeblaze_ops.kernels import triton_dispatch

    rows = []
    for L, K, E in _progress(DISPATCH_CASES, "dispatch"):
        ids = torch.randn(L, E, device="cuda").topk(K, dim=-1).indices

        def sort_histc_cumsum():
            flat = ids.reshape(-1)
            sorted_ids, perm = torch.sort(flat)
            counts = torch.histc(sorted_ids.int(), bins=E, min=0, max=E - 1)
            return perm, torch.cumsum(counts, 0, dtype=torch.int32)

        base = time_ms(sort_histc_cumsum)
        kernel = time_ms(lambda: triton_dispatch.dispatch(ids, E))
        op = time_ms(lambda: torch.ops.moeblaze.dispatch(ids, E))
        rows.append(dict(L=L, K=K, E=E, sort_histc_cumsum_ms=base, moeblaze_kernels_ms=kernel,
                         moeblaze_op_ms=op, speedup_kernels=base / kernel, speedup_op=base / op))
    return rows


def forward_table(rows):
    lines = ["| config | peer | ms | TFLOP/s | peak GB (no grad) | peak GB (training fwd) | speed vs compiled "
             "grouped_mm | peak vs compiled grouped_mm (no grad / training fwd) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for cfg, peer, r, base, speed in _against_base(rows):
        mem = (f"{r['peak_gb'] / base['peak_gb']:.2f}x / {r['train_fwd_peak_gb'] / base['train_fwd_peak_gb']:.2f}x"
               if base and base["peak_gb"] > 0 else "-")
        lines.append(f"| {cfg} | {peer} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['peak_gb']:.2f} "
                     f"| {r['train_fwd_peak_gb']:.2f} | {speed} | {mem} |")
    return "\n".join(lines)


def dispatch_table(rows):
    lines = ["| L | K | E | sort+histc+cumsum ms | moeblaze kernels ms | moeblaze op ms (with id checks) | speedup (kernels / op) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['L']} | {r['K']} | {r['E']} | {r['sort_histc_cumsum_ms']:.3f} | {r['moeblaze_kernels_ms']:.3f} "
                     f"| {r['moeblaze_op_ms']:.3f} | {r['speedup_kernels']:.1f}x / {r['speedup_op']:.1f}x |")
    return "\n".join(lines)


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cfgs = list(dict.fromkeys(r["config"] for r in rows))
    peers_ = list(dict.fromkeys(r["peer"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    width = 0.8 / len(peers_)
    for i, p in enumerate(peers_):
        vals = {r["config"]: r for r in rows if r["peer"] == p}
        xs = [j + i * width for j in range(len(cfgs))]
        axes[0].bar(xs, [vals[c]["tflops"] if c in vals else 0 for c in cfgs], width, label=p)
        axes[1].bar(xs, [vals[c]["peak_gb"] if c in vals else 0 for c in cfgs], width, label=p)
    for ax, title in zip(axes, ["forward TFLOP/s", "forward peak memory (GB)"]):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cfgs))], cfgs, rotation=30)
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["forward", "train"], default="forward",
                   help="forward: the experts' forward; train: forward + backward, activation and peak memory")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--torch-backward", action="store_true",
                   help="moeblaze's backward through the PyTorch kernels instead of the Triton ones")
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--skip", nargs="*", default=[], help="peers to leave out, e.g. hf_eager")
    p.add_argument("--no-dispatch", action="store_true", help="skip the dispatch micro-benchmark")
    p.add_argument("--out", default="bench_out")
    a = p.parse_args(argv)
    global _DEVICE
    _DEVICE = a.device
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA GPU here: --device cpu runs the smoke check")
    if a.torch_backward:
        from .kernels import _switches

        _switches["backward"] = False
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    device_name = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    result = dict(device=device_name, torch=torch.__version__, mode=a.mode, triton_backward=not a.torch_backward)
    try:
        import transformers
        import triton

        result.update(transformers=transformers.__version__, triton=triton.__version__)
    except ImportError:
        pass
    text = [f"# moeblaze bench ({a.mode}) on {result['device']}, torch {torch.__version__}"]
    if not a.no_dispatch and a.device == "cuda":
        result["dispatch"] = bench_dispatch()
        text += ["", "## dispatch", "", dispatch_table(result["dispatch"])]
        print("\n".join(text[-3:]), flush=True)
    if a.mode == "forward":
        result["forward"] = bench_forward(a.configs, set(a.skip))
        text += ["", "## forward (bf16, SwiGLU, uniform routing)", "", forward_table(result["forward"])]
    else:
        result["train"] = bench_train(a.configs, set(a.skip))
        text += ["", "## forward + backward (SwiGLU, uniform routing)", "", train_table(result["train"])]
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    (out / "bench.md").write_text("\n".join(text) + "\n")
    if a.mode == "forward" and result["forward"]:  # `--configs` alone: the dispatch rows only
        plot(result["forward"], out / "forward.png")
    print("\n".join(text), flush=True)
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
