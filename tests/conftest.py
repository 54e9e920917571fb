"""pytest setup: Triton's interpreter on CPU machines, the per-test ``seed`` fixture, and the
shared helpers (from ``moeblaze_ops.testing``) under the names the test files import.

Seeds are fixed: each test's seed is a stable hash of its node id and a base seed, 0 by
default. ``MOEBLAZE_TEST_SEED=<int>`` picks another base; ``MOEBLAZE_TEST_SEED=random``
draws one per run. A failing test's report names its seed and the base that reproduces it.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # CPU machines run the Triton kernels in Triton's interpreter (tests/test_triton_interpret.py).
    # Set before any kernel module is imported: @triton.jit reads it then.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton.language as tl  # noqa: E402

import moeblaze_ops  # noqa: E402,F401  (registers the ops)
from moeblaze_ops.testing import (  # noqa: E402,F401  (re-exported: tests import them from conftest)
    SEED_ENV,
    base_seed,
    make_layer,
    make_topk_ids,
    rel_err,
    seed_for,
)


#: What Triton's interpreter patches while it runs a kernel: the language's module and the
#: tensor classes. A device function it calls outside a kernel's own patch scope (a jit
#: function of another module than the kernel's) patches ``triton.language.core`` again
#: and never undoes it (triton 3.9), so in a process that has interpreted kernels, a
#: kernel compiled afterwards (the Gluon compile tests) would meet the interpreter's
#: builtins. Their attributes, as imported, before any kernel ran.
_LANGUAGE_OBJECTS = (tl.core, tl.tensor, tl.core.tensor_descriptor_base)
_LANGUAGE_STATE = [dict(vars(obj)) for obj in _LANGUAGE_OBJECTS]


def restore_triton_language():
    """Undoes whatever the interpreter left patched in ``_LANGUAGE_OBJECTS``."""
    for obj, state in zip(_LANGUAGE_OBJECTS, _LANGUAGE_STATE):
        for name, value in list(vars(obj).items()):
            if name not in state:
                delattr(obj, name)
            elif state[name] is not value:
                setattr(obj, name, state[name])


def pytest_configure(config):
    # Pin a random base in the environment, so that the processes this run starts
    # (pytest-xdist workers, subprocess tests) derive their seeds from the same base.
    config.moeblaze_seed_setting = os.environ.get(SEED_ENV)
    if (config.moeblaze_seed_setting or "").strip() == "random":
        os.environ[SEED_ENV] = str(base_seed())


def pytest_report_header(config):
    setting = getattr(config, "moeblaze_seed_setting", None)
    return f"moeblaze test seeds: base {base_seed()} ({SEED_ENV} {'unset' if setting is None else repr(setting)})"


@pytest.fixture
def seed(request):
    """This test's seed: fixed per test node id (see the module docstring)."""
    return seed_for(request.node.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attaches the seed to a failing test's report, with the command that reruns it."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append((
            "moeblaze seed",
            f"test seed {seed_for(item.nodeid)}, base {base_seed()}: rerun with "
            f"{SEED_ENV}={base_seed()} python -m pytest '{item.nodeid}'",
        ))
