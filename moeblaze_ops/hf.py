"""The ``"moeblaze"`` experts backend of HuggingFace transformers (v5).

transformers v5 dispatches the experts of every model decorated with
``@use_experts_implementation`` through ``transformers.integrations.moe.ExpertsInterface``.
Importing this module adds ``"moeblaze"`` there (``register()``, idempotent). So does
``import moeblaze_ops``, whatever the import order: at once if transformers has loaded
``transformers.integrations.moe`` already, else through an import hook right after it
does (``import moeblaze_ops`` itself never imports transformers). Then any of

    AutoModelForCausalLM.from_pretrained(name, experts_implementation="moeblaze")
    AutoModelForCausalLM.from_config(config, experts_implementation="moeblaze")
    model.set_experts_implementation("moeblaze")

runs the experts through ``moeblaze_ops.moe_experts``; ``"moeblaze_recompute"`` runs it in
full-recompute mode (the least memory kept for backward). ``check_model(model)`` returns
the number of experts modules moeblaze runs, and raises unless it runs all of them
(``ExpertsNotOnMoeblazeError`` for experts left on another implementation,
``NotImplementedError`` for experts the backend cannot run). The backend reads the experts
module's flags: ``is_transposed`` and ``is_concatenated`` (weight layout), ``has_bias``,
``has_gate`` (``gate_up_proj`` or ``up_proj``), and its gate: HF's default gate with the
config's ``hidden_act`` (silu -> swiglu, gelu -> geglu), or GPT-OSS's clamped gate.
Expert-parallel sentinel ids (>= num_experts) contribute nothing, as ``dispatch`` defines.

The FP8 experts of fine-grained FP8 models (transformers' ``FP8Experts``: e4m3 weights with
128 x 128 block scales) run through ``"moeblaze"`` in transformers' ``FP8ExpertsInterface``
(``moeblaze_fp8_experts_forward``), on the weights as stored; no backward through them yet.

Not covered, with a clear error: experts with ``has_post_expert_norm``, other custom
``_apply_gate`` functions, activations without a moeblaze kernel (e.g. tanh-approximated
GELU), and Llama 4, whose experts are not decorated (its ``Llama4TextExperts`` keeps the
transformers implementation).
"""

from __future__ import annotations

import sys

from .functional import moe_experts

BACKEND = "moeblaze"
#: The same backend in full-recompute mode (``moe_experts(..., recompute=True)``): backward
#: keeps only the index arrays and the router weights, and recomputes h.
RECOMPUTE_BACKEND = "moeblaze_recompute"
BACKENDS = (BACKEND, RECOMPUTE_BACKEND)

# hidden_act of HF's default gate (act(gate) * up) -> moeblaze's gated activation.
_GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}
# hidden_act of experts without a gate -> moeblaze's activation.
_PLAIN = {"silu": "silu", "swish": "silu", "gelu": "gelu", "relu": "relu"}
# Experts classes whose own _apply_gate moeblaze implements: class name -> activation.
# Their alpha and limit are read from the module.
_CUSTOM_GATES = {"GptOssExperts": "clamped_swiglu"}


def _activation(module):
    """(activation, alpha, limit) of an HF experts module (alpha and limit None where the
    activation does not read them), or a clear error for experts the backend cannot run."""
    from transformers.integrations.moe import _default_apply_gate

    name = type(module).__name__
    if getattr(module, "has_post_expert_norm", False):
        raise NotImplementedError(f"moeblaze experts backend: {name} normalises each expert's output before "
                                  "the combine (has_post_expert_norm), which moeblaze does not fuse")
    hidden_act = getattr(getattr(module, "config", None), "hidden_act", None)
    if not module.has_gate:
        if hidden_act not in _PLAIN:
            raise NotImplementedError(f"moeblaze experts backend: {name} uses hidden_act={hidden_act!r}; "
                                      f"supported without a gate: {sorted(_PLAIN)}")
        return _PLAIN[hidden_act], None, None
    if type(module)._apply_gate is _default_apply_gate:
        if hidden_act not in _GATED:
            raise NotImplementedError(f"moeblaze experts backend: {name} uses hidden_act={hidden_act!r}; "
                                      f"supported gated activations: {sorted(_GATED)}")
        return _GATED[hidden_act], None, None
    if name in _CUSTOM_GATES:
        return _CUSTOM_GATES[name], float(module.alpha), float(module.limit)
    raise NotImplementedError(f"moeblaze experts backend: {name} has its own _apply_gate, which moeblaze does "
                              f"not implement (implemented: {sorted(_CUSTOM_GATES)})")


def moeblaze_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts forward of an HF experts module, through ``moeblaze_ops.moe_experts``.

    Signature of transformers' experts backends: ``hidden_states [S, d]``,
    ``top_k_index [S, K]``, ``top_k_weights [S, K]``; returns ``[S, d]``.
    """
    return _experts_forward(self, hidden_states, top_k_index, top_k_weights, recompute=False)


def moeblaze_recompute_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """``moeblaze_experts_forward`` in full-recompute mode (the ``"moeblaze_recompute"`` backend)."""
    return _experts_forward(self, hidden_states, top_k_index, top_k_weights, recompute=True)


def _experts_forward(self, hidden_states, top_k_index, top_k_weights, recompute):
    activation, alpha, limit = _activation(self)
    w_up = self.gate_up_proj if self.has_gate else self.up_proj
    b_up = b_down = None
    if self.has_bias:
        b_up = self.gate_up_proj_bias if self.has_gate else self.up_proj_bias
        b_down = self.down_proj_bias
    return moe_experts(
        hidden_states, top_k_index, top_k_weights, w_up, self.down_proj, activation,
        b_gate_up=b_up, b_down=b_down, transposed=self.is_transposed, interleaved=not self.is_concatenated,
        alpha=alpha, limit=limit, recompute=recompute,
    )


def moeblaze_fp8_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The forward of transformers' FP8 experts (``FP8Experts``, a fine-grained FP8 model's:
    e4m3 ``gate_up_proj`` or ``up_proj`` and ``down_proj``, each with the float32
    ``*_scale_inv`` of its 128 x 128 blocks) through ``moeblaze_ops.moe_experts`` on the
    weights as stored, no bf16 copy of them: the FP8 recipe (``moeblaze_ops.fp8``), token
    rows gathered by index. Registered as ``"moeblaze"`` in transformers'
    ``FP8ExpertsInterface`` (``register_fp8``). No backward yet (it raises)."""
    activation = _fp8_activation(self)
    if self.has_gate:
        w_up, s_up = self.gate_up_proj, self.gate_up_proj_scale_inv
    else:
        w_up, s_up = self.up_proj, self.up_proj_scale_inv
    return moe_experts(hidden_states, top_k_index, top_k_weights, w_up, self.down_proj, activation,
                       w_gate_up_scale=s_up, w_down_scale=self.down_proj_scale_inv)


def _fp8_activation(module):
    """The activation of an FP8 experts module, or a clear error for one the FP8 backend
    cannot run (blocks other than 128 x 128, static activation scales, a gate of its own)."""
    name = type(module).__name__
    block = tuple(module.block_size) if getattr(module, "block_size", None) is not None else None
    if block != (128, 128):
        raise NotImplementedError(f"moeblaze FP8 experts backend: {name} has weight blocks {block}; moeblaze runs "
                                  "128 x 128 blocks (DeepSeek-V3's, HF's fine-grained FP8 default)")
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        raise NotImplementedError(f"moeblaze FP8 experts backend: {name} has activation_scheme="
                                  f"{module.activation_scheme!r}; moeblaze quantizes activations per 1 x 128 tile "
                                  "as they come ('dynamic')")
    custom = [attr for attr in ("gate_softcap", "up_softcap", "swiglu_alpha", "limit")
              if getattr(module, attr, None) is not None]
    if custom:
        raise NotImplementedError(f"moeblaze FP8 experts backend: {name} sets {custom}, a gate moeblaze's FP8 path "
                                  "does not implement")
    hidden_act = getattr(getattr(module, "config", None), "hidden_act", None)
    table = _GATED if module.has_gate else _PLAIN
    if hidden_act not in table:
        raise NotImplementedError(f"moeblaze FP8 experts backend: {name} uses hidden_act={hidden_act!r}; "
                                  f"supported: {sorted(table)}")
    return table[hidden_act]


#: The MoE families whose experts the backend runs, with how each config names its sizes.
FAMILIES = {
    # family: (model_type, experts key, expert intermediate key, extra config)
    "mixtral": ("mixtral", "num_local_experts", "intermediate_size", {}),
    "qwen2_moe": ("qwen2_moe", "num_experts", "moe_intermediate_size", {"decoder_sparse_step": 1}),
    "qwen3_moe": ("qwen3_moe", "num_experts", "moe_intermediate_size", {}),
    "olmoe": ("olmoe", "num_experts", "intermediate_size", {}),
    "deepseek_v3": ("deepseek_v3", "n_routed_experts", "moe_intermediate_size",
                    {"n_shared_experts": 1, "first_k_dense_replace": 0, "n_group": 2, "topk_group": 1}),
    "gpt_oss": ("gpt_oss", "num_local_experts", "intermediate_size", {}),
    "granitemoe": ("granitemoe", "num_local_experts", "intermediate_size", {}),
    "phimoe": ("phimoe", "num_local_experts", "intermediate_size", {}),
}


def model_config(family: str, *, hidden_size=64, num_layers=2, num_heads=4, num_experts=8, top_k=2,
                 expert_intermediate_size=32, vocab_size=256, max_positions=512, **overrides):
    """A transformers config of ``family`` (a key of ``FAMILIES``) at the given sizes.

    For tests and examples: build a model with ``AutoModelForCausalLM.from_config``, no
    download. The attention and dense-MLP sizes follow the expert sizes.
    """
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"moeblaze_ops.hf.model_config: unknown family {family!r}; known: {sorted(FAMILIES)}")
    model_type, experts_key, inter_key, extra = FAMILIES[family]
    head_dim = hidden_size // num_heads
    kw = dict(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
              num_key_value_heads=num_heads, vocab_size=vocab_size, max_position_embeddings=max_positions,
              num_experts_per_tok=top_k, intermediate_size=2 * expert_intermediate_size, head_dim=head_dim)
    kw[experts_key] = num_experts
    kw[inter_key] = expert_intermediate_size
    if family == "qwen2_moe":
        kw["shared_expert_intermediate_size"] = expert_intermediate_size
    if family == "deepseek_v3":
        del kw["head_dim"]  # its rotary width is qk_rope_head_dim
        kw.update(q_lora_rank=hidden_size // 2, kv_lora_rank=hidden_size // 2, qk_rope_head_dim=head_dim,
                  qk_nope_head_dim=head_dim, v_head_dim=head_dim)
    if family == "gpt_oss":
        kw["sliding_window"] = 64
    kw.update(extra)
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


class ExpertsNotOnMoeblazeError(ValueError):
    """``check_model``'s error for a model some of whose experts modules do not run through
    moeblaze: they kept another experts implementation (``"eager"``, ``"grouped_mm"``, ...),
    or the model has no experts module at all. ``modules`` maps each such module's name to
    the implementation it kept (empty for a model without experts)."""

    def __init__(self, message, modules):
        super().__init__(message)
        self.modules = dict(modules)


def check_model(model) -> int:
    """Checks that every experts module of ``model`` runs through moeblaze; returns their
    count (at least 1).

    Raises ``ExpertsNotOnMoeblazeError`` (a ``ValueError``) naming the experts modules
    whose ``experts_implementation`` is not one of ``BACKENDS`` (a model built or switched
    with another one, e.g. ``experts_implementation="grouped_mm"``), and for a model with
    no experts module at all: a check that passes means moeblaze runs every expert.

    transformers routes only the experts classes decorated with
    ``@use_experts_implementation`` through the experts interface. Others, such as Llama
    4's ``Llama4TextExperts`` (its router scales the expert *inputs*, which moeblaze's
    weighted combine does not express), keep their own forward even when the model's
    ``experts_implementation`` says ``"moeblaze"``. This raises ``NotImplementedError``
    for them instead of letting them run silently, and for decorated experts that the
    backend cannot run (an unsupported gate or activation).
    """
    count, elsewhere = 0, {}
    for name, module in model.named_modules():
        is_experts = type(module).__name__.endswith("Experts") and hasattr(module, "down_proj")
        if not is_experts:
            continue
        if not hasattr(module, "has_gate"):  # not decorated: the interface never sees it
            raise NotImplementedError(
                f"moeblaze experts backend: {name} ({type(module).__name__}) is not routed through transformers' "
                "experts interface, so experts_implementation='moeblaze' does not reach it; moeblaze does not "
                "support this model's experts")
        impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
        if impl in BACKENDS:
            _activation(module)
            count += 1
        else:
            elsewhere[name] = impl
    if elsewhere:
        shown = ", ".join(f"{name} ({impl!r})" for name, impl in list(elsewhere.items())[:8])
        more = f" and {len(elsewhere) - 8} more" if len(elsewhere) > 8 else ""
        raise ExpertsNotOnMoeblazeError(
            f"moeblaze experts backend: {len(elsewhere)} experts module(s) of {type(model).__name__} run another "
            f"experts implementation: {shown}{more}; build the model with experts_implementation='moeblaze' or "
            "call model.set_experts_implementation('moeblaze')", elsewhere)
    if not count:
        raise ExpertsNotOnMoeblazeError(
            f"moeblaze experts backend: {type(model).__name__} has no experts module (no MoE layer) for moeblaze "
            "to run", {})
    return count


def register() -> None:
    """Registers ``"moeblaze"`` and ``"moeblaze_recompute"`` in transformers'
    ``ExpertsInterface`` (idempotent), and ``"moeblaze"`` in its ``FP8ExpertsInterface``
    where transformers has loaded that (``register_fp8``)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(BACKEND, moeblaze_experts_forward)
    ExpertsInterface.register(RECOMPUTE_BACKEND, moeblaze_recompute_experts_forward)
    # Loaded, and past defining the interface (it imports the module this runs after).
    if hasattr(sys.modules.get(FP8_EXPERTS_MODULE), "FP8ExpertsInterface"):
        register_fp8()


#: The transformers module of ``FP8ExpertsInterface`` (fine-grained FP8 models' experts).
FP8_EXPERTS_MODULE = "transformers.integrations.finegrained_fp8"


def register_fp8() -> None:
    """Registers ``"moeblaze"`` in transformers' ``FP8ExpertsInterface`` (idempotent):
    ``experts_implementation="moeblaze"`` on a fine-grained FP8 model runs its experts
    through ``moeblaze_fp8_experts_forward``. ``import moeblaze_ops`` does it once
    transformers loads that module."""
    import importlib

    importlib.import_module(FP8_EXPERTS_MODULE).FP8ExpertsInterface.register(BACKEND, moeblaze_fp8_experts_forward)


register()
