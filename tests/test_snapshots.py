"""expecttest snapshots: the registered op schemas and the graphs torch.compile captures.

Regenerate after an intended change with ``EXPECTTEST_ACCEPT=1 pytest tests/test_snapshots.py``.
"""

import expecttest
import torch
from torch._functorch.aot_autograd import aot_module_simplified

from conftest import make_layer
from moeblaze_ops import moe_experts

OPS = ["dispatch", "expert_up", "expert_down", "expert_up_backward", "expert_down_backward",
       "expert_down_backward_", "expert_down_backward_recompute"]


def _moeblaze_calls(gm):
    """The moeblaze ops a graph calls, in order."""
    return [str(n.target) for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("moeblaze.")]


class TestSnapshots(expecttest.TestCase):
    def test_op_schemas(self):
        schemas = "\n".join(str(getattr(torch.ops.moeblaze, op).default._schema) for op in OPS)
        self.assertExpectedInline(schemas, """\
moeblaze::dispatch(Tensor topk_ids, SymInt num_experts) -> (Tensor, Tensor, Tensor)
moeblaze::expert_up(Tensor x, Tensor w_gate_up, Tensor expert_token_indices, Tensor expert_offsets, Tensor token_index_map, Tensor? b_gate_up=None, bool transposed=False) -> Tensor
moeblaze::expert_down(Tensor h, Tensor w_down, Tensor expert_token_indices, Tensor expert_offsets, Tensor token_index_map, Tensor topk_weights, Tensor? b_down=None, str activation="swiglu", bool transposed=False, bool interleaved=False, float alpha=1.702, float limit=7.) -> Tensor
moeblaze::expert_up_backward(Tensor grad_h, Tensor x, Tensor w_gate_up, Tensor expert_token_indices, Tensor expert_offsets, Tensor token_index_map, bool has_bias, bool transposed, bool need_input_grad=True, bool need_weight_grad=True) -> (Tensor, Tensor, Tensor)
moeblaze::expert_down_backward(Tensor grad_out, Tensor h, Tensor w_down, Tensor expert_token_indices, Tensor expert_offsets, Tensor token_index_map, Tensor topk_weights, Tensor? b_down, str activation, bool transposed, bool interleaved, float alpha, float limit, bool need_weight_grad=True) -> (Tensor, Tensor, Tensor, Tensor)
moeblaze::expert_down_backward_(Tensor grad_out, Tensor(a1!) h, Tensor w_down, Tensor expert_token_indices, Tensor expert_offsets, Tensor token_index_map, Tensor topk_weights, Tensor? b_down, str activation, bool transposed, bool interleaved, float alpha, float limit, bool need_weight_grad=True) -> (Tensor, Tensor, Tensor)
moeblaze::expert_down_backward_recompute(Tensor grad_out, Tensor x, Tensor w_gate_up, Tensor w_down, Tensor expert_token_indices, Tensor expert_offsets, Tensor token_index_map, Tensor topk_weights, Tensor? b_gate_up, Tensor? b_down, str activation, bool transposed, bool interleaved, float alpha, float limit, bool need_weight_grad=True) -> (Tensor, Tensor, Tensor, Tensor)""")

    def _compiled_calls(self, recompute):
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
        layer = make_layer(10, 8, 4, 4, 2, requires_grad=True, bias=True)
        fn = torch.compile(lambda kw: moe_experts(**kw, recompute=recompute), backend=backend, fullgraph=True)
        fn(layer).sum().backward()
        return "\n".join(f"{name}: {', '.join(_moeblaze_calls(captured[name]))}"
                         for name in ("dynamo", "forward", "backward"))

    def test_compiled_graphs(self):
        self.assertExpectedInline(self._compiled_calls(False), """\
dynamo: moeblaze.dispatch, moeblaze.expert_up, moeblaze.expert_down
forward: moeblaze.dispatch.default, moeblaze.expert_up.default, moeblaze.expert_down.default
backward: moeblaze.expert_down_backward.default, moeblaze.expert_up_backward.default""")

    def test_compiled_graphs_recompute(self):
        self.assertExpectedInline(self._compiled_calls(True), """\
dynamo: moeblaze.dispatch
forward: moeblaze.dispatch.default, moeblaze.expert_up.default, moeblaze.expert_down.default
backward: moeblaze.expert_down_backward_recompute.default, moeblaze.expert_up_backward.default""")
