"""The activations in Triton, for the activation pass and the GEMM epilogues (fp32 in, fp32 out).

The same math as ``moeblaze_ops.activations`` (the PyTorch side). Kernels take the
activation as a constexpr ``ACT``, one of ``moeblaze_ops.activations.ActivationCode``;
the codes below ``NUM_GATED`` are the gated ones.
"""

import triton
import triton.language as tl

from ...activations import ActivationCode

SWIGLU = tl.constexpr(int(ActivationCode.SWIGLU))
GEGLU = tl.constexpr(int(ActivationCode.GEGLU))
SILU = tl.constexpr(int(ActivationCode.SILU))
GELU = tl.constexpr(int(ActivationCode.GELU))
#: Codes below this are gated (h holds gate and up columns).
NUM_GATED = tl.constexpr(int(ActivationCode.SILU))


def is_gated_code(code) -> bool:
    """Whether ``code`` (an ``ActivationCode``) is a gated activation's, on the host."""
    return int(code) < NUM_GATED.value


@triton.jit
def _tanh_approx(x):
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _sigmoid(x, FAST: tl.constexpr):
    # FAST (CUDA, 16-bit outputs): one MUFU tanh instead of an exp and a division. In a
    # GEMM's epilogue (the up GEMM's act(h), dH's recompute) the special-function work
    # competes with the next tile's MMAs.
    if FAST:
        return 0.5 + 0.5 * _tanh_approx(0.5 * x)
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _gelu(x):
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def gated(g, u, ACT: tl.constexpr, alpha, limit, FAST: tl.constexpr):
    """a = act(gate) * up, for the gated codes."""
    if ACT == SWIGLU:
        return g * _sigmoid(g, FAST) * u
    elif ACT == GEGLU:
        return _gelu(g) * u
    else:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        return (uc + 1.0) * gc * _sigmoid(alpha * gc, FAST)


@triton.jit
def plain(h, ACT: tl.constexpr, FAST: tl.constexpr):
    """a = act(h), for the non-gated codes."""
    if ACT == SILU:
        return h * _sigmoid(h, FAST)
    elif ACT == GELU:
        return _gelu(h)
    else:
        return tl.maximum(h, 0.0)


@triton.jit
def _silu_and_grad(g, FAST: tl.constexpr):
    s = _sigmoid(g, FAST)
    return g * s, s * (1.0 + g * (1.0 - s))


@triton.jit
def _gelu_and_grad(g):
    cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
    return g * cdf, cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)


@triton.jit
def gated_grad(g, u, ACT: tl.constexpr, alpha, limit, FAST: tl.constexpr = False):
    """(a, da/dgate, da/dup) of the gated codes; the clamps pass gradient on their closed
    intervals, as torch.clamp does. FAST: the approximate-tanh sigmoid."""
    if ACT == SWIGLU:
        f, df = _silu_and_grad(g, FAST)
        return f * u, df * u, f
    elif ACT == GEGLU:
        f, df = _gelu_and_grad(g)
        return f * u, df * u, f
    else:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        s = _sigmoid(alpha * gc, FAST)
        glu = gc * s
        dglu = s * (1.0 + alpha * gc * (1.0 - s))
        return ((uc + 1.0) * glu, tl.where(g <= limit, (uc + 1.0) * dglu, 0.0),
                tl.where((u >= -limit) & (u <= limit), glu, 0.0))


@triton.jit
def plain_grad(h, ACT: tl.constexpr, FAST: tl.constexpr = False):
    """(a, da/dh) of the non-gated codes. FAST: the approximate-tanh sigmoid."""
    if ACT == SILU:
        return _silu_and_grad(h, FAST)
    elif ACT == GELU:
        return _gelu_and_grad(h)
    else:
        return tl.maximum(h, 0.0), tl.where(h > 0, 1.0, 0.0)


@triton.jit
def backward(grad_a, g, u, alpha, limit, ACT: tl.constexpr, FAST: tl.constexpr):
    """(dL/dgate, dL/dup, a) from dL/da ``grad_a`` and the raw h tiles ``(g, u)`` as
    ``load_h_pair`` returns them, in fp32; for the non-gated codes (dL/dh, dL/dh, a)."""
    if ACT < NUM_GATED:
        a, da_dg, da_du = gated_grad(g.to(tl.float32), u.to(tl.float32), ACT, alpha, limit, FAST)
        return grad_a * da_dg, grad_a * da_du, a
    a, da = plain_grad(g.to(tl.float32), ACT, FAST)
    d = grad_a * da
    return d, d, a


@triton.jit
def activate(g, u, alpha, limit, ACT: tl.constexpr, FAST: tl.constexpr):
    """The activation of raw h tiles ``(g, u)`` as ``load_h_pair`` returns them, in fp32."""
    if ACT < NUM_GATED:
        return gated(g.to(tl.float32), u.to(tl.float32), ACT, alpha, limit, FAST)
    return plain(g.to(tl.float32), ACT, FAST)
