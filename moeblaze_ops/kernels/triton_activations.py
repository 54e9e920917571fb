"""The activations in Triton, for the GEMM prologues (fp32 in, fp32 out).

The same math as ``moeblaze_ops.activations`` (the PyTorch side); ``ACT_CODES`` maps
the activation names to the constexpr codes the kernels take.
"""

import triton
import triton.language as tl

ACT_CODES = {"swiglu": 0, "geglu": 1, "clamped_swiglu": 2, "silu": 3, "gelu": 4, "relu": 5}


def is_gated_code(code: int) -> bool:
    return code < 3


@triton.jit
def _tanh_approx(x):
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _sigmoid(x, FAST: tl.constexpr):
    # FAST (CUDA, 16-bit outputs): one MUFU tanh instead of an exp and a division. In the
    # down GEMM's prologue the activation is recomputed for every output tile, and its
    # special-function work is as long as the tile's MMAs.
    if FAST:
        return 0.5 + 0.5 * _tanh_approx(0.5 * x)
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _gelu(x):
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def gated(g, u, ACT: tl.constexpr, alpha, limit, FAST: tl.constexpr):
    """a = act(gate) * up, for the gated codes 0-2."""
    if ACT == 0:
        return g * _sigmoid(g, FAST) * u
    elif ACT == 1:
        return _gelu(g) * u
    else:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        return (uc + 1.0) * gc * _sigmoid(alpha * gc, FAST)


@triton.jit
def plain(h, ACT: tl.constexpr, FAST: tl.constexpr):
    """a = act(h), for the non-gated codes 3-5."""
    if ACT == 3:
        return h * _sigmoid(h, FAST)
    elif ACT == 4:
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
    """(a, da/dgate, da/dup) of the gated codes 0-2; the clamps pass gradient on their
    closed intervals, as torch.clamp does. FAST: the approximate-tanh sigmoid."""
    if ACT == 0:
        f, df = _silu_and_grad(g, FAST)
        return f * u, df * u, f
    elif ACT == 1:
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
    """(a, da/dh) of the non-gated codes 3-5. FAST: the approximate-tanh sigmoid."""
    if ACT == 3:
        return _silu_and_grad(h, FAST)
    elif ACT == 4:
        return _gelu_and_grad(h)
    else:
        return tl.maximum(h, 0.0), tl.where(h > 0, 1.0, 0.0)
