"""Fine-tunes a HuggingFace MoE model built from a config, on synthetic data, with the
experts run by moeblaze (or any other experts backend, side by side).

    python examples/finetune_hf_moe.py                       # tiny Qwen3-MoE on CPU, < 1 minute
    python examples/finetune_hf_moe.py --experts-implementation moeblaze grouped_mm --steps 50
    python examples/finetune_hf_moe.py --family gpt_oss --size small --compile
    python examples/finetune_hf_moe.py --size 100m --device cuda --dtype bfloat16 --compile \\
        --experts-implementation moeblaze grouped_mm --steps 50

Every backend starts from the same weights and sees the same batches; the script prints
each one's loss curve, tokens/s and peak memory (CUDA), so they can be compared in one run.
The synthetic task is next-token prediction on a fixed corpus of random sequences, which
a small model memorises within a few dozen steps.
"""

import argparse
import time

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

import moeblaze_ops.hf
from moeblaze_ops.hf import FAMILIES, model_config

SIZES = {
    # name: model_config sizes
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_experts=8, top_k=2, expert_intermediate_size=32,
                 vocab_size=256),
    "small": dict(hidden_size=256, num_layers=4, num_heads=4, num_experts=16, top_k=4, expert_intermediate_size=128,
                  vocab_size=1024),
    # About 100M parameters (Qwen3-MoE: 8 layers x 32 experts x 3 x 512 x 256 in the experts).
    "100m": dict(hidden_size=512, num_layers=8, num_heads=8, num_experts=32, top_k=4, expert_intermediate_size=256,
                 vocab_size=8192),
}


def batches(steps, batch, seq, vocab, seed, corpus_size=64):
    """Batches drawn from a fixed corpus of random sequences: a small model memorises it,
    so the loss falls within a few dozen steps."""
    g = torch.Generator().manual_seed(seed)
    corpus = torch.randint(0, vocab, (corpus_size, seq), generator=g)
    for _ in range(steps):
        yield corpus[torch.randint(0, corpus_size, (batch,), generator=g)]


def train(args, impl, initial_state):
    torch.manual_seed(args.seed)
    config = model_config(args.family, max_positions=max(512, args.seq), **SIZES[args.size])
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.load_state_dict(initial_state)
    model.to(args.device).train()
    model.set_experts_implementation(impl)
    if impl in moeblaze_ops.hf.BACKENDS:
        moeblaze_ops.hf.check_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    run = model
    if args.compile:
        with torch.no_grad():  # transformers installs its output hooks on the first call
            model(torch.zeros(1, 8, dtype=torch.long, device=args.device))
        run = torch.compile(model, fullgraph=True)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    losses, tokens, t0 = [], 0, None
    data = batches(args.steps, args.batch, args.seq, config.vocab_size, args.seed)
    for step, ids in enumerate(tqdm(data, total=args.steps, desc=f"{impl:>10}", leave=False)):
        if step == args.warmup:  # time the steps after compilation and warm-up
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0, tokens = time.perf_counter(), 0
        ids = ids.to(args.device)
        loss = run(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        tokens += ids.numel()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0 if t0 is not None else float("nan")
    peak = torch.cuda.max_memory_allocated() / 1e9 if args.device.startswith("cuda") else float("nan")
    return losses, tokens / elapsed, peak


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="qwen3_moe", choices=sorted(FAMILIES))
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of tokens/s")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile(model, fullgraph=True)")
    p.add_argument("--experts-implementation", nargs="+", default=["moeblaze"],
                   help="one or more of moeblaze, moeblaze_recompute, grouped_mm, batched_mm, eager: each trains "
                        "from the same start")
    args = p.parse_args()

    torch.manual_seed(args.seed)
    config = model_config(args.family, max_positions=max(512, args.seq), **SIZES[args.size])
    initial_state = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).state_dict()
    n_params = sum(t.numel() for t in initial_state.values())
    print(f"{args.family} ({args.size}, {n_params / 1e6:.1f}M parameters), {args.steps} steps of "
          f"{args.batch}x{args.seq} tokens on {args.device}, {args.dtype}{', compiled' if args.compile else ''}")
    results = {impl: train(args, impl, initial_state) for impl in args.experts_implementation}
    every = max(1, args.steps // 10)
    print("step  " + "  ".join(f"{impl:>12}" for impl in results))
    for step in range(0, args.steps, every):
        print(f"{step:4d}  " + "  ".join(f"{r[0][step]:12.4f}" for r in results.values()))
    print(f"last  " + "  ".join(f"{r[0][-1]:12.4f}" for r in results.values()))
    for impl, (losses, tps, peak) in results.items():
        print(f"{impl}: final loss {losses[-1]:.4f}, {tps:,.0f} tokens/s, peak memory "
              f"{'n/a (CPU)' if peak != peak else f'{peak:.2f} GB'}")


if __name__ == "__main__":
    main()
