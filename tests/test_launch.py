"""``kernels.launch``: the key under which a compiled kernel is launched again refines
Triton's own specialisation of the arguments (equal keys, equal specialisations), so a
launch plan can never run a kernel compiled for another kind of argument. The launches
themselves are checked on the GPU (tests/test_gpu.py, ``test_launch_plans_*``)."""

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

pytest.importorskip("triton")
jit = pytest.importorskip("triton.runtime.jit")
if not hasattr(jit, "native_specialize_impl"):
    pytest.skip("this Triton has no native_specialize_impl to compare with", allow_module_level=True)

from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from moeblaze_ops.kernels.launch import (_Signature, _Unplannable, argument_kind, kernel_signature,  # noqa: E402
                                         plan_key)


def triton_specialisation(value):
    """What Triton's JIT keys a non-constexpr argument on (type and attribute)."""
    return jit.native_specialize_impl(BaseBackend, value, False, True, True)


def _one_argument(value):
    """A kernel's signature of one argument (never launched)."""


_ONE_ARGUMENT = _Signature(jit.JITFunction(_one_argument))


def kind_of(value):
    """The kind a launch plan's key gives ``value`` (``plan_key``'s binder, which computes
    the common kinds inline and calls ``argument_kind`` for the rest)."""
    key, _ = plan_key(_ONE_ARGUMENT, 0, (value,), {})
    return key[2]


def assert_refines(values):
    specialisations = {}
    for value in values:
        specialisations.setdefault(kind_of(value), set()).add(triton_specialisation(value))
        specialisations.setdefault(("argument_kind", argument_kind(value)), set()).add(triton_specialisation(value))
    split = {kind: spec for kind, spec in specialisations.items() if len(spec) > 1}
    assert not split, f"one key, several Triton specialisations: {split}"


EDGES = [0, 1, 2, 15, 16, 17, 32, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 1, -(2**31) - 16, 2**63 - 1,
         2**63, 2**63 + 16, -(2**63), 2**64 - 1, 2**64 - 16, -1, -16]


@hypothesis_settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from(EDGES)), min_size=2, max_size=8))
def test_int_keys_refine_triton(values):
    assert_refines(values + EDGES)


def test_scalar_and_none_keys_refine_triton():
    assert_refines([True, False, 0.0, 1.5, -3e38, 1e300, float("inf"), float("nan"), None])
    assert len({kind_of(v) for v in (True, 1, 1.0, None)}) == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.int8])
def test_tensor_keys_refine_triton(dtype):
    base = torch.zeros(4096, dtype=torch.int8)
    views = [base[offset:offset + 64].view(dtype) if dtype.itemsize == 1 else
             base[offset:offset + 64 * dtype.itemsize].view(dtype) for offset in range(0, 64, dtype.itemsize)]
    views += [torch.nn.Parameter(v.float(), requires_grad=False) for v in views[:2]]
    assert_refines(views)
    assert {kind_of(v)[1] for v in views} == {True, False}  # alignment is part of the key


def test_descriptor_keys_refine_triton():
    descriptors = [TensorDescriptor.from_tensor(torch.zeros(rows, cols, dtype=dtype), block)
                   for dtype in (torch.bfloat16, torch.float32)
                   for rows, cols in ((64, 64), (128, 256), (80, 48))
                   for block in ([16, 16], [16, 32], [32, 16])]
    assert_refines(descriptors)


def test_gluon_descriptor_keys_refine_triton():
    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    gl = pytest.importorskip("triton.experimental.gluon.language")
    descriptors = []
    for dtype, gl_dtype in ((torch.bfloat16, gl.bfloat16), (torch.float16, gl.float16)):
        for block in ([16, 32], [64, 64]):
            layout = gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
            for rows in (64, 128):
                descriptors.append(hopper.TensorDescriptor.from_tensor(torch.zeros(rows, 64, dtype=dtype), block,
                                                                       layout))
    assert_refines(descriptors)


@pytest.mark.parametrize("value", [[1, 2], (3,), torch.tensor(1).numpy(), "tf32", object()])
def test_unknown_argument_kinds_take_the_jit_path(value):
    with pytest.raises(_Unplannable):
        kind_of(value)


def _kernel_source(src_ptr, dst_ptr, n, scale, BLOCK: "tl.constexpr", FLAG: "tl.constexpr" = False):
    """A kernel's signature (never launched here): the JIT reads its parameters."""


def test_plan_keys_bind_arguments_in_parameter_order():
    """``plan_key`` puts positional and keyword arguments in parameter order, fills
    defaults, keeps options (num_warps) apart, keys constexprs by value and the other
    arguments by kind, and refuses what the JIT would refuse (the JIT then says why)."""
    sig = _Signature(jit.JITFunction(_kernel_source))
    src, dst = torch.zeros(64), torch.zeros(64)
    key, values = plan_key(sig, 0, (src, dst), dict(n=17, scale=0.5, BLOCK=64, num_warps=4))
    assert values == [src, dst, 17, 0.5, 64, False]
    same, _ = plan_key(sig, 0, (torch.zeros(64), dst, 33), dict(scale=2.0, BLOCK=64, num_warps=4))
    assert key == same  # another aligned float32 pointer, another int neither 1 nor a multiple of 16
    for args, kwargs in [((src[1:], dst, 17), {}), ((src, dst, 16), {}), ((src, dst, 1), {}),
                         ((src, dst, 17), dict(FLAG=True)), ((src, dst, 17), dict(num_warps=8)),
                         ((src.double(), dst, 17), {})]:
        kwargs = {"scale": 0.5, "BLOCK": 64, "num_warps": 4, **kwargs}
        assert plan_key(sig, 0, args, kwargs)[0] != key, (args, kwargs)
    assert plan_key(sig, 1, (src, dst), dict(n=17, scale=0.5, BLOCK=64, num_warps=4))[0] != key  # device
    with pytest.raises(_Unplannable):
        plan_key(sig, 0, (src, dst, 17, 0.5, 64, False, 1), {})
    with pytest.raises(_Unplannable):
        plan_key(sig, 0, (src, dst, 17), dict(n=17, scale=0.5, BLOCK=64))
    with pytest.raises(_Unplannable):  # a required argument missing
        plan_key(sig, 0, (src, dst), dict(scale=0.5, BLOCK=64))


def _shadowing_source(type, tuple, n, BLOCK: "tl.constexpr"):
    """A kernel's signature whose parameters are named as builtins (never launched)."""


def _reserved_source(_plan_kind, BLOCK: "tl.constexpr"):
    """A kernel's signature with a parameter named as a binder's own helper (never launched)."""


def test_plan_keys_of_parameters_named_as_builtins():
    """The binder's code reaches its helpers under names of its own: parameters named
    ``type`` or ``tuple`` get their kinds as any other; a parameter named as a helper
    sends the kernel down the JIT's path."""
    sig = _Signature(jit.JITFunction(_shadowing_source))
    src = torch.zeros(64)
    key, values = plan_key(sig, 0, (src, 17, 16), dict(BLOCK=32))
    assert values == [src, 17, 16, 32]
    assert key[2:] == (kind_of(src), kind_of(17), kind_of(16), 32)
    assert kernel_signature(jit.JITFunction(_reserved_source)) is None
