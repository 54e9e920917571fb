"""``python -m moeblaze_ops.bench.generate``: tokens/s of HF ``generate`` with moeblaze's experts
against transformers' ``grouped_mm`` experts, on a Qwen3-MoE model of the real Qwen3-30B-A3B
widths (hidden 2048, 128 experts of width 768, top 8, 32 query / 4 key-value heads of 128) but
``--layers`` decoder layers (default 4), random weights, bf16 on CUDA.

    python -m moeblaze_ops.bench.generate --device cuda --batch 1 32 --new-tokens 64 --out gen_out
    python -m moeblaze_ops.bench.generate --device cpu --tiny --batch 1 --new-tokens 4   # the smoke check

Generation is greedy (``do_sample=False``) with ``min_new_tokens = max_new_tokens``, so every
backend generates the same number of tokens, and uses a static cache, which transformers
compiles for: with ``cache_implementation="static"`` and a ``compile_config``, ``generate``
runs the prefill eagerly and every decode step through ``torch.compile(model.__call__,
fullgraph=True, mode=--compile)`` (transformers 5.x's automatic compilation; by default
``mode="reduce-overhead"``, CUDA graphs). Compiling ``model.forward`` by hand on top of that
would nest two compilations, so this script passes the ``compile_config`` instead.

For each batch size and backend: one untimed ``generate`` that compiles and records the logits
of the first ``--compare-steps`` steps, ``--warmup`` more untimed calls, then ``--repeats``
timed ones (CUDA-synchronized; their median counts). tokens/s is
``batch * new_tokens / seconds`` of a whole ``generate`` call, prefill included. The two
backends' logits must agree (relative error ``||a - b|| / ||b||`` under 2e-2 in bf16, 1e-4 in
fp32) at every step whose inputs are still the same: greedy tokens of a random model often
diverge after a near-tie, and from there on a row's logits no longer compare. A disagreement
makes the command exit with status 1, after writing its results.

Prints a markdown table (stdout) and writes ``generate.md`` and ``generate.json`` under
``--out``; progress and notes go to stderr. ``--tiny`` shrinks every width (fp32 on CPU, no
compilation unless ``--compile`` says so) to check the script itself in seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from .cli import non_negative_int, positive_int
from .console import note, progress

__all__ = ["BACKENDS", "REFERENCE", "QWEN3_30B_A3B", "TINY", "COMPILE_MODES", "TOLERANCE", "build_model",
           "compile_kwargs", "generate_logits", "time_generate", "logits_agreement", "markdown", "build_parser",
           "main"]

#: The experts backends compared, in the order they run.
BACKENDS = ("moeblaze", "grouped_mm")
#: The backend the speed ratio and the logits agreement are measured against: transformers'
#: fastest experts implementation.
REFERENCE = "grouped_mm"

#: Qwen3-30B-A3B's widths (its config.json on the Hub), the layer count left to ``--layers``.
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     vocab_size=151936, norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=40960,
                     tie_word_embeddings=False)
#: ``--tiny``: the same model shape at widths a CPU runs in milliseconds a step.
TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, norm_topk_prob=True,
            max_position_embeddings=512, tie_word_embeddings=False)

#: ``--compile`` choices: ``torch.compile`` modes (Inductor), ``aot_eager`` (Dynamo's capture
#: and AOTAutograd without Inductor: a quick check on CPU), or ``none`` (eager decode steps).
COMPILE_MODES = ("reduce-overhead", "default", "max-autotune", "aot_eager", "none")

#: Largest relative error of the logits between the backends, by dtype: bf16 rounds every
#: layer's output to 8 bits of mantissa, and the two backends round at different places.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def build_model(widths, layers, *, device, dtype, seed):
    """A Qwen3-MoE causal LM of ``widths`` (``QWEN3_30B_A3B`` or ``TINY``) with ``layers``
    decoder layers, every one an MoE layer, with random weights (transformers' initialisation,
    seeded) made directly on ``device`` in ``dtype``, in eval mode.

    Its generation config has no EOS, so that ``generate`` always runs to ``max_new_tokens``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=layers, **widths)
    torch.manual_seed(seed)
    # On the device at once: the 4-layer model has about 3.1B parameters, which the CPU would
    # initialise for tens of seconds before the copy.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def compile_kwargs(mode, device):
    """The ``generate`` keyword arguments that compile its decode steps with ``mode`` (a
    ``COMPILE_MODES`` item), or keep them eager (``"none"``)."""
    from transformers import CompileConfig

    if mode == "none":
        # generate compiles a static cache's decode steps on CUDA by itself; "none" means eager.
        return {"disable_compile": True}
    if mode == "aot_eager":
        config = CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager", mode=None)
    else:
        # dynamic=False: every batch size gets its own static graph (the state is reset between
        # runs anyway), not a dynamic one after the second size, which CUDA graphs would record
        # per size regardless.
        config = CompileConfig(fullgraph=True, dynamic=False, mode=mode)
    if torch.device(device).type != "cuda":
        config._compile_all_devices = True  # transformers compiles on CUDA (and a few others) only, unless told
    return {"compile_config": config}


def _reset_compiled(model):
    """Forgets every compiled graph, CUDA graph and static cache of an earlier run: the next
    backend (or batch size) compiles from scratch and nothing of the last one stays in memory."""
    torch._dynamo.reset()  # also resets the CUDA graph trees of mode="reduce-overhead"
    for attr in ("_compiled_call", "_last_compile_config", "_cache"):  # what generate caches on the model
        model.__dict__.pop(attr, None)


def _generate(model, ids, new_tokens, extra, **kwargs):
    mask = torch.ones_like(ids)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, cache_implementation="static", **extra, **kwargs)


def generate_logits(model, ids, new_tokens, extra, steps):
    """One untimed ``generate`` (it compiles): (new tokens [B, new_tokens] on the CPU, raw logits
    of the first ``steps`` steps [steps, B, vocab] fp32 on the CPU)."""
    out = _generate(model, ids, new_tokens, extra, return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[:, ids.shape[1]:].cpu()
    logits = torch.stack([step.float().cpu() for step in out.logits[:steps]])
    return tokens, logits


def time_generate(model, ids, new_tokens, extra, *, warmup, repeats, desc):
    """Seconds of each of ``repeats`` timed ``generate`` calls after ``warmup`` untimed ones, and
    the number of tokens the last one generated per row (``new_tokens`` unless it stopped early)."""
    device = ids.device
    for _ in range(warmup):
        _generate(model, ids, new_tokens, extra)
    times, generated = [], 0
    for _ in progress(range(repeats), desc):
        _sync(device)
        start = time.perf_counter()
        out = _generate(model, ids, new_tokens, extra)
        _sync(device)
        times.append(time.perf_counter() - start)
        generated = out.shape[1] - ids.shape[1]
    return times, generated


def logits_agreement(tokens, logits, ref_tokens, ref_logits):
    """How far one backend's logits are from the reference's, at the steps that compare.

    Step ``s``'s logits of a row depend on the row's tokens before ``s``; a row compares at
    step ``s`` while both backends generated the same tokens up to it. Returns
    ``{"rel_err_per_step": [...] (None where no row compares), "max_rel_err", "steps_compared",
    "rows_compared_per_step", "tokens_equal" (fraction of generated tokens that agree)}``."""
    from ..testing import rel_err

    same = tokens == ref_tokens  # [B, new_tokens]
    per_step, rows_per_step = [], []
    for step in range(logits.shape[0]):
        rows = same[:, :step].all(dim=1)  # step 0 (the prefill's logits) always compares
        rows_per_step.append(int(rows.sum()))
        per_step.append(rel_err(logits[step][rows], ref_logits[step][rows]) if rows.any() else None)
    compared = [e for e in per_step if e is not None]
    return {"rel_err_per_step": per_step, "max_rel_err": max(compared), "steps_compared": len(compared),
            "rows_compared_per_step": rows_per_step, "tokens_equal": float(same.float().mean())}


def _cell(value, fmt):
    return "-" if value is None else format(value, fmt)


def markdown(result):
    """The run's markdown: a title, the speed table (one row per batch and backend) and the
    logits agreement table (one row per batch)."""
    m = result["model"]
    lines = [f"# generate: Qwen3-MoE {'tiny' if result['tiny'] else '30B-A3B widths'}, {m['layers']} layers "
             f"({m['parameters'] / 1e9:.2f}B parameters), {result['dtype']}, static cache, compile "
             f"{result['compile']}, on {result['device']}",
             "",
             f"prompt {result['prompt_len']} tokens, {result['new_tokens']} new tokens, greedy; torch "
             f"{result['torch']}, transformers {result['transformers']}; median of {result['repeats']} runs",
             "",
             f"| backend | batch | s / generate | tokens/s | vs {REFERENCE} | peak GB |",
             "| --- | --- | --- | --- | --- | --- |"]
    ref = {r["batch"]: r for r in result["rows"] if r["backend"] == REFERENCE}
    for r in result["rows"]:
        base = ref.get(r["batch"])
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        lines.append(f"| {r['backend']} | {r['batch']} | {r['seconds']:.4f} | {r['tokens_per_s']:,.1f} | {ratio} | "
                     f"{_cell(r['peak_gb'], '.2f')} |")
    lines += ["", f"Logits, moeblaze against {REFERENCE} (relative error, steps whose inputs agree):", "",
              "| batch | steps compared | max rel err | per step | tolerance | tokens equal | ok |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for a in result["logits"]:
        steps = ", ".join(_cell(e, ".1e") for e in a["rel_err_per_step"])
        lines.append(f"| {a['batch']} | {a['steps_compared']} | {a['max_rel_err']:.2e} | {steps} | "
                     f"{a['tolerance']:.0e} | {a['tokens_equal']:.0%} | {'yes' if a['ok'] else 'NO'} |")
    return "\n".join(lines) + "\n"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and shows every flag's default."""


def build_parser():
    """The command line (``--help`` lists every flag and its default)."""
    p = argparse.ArgumentParser(prog="python -m moeblaze_ops.bench.generate", description=__doc__,
                                formatter_class=_HelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=positive_int, nargs="+", default=[1, 32], help="batch sizes, each timed")
    p.add_argument("--new-tokens", type=positive_int, default=64, help="tokens generated per row")
    p.add_argument("--prompt-len", type=positive_int, default=32, help="tokens of each (random) prompt")
    p.add_argument("--layers", type=positive_int, default=4, help="decoder layers, every one an MoE layer")
    p.add_argument("--tiny", action="store_true", help="tiny widths instead of Qwen3-30B-A3B's (a CPU smoke check)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="weights and activations (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--compile", choices=COMPILE_MODES, default=None,
                   help="how generate compiles the decode steps (default: reduce-overhead on cuda, none on cpu)")
    p.add_argument("--warmup", type=non_negative_int, default=1,
                   help="untimed generate calls after the first (which compiles and records the logits)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed generate calls; their median counts")
    p.add_argument("--compare-steps", type=positive_int, default=4,
                   help="first decoding steps whose logits are compared between the backends")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts")
    p.add_argument("--out", default=None, help="folder for generate.md and generate.json (default: print only)")
    return p


def main(argv=None):
    """Runs the benchmark with command-line arguments ``argv`` (default ``sys.argv[1:]``);
    prints the markdown, writes ``generate.md`` and ``generate.json`` under ``--out`` and
    returns the JSON's dict (``"ok"``: every logits agreement within tolerance)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: --device cpu --tiny runs the smoke check")
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    compile_mode = args.compile or ("reduce-overhead" if args.device == "cuda" else "none")
    if compile_mode == "reduce-overhead" and args.device != "cuda":
        parser.error("--compile reduce-overhead records CUDA graphs: it needs --device cuda")
    steps = min(args.compare_steps, args.new_tokens)

    import transformers

    import moeblaze_ops.hf  # registers experts_implementation="moeblaze"

    widths = dict(TINY if args.tiny else QWEN3_30B_A3B)
    widths["max_position_embeddings"] = max(widths["max_position_embeddings"], args.prompt_len + args.new_tokens)
    model = build_model(widths, args.layers, device=args.device, dtype=dtype, seed=args.seed)
    parameters = sum(p.numel() for p in model.parameters())
    note(f"Qwen3-MoE, {args.layers} layers, {parameters / 1e9:.2f}B parameters, {dtype} on {args.device}, "
         f"compile {compile_mode}")
    extra = compile_kwargs(compile_mode, args.device)
    device_name = torch.cuda.get_device_name(args.device) if args.device == "cuda" else "cpu"

    rows, agreements = [], []
    for batch in args.batch:
        ids = torch.randint(0, widths["vocab_size"], (batch, args.prompt_len),
                            generator=torch.Generator().manual_seed(args.seed + batch)).to(args.device)
        seen = {}
        for backend in BACKENDS:
            _reset_compiled(model)
            model.set_experts_implementation(backend)
            if backend in moeblaze_ops.hf.BACKENDS:
                moeblaze_ops.hf.check_model(model)  # raises unless moeblaze runs every experts module
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats(args.device)
            # The first call compiles (minutes at full width on a GPU): say so before the wait.
            note(f"{backend}, batch {batch}: first generate (compiles with {compile_mode}, records the logits)")
            seen[backend] = generate_logits(model, ids, args.new_tokens, extra, steps)
            times, generated = time_generate(model, ids, args.new_tokens, extra, warmup=args.warmup,
                                             repeats=args.repeats, desc=f"{backend} batch {batch}")
            seconds = statistics.median(times)
            peak = torch.cuda.max_memory_allocated(args.device) / 1e9 if args.device == "cuda" else None
            rows.append({"backend": backend, "batch": batch, "prompt_len": args.prompt_len,
                         "new_tokens": args.new_tokens, "tokens": generated, "seconds": seconds, "times": times,
                         "tokens_per_s": batch * generated / seconds, "peak_gb": peak})
            note(json.dumps(rows[-1]))
        agreement = logits_agreement(*seen["moeblaze"], *seen[REFERENCE])
        agreement.update(batch=batch, backend="moeblaze", reference=REFERENCE, tolerance=TOLERANCE[dtype])
        agreement["ok"] = agreement["max_rel_err"] < agreement["tolerance"]
        agreements.append(agreement)
    _reset_compiled(model)

    result = {"model": {"family": "qwen3_moe", "layers": args.layers, "parameters": parameters, **widths},
              "tiny": args.tiny, "device": device_name, "dtype": str(dtype).removeprefix("torch."),
              "compile": compile_mode, "torch": torch.__version__, "transformers": transformers.__version__,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "warmup": args.warmup,
              "repeats": args.repeats, "rows": rows, "logits": agreements,
              "ok": all(a["ok"] for a in agreements)}
    text = markdown(result)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "generate.md").write_text(text)
        (out / "generate.json").write_text(json.dumps(result, indent=2))
    if not result["ok"]:
        note(f"moeblaze's logits disagree with {REFERENCE}'s beyond the tolerance: see the logits table")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
