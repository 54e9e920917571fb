"""What a new user hits first: second backwards, help(), errors under torch.compile, raw
ops fed arrays that are not a dispatch result, sentinels with non-finite weights, limits,
torch.func and double backward."""

import os
import pydoc
import traceback

import pytest
import torch

import moeblaze_ops
from moeblaze_ops import moe_experts, settings
from moeblaze_ops.testing import make_layer, reference_moe, rel_err

GRADS = ("x", "topk_weights", "w_gate_up", "w_down", "b_gate_up", "b_down")
OPS = ("dispatch", "expert_up", "expert_down", "expert_up_backward", "expert_down_backward",
       "expert_down_backward_", "expert_down_backward_recompute", "expert_layer")


def _grads(layer, out, grad_out, retain):
    names = [k for k in GRADS if layer[k] is not None]
    return torch.autograd.grad(out, [layer[k] for k in names], grad_out, retain_graph=retain)


# --------------------------------------------------------------------------- second backward


@pytest.mark.parametrize("mode", [{}, {"overwrite_h": False}, {"recompute": True}], ids=["default", "kept_apart",
                                                                                        "recompute"])
def test_second_backward_through_the_same_graph(mode, seed):
    """retain_graph: a second (and third) backward gives the first one's gradients bit for
    bit in every mode, also the default one that writes dH over the kept h."""
    layer = make_layer(30, 16, 8, 4, 2, seed=seed, bias=True, requires_grad=True, sentinel_frac=0.1)
    out = moe_experts(**layer, **mode)
    g = torch.randn_like(out)
    first = _grads(layer, out, g, retain=True)
    second = _grads(layer, out, g, retain=True)
    third = _grads(layer, out, g, retain=False)
    ref = _grads(layer, reference_moe(**{k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v)
                                         for k, v in layer.items()}), g.double(), retain=False)
    for a, b, c, r in zip(first, second, third, ref):
        assert torch.equal(a, b) and torch.equal(a, c), f"seed={seed}"
        assert rel_err(a, r) < 1e-5, f"seed={seed}"


@pytest.mark.parametrize("backend", ["moeblaze", "moeblaze_recompute"])
def test_hf_backend_second_backward(backend, seed):
    """The HF backends under retain_graph=True: both backwards give eager's gradients."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    import moeblaze_ops.hf

    torch.manual_seed(seed)
    cfg = moeblaze_ops.hf.model_config("qwen3_moe", num_layers=1)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    grads = {}
    for impl in ("eager", backend):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, experts_implementation=impl)
        loss = model(input_ids=ids, labels=ids).loss
        params = [p for p in model.parameters() if p.requires_grad]
        first = torch.autograd.grad(loss, params, retain_graph=True)
        second = torch.autograd.grad(loss, params)
        assert all(torch.equal(a, b) for a, b in zip(first, second)), impl
        grads[impl] = first
    for a, b in zip(grads["eager"], grads[backend]):
        assert rel_err(b, a) < 1e-4


# --------------------------------------------------------------------------- help()


@pytest.mark.parametrize("name", OPS)
def test_help_shows_the_ops_documentation(name):
    """help() of the package's op objects and of torch.ops.moeblaze.* shows the op's own
    schema and docstring, not the CustomOpDef/OpOverloadPacket class documentation."""
    packet = getattr(torch.ops.moeblaze, name)
    for obj in (packet, getattr(moeblaze_ops, name, None)):
        if obj is None:
            continue
        text = pydoc.render_doc(obj, renderer=pydoc.plaintext)
        assert f"moeblaze::{name}(" in text
        first_doc_line = packet.__doc__.split("\n\n", 1)[1].splitlines()[0]
        assert len(first_doc_line) > 20 and first_doc_line in text
        assert "Methods defined here" not in text  # the class help


# --------------------------------------------------------------------------- errors under torch.compile


def _exception_lines(error):
    """The exception lines of a printed traceback, in the order a user reads them."""
    lines = "".join(traceback.format_exception(error)).splitlines()
    return [line for line in lines if line and not line.startswith((" ", "Traceback", "The above", "During"))]


@pytest.mark.slow
def test_compiled_front_door_error_shows_the_message_first(seed):
    """A bad input under torch.compile(fullgraph=True): the first exception a printed
    traceback shows carries moe_experts' own message (Dynamo chains it as the cause)."""
    layer = make_layer(8, 16, 8, 4, 2, seed=seed)
    bad = {**layer, "topk_weights": layer["topk_weights"][:, :1]}
    with pytest.raises(ValueError) as eager:
        moe_experts(**bad)
    torch._dynamo.reset()
    with pytest.raises(Exception) as compiled:
        torch.compile(moe_experts, fullgraph=True)(**bad)
    assert str(eager.value) in _exception_lines(compiled.value)[0]


@pytest.mark.slow
def test_compiled_raw_op_error_carries_the_message():
    """A raw op's bad argument under torch.compile: torch 2.13's Dynamo reports fake-function
    errors as TorchRuntimeError, with the op's own message in its explanation."""
    ids = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError) as eager:
        torch.ops.moeblaze.dispatch(ids, 0)
    torch._dynamo.reset()
    with pytest.raises(Exception) as compiled:
        torch.compile(lambda t: torch.ops.moeblaze.dispatch(t, 0), fullgraph=True)(ids)
    assert str(eager.value) in str(compiled.value)


# --------------------------------------------------------------------------- raw ops and their index arrays


def _raw_args(seed, L=10, K=2, E=4):
    layer = make_layer(L, 8, 4, E, K, seed=seed)
    eti, offsets, tim = moeblaze_ops.dispatch(layer["topk_ids"], E)
    h = torch.ops.moeblaze.expert_up(layer["x"], layer["w_gate_up"], eti, offsets, tim)
    return layer, h, eti, offsets, tim


def test_topk_weights_transposed_is_refused(seed):
    layer, h, eti, offsets, tim = _raw_args(seed)
    with pytest.raises(ValueError, match="expert_token_indices.*token ids in \\[0, L = 2\\)"):
        torch.ops.moeblaze.expert_down(h, layer["w_down"], eti, offsets, tim, layer["topk_weights"].t().contiguous())


@pytest.mark.parametrize("defect,arg", [("decreasing_offsets", "expert_offsets"),
                                        ("offsets_past_rows", "expert_offsets"),
                                        ("token_out_of_range", "expert_token_indices"),
                                        ("negative_token", "expert_token_indices"),
                                        ("map_not_a_permutation", "token_index_map"),
                                        ("map_out_of_range", "token_index_map")])
@pytest.mark.parametrize("op", ["expert_up", "expert_down", "expert_down_backward"])
def test_index_arrays_that_are_not_a_dispatch_result(defect, arg, op, seed):
    """On the portable backend each op names the array whose values are wrong (instead of
    an IndexError or a silently wrong result)."""
    layer, h, eti, offsets, tim = _raw_args(seed)
    eti, offsets, tim = eti.clone(), offsets.clone(), tim.clone()
    if defect == "decreasing_offsets":
        offsets[2], offsets[3] = offsets[3], offsets[2] - 1
    elif defect == "offsets_past_rows":
        offsets[-1] = tim.numel() + 1
    elif defect == "token_out_of_range":
        eti[3] = layer["x"].shape[0]
    elif defect == "negative_token":
        eti[0] = -1
    elif defect == "map_not_a_permutation":
        tim[1] = tim[0]
    else:
        tim[0] = tim.numel()
    call = {
        "expert_up": lambda: torch.ops.moeblaze.expert_up(layer["x"], layer["w_gate_up"], eti, offsets, tim),
        "expert_down": lambda: torch.ops.moeblaze.expert_down(h, layer["w_down"], eti, offsets, tim,
                                                              layer["topk_weights"]),
        "expert_down_backward": lambda: torch.ops.moeblaze.expert_down_backward(
            torch.randn_like(layer["x"]), h, layer["w_down"], eti, offsets, tim, layer["topk_weights"], None,
            "swiglu", False, False, 1.702, 7.0),
    }[op]
    with pytest.raises(ValueError, match=f"moeblaze.{op}: argument '{arg}'"):
        call()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("defect", ["decreasing_offsets", "token_out_of_range", "map_out_of_range", "none"])
def test_index_arrays_checked_by_the_triton_backend(defect, seed):
    """The Triton backend's device-side check (run here by the interpreter, where the
    assert raises at once): wrong arrays fail with the op's message, right ones pass."""
    layer, h, eti, offsets, tim = _raw_args(seed)
    eti, offsets, tim = eti.clone(), offsets.clone(), tim.clone()
    if defect == "decreasing_offsets":
        offsets[2], offsets[3] = offsets[3], offsets[2] - 1
    elif defect == "token_out_of_range":
        eti[-1] = layer["x"].shape[0]
    elif defect == "map_out_of_range":
        tim[-1] = -1
    with settings.override(backend="triton"):
        run = lambda: torch.ops.moeblaze.expert_down(h, layer["w_down"], eti, offsets, tim,  # noqa: E731
                                                     layer["topk_weights"])
        if defect == "none":
            assert rel_err(run(), reference_moe(**{k: (v.double() if torch.is_tensor(v) and v.is_floating_point()
                                                       else v) for k, v in layer.items()})) < 1e-5
        else:
            with pytest.raises(RuntimeError, match="moeblaze.expert_down: index arrays not from dispatch"):
                run()


@pytest.mark.parametrize("op", OPS)
def test_device_check_messages_fit_a_cuda_assert(op):
    """CUDA's torch._assert_async refuses messages of 255 characters or more."""
    from moeblaze_ops.checks import id_value_messages, index_values_message

    assert all(len(m) < 255 for m in (index_values_message(op), *id_value_messages(op)))


# --------------------------------------------------------------------------- sentinels


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("poison", [float("inf"), float("nan"), -float("inf")])
def test_sentinel_weights_contribute_nothing(backend, poison, seed):
    """A sentinel slot (id >= E) adds nothing to the output or any gradient whatever its
    router weight, inf and NaN included: the same bits as with weight 0 there, and a zero
    router gradient there."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    layer = make_layer(24, 16, 8, 4, 2, seed=seed, bias=True, sentinel_frac=0.3)
    sentinel = layer["topk_ids"] >= 4
    assert sentinel.any() and not sentinel.all()
    results = []
    for fill in (0.0, poison):
        inputs = {k: (v.detach().clone().requires_grad_(k in GRADS) if torch.is_tensor(v) and v.is_floating_point()
                      else v) for k, v in layer.items()}
        with torch.no_grad():
            inputs["topk_weights"][sentinel] = fill
        with settings.override(backend=backend):
            out = moe_experts(**inputs)
            grads = _grads(inputs, out, torch.ones_like(out), retain=False)
        results.append((out, grads))
    (out0, grads0), (out1, grads1) = results
    assert torch.isfinite(out1).all() and torch.equal(out0, out1)
    for name, a, b in zip(GRADS, grads0, grads1):
        assert torch.isfinite(b).all() and torch.equal(a, b), name
    assert (grads1[1][sentinel] == 0).all()


# --------------------------------------------------------------------------- limits and blame


def test_routed_rows_beyond_int32_are_refused():
    ids = torch.empty(2**29, 8, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="moeblaze.dispatch: argument 'topk_ids' routes 4294967296"):
        torch.ops.moeblaze.dispatch(ids, 8)


def test_too_many_experts_is_refused_before_allocating():
    with pytest.raises(ValueError, match="'num_experts' must be at most 65536, got 1000000000"):
        torch.ops.moeblaze.dispatch(torch.zeros(4, 2, dtype=torch.int64), 10**9)


def test_no_experts_blames_the_weights(seed):
    layer = make_layer(8, 16, 8, 4, 2, seed=seed)
    with pytest.raises(ValueError, match="moeblaze.moe_experts: argument 'w_gate_up' must hold between 1"):
        moe_experts(**{**layer, "w_gate_up": layer["w_gate_up"][:0], "w_down": layer["w_down"][:0]})


@pytest.mark.parametrize("odd_one", ["x", "topk_ids", "topk_weights", "w_down"])
def test_a_tensor_on_another_device_is_the_one_named(odd_one, seed):
    layer = make_layer(8, 16, 8, 4, 2, seed=seed)
    layer[odd_one] = layer[odd_one].to("meta")
    with pytest.raises(ValueError, match=f"argument '{odd_one}' must be on device cpu, got meta"):
        moe_experts(**layer)


# --------------------------------------------------------------------------- torch.func, double backward


def test_torch_func_transforms_are_refused_clearly(seed):
    layer = make_layer(8, 16, 8, 4, 2, seed=seed)
    message = "does not support torch.func transforms"
    with pytest.raises(NotImplementedError, match=message):
        torch.func.grad(lambda x: moe_experts(**{**layer, "x": x}).sum())(layer["x"])
    with pytest.raises(NotImplementedError, match=message):
        torch.vmap(lambda x: moe_experts(**{**layer, "x": x}))(layer["x"][None].expand(2, -1, -1))


@pytest.mark.parametrize("mode", [{}, {"overwrite_h": False}, {"recompute": True}])
def test_double_backward_is_refused_clearly(mode, seed):
    layer = make_layer(8, 16, 8, 4, 2, seed=seed, dtype=torch.float64, requires_grad=True)
    out = moe_experts(**layer, **mode)
    (grad_x,) = torch.autograd.grad(out.square().sum(), layer["x"], create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        grad_x.sum().backward()


@pytest.mark.parametrize("op", ["expert_up_backward", "expert_down_backward"])
def test_backward_ops_refuse_their_own_differentiation(op, seed):
    """A backward op called directly on tensors that require grad: differentiating its
    outputs raises, rather than returning a gradient no formula computed."""
    layer = make_layer(8, 16, 8, 4, 2, seed=seed, dtype=torch.float64)
    ops = torch.ops.moeblaze
    eti, offsets, tim = ops.dispatch(layer["topk_ids"], 4)
    x, w_gate_up, w_down = layer["x"], layer["w_gate_up"], layer["w_down"]
    h = ops.expert_up(x, w_gate_up, eti, offsets, tim)
    if op == "expert_up_backward":
        grad = torch.randn_like(h).requires_grad_(True)
        outputs = ops.expert_up_backward(grad, x, w_gate_up, eti, offsets, tim, False, False)
    else:
        grad = torch.randn_like(x).requires_grad_(True)
        outputs = ops.expert_down_backward(grad, h, w_down, eti, offsets, tim, layer["topk_weights"], None,
                                           "swiglu", False, False, 1.702, 7.0)
    with pytest.raises(NotImplementedError, match="double backward"):
        outputs[0].sum().backward()


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


# --------------------------------------------------------------------------- the kernel configuration's rules


def test_rule_small_gemms():
    """GEMMs of fewer than ``SMALL_GEMM_FLOP`` operations are small: they run the ``tl``
    kernel (every kind with a Gluon kernel runs it from that count on) and read their
    weights by pointer (up, dH, dX read them by TMA from that count on, down never)."""
    from moeblaze_ops.kernels import config

    limit = config.SMALL_GEMM_FLOP
    assert limit == 10**11
    assert config.is_small_gemm(limit - 1) and not config.is_small_gemm(limit)
    for kind in config.GEMM_KINDS:
        assert not config.runs_gluon(kind, limit - 1)
        assert config.runs_gluon(kind, limit) == (kind in config.GLUON_KINDS)
        assert not config.reads_weight_by_tma(kind, limit - 1)
        assert config.reads_weight_by_tma(kind, limit) == (kind in ("up", "dh", "dx"))
    assert "dh_wide" not in config.GLUON_KINDS


def test_rule_warp_specialization_and_mma_partitions():
    """The Gluon row GEMMs are warp-specialised from 1024 routed rows per expert on average;
    the weight gradient splits its MMA warpgroups for "wgrad_up" only."""
    from moeblaze_ops.kernels import config

    assert config.row_gemm_warp_specialized(1024 * 8, 8) and not config.row_gemm_warp_specialized(1024 * 8 - 1, 8)
    assert config.wgrad_split_mma("wgrad_up") and not config.wgrad_split_mma("wgrad_down")
    assert config.ROW_BAND == 4


def test_rule_activation_beside_h():
    """act(h) is written beside h in layers of at most 8192 intermediate columns and at
    least 2048 routed rows per expert; the rule's signature is what the lowerings call."""
    import inspect

    from moeblaze_ops.kernels import config

    assert list(inspect.signature(config.activation_beside_h).parameters) == ["columns", "rows", "experts"]
    assert config.activation_beside_h(8192, 2048 * 16, 16)
    assert not config.activation_beside_h(8193, 2048 * 16, 16)
    assert not config.activation_beside_h(8192, 2048 * 16 - 1, 16)


def test_rule_dh_epilogue_and_wide_tile():
    """The ``tl`` dH epilogue goes in slices of 64 columns (1, 2 or 4 a tile), and the
    "dh_wide" tile runs from 12288 intermediate columns."""
    from moeblaze_ops.kernels import config

    assert [config.dh_epilogue_slices(n) for n in (16, 64, 128, 256, 512)] == [1, 1, 2, 4, 4]
    assert config.dh_tile_kind(12287) == "dh" and config.dh_tile_kind(12288) == "dh_wide"


@pytest.mark.parametrize("rows,bins,family", [
    (0, 1, "one_program"), (4096, 256, "one_program"), (4097, 8, "one_hot"), (4097, 16, "sorted"),
    (10**6, 15, "one_hot"), (10**6, 256, "sorted")])
def test_rule_dispatch_family(rows, bins, family):
    """Routings of up to 4096 rows go to one program; larger ones are ranked by sorted
    chunks of 512 rows from 16 bins, by one-hot tiles below; one program never takes more
    than it can sort (``MAX_ONE_PROGRAM_ROWS``)."""
    from moeblaze_ops.kernels import config

    assert config.dispatch_family(rows, bins) == family
    assert config.DISPATCH_SORT_CHUNK == 512
    assert config.DISPATCH_ONE_PROGRAM_MAX_ROWS <= config.MAX_ONE_PROGRAM_ROWS == 8192


def test_tiles_are_pruned_by_shared_memory(monkeypatch):
    """The tile table's prune: a device with 64 KB of shared memory per block gets the first
    16-bit tile that fits, and autotuning's candidates are exactly the fitting tiles, once
    each (device traits stubbed: no GPU needed)."""
    from moeblaze_ops.kernels import config

    limit = 64 * 1024
    monkeypatch.setattr(config, "_device_traits", lambda index: ("any", limit))
    cuda = torch.device("cuda", 0)
    config._table_tile.cache_clear()  # picks cached for a real device (or for this stub, after)
    try:
        tile = config.pick_tile("up", torch.bfloat16, cuda)
    finally:
        config._table_tile.cache_clear()
    table = config.TILE_TABLE[("up", "16bit", "any")]
    assert tile == next(t for t in table if t.smem_bytes(2) <= limit)
    candidates = config.candidate_tiles(("up", "down", "dx"), torch.bfloat16, cuda)
    assert len(candidates) == len(set(candidates)) > 0
    assert all(t.smem_bytes(2) <= limit for t in candidates)
    every = {t for (kind, cls, _), tiles in config.TILE_TABLE.items()
             if kind in ("up", "down", "dx") and cls == "16bit" for t in tiles}
    assert set(candidates) == {t for t in every if t.smem_bytes(2) <= limit}


def test_dh_tile_by_layer_width(monkeypatch):
    """dH takes the "dh_wide" tile from ``config.DH_WIDE_MIN_COLUMNS`` intermediate columns
    and the "dh" tile below; an override of the "dh" tile alone applies at every width, one
    of "dh_wide" too above the threshold (an H200's traits stubbed: no GPU needed)."""
    from types import SimpleNamespace

    from moeblaze_ops.kernels import config
    from moeblaze_ops.kernels import triton_experts_backward as tb

    monkeypatch.setattr(config, "_device_traits", lambda index: ("sm90", 227 * 1024))
    h = SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cuda", 0))
    narrow, wide = (config.TILE_TABLE[(kind, "16bit", "sm90")][0] for kind in ("dh", "dh_wide"))
    assert narrow != wide
    tuned, tuned_wide = config.GemmTile(64, 64, 32, 4, 2), config.GemmTile(64, 128, 32, 4, 2)
    config._table_tile.cache_clear()
    try:
        wide_from = config.DH_WIDE_MIN_COLUMNS
        assert (tb.dh_tile(h, wide_from - 1), tb.dh_tile(h, wide_from)) == (narrow, wide)
        with settings.override(tiles={"dh": tuned}):
            assert (tb.dh_tile(h, wide_from - 1), tb.dh_tile(h, wide_from)) == (tuned, tuned)
        with settings.override(tiles={"dh": tuned, "dh_wide": tuned_wide}):
            assert (tb.dh_tile(h, wide_from - 1), tb.dh_tile(h, wide_from)) == (tuned, tuned_wide)
    finally:
        config._table_tile.cache_clear()


def test_dh_kernel_choice_sizes_the_router_partials(monkeypatch):
    """Where the Gluon dH module is given (``config.runs_gluon``) and applies (at any
    width), ``launch_dh`` hands it the operands and the "dh" tile override (else None: the
    kernel's own), and the router partials are sized by its columns per partial; where it
    does not apply or none is given, by the tl kernel's tile. The Gluon module is a
    stand-in that records its launch (no GPU)."""
    from types import SimpleNamespace

    from moeblaze_ops.kernels import config
    from moeblaze_ops.kernels import grouped_gemm as gg
    from moeblaze_ops.kernels import triton_experts_backward as tb

    launches = []
    fake = SimpleNamespace(PART_COLUMNS=64, applies=lambda *a: True,
                           launch_dh=lambda *args, **kwargs: launches.append((args, kwargs)))
    given = {"module": None}
    monkeypatch.setattr(gg, "gluon_kernels", lambda kind, t, flop: given["module"] if kind == "dh" else None)
    L, d, I, E, K = 6, 32, 320, 4, 2
    h = torch.randn(L * K, 2 * I)
    w_down = torch.randn(E, d, I)
    grad_out = torch.randn(L, d)
    operands = dict(act=0, transposed=False, interleaved=False, has_bias=False)

    def part_columns():
        return tb.dh_part_columns(tb.dh_gluon_module(grad_out, h, w_down, **operands), h, I)

    tl_columns = tb.dh_tile(h, I).block_n
    assert tl_columns != 64
    assert part_columns() == tl_columns
    given["module"] = fake
    assert part_columns() == 64
    monkeypatch.setattr(config, "DH_WIDE_MIN_COLUMNS", I)  # a wide layer: the Gluon kernel too
    assert part_columns() == 64
    tuned = config.GemmTile(128, 128, 64, 4, 5)
    gluon = tb.dh_gluon_module(grad_out, h, w_down, **operands)
    assert gluon is fake
    parts = torch.empty(L * K, gg.cdiv(I, 64))
    args = (gluon, grad_out, h, w_down, None, torch.rand(L, K), None, None, None, h, None, parts, None)
    for tiles in [{}, {"dh": tuned}]:
        with settings.override(tiles=tiles):
            tb.launch_dh(*args, act=0, transposed=False, interleaved=False, alpha=1.0, limit=7.0)
    fake.applies = lambda *a: False
    assert part_columns() == tl_columns
    assert [kwargs["tile"] for _, kwargs in launches] == [None, tuned]
    assert all(args[9] is parts and set(kwargs) == {"act", "transposed", "alpha", "limit", "tile"}
               for args, kwargs in launches)


@pytest.mark.parametrize("rows,offsets_32", [(1024, True), (2**28 + 1, False)], ids=["small", "past_int32"])
def test_gathered_copies_use_32_bit_offsets_only_where_they_fit(rows, offsets_32, monkeypatch):
    """The warp-specialised Gluon copies (the dH kernel's and the row GEMM's) gather A's
    rows with 32-bit element offsets only where A has fewer than 2^31 elements; past that,
    64-bit ones (a wrong choice would address other rows without a fault). Meta tensors
    stand in for an A that large; the launch is recorded, not run (no GPU)."""
    pytest.importorskip("triton.experimental.gluon")
    from moeblaze_ops.kernels import gluon_dh, gluon_row_gemm

    launches = []
    for module in (gluon_dh, gluon_row_gemm):
        monkeypatch.setattr(module, "launch", lambda kernel, grid, *args, **kwargs: launches.append(kwargs))
        monkeypatch.setattr(module, "host_descriptor", lambda t, block: object())
    # An H200's shared memory a block, which the dH launch sizes its ring of h from.
    from moeblaze_ops.kernels import config

    monkeypatch.setattr(config, "shared_memory_per_block", lambda device: 232448)
    d, I, E, K = 128, 64, 4, 2
    meta = dict(device="meta", dtype=torch.bfloat16)
    grad_out = torch.empty(rows, d, **meta)  # A of both GEMMs, [L, d]: 2^35 elements in the large case
    LK = 64
    h, w_down = torch.empty(LK, 2 * I, **meta), torch.empty(E, d, I, **meta)
    ids = torch.empty(LK, dtype=torch.int32, device="meta")
    parts = torch.empty(LK, I // gluon_dh.PART_COLUMNS, dtype=torch.float32, device="meta")
    gluon_dh.launch_dh(grad_out, h, w_down, ids, torch.empty(LK // K, K, device="meta"), ids, ids, h, None, parts,
                       act=0, transposed=False, alpha=1.0, limit=7.0)
    out = torch.empty(LK, 2 * I, **meta)
    gluon_row_gemm.launch_row_gemm(grad_out, ids, torch.empty(E, 2 * I, d, **meta), None, ids, out, False,
                                   warp_specialize=True)
    assert [kwargs["A_OFFSETS_32"] for kwargs in launches] == [offsets_32, offsets_32]
