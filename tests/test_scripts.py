"""The tools in scripts/ run on CPU: tile sweeps, host time, kernel-by-kernel profiles,
sustained steps and the GPU machine's one-call script (their GPU numbers come from the GPU
machine)."""

import math

import pytest

from moeblaze_ops.bench import CONFIGS, make_inputs

#: ``make_inputs``' routing arguments at their defaults: uniform routing.
UNIFORM = dict(tilt=0.0, hot=0.0, empty=0)


def _script(name):
    """``scripts/<name>.py`` as a module."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tile_sweep_runs_on_cpu(capsys):
    """scripts/tune.py: a row per kind and tile beside the default's; a kind the settings do
    not know is a usage error naming it."""
    tune = _script("tune")
    tune.main(["--device", "cpu", "--configs", "smoke", "--kinds", "up", "dh", "--tiles", "16,16,16,4,1",
               "--rounds", "1"])
    out = capsys.readouterr().out
    for kind in ("up", "dh"):
        assert f"| {kind} | default | " in out and f"| {kind} | 16,16,16,4,1 | " in out, out
    with pytest.raises(SystemExit):
        tune.main(["--device", "cpu", "--kinds", "no_such_kind"])
    assert "no_such_kind" in capsys.readouterr().err


def test_host_overhead_and_profile_step_run_on_cpu(capsys):
    host, device, wall = _script("host_overhead").main(["--device", "cpu", "--config", "smoke", "--steps", "2",
                                                        "--repeats", "2"])
    assert host > 0 and wall > 0 and math.isnan(device)
    assert capsys.readouterr().out.startswith(f"host ms per step {host:.3f} (min of 2 repeats of 2 steps), "
                                              f"wall ms per step unprofiled {wall:.3f}")
    _script("profile_step").main(["--device", "cpu", "--configs", "smoke", "--peers", "moeblaze", "--steps", "1",
                                  "--rows", "3"])
    assert "## smoke moeblaze: host ms per step" in capsys.readouterr().out
    _script("profile_step").main(["--device", "cpu", "--decode", "3", "--decode-configs", "smoke_decode",
                                  "--decode-peers", "moeblaze_graph", "--layers", "2", "--steps", "1", "--rows", "3"])
    printed = capsys.readouterr().out
    assert "## smoke_decode T=3 moeblaze_graph (2 layers a step): host ms per step" in printed
    assert "moeblaze::expert_layer" in printed  # the profiled stack ran the layer


def test_sustained_step_runs_on_cpu(capsys):
    """scripts/sustained_step.py: a row per phase, in the order of ``--tokens``, the peers in
    turn ``--rounds`` times, each phase with at least one step and its time per token from
    its median step; nothing sampled on the CPU; a non-positive ``--seconds`` and a peer
    not available here are errors."""
    script = _script("sustained_step")
    rows = script.main(["--device", "cpu", "--configs", "smoke", "--tokens", "16", "40", "--seconds", "0.05",
                        "--peers", "moeblaze", "hf_grouped_mm", "--rounds", "2"])
    peers = ["moeblaze", "hf_grouped_mm"] * 2
    assert [(r["T"], r["peer"], r["round"]) for r in rows] == (
        [(16, p, 1 + i // 2) for i, p in enumerate(peers)] + [(40, p, 1 + i // 2) for i, p in enumerate(peers)])
    for r in rows:
        assert r["steps"] >= 1 and r["settled"] is None
        assert r["us_per_token"] == pytest.approx(r["median_ms"] * 1e3 / r["T"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("| config | T | peer | round | steps |") and len(printed) == 2 + len(rows)
    assert printed[-1].startswith("| smoke | 40 | hf_grouped_mm | 2 | ") and printed[-1].endswith("| - | - | - |")
    with pytest.raises(SystemExit) as exit_:
        script.main(["--device", "cpu", "--configs", "smoke", "--seconds", "0"])
    assert exit_.value.code == 2
    with pytest.raises(SystemExit, match="not available here: moeblaze_cudagraphs"):
        script.main(["--device", "cpu", "--configs", "smoke", "--seconds", "0.05", "--peers", "moeblaze_cudagraphs"])


def test_sustained_step_averages_the_settled_samples():
    """The clock, power and temperature of a phase: the means of the last three quarters
    of nvidia-smi's samples, unreadable ones left out."""
    script = _script("sustained_step")
    lines = ["1980, 300.5, 40", "[N/A], 310, 41", "1500, 650, 55", "1400, 700, 60", "1300, 690, 62"]
    # Four readable samples: the first quarter (one) dropped, the other three averaged.
    assert script.settled_means(lines) == pytest.approx([(1500 + 1400 + 1300) / 3, (650 + 700 + 690) / 3,
                                                         (55 + 60 + 62) / 3])
    assert script.settled_means(["[N/A], [N/A], [N/A]"]) is None


def test_profile_step_takes_the_benchmarks_routing(capsys, monkeypatch):
    """scripts/profile_step.py --tilt/--hot/--empty: the layer drawn with them, its label
    naming them; too many empty experts for a config is a usage error before anything runs."""
    script = _script("profile_step")
    seen = []

    def make_inputs_spy(*args, **kwargs):
        inputs = make_inputs(*args, **kwargs)
        seen.append(({key: kwargs.get(key, default) for key, default in UNIFORM.items()}, inputs[1]))
        return inputs

    monkeypatch.setattr(script, "make_inputs", make_inputs_spy)
    T, d, I, E, K = CONFIGS["smoke"]
    common = ["--device", "cpu", "--configs", "smoke", "--peers", "moeblaze", "--steps", "1", "--rows", "3"]
    script.main([*common, "--tilt", "1", "--hot", "4", "--empty", "2"])
    assert f"## smoke T={T} tilt=1 hot=4 empty=2 moeblaze: host ms per step" in capsys.readouterr().out
    (routing, ids), = seen
    assert routing == dict(tilt=1.0, hot=4.0, empty=2) and int(ids.max()) < E - 2
    with pytest.raises(SystemExit) as exit_:
        script.main([*common, "--empty", str(E - K + 1)])
    assert exit_.value.code == 2 and "config smoke " in capsys.readouterr().err
    assert len(seen) == 1


def test_gpu_check_parses_and_skips_only_peer_names():
    """scripts/gpu_check.sh is valid bash, and the peers its benchmark leaves out are peer
    names (the benchmark refuses others), all but moeblaze eager and compiled."""
    import pathlib
    import re
    import subprocess

    from moeblaze_ops.bench.implementations import PEER_NAMES

    path = pathlib.Path(__file__).parents[1] / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    skipped = set(re.search(r'^SKIP_PEERS="(.*?)"', path.read_text(), re.M).group(1).split())
    assert skipped == set(PEER_NAMES) - {"moeblaze", "moeblaze_compiled", "hf_grouped_mm_cudagraphs",
                                         "moeblaze_cudagraphs"}
    # Each side's benchmark is given the names it knows: an older copy refuses new ones.
    known = subprocess.run(["bash", "-c", f'pypath() {{ echo "$PYTHONPATH"; }}; '
                            f'eval "$(sed -n "/^known_peers()/,/^}}/p" {path})"; known_peers new moeblaze no_such_peer'],
                           capture_output=True, text=True)
    assert known.stdout.split() == ["moeblaze"], known.stderr
