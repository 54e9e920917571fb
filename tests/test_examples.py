"""The examples run and report small errors."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ops_direct_example():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ops_direct.py"), "--tokens", "64", "--hidden", "32",
         "--intermediate", "48", "--experts", "4", "--topk", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    errors = re.findall(r"(out|grad \w+) ([0-9.e+-]+)", proc.stdout.split("relative error")[1])
    assert [name for name, _ in errors] == ["out", "grad x", "grad topk_weights", "grad w_gate_up", "grad w_down"]
    assert all(float(v) < 1e-5 for _, v in errors), proc.stdout


def test_finetune_example_compares_backends():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "finetune_hf_moe.py"), "--steps", "8", "--warmup", "2",
         "--experts-implementation", "moeblaze", "eager"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    finals = dict(re.findall(r"^(\w+): final loss ([0-9.]+)", proc.stdout, re.MULTILINE))
    assert finals.keys() == {"moeblaze", "eager"}, proc.stdout
    # Same start, same batches: the two backends' curves agree to float32 rounding.
    assert abs(float(finals["moeblaze"]) - float(finals["eager"])) < 1e-3, proc.stdout
