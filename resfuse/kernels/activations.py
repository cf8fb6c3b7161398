"""@triton.jit activation helpers that the generated epilogues call by name (epilogue.py's op table emits the
call; codegen.py imports every name in HELPERS into each generated kernel's module).

Entry points: `gelu_erf(x, OUT)`, `logistic_div(x, z, OUT)`, `sixth(x, OUT)`, `sum_rows(t)`.
"""
from __future__ import annotations

import triton
import triton.language as tl

HELPERS = ("gelu_erf", "logistic_div", "sixth", "sum_rows")


@triton.jit
def sum_rows(t):
    """The column sums of a 2-D tile. tl.sum is a @jit helper decorated at triton's import (see tiles.py); its
    combine function is not called under the interpreter (which runs it as one np.sum), so reducing with it is
    safe in both modes."""
    return tl.reduce(t, 0, tl.standard._sum_combine)


@triton.jit
def gelu_erf(x, OUT: tl.constexpr):
    """Exact (erf) GELU, x * Phi(x), with Phi(-|x|) = erfc(|x| / sqrt 2) / 2 from erfc(z) = t * exp(-z^2 + P(t)),
    t = 1 / (1 + z / 2), P a polynomial, for a value stored as OUT (the output's element type):
    - OUT fp32: P is the Chebyshev fit of Numerical Recipes' erfcc, degree 9, relative error below 1.2e-7 for every
      z >= 0;
    - OUT fp16 or bf16: P is a degree-5 fit (tests/test_activation_values.py checks it), GELU's relative error below
      1.1e-5 for x >= -19 (Phi underflows fp32 below that); an fp16 result's rounding alone is up to 4.9e-4, so at
      most a few values in a hundred round to the neighbouring fp16 number, as a different summation order in the
      GEMM would make them do. It takes 17 sm_90 instructions a value, against the degree-9 fit's 24
      (`python bench/gelu_sass.py`).
    GELU's arithmetic bounds a GEMM epilogue over a wide output (ConvNeXt's pointwise layers, BERT's FFN) and the
    epilogue pass after cuBLAS, so it is written for the fewest instructions (the degree-9 fit through tl.exp and a
    division took 5 more, libdevice's erff more still; twenty-eighth session):
    - P's coefficients are scaled by log2(e), with log2 of erfc's factor 1/2 in the constant term, so the
      exponential is one ex2 (tl.exp2, ex2.approx.ftz: no multiply by log2(e), no denormal fix-ups);
    - t is rsqrt(y)^2, a single MUFU op where the division (div.full) costs several, good to 3e-7; for fp32 one
      Newton step restores the reciprocal to fp32's precision, with |x| clamped at 1e4 for y only (Phi is 0 or 1
      in fp32 there already), so that y * t is never inf * 0. Either way +inf gives inf and -inf NaN, as eager's CUDA
      kernel does.
    Where eager's 1 + erf(x) cancels (x below about -3) it keeps Phi's relative error small."""
    if OUT.primitive_bitwidth > 16:
        y = 1.0 + 0.3535533905932738 * tl.minimum(tl.abs(x), 1e4)
        r = tl.math.rsqrt(y)
        t = r * r
        t = t + t * (1.0 - y * t)
        p = 0.246517298 * t - 1.18611495
        p = p * t + 2.14747446
        p = p * t - 1.63775315
        p = p * t + 0.402321582
        p = p * t - 0.26875686
        p = p * t + 0.139630057
        p = p * t + 0.539700616
        p = p * t + 1.4427292
        p = p * t - 2.82574822
    else:  # no Newton step, so no clamp: t = 0 at |x| = inf
        r = tl.math.rsqrt(1.0 + 0.3535533905932738 * tl.abs(x))
        t = r * r
        p = 0.322295958 * t - 1.00089942
        p = p * t + 0.660561107
        p = p * t + 0.379135655
        p = p * t + 1.46589975
        p = p * t - 2.82700056
    half_erfc = t * tl.exp2(p - 0.7213475204444817 * x * x)
    return x * tl.where(x >= 0.0, 1.0 - half_erfc, half_erfc)


@triton.jit
def logistic_div(x, z, OUT: tl.constexpr):
    """x / (1 + exp(-z)), x times the logistic function of z (silu: z = x; sigmoid: x = 1; tanh-approximated GELU:
    z = 2 sqrt(2/pi) (x + 0.044715 x^3)), for a value stored as OUT (the output's element type):
    - OUT fp32: one IEEE division, as eager computes it;
    - OUT fp16 or bf16: x * rsqrt(1 + exp(-z))^2, a MUFU op and two multiplies in place of the division's dozen
      instructions and its slow-path branch (Triton's `/` is div.rn.f32), good to 3e-7 relative where the stored
      value's spacing is 1e-3 (fp16) or 8e-3 (bf16): at most 0.5% of the values round to the neighbouring number
      (tanh-GELU's bf16 0.6%, its z rounded in fp32; eager's own form misrounds 16% there:
      tests/test_activation_values.py). The GEMM epilogues of gated MLPs (SwiGLU), EfficientNet and GPT-2 run it on
      every output element, at one CTA an SM, where nothing hides it.
    Either way exp(-z) = inf gives x * 0 (-0 for a negative x, NaN for x = -inf), as eager's division by inf does."""
    if OUT.primitive_bitwidth > 16:
        return x / (1.0 + tl.exp(-z))
    else:
        r = tl.math.rsqrt(1.0 + tl.exp(-z))
        return x * (r * r)


@triton.jit
def sixth(x, OUT: tl.constexpr):
    """x / 6 (hardswish's and hardsigmoid's scale) for a value stored as OUT: an IEEE division for fp32, as eager's;
    for fp16/bf16 a multiply by fp32's 1/6, within 1.5 fp32 ulps of it."""
    if OUT.primitive_bitwidth > 16:
        return x / 6.0
    else:
        return x * 0.16666666666666666
