"""HF ``generate`` with the moeblaze experts backend: greedy decoding of a tiny Qwen3-MoE gives
the tokens and logits of transformers' own ``eager`` experts, with the default (dynamic) cache,
with a static cache, and with the decode steps compiled (``torch.compile(fullgraph=True)``,
``aot_eager``: Inductor on CPU takes too long for this file; the GPU benchmark,
``python -m moeblaze_ops.bench.generate --device cuda``, compiles with Inductor and CUDA graphs).
Also the benchmark's own smoke run on CPU."""

import json
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")
import moeblaze_ops.hf  # noqa: E402  (registers experts_implementation="moeblaze")
from moeblaze_ops.testing import rel_err  # noqa: E402
from transformers import AutoModelForCausalLM, CompileConfig, Qwen3MoeForCausalLM  # noqa: E402

LAYERS, VOCAB, NEW_TOKENS = 2, 128, 8
PAD = 0


@pytest.fixture(scope="module")
def model():
    """A tiny Qwen3-MoE (fp32, 8 experts, top-2) with random weights from a fixed seed.

    Module-scoped: building it is the slow part, and each test selects its experts backend
    before generating (``generate``), so the tests do not depend on each other's choice."""
    config = moeblaze_ops.hf.model_config("qwen3_moe", hidden_size=64, num_layers=LAYERS, num_heads=4, num_experts=8,
                                          top_k=2, expert_intermediate_size=32, vocab_size=VOCAB, max_positions=64,
                                          pad_token_id=PAD)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, experts_implementation="eager").eval()
    assert isinstance(model, Qwen3MoeForCausalLM)
    # from_config leaves the norms at one and its weights small (std 0.02): noise on every
    # parameter spreads the router's scores and the logits, so that a wrong expert or a wrong
    # weight changes the greedy tokens instead of hiding under near-ties.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    # A random model has no EOS: every run generates exactly NEW_TOKENS tokens.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model


@pytest.fixture(scope="module")
def prompt():
    """Two prompts of 7 tokens, the second left-padded by 2 (the batch layout of ``generate``):
    (input_ids, attention_mask)."""
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(99))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = PAD, 0
    return ids, mask


def generate(model, prompt, impl, **kwargs):
    """Greedy ``generate`` of NEW_TOKENS tokens with experts backend ``impl``; returns
    (new tokens [B, NEW_TOKENS], per-step raw logits [NEW_TOKENS, B, vocab])."""
    model.set_experts_implementation(impl)
    ids, mask = prompt
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, return_dict_in_generate=True, output_logits=True, **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits)


class CountMoeblazeCalls(TorchDispatchMode):
    """Counts the calls of ``torch.ops.moeblaze`` ops under it, by op name: the proof that the
    experts ran through moeblaze and not through another backend that gives the same numbers."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "moeblaze":
            name = func.overloadpacket.__name__
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def eager_reference(model, prompt):
    """Tokens and logits of transformers' ``eager`` experts (its per-expert loop), the
    reference of every test here."""
    return generate(model, prompt, "eager")


def assert_same_generation(got, want):
    """The same tokens, and every step's logits equal to fp32 rounding (relative error < 1e-5)."""
    tokens, logits = got
    want_tokens, want_logits = want
    assert torch.equal(tokens, want_tokens), (tokens, want_tokens)
    # Identical tokens make every step's input identical, so every step's logits compare.
    for step in range(NEW_TOKENS):
        assert rel_err(logits[step], want_logits[step]) < 1e-5, f"step {step}"


def test_reference_is_not_degenerate(eager_reference):
    """The reference generation has several different tokens per row, so that equal tokens
    mean something (a model that repeats one token would agree with almost anything)."""
    tokens, logits = eager_reference
    assert tokens.shape == (2, NEW_TOKENS) and logits.shape == (NEW_TOKENS, 2, VOCAB)
    for row in tokens:
        assert len(set(row.tolist())) >= 3, tokens


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_matches_eager_experts(model, prompt, eager_reference, cache):
    """Greedy ``generate`` with moeblaze: the eager backend's tokens, and its logits at every step
    to fp32 rounding; moeblaze's one-op layer (``expert_layer``: nothing to differentiate) ran once
    per MoE layer and forward (the prefill, then one per new token after the first)."""
    kwargs = {"cache_implementation": "static"} if cache == "static" else {}
    want = eager_reference if cache == "dynamic" else generate(model, prompt, "eager", **kwargs)
    assert_same_generation(want, eager_reference)  # the static cache changes nothing in eager either
    with CountMoeblazeCalls() as counter:
        got = generate(model, prompt, "moeblaze", **kwargs)
    assert moeblaze_ops.hf.check_model(model) == LAYERS
    assert_same_generation(got, eager_reference)
    assert counter.calls == {"dispatch": LAYERS * NEW_TOKENS, "expert_layer": LAYERS * NEW_TOKENS}, counter.calls


def test_compiled_decode_matches_eager_experts(model, prompt, eager_reference):
    """A static cache and a ``compile_config``: ``generate`` runs the prefill eagerly and every
    decode step through ``torch.compile(model.__call__, fullgraph=True)`` (transformers' automatic
    compilation; ``_compile_all_devices`` allows it on CPU). The graphs Dynamo captured hold
    moeblaze's ops, one ``expert_layer`` per MoE layer, and the tokens and logits are the eager
    backend's."""
    graphs = []

    def spy_backend(gm, example_inputs):
        """aot_eager, keeping each captured graph (a plain function: CompileConfig deep-copies
        its fields, and a function survives that as itself)."""
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compile_config = CompileConfig(fullgraph=True, backend=spy_backend, mode=None)
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    model.__dict__.pop("_compiled_call", None)  # transformers caches the compiled call on the model
    try:
        got = generate(model, prompt, "moeblaze", cache_implementation="static", compile_config=compile_config)
    finally:
        model.__dict__.pop("_compiled_call", None)
        torch._dynamo.reset()
    assert_same_generation(got, eager_reference)
    assert graphs, "generate did not compile the decode steps"
    for gm in graphs:
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        assert sum("moeblaze.expert_layer" in t for t in targets) == LAYERS, targets


def test_generate_benchmark_smoke(tmp_path):
    """``python -m moeblaze_ops.bench.generate`` at tiny sizes on CPU: both backends timed, the
    logits agreement recorded (no timing asserts: CPU speed says nothing)."""
    from moeblaze_ops.bench import generate as bench_generate

    result = bench_generate.main(["--device", "cpu", "--tiny", "--batch", "1", "--new-tokens", "4",
                                  "--out", str(tmp_path)])
    written = json.loads((tmp_path / "generate.json").read_text())
    assert written == json.loads(json.dumps(result))
    rows = {(r["backend"], r["batch"]): r for r in written["rows"]}
    assert set(rows) == {("moeblaze", 1), ("grouped_mm", 1)}
    for r in rows.values():
        assert r["new_tokens"] == 4 and r["tokens"] == 4
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0, r
    (agreement,) = written["logits"]
    assert agreement["batch"] == 1 and agreement["steps_compared"] >= 1
    assert agreement["max_rel_err"] < agreement["tolerance"] == 1e-4, agreement  # fp32 on CPU
    assert agreement["ok"] and written["ok"]
    assert "| moeblaze |" in (tmp_path / "generate.md").read_text()
