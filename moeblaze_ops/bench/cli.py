"""``python -m moeblaze_ops.bench``: moeblaze against its peers, side by side, in one run.

Peers: HF transformers' experts backends ``eager`` (a loop over experts), ``grouped_mm``
and ``grouped_mm`` under ``torch.compile``; moeblaze eager and compiled. Forward mode times
the experts' forward (bf16, SwiGLU, uniform routing) and measures its peak memory above the
inputs; train mode times forward + backward and measures the activation memory kept for
backward (the unique storages autograd saves, parameters and the layer input excluded) and
the peak memory of one step, from no gradients and adding into the gradients of the step
before (gradient accumulation, "peak GB, accumulating"). ``--tokens T ...`` runs each config
at those token counts in place of its own T (a row each); ``--tilt X`` adds ``X * linspace(1, 0, E)`` to the router
logits (expert 0 busiest), ``--hot X`` adds X to expert 0's logit alone (one hot expert), and
``--empty N`` leaves the last N experts without tokens (their logits -inf; a config with
fewer than K other experts is a usage error): they combine, the same routing for every peer.
Each row gives its T, its routing's tilt, hot and empty, its time per token and its
routing's load imbalance (the busiest expert's routed rows over the mean).
``--variant`` times another layer in forward and train modes: ``bias`` (random biases
``b_gate_up`` and ``b_down``, the same x, weights and routing) or ``clamped`` (GPT-OSS's clamped
SwiGLU, interleaved, with those biases), both measured on moeblaze's peers alone (HF's and
SonicMoE compute plain SwiGLU), or ``fp16`` (every peer in float16 in place of bf16; CUDA only).
A dispatch micro-benchmark compares moeblaze's dispatch with the sort + histc + cumsum that
``grouped_mm`` runs. ``--cudagraphs`` adds ``grouped_mm`` and moeblaze compiled with
``mode="reduce-overhead"`` (time only), and times the dispatch calls replayed from CUDA
graphs too (device time, without the host's launches). ``--settle SECONDS`` steps each peer
(and each dispatch call) back to back for SECONDS before timing it, so that the timing runs
at the clocks a training loop settles at (the GPU's power limit), not the higher ones of a
cool GPU: without it a 40 ms step is timed over some 250 ms, mostly before the clocks settle
(bench.json records it as ``settle_s``). Writes bench.md (tables), bench.json and
forward.png (bar charts, with matplotlib) under ``--out``.

``--peer-site DIR`` (repeatable) adds DIR as a site directory (its ``.pth`` files
processed) before the peers are imported: where a peer's wheels were installed with
``pip install --target DIR`` (SonicMoE's CuTe DSL is found through a ``.pth`` file).

``--set NAME=VALUE`` (repeatable) runs every measurement with that field of
``moeblaze_ops.settings.KernelSettings`` changed; VALUE is a Python literal (``None``,
``512``, ``False``) or else a string. A NAME the settings do not have, or a VALUE they
reject, is a usage error (exit code 2) that says which fields there are; so is a name
``--configs`` or ``--skip`` does not know. ``--device cpu --configs smoke`` is a quick
check of the benchmark itself (fp32, no peak memory, no dispatch micro-benchmark).

``--mode decode`` times the experts' forward at inference token counts (``--tokens``, 1 to
4096 by default) for the decode shapes (``--configs mixtral_decode qwen3_a3b_decode``), each
beside the floor of the bytes its routing must read, at ``--nominal-tbps`` and at the read
bandwidth measured in the same run (``--bandwidth-mb``): moeblaze compiled with CUDA graphs,
moeblaze eager captured into CUDA graphs, and compiled ``grouped_mm`` with CUDA graphs,
rotating over copies of the weights so that L2 holds none of what a call reads. Writes
decode.md, decode.json and decode.png under ``--out`` (``moeblaze_ops.bench.decode``);
``--device cpu --configs smoke_decode`` checks it in seconds.

``python -m moeblaze_ops.bench.expert_parallel`` (under torchrun, or ``--spawn N --device
cpu``) measures expert parallelism against one device.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import site
import time
from pathlib import Path

import torch

from .. import settings
from . import decode
from .configs import CONFIGS, DECODE_SHAPES, DECODE_TOKENS, VARIANTS, check_empty
from .console import note
from .implementations import PEER_NAMES
from .measure import BenchContext, bench_dispatch, bench_forward, bench_train
from .report import dispatch_table, forward_table, layer, plot, routing, title, train_table

__all__ = ["add_peer_sites", "finite_float", "main", "non_negative_float", "non_negative_int", "parse_setting",
           "positive_int", "setting_changes"]


def parse_setting(text):
    """``NAME=VALUE`` -> (NAME, VALUE), VALUE read as a Python literal or else kept as a string;
    an argparse type, so a malformed item is a usage error (the names are checked by the
    settings themselves: ``setting_changes``)."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        value = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        value = raw.strip()
    return name, value


def _parser():
    p = argparse.ArgumentParser(prog="python -m moeblaze_ops.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["forward", "train", "decode"], default="forward",
                   help="forward: the experts' forward; train: forward + backward, activation and peak memory; "
                        "decode: the forward at inference token counts against its memory floor")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--set", dest="settings", metavar="NAME=VALUE", action="append", type=parse_setting, default=[],
                   help="change a kernel setting for the whole run (repeatable), e.g. --set column_slab=None")
    # None: the mode's own default (every config; decode: DEFAULT_SHAPES); checked against
    # the mode in _check_names.
    p.add_argument("--configs", nargs="*", default=None, choices=[*CONFIGS, *DECODE_SHAPES],
                   help="layer shapes to measure (none: the dispatch micro-benchmark alone); decode mode takes "
                        f"{', '.join(DECODE_SHAPES)} (default {' '.join(decode.DEFAULT_SHAPES)})")
    # None: the mode's own default (each config's T; decode: DECODE_TOKENS), filled in by _check_names.
    p.add_argument("--tokens", nargs="+", type=positive_int, default=None, metavar="T",
                   help="token counts: forward and train modes run each config at each, in place of its own T "
                        "(default: the config's T); decode mode measures each (default: "
                        f"{' '.join(map(str, DECODE_TOKENS))})")
    p.add_argument("--tilt", type=finite_float, default=0.0, metavar="X",
                   help="forward and train modes: imbalanced routing, X * linspace(1, 0, E) added to the router "
                        "logits (expert 0 busiest; default: 0, uniform)")
    p.add_argument("--hot", type=finite_float, default=0.0, metavar="X",
                   help="forward and train modes: X added to expert 0's router logit for every token (4: one hot "
                        "expert in nearly every token's top-K; default: 0)")
    p.add_argument("--empty", type=non_negative_int, default=0, metavar="N",
                   help="forward and train modes: the last N experts get no tokens (their router logits -inf; at "
                        "most E - K of a config's E experts; default: 0)")
    p.add_argument("--settle", type=non_negative_float, default=0.0, metavar="SECONDS",
                   help="forward and train modes: step each peer back to back for SECONDS before timing it, so "
                        "the timing runs at the clocks of a GPU at its power limit, as in a training loop "
                        "(e.g. 10; default: 0, timed after a 50 ms warm-up)")
    p.add_argument("--variant", choices=VARIANTS, default="none",
                   help="forward and train modes: the layer measured; none: SwiGLU without biases (bf16 on CUDA); "
                        "bias: with random biases b_gate_up and b_down; clamped: GPT-OSS's clamped SwiGLU, "
                        "interleaved, with those biases (bias and clamped: moeblaze's peers alone, the others "
                        "compute plain SwiGLU); fp16: float16 in place of bf16 (CUDA only; default: none)")
    p.add_argument("--skip", nargs="*", default=[], choices=list(dict.fromkeys(PEER_NAMES + decode.DECODE_PEER_NAMES)),
                   metavar="PEER", help=f"peers to leave out, of: {', '.join(PEER_NAMES)}; in decode mode, of: "
                                        f"{', '.join(decode.DECODE_PEER_NAMES)}")
    p.add_argument("--no-dispatch", action="store_true", help="skip the dispatch micro-benchmark")
    p.add_argument("--cudagraphs", action="store_true",
                   help="add grouped_mm and moeblaze compiled with mode='reduce-overhead' (CUDA graphs; "
                        "time only: their memory is the graphs' pool), and dispatch timed from CUDA graphs")
    p.add_argument("--peer-site", metavar="DIR", action="append", default=[],
                   help="a site directory holding peers' packages, e.g. one that pip --target installed "
                        "SonicMoE into (repeatable)")
    p.add_argument("--out", default="bench_out")
    g = p.add_argument_group("decode mode")
    g.add_argument("--nominal-tbps", type=float, default=3.35,
                   help="the card's nominal memory bandwidth in TB/s, for the nominal floor (default: %(default)s, "
                        "H100 SXM)")
    g.add_argument("--bandwidth-mb", type=float, default=None,
                   help="MB of the buffer whose sum() measures the read bandwidth (default: 4096 on CUDA, 64 on CPU)")
    g.add_argument("--calls", type=positive_int, default=200, help="timed calls per repeat (default: %(default)s)")
    g.add_argument("--repeats", type=positive_int, default=5,
                   help="repeats of the timed calls; the median is reported (default: %(default)s)")
    g.add_argument("--layers-per-graph", type=positive_int, default=8,
                   help="layers each CUDA graph peer's graph runs, the draws in turn, as a model step's graph does; "
                        "a layer's time is the graph's over its layers (default: %(default)s)")
    return p


def _argument_type(name, convert, holds, requirement, doc):
    """An argparse type called ``name`` (argparse names it in its errors): ``convert(text)``,
    refused with "must be ``requirement``" unless ``holds`` of it."""
    def parse(text):
        value = convert(text)
        if not holds(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {value}")
        return value

    parse.__name__ = parse.__qualname__ = name
    parse.__doc__ = doc
    return parse


positive_int = _argument_type("positive_int", int, lambda v: v >= 1, "at least 1",
                              "An argparse type: an integer of at least 1.")
non_negative_int = _argument_type("non_negative_int", int, lambda v: v >= 0, "at least 0",
                                  "An argparse type: an integer of at least 0.")
finite_float = _argument_type("finite_float", float, math.isfinite, "finite",
                              "An argparse type: a float that is neither infinite nor NaN.")
non_negative_float = _argument_type("non_negative_float", float, lambda v: math.isfinite(v) and v >= 0,
                                    "finite and at least 0", "An argparse type: a finite float of at least 0.")


def _check_names(parser, args):
    """Fills in the mode's default ``--configs`` and ``--tokens`` (a token count given twice
    counts once: its rows would be one case's) and makes a shape or peer another mode
    measures a usage error: decode shapes and peers are decode mode's alone."""
    decoding = args.mode == "decode"
    if args.configs is None:
        args.configs = list(decode.DEFAULT_SHAPES if decoding else CONFIGS)
    if args.tokens is not None:
        args.tokens = list(dict.fromkeys(args.tokens))
    elif decoding:
        args.tokens = list(DECODE_TOKENS)
    shapes = DECODE_SHAPES if decoding else CONFIGS
    wrong = [name for name in args.configs if name not in shapes]
    if wrong:
        parser.error(f"--configs: {', '.join(wrong)} not measured in {args.mode} mode, which takes: "
                     f"{', '.join(shapes)}")
    peer_names = decode.DECODE_PEER_NAMES if decoding else PEER_NAMES
    wrong = [name for name in args.skip if name not in peer_names]
    if wrong:
        parser.error(f"--skip: {', '.join(wrong)} not a peer of {args.mode} mode, whose peers are: "
                     f"{', '.join(peer_names)}")


def check_empty_configs(parser, configs, empty):
    """Makes ``--empty`` a usage error of ``parser``, before anything is measured, where one
    of ``configs`` has fewer than K experts left for a token's K distinct choices
    (``check_empty``, ``make_inputs``' own check, names the numbers; the error names the
    config too)."""
    for name in configs:
        _, _, _, E, K = CONFIGS[name]
        try:
            check_empty(E, K, empty)
        except ValueError as e:
            parser.error(f"--empty {empty}: config {name} (E={E}, K={K}): {e}")


def setting_changes(parser, items):
    """``{NAME: VALUE}`` of the ``--set`` items (``parse_setting``'s pairs; a later one wins),
    checked by ``KernelSettings`` itself: a name it does not have or a value it rejects is
    ``parser``'s usage error, with the settings' own message (which lists the fields)."""
    changes = dict(items)
    try:
        settings.current().replace(**changes)
    except (ValueError, TypeError) as e:
        parser.error(f"--set: {e}")
    return changes


def _jsonable(value):
    """JSON form of a setting value json cannot write itself (sets, tiles)."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return repr(value)


def _versions():
    """Versions of the peers' libraries that are importable."""
    found = {}
    for name in ("transformers", "triton"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            pass
    return found


def _measure(args, ctx, changes):
    """Runs the measurements (under the settings in force) -> (bench.json's dict, bench.md's lines)."""
    device_name = torch.cuda.get_device_name() if ctx.on_cuda else "CPU"
    result = dict(device=device_name, torch=torch.__version__, mode=args.mode, settings=changes, tilt=args.tilt,
                  hot=args.hot, empty=args.empty, tokens=args.tokens, variant=args.variant, settle_s=args.settle,
                  **_versions())
    heading = routing(args.tilt, args.hot, args.empty)
    text = [title(args.mode, device_name, torch.__version__, changes)]
    if not args.no_dispatch:
        if ctx.on_cuda:
            result["dispatch"] = bench_dispatch(ctx)
            text += ["", "## dispatch", "", dispatch_table(result["dispatch"])]
            print("\n".join(text[-3:]), flush=True)
        else:
            note(f"bench: dispatch micro-benchmark left out on {ctx.device} (it times CUDA kernels)")
    # The variants with biases or another activation: moeblaze's peers alone (``peers``).
    others_left_out = args.variant in ("bias", "clamped") and args.configs
    left_out = (f"--variant {args.variant}: HF's peers and SonicMoE compute plain SwiGLU without biases, "
                f"so only moeblaze's peers are measured")
    if others_left_out:
        note(f"bench: {left_out}")
    if args.mode == "forward":
        result["forward"] = bench_forward(ctx, args.configs)
        dtype = "bf16" if ctx.on_cuda else "fp32"  # make_inputs' default dtype
        text += ["", f"## forward ({layer(args.variant, dtype)}, {heading})", ""]
        text += [left_out, ""] if others_left_out else []
        text += [forward_table(result["forward"])]
    else:
        result["train"] = bench_train(ctx, args.configs)
        text += ["", f"## forward + backward ({layer(args.variant)}, {heading})", ""]
        text += [left_out, ""] if others_left_out else []
        text += [train_table(result["train"])]
    return result, text


def add_peer_sites(parser, directories):
    """Adds each of ``directories`` (``--peer-site``) as a site directory, reading its
    ``.pth`` files; a missing one is ``parser``'s error."""
    for directory in directories:
        if not Path(directory).is_dir():
            parser.error(f"--peer-site: no directory {directory!r}")
        site.addsitedir(directory)


def _run_decode(args, changes):
    """Decode mode (``moeblaze_ops.bench.decode``) under the ``--set`` settings: writes
    decode.json, decode.md and decode.png under ``--out`` and prints the table."""
    opts = decode.DecodeOptions(shapes=tuple(args.configs), tokens=tuple(args.tokens), device=args.device,
                                nominal_tbps=args.nominal_tbps, bandwidth_mb=args.bandwidth_mb, calls=args.calls,
                                repeats=args.repeats, skip=frozenset(args.skip),
                                layers_per_graph=args.layers_per_graph)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    # The settings as bench.json writes them (sets and tiles made JSON), for decode.json.
    record = dict(torch=torch.__version__, settings=json.loads(json.dumps(changes, default=_jsonable)), **_versions())
    with settings.override(**changes):
        _, text = decode.run_decode(opts, out, record)
    print("\n".join(text), flush=True)
    print(f"\n({time.time() - t0:.0f} s)")


def main(argv=None):
    """Runs the benchmark with command-line arguments ``argv`` (``sys.argv[1:]`` by default)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: --device cpu runs the smoke check")
    changes = setting_changes(parser, args.settings)
    add_peer_sites(parser, args.peer_site)
    if args.cudagraphs and args.device != "cuda":
        parser.error("--cudagraphs needs --device cuda")
    _check_names(parser, args)
    if args.mode == "decode":
        if args.cudagraphs:
            parser.error("--cudagraphs is for forward and train modes: decode mode replays CUDA graphs on CUDA anyway")
        for flag in ("tilt", "hot", "empty"):
            if getattr(args, flag):
                parser.error(f"--{flag} is for forward and train modes: decode mode draws uniform routing")
        if args.variant != "none":
            parser.error(f"--variant {args.variant} is for forward and train modes: decode mode measures the "
                         f"plain SwiGLU layer")
        if args.settle:
            parser.error("--settle is for forward and train modes: decode mode times its own repeats")
        return _run_decode(args, changes)
    if args.variant == "fp16" and args.device != "cuda":
        parser.error("--variant fp16 needs --device cuda: on the CPU the benchmark computes in fp32, not the bf16 "
                     "that fp16 replaces, so there is no CPU layer for it to change")
    check_empty_configs(parser, args.configs, args.empty)
    ctx = BenchContext(device=args.device, skip=frozenset(args.skip), cuda_graphs=args.cudagraphs, tilt=args.tilt,
                       hot=args.hot, empty=args.empty, tokens=tuple(args.tokens) if args.tokens else None,
                       variant=args.variant, settle_s=args.settle)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    # The override also tags torch.compile's caches with the settings (settings.override),
    # so compiled peers never load a graph compiled under other settings.
    with settings.override(**changes):
        result, text = _measure(args, ctx, changes)
    (out / "bench.json").write_text(json.dumps(result, indent=1, default=_jsonable))
    (out / "bench.md").write_text("\n".join(text) + "\n")
    if args.mode == "forward" and result["forward"]:  # `--configs` alone: the dispatch rows only
        if not plot(result["forward"], out / "forward.png"):
            note("bench: forward.png not written (matplotlib is not importable)")
    print("\n".join(text), flush=True)
    print(f"\n({time.time() - t0:.0f} s)")
