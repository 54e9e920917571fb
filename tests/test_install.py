"""The package without Triton: Triton is a dependency only where it publishes wheels (an
environment marker in pyproject.toml), so ``import moeblaze_ops`` and the CPU path must
run with it absent, and choosing the Triton backend then raises a clear error.

The runs without Triton are fresh interpreters (subprocesses) whose first statement
installs an import blocker: a ``sys.meta_path`` finder that answers ``triton`` and every
``triton.*`` with ModuleNotFoundError, as an interpreter without Triton installed does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The first lines of every script: hides Triton from the interpreter, and records the
#: attempts to import it as (module, file of the import statement) in ``BLOCKED``; torch
#: itself tries (``torch.utils._triton.has_triton_package``) and copes. ``moeblaze_blocked()``:
#: the attempts made by moeblaze_ops code.
BLOCKER = textwrap.dedent("""
    import importlib.abc, os, sys

    BLOCKED = []

    class HideTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                frame = sys._getframe(1)
                while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
                    frame = frame.f_back  # the import machinery; the frame after it imports
                BLOCKED.append((name, frame.f_code.co_filename if frame is not None else "?"))
                raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
            return None

    def moeblaze_blocked():
        import moeblaze_ops
        package = os.path.dirname(os.path.abspath(moeblaze_ops.__file__)) + os.sep
        return [(name, file) for name, file in BLOCKED if os.path.abspath(file).startswith(package)]

    sys.meta_path.insert(0, HideTriton())
    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        del sys.modules[name]
""")


def run_without_triton(body: str) -> subprocess.CompletedProcess:
    """Runs ``body`` after ``BLOCKER`` in a fresh interpreter; returns the finished process."""
    env = dict(os.environ)
    for name in ("MOEBLAZE_BACKEND", "TRITON_INTERPRET"):
        env.pop(name, None)  # the defaults: backend "auto", no interpreter
    return subprocess.run([sys.executable, "-c", BLOCKER + textwrap.dedent(body)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def check_ran(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def test_blocker_hides_triton():
    """The blocker itself works: ``import triton`` fails under it (else the tests below
    would prove nothing)."""
    proc = run_without_triton("""
        try:
            import triton
        except ImportError:
            print("hidden")
        else:
            raise SystemExit("triton imported despite the blocker")
    """)
    check_ran(proc)
    assert "hidden" in proc.stdout


def test_cpu_path_without_triton():
    """``import moeblaze_ops``, ``dispatch`` and ``moe_experts`` forward and backward on CPU
    fp32 tensors, against the float64 reference, never touching Triton."""
    proc = run_without_triton("""
        import torch
        import moeblaze_ops
        from moeblaze_ops import settings
        from moeblaze_ops.testing import make_layer, reference_moe, rel_err

        assert settings.current().backend == "auto", settings.current()
        L, d, I, E, K = 24, 32, 16, 6, 2
        layer = make_layer(L, d, I, E, K, dtype=torch.float32, seed=1234, requires_grad=True)
        ids = layer["topk_ids"]

        eti, offsets, tim = moeblaze_ops.dispatch(ids.to(torch.int32), E)
        counts = torch.bincount(ids.flatten(), minlength=E)
        assert torch.equal(offsets.long(), torch.cat([counts.new_zeros(1), counts.cumsum(0)])), offsets

        out = moeblaze_ops.moe_experts(**layer)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        names = ["x", "topk_weights", "w_gate_up", "w_down"]
        grads = torch.autograd.grad(out, [layer[n] for n in names], grad_out)

        ref_inputs = {k: (v.detach().double().requires_grad_(True) if k in names else v)
                      for k, v in layer.items()}
        ref = reference_moe(**ref_inputs)
        ref_grads = torch.autograd.grad(ref, [ref_inputs[n] for n in names], grad_out.double())
        errors = {"out": rel_err(out, ref), **{n: rel_err(g, r) for n, g, r in zip(names, grads, ref_grads)}}
        print("rel errors", errors)
        assert all(e < 1e-5 for e in errors.values()), errors

        loaded = sys.modules.get("triton")
        assert loaded is None, f"triton was imported: {loaded!r}"
        assert not moeblaze_blocked(), f"moeblaze_ops tried to import triton on the CPU path: {moeblaze_blocked()}"
        print("ok")
    """)
    check_ran(proc)
    assert "ok" in proc.stdout


def test_hf_backend_without_triton():
    """The transformers experts backend on CPU, without Triton."""
    pytest.importorskip("transformers")
    proc = run_without_triton("""
        import torch
        import moeblaze_ops.hf
        from transformers import AutoModelForCausalLM

        config = moeblaze_ops.hf.model_config("qwen3_moe", num_layers=1)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, experts_implementation="moeblaze")
        assert moeblaze_ops.hf.check_model(model) > 0
        ids = torch.randint(0, config.vocab_size, (2, 8))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss), loss
        assert sys.modules.get("triton") is None, sys.modules.get("triton")
        assert not moeblaze_blocked(), moeblaze_blocked()
        print("ok")
    """)
    check_ran(proc)
    assert "ok" in proc.stdout


def test_triton_backend_without_triton_raises_clear_error():
    """``settings.override(backend="triton")`` then an op: an ImportError that names triton and
    the ways on (install it, or the torch backend), raised before any kernel module loads."""
    proc = run_without_triton("""
        import torch
        import moeblaze_ops
        from moeblaze_ops import settings

        ids = torch.tensor([[0, 1], [1, 2]], dtype=torch.int32)
        for call in ("dispatch", "moe_experts"):
            with settings.override(backend="triton"):
                try:
                    if call == "dispatch":
                        moeblaze_ops.dispatch(ids, 3)
                    else:
                        moeblaze_ops.moe_experts(torch.randn(2, 8), ids, torch.ones(2, 2),
                                                 torch.randn(3, 8, 8), torch.randn(3, 8, 4))
                except ImportError as error:
                    message = str(error)
                    print(call, type(error).__name__, message)
                    assert type(error) is not ModuleNotFoundError, "a bare ModuleNotFoundError"
                    for needle in ("triton", "pip install triton", "MOEBLAZE_BACKEND=torch", 'backend="torch"'):
                        assert needle in message, (needle, message)
                else:
                    raise SystemExit(f"{call} under backend='triton' ran without triton")
        # Nothing half-imported is left behind, and the torch backend still runs.
        assert not [m for m in sys.modules if m.startswith("moeblaze_ops.kernels.triton")]
        with settings.override(backend="torch"):
            moeblaze_ops.dispatch(ids, 3)
        print("ok")
    """)
    check_ran(proc)
    assert "ok" in proc.stdout


def _triton_requirement():
    requirements = pytest.importorskip("packaging.requirements")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [requirements.Requirement(r) for r in project["dependencies"]]
    found = [r for r in found if r.name == "triton"]
    assert len(found) == 1, project["dependencies"]
    return found[0]


def test_triton_requirement_has_marker():
    """pyproject.toml: triton only where it has wheels (Linux x86_64 and aarch64)."""
    req = _triton_requirement()
    assert req.marker is not None, f"triton is required on every platform: {req}"
    assert req.specifier.contains("3.6.0"), req

    def env(system, machine):
        sys_platform = {"Linux": "linux", "Darwin": "darwin", "Windows": "win32"}[system]
        return dict(platform_system=system, platform_machine=machine, sys_platform=sys_platform,
                    os_name="nt" if system == "Windows" else "posix")

    assert req.marker.evaluate(env("Linux", "x86_64"))
    assert req.marker.evaluate(env("Linux", "aarch64"))
    for system, machine in [("Darwin", "arm64"), ("Darwin", "x86_64"), ("Windows", "AMD64"), ("Windows", "ARM64"),
                            ("Linux", "ppc64le")]:
        assert not req.marker.evaluate(env(system, machine)), (system, machine, str(req.marker))
