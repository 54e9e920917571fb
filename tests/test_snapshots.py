"""expecttest snapshots: the registered op schemas, the graphs torch.compile captures, and
the test seeds (fixed per test; tests/conftest.py).

Regenerate after an intended change with ``EXPECTTEST_ACCEPT=1 pytest tests/test_snapshots.py``.
"""

import os
import subprocess
import sys
from pathlib import Path

import expecttest
import pytest
import torch
from torch._functorch.aot_autograd import aot_module_simplified

from moeblaze_ops import moe_experts
from moeblaze_ops.testing import SEED_ENV, base_seed, current_test_seed, make_layer, seed_for

OPS = ["dispatch", "expert_up", "expert_down", "expert_up_backward", "expert_down_backward",
       "expert_down_backward_", "expert_down_backward_recompute", "expert_layer"]


def _moeblaze_calls(gm):
    """The moeblaze ops a graph calls, in order."""
    return [str(n.target) for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("moeblaze.")]


class TestSnapshots(expecttest.TestCase):
    def test_op_schemas(self):
        schemas = "\n".join(str(getattr(torch.ops.moeblaze, op).default._schema) for op in OPS)
        self.assertExpectedInline(schemas, """\
moeblaze::dispatch(Tensor topk_ids, SymInt num_experts) -> (Tensor, Tensor, Tensor)
moeblaze::expert_up(Tensor x, Tensor w_gate_up, Tensor expert_token_indices, Tensor expert_offsets, Tensor token_index_map, Tensor? b_gate_up=None, bool transposed=False, bool validate=True) -> Tensor
moeblaze::expert_down(Tensor h, Tensor w_down, Tensor expert_token_indices, Tensor expert_offsets, Tensor token_index_map, Tensor topk_weights, Tensor? b_down=None, str activation="swiglu", bool transposed=False, bool interleaved=False, float alpha=1.702, float limit=7., bool validate=True) -> Tensor
moeblaze::expert_up_backward(Tensor grad_h, Tensor x, Tensor w_gate_up, Tensor expert_token_indices, Tensor expert_offsets, Tensor token_index_map, bool has_bias, bool transposed, bool need_input_grad=True, bool need_weight_grad=True, bool validate=True) -> (Tensor, Tensor, Tensor)
moeblaze::expert_down_backward(Tensor grad_out, Tensor h, Tensor w_down, Tensor expert_token_indices, Tensor expert_offsets, Tensor token_index_map, Tensor topk_weights, Tensor? b_down, str activation, bool transposed, bool interleaved, float alpha, float limit, bool need_weight_grad=True, bool validate=True) -> (Tensor, Tensor, Tensor, Tensor)
moeblaze::expert_down_backward_(Tensor grad_out, Tensor(a!) h, Tensor w_down, Tensor expert_token_indices, Tensor expert_offsets, Tensor token_index_map, Tensor topk_weights, Tensor? b_down, str activation, bool transposed, bool interleaved, float alpha, float limit, bool need_weight_grad=True, bool validate=True) -> (Tensor, Tensor, Tensor)
moeblaze::expert_down_backward_recompute(Tensor grad_out, Tensor x, Tensor w_gate_up, Tensor w_down, Tensor expert_token_indices, Tensor expert_offsets, Tensor token_index_map, Tensor topk_weights, Tensor? b_gate_up, Tensor? b_down, str activation, bool transposed, bool interleaved, float alpha, float limit, bool need_weight_grad=True, bool validate=True) -> (Tensor, Tensor, Tensor, Tensor)
moeblaze::expert_layer(Tensor x, Tensor w_gate_up, Tensor w_down, Tensor expert_token_indices, Tensor expert_offsets, Tensor token_index_map, Tensor topk_weights, Tensor? b_gate_up=None, Tensor? b_down=None, str activation="swiglu", bool transposed=False, bool interleaved=False, float alpha=1.702, float limit=7., bool validate=True, Tensor? w_gate_up_scale=None, Tensor? w_down_scale=None) -> Tensor""")

    def _compiled_calls(self, recompute, grad=True):
        captured = {}

        def backend(gm, example_inputs):
            captured["dynamo"] = gm

            def keep(name):
                def compiler(g, _):
                    captured[name] = g
                    return g
                return compiler

            return aot_module_simplified(gm, example_inputs, fw_compiler=keep("forward"),
                                         bw_compiler=keep("backward"))

        torch._dynamo.reset()
        layer = make_layer(10, 8, 4, 4, 2, requires_grad=grad, bias=True)
        fn = torch.compile(lambda kw: moe_experts(**kw, recompute=recompute), backend=backend, fullgraph=True)
        out = fn(layer)
        if grad:
            out.sum().backward()
        return "\n".join(f"{name}: {', '.join(_moeblaze_calls(captured[name]))}"
                         for name in ("dynamo", "forward", "backward") if name in captured)

    def test_compiled_graphs(self):
        self.assertExpectedInline(self._compiled_calls(False), """\
dynamo: moeblaze.dispatch, moeblaze.expert_up, moeblaze.expert_down
forward: moeblaze.dispatch.default, moeblaze.expert_up.default, moeblaze.expert_down.default
backward: moeblaze.expert_down_backward.default, moeblaze.expert_up_backward.default""")

    def test_compiled_graphs_recompute(self):
        self.assertExpectedInline(self._compiled_calls(True), """\
dynamo: moeblaze.dispatch, moeblaze.expert_layer.default
forward: moeblaze.dispatch.default, moeblaze.expert_layer.default
backward: moeblaze.expert_down_backward_recompute.default, moeblaze.expert_up_backward.default""")

    def test_compiled_graph_without_gradients(self):
        self.assertExpectedInline(self._compiled_calls(False, grad=False), """\
dynamo: moeblaze.dispatch, moeblaze.expert_layer.default
forward: moeblaze.dispatch.default, moeblaze.expert_layer.default""")


# Seeds: fixed per test, so a failure reruns with the same inputs; the snapshot pins them
# across processes and Python versions.
class TestSeeds(expecttest.TestCase):
    def test_seeds_are_fixed_per_node_id(self):
        node = "tests/test_gradients.py::test_deterministic"
        self.assertExpectedInline(
            str([seed_for(node, base=0), seed_for(node, base=1), seed_for(node + "[x]", base=0)]),
            """[1467847191, 1959262374, 1381990237]""")


def test_seed_fixture_is_the_node_ids_seed(seed, request):
    assert seed == seed_for(request.node.nodeid) == current_test_seed()
    assert seed != seed_for(request.node.nodeid + "x")  # other tests draw other inputs


def test_seed_base_from_the_environment(monkeypatch):
    monkeypatch.delenv(SEED_ENV, raising=False)
    assert base_seed() == 0
    monkeypatch.setenv(SEED_ENV, "7")
    assert base_seed() == 7 and seed_for("t") == seed_for("t", base=7) != seed_for("t", base=0)
    monkeypatch.setenv(SEED_ENV, "random")
    assert base_seed() == base_seed()  # drawn once per process: every test shares the base
    monkeypatch.setenv(SEED_ENV, "seven")
    with pytest.raises(ValueError, match=SEED_ENV):
        base_seed()


def test_failure_report_names_the_seed(tmp_path):
    """A failing test's report carries its seed and the command that reruns it."""
    test_file = tmp_path / "test_fails.py"
    test_file.write_text("def test_fails(seed):\n    assert seed < 0\n")
    env = {**os.environ, "MOEBLAZE_TEST_SEED": "3", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(test_file)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    seed = seed_for("test_fails.py::test_fails", base=3)
    assert f"test seed {seed}, base 3: rerun with MOEBLAZE_TEST_SEED=3" in proc.stdout, proc.stdout[-3000:]
