"""Fine-tunes a HuggingFace MoE model built from a config, on synthetic data, with the
experts run by moeblaze (or any other experts backend, side by side).

    python examples/finetune_hf_moe.py                       # tiny Qwen3-MoE on CPU, < 1 minute
    python examples/finetune_hf_moe.py --experts-implementation moeblaze grouped_mm --steps 50
    python examples/finetune_hf_moe.py --family gpt_oss --size small --compile
    python examples/finetune_hf_moe.py --size 100m --device cuda --dtype bfloat16 --compile \\
        --experts-implementation moeblaze grouped_mm --steps 50
    python examples/finetune_hf_moe.py --size 100m --device cuda --dtype bfloat16 --compile reduce-overhead \\
        --experts-implementation moeblaze grouped_mm --steps 50

Every backend starts from the same weights and sees the same batches; the script prints
each one's loss curve, tokens/s and peak memory (CUDA), so they can be compared in one run.
``--device cpu`` (the default) runs moeblaze's portable PyTorch kernels; ``--device cuda``
(or ``cuda:N``) its Triton kernels on a GPU. The synthetic task is next-token prediction
on a fixed corpus of random sequences, which a small model memorises within a few dozen
steps.
"""

import argparse
import time

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

import moeblaze_ops.hf
from moeblaze_ops.bench.cli import non_negative_int, positive_int
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


#: ``torch.compile`` modes ``--compile`` takes.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


def batches(steps, batch, seq, vocab, seed, corpus_size=64):
    """Batches drawn from a fixed corpus of random sequences: a small model memorises it,
    so the loss falls within a few dozen steps."""
    g = torch.Generator().manual_seed(seed)
    corpus = torch.randint(0, vocab, (corpus_size, seq), generator=g)
    for _ in range(steps):
        yield corpus[torch.randint(0, corpus_size, (batch,), generator=g)]


def build_model(config, initial_state, impl, *, device, dtype, compile_mode, lr):
    """The model with experts backend ``impl``, loaded from ``initial_state`` onto ``device``,
    its AdamW, and what a step calls: the model, or it compiled with ``compile_mode``."""
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(initial_state)
    model.to(device).train()
    model.set_experts_implementation(impl)
    if impl in moeblaze_ops.hf.BACKENDS:
        moeblaze_ops.hf.check_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    run = model
    if compile_mode:
        with torch.no_grad():  # transformers installs its output hooks on the first call
            model(torch.zeros(1, 8, dtype=torch.long, device=device))
        run = torch.compile(model, fullgraph=True, mode=compile_mode)
    return run, opt


def train_step(run, opt, ids, compile_mode=None):
    """One optimizer step of next-token prediction on ``ids``; returns the loss (not read)."""
    if compile_mode == "reduce-overhead":
        # A new step: the CUDA graphs may overwrite the previous step's outputs now.
        torch.compiler.cudagraph_mark_step_begin()
    loss = run(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def train(args, impl, initial_state):
    torch.manual_seed(args.seed)
    config = model_config(args.family, max_positions=max(512, args.seq), **SIZES[args.size])
    run, opt = build_model(config, initial_state, impl, device=args.device, dtype=getattr(torch, args.dtype),
                           compile_mode=args.compile, lr=args.lr)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    losses, tokens, t0 = [], 0, None
    data = batches(args.steps, args.batch, args.seq, config.vocab_size, args.seed)
    for step, ids in enumerate(tqdm(data, total=args.steps, desc=f"{impl:>10}", leave=False)):
        if step == args.warmup:  # time the steps after compilation and warm-up
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0, tokens = time.perf_counter(), 0
        loss = train_step(run, opt, ids.to(args.device), args.compile)
        losses.append(float(loss.detach()))
        tokens += ids.numel()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0 if t0 is not None else float("nan")
    peak = torch.cuda.max_memory_allocated() / 1e9 if args.device.startswith("cuda") else float("nan")
    return losses, tokens / elapsed, peak


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and shows every flag's default."""


def experts_backends():
    """The experts backends this transformers offers: ``eager`` (its per-expert loop)
    and every key of its ``ExpertsInterface``, which includes moeblaze's two (registered
    by ``import moeblaze_ops.hf``)."""
    from transformers.integrations.moe import ExpertsInterface

    return ["eager"] + sorted(k for k in ExpertsInterface().keys() if k != "eager")


def _device(text):
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: moeblaze runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: this torch sees no CUDA GPU (torch.cuda.is_available() is "
                                         "False); use --device cpu, or install the CUDA build of torch")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return text


def build_parser():
    backends = experts_backends()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument("--family", default="qwen3_moe", choices=sorted(FAMILIES),
                   help="MoE model family, built from a small config (no download)")
    p.add_argument("--size", default="tiny", choices=sorted(SIZES),
                   help="model size: tiny (0.2M parameters, CPU), small, 100m (about 100M parameters, GPU)")
    p.add_argument("--device", default="cpu", type=_device,
                   help="where to train: cpu (moeblaze's portable PyTorch kernels), cuda or cuda:N (its Triton "
                        "kernels; also reports each backend's peak GPU memory)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the model's weights and activations")
    p.add_argument("--steps", type=positive_int, default=60, help="training steps per backend (at least 1)")
    p.add_argument("--warmup", type=non_negative_int, default=3,
                   help="first steps left out of tokens/s (compilation, allocator warm-up); less than --steps")
    p.add_argument("--batch", type=positive_int, default=8, help="sequences per step")
    p.add_argument("--seq", type=positive_int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the synthetic batches")
    p.add_argument("--compile", nargs="?", const="default", choices=COMPILE_MODES, metavar="MODE",
                   help="train torch.compile(model, fullgraph=True, mode=MODE); MODE is one of "
                        f"{', '.join(COMPILE_MODES)} (default when the flag has none; reduce-overhead "
                        "replays CUDA graphs)")
    p.add_argument("--experts-implementation", nargs="+", default=["moeblaze"], choices=backends,
                   metavar="IMPL",
                   help=f"one or more experts backends, each trained from the same start: {', '.join(backends)} "
                        "(deepgemm and sonicmoe need a CUDA GPU and their kernels installed)")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.warmup >= args.steps:
        p.error(f"--warmup ({args.warmup}) must be less than --steps ({args.steps}): tokens/s is measured over "
                "the steps after the warm-up")
    return args


def main(argv=None):
    """Runs the example with command-line arguments ``argv`` (default: ``sys.argv[1:]``);
    returns ``{backend: (losses, tokens/s, peak GB or nan on CPU)}``."""
    args = parse_args(argv)

    torch.manual_seed(args.seed)
    config = model_config(args.family, max_positions=max(512, args.seq), **SIZES[args.size])
    initial_state = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).state_dict()
    n_params = sum(t.numel() for t in initial_state.values())
    print(f"{args.family} ({args.size}, {n_params / 1e6:.1f}M parameters), {args.steps} steps of "
          f"{args.batch}x{args.seq} tokens on {args.device}, {args.dtype}"
          f"{f', compiled ({args.compile})' if args.compile else ''}")
    results = {impl: train(args, impl, initial_state) for impl in args.experts_implementation}
    every = max(1, args.steps // 10)
    print("step  " + "  ".join(f"{impl:>12}" for impl in results))
    for step in range(0, args.steps, every):
        print(f"{step:4d}  " + "  ".join(f"{r[0][step]:12.4f}" for r in results.values()))
    print("last  " + "  ".join(f"{r[0][-1]:12.4f}" for r in results.values()))
    for impl, (losses, tps, peak) in results.items():
        print(f"{impl}: final loss {losses[-1]:.4f}, {tps:,.0f} tokens/s, peak memory "
              f"{'n/a (CPU)' if peak != peak else f'{peak:.2f} GB'}")
    return results


if __name__ == "__main__":
    main()
