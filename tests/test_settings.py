"""``moeblaze_ops.settings``: the four user settings, their errors, the one environment
variable, overrides across threads."""

import os

import pytest

from moeblaze_ops import settings


def test_settings_override_reaches_other_threads():
    """Autograd runs the backward of CUDA ops on its own device threads: an override must be
    in force there too (per-thread settings left the backward kernels on the defaults)."""
    import threading

    def seen_from_another_thread():
        out = []
        thread = threading.Thread(target=lambda: out.append(settings.current().column_slab))
        thread.start()
        thread.join()
        return out[0]

    default = settings.current().column_slab
    with settings.override(column_slab=7):
        with settings.override(column_slab=9):
            assert seen_from_another_thread() == 9
        assert seen_from_another_thread() == 7
    assert seen_from_another_thread() == default


# --------------------------------------------------------------------------- settings: errors a user meets


@pytest.mark.parametrize("name,bad,shown,allowed", [
    ("column_slab", "abc", "'abc'", "None or a positive int"), ("column_slab", 0, "0", "None or a positive int"),
    ("column_slab", 512.0, "512.0", "None or a positive int"), ("column_slab", True, "True", "None or a positive int"),
    ("poison", 1, "1", "True or False"), ("backend", "cuda", "'cuda'", "'auto', 'triton', 'torch'"),
    ("tiles", {"up": "big"}, "'big'", "must be a GemmTile"), ("tiles", {"upp": (64, 64, 32, 4, 3)}, "'upp'", "known:"),
    ("tiles", [("up", (64, 64, 32, 4, 3))], "[('up'", "mapping of GEMM kind to GemmTile"),
    ("tiles", {"up": (64, 64, 32, 4, 0)}, "(64, 64, 32, 4, 0)", "num_stages must be a positive int"),
])
def test_settings_refuse_bad_values_by_name(name, bad, shown, allowed):
    """A setting of the wrong type or value is refused when the settings are made, by a
    ValueError naming the setting, the value and what is allowed, rather than a TypeError
    from deep inside a kernel launch (``column_slab="abc"`` used to compare a str with an
    int in the combine)."""
    for make in (lambda: settings.KernelSettings(**{name: bad}), lambda: settings.override(**{name: bad}).__enter__()):
        with pytest.raises(ValueError) as error:
            make()
        message = str(error.value)
        assert name in message and shown in message and allowed in message, message


def test_settings_take_tiles_as_tuples():
    """A tile given as the tuple of its fields is kept as a ``GemmTile``; the user's dict is
    copied, so changing it later changes no settings."""
    from moeblaze_ops.kernels.config import GemmTile

    tiles = {"up": (64, 64, 32, 4, 3)}
    made = settings.KernelSettings(tiles=tiles)
    tiles["down"] = GemmTile(64, 64, 32, 4, 3)
    assert made.tiles == {"up": GemmTile(64, 64, 32, 4, 3)}


@pytest.mark.parametrize("name", sorted(settings.REMOVED))
def test_removed_settings_are_refused_by_name(name):
    """A setting that was removed (its alternative never won, or it became a rule of
    ``kernels.config``) is refused by a ValueError that says it was removed, what took its
    place and which settings there are: by ``override``, ``replace`` and the constructor."""
    for make in (lambda: settings.override(**{name: 1}).__enter__(),
                 lambda: settings.current().replace(**{name: 1}),
                 lambda: settings.KernelSettings(**{name: 1})):
        with pytest.raises(ValueError) as error:
            make()
        message = str(error.value)
        assert f"'{name}' was removed" in message and settings.REMOVED[name] in message, message
        assert "backend, poison, tiles, column_slab" in message, message


def test_unknown_settings_are_refused_by_name():
    """A name that was never a setting is refused with the settings there are."""
    with pytest.raises(ValueError, match=r"no setting named 'colum_slab'; the settings are: backend, poison"):
        settings.KernelSettings(colum_slab=256)
    with pytest.raises(ValueError, match="no setting named 'colum_slab'"):
        settings.override(colum_slab=256).__enter__()


def test_settings_have_few_fields():
    """The settings are the user's choices only (every other choice is a rule of
    ``kernels.config``), each documented in ``KernelSettings``' docstring."""
    import dataclasses

    names = [f.name for f in dataclasses.fields(settings.KernelSettings)]
    assert names == ["backend", "poison", "tiles", "column_slab"]
    assert all(f"{name}:" in settings.KernelSettings.__doc__ for name in names)


def _python(script, **env):
    """Runs ``script`` in a fresh interpreter with the environment changed by ``env`` (a
    None value removes the variable); returns the finished process."""
    import subprocess
    import sys
    import textwrap

    environ = dict(os.environ)
    for key, value in env.items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=environ, capture_output=True,
                          text=True, timeout=300)


def test_backend_environment_variable_is_checked_on_first_use():
    """``MOEBLAZE_BACKEND`` is read when the settings are first needed, not at import, and a
    value that is no backend fails there with a ValueError naming it and the allowed ones;
    "triton" and "torch" are taken as they are."""
    run = _python("""
        import moeblaze_ops  # no settings read yet
        from moeblaze_ops import settings
        try:
            settings.current()
        except ValueError as error:
            print("refused:", error)
    """, MOEBLAZE_BACKEND="bogus")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "refused:" in run.stdout and "'bogus'" in run.stdout, run.stdout
    assert all(f"'{name}'" in run.stdout for name in ("auto", "triton", "torch")), run.stdout
    for name in ("torch", "triton"):
        run = _python("from moeblaze_ops import settings; print(settings.current().backend)", MOEBLAZE_BACKEND=name)
        assert run.returncode == 0 and run.stdout.split() == [name], run.stderr[-2000:]


def test_triton_backend_on_cpu_tensors_outside_the_interpreter():
    """``backend="triton"`` with CPU tensors and no ``TRITON_INTERPRET=1``: a clear error
    naming the two ways on (the interpreter, or the "torch" / "auto" backends), not
    Triton's own "0 active drivers" from inside a launch."""
    pytest.importorskip("triton")
    run = _python("""
        import torch, moeblaze_ops
        from moeblaze_ops import settings
        from moeblaze_ops.kernels import TritonDeviceError
        with settings.override(backend="triton"):
            try:
                moeblaze_ops.dispatch(torch.tensor([[0, 1], [1, 2]]), 3)
            except TritonDeviceError as error:
                print("refused:", error)
    """, TRITON_INTERPRET=None, MOEBLAZE_BACKEND=None)
    assert run.returncode == 0, run.stderr[-2000:]
    message = run.stdout
    for needle in ("refused:", "TRITON_INTERPRET=1", 'backend="torch"', '"auto"', "cpu"):
        assert needle in message, (needle, message)
