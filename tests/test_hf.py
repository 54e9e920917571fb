"""The transformers experts backend on tiny models built from configs (no downloads), and
its registration whatever the order in which moeblaze_ops and transformers are imported."""

import importlib
import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
import moeblaze_ops  # noqa: E402
import moeblaze_ops.hf  # noqa: E402  (registers experts_implementation="moeblaze")
from moeblaze_ops.testing import rel_err  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from moeblaze_ops.hf import FAMILIES, model_config  # noqa: E402

LAYERS, VOCAB = 2, 96


def tiny_model(family, seed, num_layers=LAYERS, **extra):
    config = model_config(family, hidden_size=32, num_layers=num_layers, num_experts=4, top_k=2,
                          expert_intermediate_size=24, vocab_size=VOCAB, max_positions=64, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # from_config leaves some weights at zero (biases, norms): give every parameter a value.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def router_logits_flag(family):
    """output_router_logits=True (the aux loss) where this transformers computes it: 5.17's
    GraniteMoE fails in its own aux-loss code with every backend, eager included."""
    if family == "granitemoe":
        from packaging.version import Version

        return Version(transformers.__version__) >= Version("5.24")
    return True


def loss_and_grads(model, ids, run=None):
    """Loss and parameter gradients of ``model``, running it through ``run`` (e.g. compiled)."""
    model.zero_grad()
    torch.manual_seed(0)  # PhiMoE's training-mode router samples: the same draws for every backend
    out = (model if run is None else run)(ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("family", list(FAMILIES))
def test_matches_eager_backend(family, seed):
    model = tiny_model(family, seed, output_router_logits=router_logits_flag(family))
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))
    model.set_experts_implementation("eager")
    ref, ref_grads = loss_and_grads(model, ids)
    model.set_experts_implementation("moeblaze")
    assert moeblaze_ops.hf.check_model(model) == LAYERS
    out, grads = loss_and_grads(model, ids)
    assert rel_err(out.logits, ref.logits) <= 1e-5, f"seed={seed}"
    assert rel_err(out.loss, ref.loss) <= 1e-5
    if getattr(ref, "aux_loss", None) is not None:  # the router's load-balancing loss
        assert rel_err(out.aux_loss, ref.aux_loss) <= 1e-5
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert rel_err(grads[name], ref_grads[name]) <= 1e-5, f"grad {name} seed={seed}"
    # The router's gradient comes through topk_weights (grad_topk_weights of expert_down).
    router = [n for n in grads if n.endswith("mlp.gate.weight") or ".router." in n]
    assert len(router) >= LAYERS, sorted(grads)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_recompute_backend_matches_eager(family, seed):
    """experts_implementation="moeblaze_recompute": the same logits and gradients."""
    model = tiny_model(family, seed)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))
    model.set_experts_implementation("eager")
    ref, ref_grads = loss_and_grads(model, ids)
    model.set_experts_implementation(moeblaze_ops.hf.RECOMPUTE_BACKEND)
    assert moeblaze_ops.hf.check_model(model) == LAYERS
    out, grads = loss_and_grads(model, ids)
    assert rel_err(out.logits, ref.logits) <= 1e-5, f"seed={seed}"
    for name in ref_grads:
        assert rel_err(grads[name], ref_grads[name]) <= 1e-5, f"grad {name} seed={seed}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_train_step(family, seed):
    """torch.compile(fullgraph=True) of a whole train step: no graph break in any family,
    the eager loss and gradients. One decoder layer: the layers are alike, and compile time
    grows with their number."""
    model = tiny_model(family, seed, num_layers=1, output_router_logits=router_logits_flag(family))
    model.set_experts_implementation("moeblaze")
    if family == "phimoe":
        model.eval()  # its training-mode router samples, and compiled code draws other random numbers
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))
    eager, eager_grads = loss_and_grads(model, ids)  # also installs transformers' output hooks
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: any graph break raises
    out, grads = loss_and_grads(model, ids, run=compiled)
    assert rel_err(out.loss, eager.loss) <= 1e-5
    for name in eager_grads:
        assert rel_err(grads[name], eager_grads[name]) <= 1e-5, f"grad {name}"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
    after = compiled(ids, labels=ids).loss
    assert torch.isfinite(after) and not torch.equal(after, out.loss)


def test_selection_paths(seed):
    """Built with moeblaze, the check counts its experts; switched to another implementation,
    the check raises naming the modules that left moeblaze; switched back, it counts again."""
    config = model_config("qwen3_moe", hidden_size=32, num_layers=LAYERS, num_experts=4)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="moeblaze")
    assert model.config._experts_implementation == "moeblaze"
    assert moeblaze_ops.hf.check_model(model) == LAYERS
    model.set_experts_implementation("grouped_mm")
    with pytest.raises(moeblaze_ops.hf.ExpertsNotOnMoeblazeError) as error:
        moeblaze_ops.hf.check_model(model)
    assert error.value.modules == {f"model.layers.{i}.mlp.experts": "grouped_mm" for i in range(LAYERS)}
    model.set_experts_implementation(moeblaze_ops.hf.RECOMPUTE_BACKEND)
    assert moeblaze_ops.hf.check_model(model) == LAYERS


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
def test_experts_on_another_implementation_are_an_error(impl):
    """A model whose experts run another implementation fails the check (a ValueError)
    naming each such module and the implementation it kept: a check that passes means
    moeblaze runs the experts."""
    config = model_config("qwen3_moe", hidden_size=32, num_layers=LAYERS, num_experts=4)
    model = AutoModelForCausalLM.from_config(config, experts_implementation=impl)
    with pytest.raises(ValueError, match=rf"model\.layers\.0\.mlp\.experts \('{impl}'\)") as error:
        moeblaze_ops.hf.check_model(model)
    assert "model.layers.1.mlp.experts" in str(error.value)
    assert isinstance(error.value, moeblaze_ops.hf.ExpertsNotOnMoeblazeError)


def test_model_without_experts_is_an_error():
    """Nothing for moeblaze to run (a dense model) fails the check too."""
    config = AutoConfig.for_model("llama", hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=4, vocab_size=VOCAB, intermediate_size=48)
    with pytest.raises(moeblaze_ops.hf.ExpertsNotOnMoeblazeError, match="no experts module") as error:
        moeblaze_ops.hf.check_model(AutoModelForCausalLM.from_config(config))
    assert error.value.modules == {}


def test_sentinel_ids_contribute_nothing(seed):
    model = tiny_model("qwen3_moe", seed)
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(6, 32)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    w = torch.rand(6, 2)
    E = experts.num_experts
    with_sentinels = ids.clone()
    with_sentinels[::2, 1] = E  # owned by another rank
    got = moeblaze_ops.hf.moeblaze_experts_forward(experts, x, with_sentinels, w)
    zeroed = w.clone()
    zeroed[::2, 1] = 0
    want = moeblaze_ops.hf.moeblaze_experts_forward(experts, x, ids, zeroed)
    assert rel_err(got, want) <= 1e-6


def test_unsupported_activation_is_a_clear_error(seed):
    model = tiny_model("mixtral", seed, hidden_act="gelu_pytorch_tanh")
    model.set_experts_implementation("moeblaze")
    with pytest.raises(NotImplementedError, match="gelu_pytorch_tanh"):
        moeblaze_ops.hf.check_model(model)
    with pytest.raises(NotImplementedError, match="gelu_pytorch_tanh"):
        model(torch.randint(0, VOCAB, (1, 4)))


def test_llama4_is_a_clear_error():
    config = AutoConfig.for_model("llama4_text", hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                                  num_key_value_heads=4, vocab_size=VOCAB, intermediate_size=24,
                                  intermediate_size_mlp=48, num_local_experts=4, num_experts_per_tok=1, head_dim=8)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="moeblaze")
    with pytest.raises(NotImplementedError, match="Llama4TextExperts"):
        moeblaze_ops.hf.check_model(model)


def _run_fresh_python(code, timeout=300):
    """Runs ``code`` in a new interpreter (nothing imported yet); returns its stdout."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_import_does_not_import_transformers():
    """``import moeblaze_ops`` stays cheap: it leaves transformers unimported (it only
    installs the hook that registers the backends once transformers loads)."""
    out = _run_fresh_python("""
        import json, sys
        import moeblaze_ops
        print(json.dumps({
            "transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers"),
            "hf": "moeblaze_ops.hf" in sys.modules,
            "hook": any(getattr(f, "name", None) == "transformers.integrations.moe" for f in sys.meta_path),
        }))
    """)
    assert json.loads(out.splitlines()[-1]) == {"transformers": [], "hf": False, "hook": True}


def test_backend_registered_when_moeblaze_ops_is_imported_first(seed):
    """``import moeblaze_ops`` then ``import transformers``, and nothing imports
    moeblaze_ops.hf: experts_implementation="moeblaze" is accepted and runs the experts
    (the eager backend's logits), and the import hook is gone once it has fired."""
    out = _run_fresh_python(f"""
        import json, sys
        import moeblaze_ops
        import transformers
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model("qwen3_moe", hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=4, head_dim=8, vocab_size={VOCAB}, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=24, intermediate_size=48)
        torch.manual_seed({seed})
        model = AutoModelForCausalLM.from_config(config, experts_implementation="moeblaze")
        implementation = model.config._experts_implementation
        with torch.no_grad():  # from_config leaves some weights at zero: give every one a value
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        ids = torch.randint(0, {VOCAB}, (2, 9))
        calls = []
        from torch.utils._python_dispatch import TorchDispatchMode

        class CountMoeblazeCalls(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                calls.append(str(func.overloadpacket))
                return func(*args, **(kwargs or {{}}))

        with torch.no_grad():
            with CountMoeblazeCalls():
                got = model(ids).logits
            model.set_experts_implementation("eager")
            want = model(ids).logits
        from moeblaze_ops.testing import rel_err
        print(json.dumps({{
            "implementation": implementation,
            "expert_layer_calls": calls.count("moeblaze.expert_layer"),
            "rel_err": rel_err(got, want),
            "hook_left": any(getattr(f, "name", None) == "transformers.integrations.moe" for f in sys.meta_path),
        }}))
    """)
    result = json.loads(out.splitlines()[-1])
    assert result["implementation"] == "moeblaze"
    # The one MoE layer ran through moeblaze: without gradients, as its one-op layer.
    assert result["expert_layer_calls"] == 1, result
    assert result["rel_err"] <= 1e-5, f"{result} seed={seed}"
    assert not result["hook_left"]


@pytest.fixture
def probe_module(tmp_path, monkeypatch):
    """The name of a fresh importable module (``VALUE = 1``); unloaded afterwards, and any
    hook left on it removed."""
    name = f"moeblaze_hook_probe_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield name
    sys.modules.pop(name, None)
    sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "name", None) != name]


def _hooks_on(name):
    return [f for f in sys.meta_path if isinstance(f, moeblaze_ops.import_hooks.PostImportHook) and f.name == name]


def test_post_import_hook_fires_once_after_the_import(probe_module):
    seen = []
    callback = seen.append
    moeblaze_ops.import_hooks.when_imported(probe_module, callback)
    moeblaze_ops.import_hooks.when_imported(probe_module, callback)  # idempotent: one hook
    (hook,) = _hooks_on(probe_module)
    assert seen == []
    module = importlib.import_module(probe_module)
    assert seen == [module] and module.VALUE == 1  # after the module ran
    assert _hooks_on(probe_module) == []  # removed once done
    assert "exec_module" not in vars(module.__spec__.loader)  # the loader restored
    hook._fire(module)  # a second firing (another thread's) does nothing
    importlib.reload(module)
    assert seen == [module]


def test_post_import_hook_runs_at_once_for_an_imported_module(probe_module):
    module = importlib.import_module(probe_module)
    seen = []
    moeblaze_ops.import_hooks.when_imported(probe_module, seen.append)
    assert seen == [module] and _hooks_on(probe_module) == []


def test_post_import_hook_survives_a_failed_import(probe_module, tmp_path):
    """A module whose import raises does not fire the hook, which waits for the next try;
    a callback that raises warns instead of breaking the import."""
    path = tmp_path / f"{probe_module}.py"
    path.write_text("raise ImportError('not yet')\n")
    seen = []

    def callback(module):
        seen.append(module)
        raise RuntimeError("registration failed")

    moeblaze_ops.import_hooks.when_imported(probe_module, callback)
    with pytest.raises(ImportError, match="not yet"):
        importlib.import_module(probe_module)
    assert seen == [] and len(_hooks_on(probe_module)) == 1
    path.write_text("VALUE = 2\n")
    importlib.invalidate_caches()
    sys.modules.pop(probe_module, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(probe_module)
    assert module.VALUE == 2 and seen == [module]
    assert any("registration failed" in str(w.message) for w in caught)
    assert _hooks_on(probe_module) == []
