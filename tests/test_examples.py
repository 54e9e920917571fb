"""The examples run, report small errors and reject bad flags; README's quick start and
the code blocks of its "Use" section run as written.

The examples are called in-process through their ``main(argv)`` (quick); one subprocess
per script checks the command line a user types (exit code 2 for a bad flag).

A README code block that cannot run here (it needs a CUDA GPU or a download) is marked by
an HTML comment on the line right above it, ``<!-- not run: needs cuda -->`` or
``<!-- not run: needs download -->``; every other ``python`` block of "Use" runs, in
order, in one namespace (later blocks may use the tensors of earlier ones).
"""

import argparse
import functools
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SKIP_MARK = re.compile(r"<!--\s*not run:\s*needs (cuda|download)\s*-->")


@functools.cache
def example(name):
    """The module examples/<name>.py, imported once."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def argparse_error(capsys, main, argv):
    """Runs ``main(argv)``, which must stop with argparse's usage error; returns its message."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def help_text(capsys, main):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # unwrapped


def check_help(parser):
    """Every flag has a help string, and --help shows its default."""
    assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
    formatter = parser._get_formatter()
    flags = {}
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, action.option_strings
        assert "%(default)" in formatter._get_help_string(action), action.option_strings
        flags[action.option_strings[0]] = action.help
    return flags


def section(title):
    """The text of README's ``## title`` section."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def code_blocks(text, lang):
    """``(code, skip_reason or None)`` of every ```lang block of ``text``."""
    blocks = []
    for m in re.finditer(rf"(?:^([^\n]*)\n)?```{lang}\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        mark = SKIP_MARK.search(m.group(1) or "")
        blocks.append((m.group(2), f"needs {mark.group(1)}" if mark else None))
    return blocks


# --- examples/ops_direct.py ---------------------------------------------------------------

def test_ops_direct_example(capsys):
    errors = example("ops_direct").main(["--tokens", "64", "--hidden", "32", "--intermediate", "48",
                                         "--experts", "4", "--topk", "2"])
    assert list(errors) == ["out", "grad x", "grad topk_weights", "grad w_gate_up", "grad w_down"]
    assert all(v < 1e-5 for v in errors.values()), errors
    printed = capsys.readouterr().out
    assert "relative error vs float64 loop: out " in printed and "grad w_down" in printed


def test_ops_direct_help_and_errors(capsys):
    mod = example("ops_direct")
    main = mod.main
    flags = check_help(mod.build_parser())
    assert set(flags) == {"--tokens", "--hidden", "--intermediate", "--experts", "--topk", "--device", "--dtype",
                          "--seed"}
    assert "cuda" in flags["--device"]
    assert "(default: 4096)" in help_text(capsys, main)
    assert "--topk (9) must be at most --experts (8)" in argparse_error(capsys, main, ["--topk", "9"])
    assert "at least 1" in argparse_error(capsys, main, ["--tokens", "0"])


def test_ops_direct_script_runs():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ops_direct.py"), "--tokens", "32", "--hidden", "16",
         "--intermediate", "16", "--experts", "4"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "relative error vs float64 loop" in proc.stdout


# --- examples/finetune_hf_moe.py ----------------------------------------------------------

def test_finetune_example_compares_backends(capsys):
    results = example("finetune_hf_moe").main(["--steps", "8", "--warmup", "2",
                                               "--experts-implementation", "moeblaze", "eager"])
    printed = capsys.readouterr().out
    finals = dict(re.findall(r"^(\w+): final loss ([0-9.]+), [0-9,]+ tokens/s, peak memory n/a \(CPU\)$",
                             printed, re.MULTILINE))
    assert finals.keys() == results.keys() == {"moeblaze", "eager"}, printed
    # Same start, same batches: the two backends' curves agree to float32 rounding.
    assert abs(float(finals["moeblaze"]) - float(finals["eager"])) < 1e-3, printed
    for losses, tokens_per_s, _ in results.values():
        assert len(losses) == 8 and tokens_per_s > 0


def test_finetune_one_step_without_warmup(capsys):
    results = example("finetune_hf_moe").main(["--steps", "1", "--warmup", "0"])
    (losses, tokens_per_s, _), = results.values()
    assert len(losses) == 1 and tokens_per_s > 0  # not nan
    assert "nan" not in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["--steps", "5", "--warmup", "5"], "--warmup (5) must be less than --steps (5)"),
    (["--warmup", "-1"], "argument --warmup: must be at least 0"),
    (["--experts-implementation", "moeblaze", "nope"], "argument --experts-implementation: invalid choice: 'nope'"),
    (["--device", "nonsense"], "argument --device: 'nonsense' is not a torch device"),
    (["--compile", "fast"], "argument --compile: invalid choice: 'fast'"),
])
def test_finetune_rejects_bad_flags(capsys, argv, message):
    assert message in argparse_error(capsys, example("finetune_hf_moe").main, argv)


@pytest.mark.parametrize("argv,mode", [([], None), (["--compile"], "default"),
                                       (["--compile", "reduce-overhead", "--steps", "4"], "reduce-overhead")])
def test_finetune_compile_flag_takes_a_mode(argv, mode):
    assert example("finetune_hf_moe").parse_args(argv).compile == mode


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_finetune_rejects_cuda_without_gpu(capsys):
    err = argparse_error(capsys, example("finetune_hf_moe").main, ["--device", "cuda"])
    assert "no CUDA GPU" in err


def test_finetune_backends_are_transformers_experts_backends(capsys):
    from transformers.integrations.moe import ExpertsInterface

    mod = example("finetune_hf_moe")
    offered = set(ExpertsInterface().keys())
    backends = mod.experts_backends()
    assert set(backends) == offered | {"eager"}
    assert {"eager", "grouped_mm", "moeblaze", "moeblaze_recompute"} <= set(backends)
    # The list is read at run time: a backend registered later is offered too.
    ExpertsInterface.register("test_examples_dummy", ExpertsInterface._global_mapping["grouped_mm"])
    try:
        assert "test_examples_dummy" in mod.experts_backends()
    finally:
        del ExpertsInterface._global_mapping["test_examples_dummy"]
    err = argparse_error(capsys, mod.main, ["--experts-implementation", "nope"])
    assert all(repr(b) in err for b in backends), err


def test_finetune_help_shows_defaults_and_documents_every_flag(capsys):
    mod = example("finetune_hf_moe")
    flags = check_help(mod.build_parser())
    assert len(flags) == 12, flags
    device = flags["--device"]
    assert all(word in device for word in ["cpu", "cuda", "cuda:N", "peak"]), device
    text = help_text(capsys, mod.main)
    assert "(default: 60)" in text and "(default: ['moeblaze'])" in text


def test_finetune_script_exit_code():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "finetune_hf_moe.py"), "--steps", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "--steps" in proc.stderr


# --- README ---------------------------------------------------------------------------------

def test_readme_quick_start_compares_with_grouped_mm(capsys):
    commands = [line for code, _ in code_blocks(section("Quick start"), "bash") for line in code.splitlines()
                if line.startswith("python examples/finetune_hf_moe.py")]
    assert len(commands) == 1, commands
    argv = shlex.split(commands[0])[2:]
    mod = example("finetune_hf_moe")
    args = mod.parse_args(argv)
    assert args.device == "cpu" and {"moeblaze", "grouped_mm"} <= set(args.experts_implementation)
    # The command as written, cut to a few steps (later flags win), runs on CPU.
    results = mod.main(argv + ["--steps", "3", "--warmup", "1"])
    assert set(results) == set(args.experts_implementation)
    printed = capsys.readouterr().out
    assert "grouped_mm: final loss" in printed and "n/a (CPU)" in printed
    quick = " ".join(section("Quick start").split())
    for said in ["final loss", "tokens/s", "peak GPU memory", "`n/a (CPU)`"]:
        assert said in quick


def test_readme_states_test_time_gpu_tests_and_torch_pin():
    quick = " ".join(section("Quick start").split())
    # the measured first run of the test command
    assert re.search(r"2-core CPU machine, from a fresh clone in a new virtual environment, the test command took "
                     r"\d+ min \d+ s", quick)
    assert "`-m gpu`" in quick and "skip without a CUDA GPU" in quick
    assert "any torch >= 2.11 works" in quick and "CUDA build of torch" in quick
    assert "DESIGN.md" not in README.read_text()


def test_readme_use_blocks_run():
    blocks = code_blocks(section("Use"), "python")
    to_run = [code for code, skip in blocks if skip is None]
    assert len(to_run) >= 3, blocks
    namespace = {"__name__": "__readme__"}
    torch.manual_seed(0)
    for code in to_run:
        exec(compile(code, str(README), "exec"), namespace)
    out = namespace["out"]
    assert out.shape == namespace["x"].shape and torch.isfinite(out).all()
    assert namespace["x"].grad is not None and namespace["w_gate_up"].grad is not None


def test_readme_skip_marks_are_recognised():
    text = "<!-- not run: needs cuda -->\n```python\nx.cuda()\n```\n\n```python\nprint(1)\n```\n"
    assert code_blocks(text, "python") == [("x.cuda()\n", "needs cuda"), ("print(1)\n", None)]

