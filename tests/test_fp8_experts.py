"""FP8 experts through ``moe_experts`` and ``expert_layer``: the recipe's math on both
backends (the portable one, and the Triton one in the interpreter), pre-quantized weights,
the op's registration (opcheck), and the errors of what is not built yet."""

import os

import pytest
import torch

from conftest import rel_err
from moeblaze_ops import fp8, moe_experts, settings
from moeblaze_ops.testing import make_layer, reference_moe_fp8

CASES = [("swiglu", "concatenated", False), ("clamped_swiglu", "transposed_interleaved", True),
         ("gelu", "transposed", False)]


def _layer(activation, layout, bias, seed, dtype=torch.float32, L=12, sentinel_frac=0.2):
    return make_layer(L, 256, 128, 4, 2, dtype=dtype, activation=activation, layout=layout, bias=bias,
                      sentinel_frac=sentinel_frac, seed=seed)


def _reference(layer, h_dtype):
    as64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in layer.items()}
    return reference_moe_fp8(**as64, h_dtype=h_dtype)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("activation,layout,bias", CASES)
def test_fp8_layer_is_the_recipe(activation, layout, bias, backend, seed):
    """``precision="fp8"`` against the recipe in float64 (``testing.reference_moe_fp8``, h
    rounded to fp32 as the kernels store it): within 1e-3 (the scales and e4m3 values
    agree; only the fp32 sums differ), sentinel ids adding nothing, every buffer of the
    Triton kernels NaN-poisoned first."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend on CPU tensors needs TRITON_INTERPRET=1")
    layer = _layer(activation, layout, bias, seed)
    with torch.no_grad(), settings.override(backend=backend, poison=True):
        out = moe_experts(**layer, precision="fp8")
    assert out.dtype == torch.float32
    assert rel_err(out, _reference(layer, torch.float32)) < 1e-3


def test_fp8_weights_given_quantized(seed):
    """e4m3 weights with their scales (as a checkpoint stores them) run the layer the
    ``precision="fp8"`` call runs on the weights they came from, bit for bit, in bf16 too,
    where the recipe in float64 with h rounded to bf16 is within bf16's rounding."""
    layer = _layer("swiglu", "concatenated", True, seed, dtype=torch.bfloat16)
    (wgu, sgu), (wd, sd) = fp8.quantize_blocks(layer["w_gate_up"]), fp8.quantize_blocks(layer["w_down"])
    with torch.no_grad():
        quantized_here = moe_experts(**layer, precision="fp8")
        given = moe_experts(**{**layer, "w_gate_up": wgu, "w_down": wd}, w_gate_up_scale=sgu, w_down_scale=sd)
    assert given.dtype == torch.bfloat16 and torch.equal(given, quantized_here)
    assert rel_err(given, _reference(layer, torch.bfloat16)) < 1e-2


def test_fp8_layer_compiles(seed):
    """``torch.compile(fullgraph=True)`` captures the FP8 layer (the op as an extern call)
    and gives the eager result."""
    layer = _layer("swiglu", "concatenated", False, seed)
    fn = torch.compile(lambda **kw: moe_experts(**kw, precision="fp8"), fullgraph=True)
    with torch.no_grad():
        assert torch.equal(fn(**layer), moe_experts(**layer, precision="fp8"))


def test_fp8_op_registration(seed):
    """``expert_layer`` with FP8 weights: its schema, fake function and autograd
    registration (``torch.library.opcheck``), and its backward refusing clearly."""
    ops = torch.ops.moeblaze
    layer = _layer("swiglu", "concatenated", True, seed, sentinel_frac=0.0)
    (wgu, sgu), (wd, sd) = fp8.quantize_blocks(layer["w_gate_up"]), fp8.quantize_blocks(layer["w_down"])
    eti, offsets, tim = ops.dispatch(layer["topk_ids"], 4)
    args = (layer["x"], wgu, wd, eti, offsets, tim, layer["topk_weights"], layer["b_gate_up"], layer["b_down"],
            "swiglu", False, False, 1.702, 7.0, True, sgu, sd)
    # test_schema compares the inputs before and after with float arithmetic, which e4m3
    # tensors do not have on the CPU: their bytes are compared here instead.
    torch.library.opcheck(ops.expert_layer.default, args, test_utils=("test_autograd_registration", "test_faketensor",
                                                                      "test_aot_dispatch_static",
                                                                      "test_aot_dispatch_dynamic"))
    before = [t.clone() for t in (wgu, wd, sgu, sd)]
    ops.expert_layer(*args)
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == fp8.E4M3 else a,
                           b.view(torch.uint8) if b.dtype == fp8.E4M3 else b)
               for a, b in zip(before, (wgu, wd, sgu, sd)))
    x = layer["x"].clone().requires_grad_(True)
    out = ops.expert_layer(x, *args[1:])
    with pytest.raises(NotImplementedError, match="no backward yet"):
        out.sum().backward()
    # Compiled with gradients on, AOTAutograd traces the backward at once: the same clear error.
    compiled = torch.compile(lambda **kw: moe_experts(**kw, precision="fp8"), fullgraph=True)
    with pytest.raises(Exception, match="no backward yet.*torch.no_grad"):
        compiled(**{**layer, "x": layer["x"].detach().requires_grad_(True)})


def test_fp8_errors(seed):
    layer = _layer("swiglu", "concatenated", False, seed)
    (wgu, sgu), (wd, sd) = fp8.quantize_blocks(layer["w_gate_up"]), fp8.quantize_blocks(layer["w_down"])
    with pytest.raises(ValueError, match="'precision' must be one of"):
        moe_experts(**layer, precision="fp4")
    # With gradients on, the forward runs (evaluation without no_grad); a backward raises.
    out = moe_experts(**{**layer, "x": layer["x"].requires_grad_(True)}, precision="fp8")
    with torch.no_grad():
        assert torch.equal(out, moe_experts(**layer, precision="fp8"))
    with pytest.raises(NotImplementedError, match="no backward yet"):
        out.sum().backward()
    # Compiled with gradients on, AOTAutograd traces the backward at once: the same clear error.
    compiled = torch.compile(lambda **kw: moe_experts(**kw, precision="fp8"), fullgraph=True)
    with pytest.raises(Exception, match="no backward yet.*torch.no_grad"):
        compiled(**{**layer, "x": layer["x"].detach().requires_grad_(True)})
    with torch.no_grad():
        with pytest.raises(ValueError, match="'w_down_scale' must be given"):
            moe_experts(**{**layer, "w_gate_up": wgu, "w_down": wd}, w_gate_up_scale=sgu)
        with pytest.raises(ValueError, match="'w_down' must have dtype in"):
            moe_experts(**{**layer, "w_gate_up": wgu}, w_gate_up_scale=sgu, w_down_scale=sd)
        with pytest.raises(ValueError, match=r"'w_gate_up_scale' must have shape"):
            moe_experts(**{**layer, "w_gate_up": wgu, "w_down": wd}, w_gate_up_scale=sgu[:, :1], w_down_scale=sd)
        odd = make_layer(4, 200, 128, 2, 1, seed=seed)  # d = 200: off the 128-wide block
        with pytest.raises(ValueError, match="not a multiple of 128.*pad it to 256"):
            moe_experts(**odd, precision="fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("activation,layout,bias", CASES)
def test_fp8_layer_on_gpu(activation, layout, bias, seed):
    """The FP8 layer's CUDA kernels (the ``tl`` FP8 GEMM on e4m3 tensor cores), bf16, at a
    size with several tiles per expert: within bf16's rounding of the recipe in float64."""
    layer = make_layer(300, 512, 256, 8, 2, dtype=torch.bfloat16, activation=activation, layout=layout, bias=bias,
                       routing="skewed", sentinel_frac=0.1, seed=seed)
    on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in layer.items()}
    with torch.no_grad(), settings.override(poison=True):
        out = moe_experts(**on_gpu, precision="fp8")
    assert out.dtype == torch.bfloat16
    assert rel_err(out.double().cpu(), _reference(layer, torch.bfloat16)) < 2e-2


def _fp8_experts_module(seed, **attrs):
    """transformers' ``FP8Experts`` (a fine-grained FP8 model's experts, 4 experts, d 256,
    I 128, SiLU gate), its e4m3 weights and scales from random bf16 ones."""
    import types

    finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
    config = types.SimpleNamespace(hidden_size=256, num_experts=4, moe_intermediate_size=128, hidden_act="silu")
    module = finegrained.FP8Experts(config, block_size=attrs.pop("block_size", (128, 128)), **attrs)
    g = torch.Generator().manual_seed(seed)
    for name, shape, fan_in in (("gate_up_proj", (4, 256, 256), 256), ("down_proj", (4, 256, 128), 128)):
        q, scale = fp8.quantize_blocks(torch.randn(*shape, generator=g) * fan_in ** -0.5)
        getattr(module, name).data.copy_(q)
        getattr(module, f"{name}_scale_inv").data.copy_(scale)
    return module


def test_hf_fp8_experts_backend(seed):
    """``"moeblaze"`` is registered in transformers' ``FP8ExpertsInterface``, and runs an
    ``FP8Experts`` module on its e4m3 weights and ``*_scale_inv`` as stored: within 1e-3 of
    the recipe in float64 on those weights (dequantized with those scales)."""
    finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from moeblaze_ops import hf

    assert finegrained.FP8ExpertsInterface._global_mapping["moeblaze"] is hf.moeblaze_fp8_experts_forward
    module = _fp8_experts_module(seed)
    layer = make_layer(10, 256, 128, 4, 2, seed=seed)
    with torch.no_grad():
        out = hf.moeblaze_fp8_experts_forward(module, layer["x"], layer["topk_ids"], layer["topk_weights"])
    reference = reference_moe_fp8(layer["x"].double(), layer["topk_ids"], layer["topk_weights"].double(),
                                  module.gate_up_proj, module.down_proj, h_dtype=torch.float32,
                                  w_gate_up_scale=module.gate_up_proj_scale_inv,
                                  w_down_scale=module.down_proj_scale_inv)
    assert rel_err(out, reference) < 1e-3


@pytest.mark.parametrize("attrs,message", [({"block_size": (64, 64)}, "blocks \\(64, 64\\)"),
                                           ({"activation_scheme": "static"}, "activation_scheme='static'")])
def test_hf_fp8_experts_backend_refuses(attrs, message, seed):
    from moeblaze_ops import hf

    module = _fp8_experts_module(seed, **attrs) if "block_size" not in attrs else None
    if module is None:  # 64 x 64 blocks: the module's own scales are shaped for them
        finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
        import types

        config = types.SimpleNamespace(hidden_size=256, num_experts=4, moe_intermediate_size=128, hidden_act="silu")
        module = finegrained.FP8Experts(config, **attrs)
    layer = make_layer(4, 256, 128, 4, 2, seed=seed)
    with torch.no_grad(), pytest.raises(NotImplementedError, match=message):
        hf.moeblaze_fp8_experts_forward(module, layer["x"], layer["topk_ids"], layer["topk_weights"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hf_fp8_model_logits_match_grouped_mm(seed):
    """A tiny Qwen3-MoE-shaped model quantized by transformers' fine-grained FP8 (128 x 128
    blocks): its logits with ``experts_implementation="moeblaze"`` match those of HF's own
    FP8 ``grouped_mm`` experts (both quantize activations per 1 x 128 tile; they round h at
    different points), on the same weights."""
    transformers = pytest.importorskip("transformers")
    from moeblaze_ops import hf

    config = hf.model_config("qwen3_moe", hidden_size=256, num_heads=4, expert_intermediate_size=128,
                             num_experts=8, top_k=2)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():  # random weights of a trained model's scale
            p.normal_(0, 0.02)
    path = f"/tmp/moeblaze_fp8_model_{seed}"
    model.save_pretrained(path)
    quantization = transformers.FineGrainedFP8Config(weight_block_size=(128, 128))
    logits = {}
    ids = torch.randint(0, config.vocab_size, (2, 24), device="cuda")
    for backend in ("grouped_mm", "moeblaze"):
        fp8_model = transformers.AutoModelForCausalLM.from_pretrained(
            path, quantization_config=quantization, torch_dtype=torch.bfloat16, device_map="cuda",
            experts_implementation=backend)
        with torch.no_grad():
            logits[backend] = fp8_model(ids).logits.double().cpu()
    assert rel_err(logits["moeblaze"], logits["grouped_mm"]) < 3e-2
