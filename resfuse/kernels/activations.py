"""@triton.jit activation helpers that the generated epilogues call by name (epilogue.py's op table emits the
call; codegen.py imports every name in HELPERS into each generated kernel's module).

Entry points: `gelu_erf(x)`, `sum_rows(t)`.
"""
from __future__ import annotations

import triton
import triton.language as tl

HELPERS = ("gelu_erf", "sum_rows")


@triton.jit
def sum_rows(t):
    """The column sums of a 2-D tile. tl.sum is a @jit helper decorated at triton's import (see tiles.py); its
    combine function is not called under the interpreter (which runs it as one np.sum), so reducing with it is
    safe in both modes."""
    return tl.reduce(t, 0, tl.standard._sum_combine)


@triton.jit
def gelu_erf(x):
    """Exact (erf) GELU, x * Phi(x), with Phi(-|x|) = erfc(|x| / sqrt 2) / 2 from the Chebyshev fit in
    Numerical Recipes (erfcc): erfc(z) = t * exp(-z^2 + P(t)), t = 1 / (1 + z / 2), relative error below
    1.2e-7 for every z >= 0: a reciprocal, nine FMAs and one exp. GELU's arithmetic bounds a GEMM epilogue over a
    wide output (ConvNeXt's pointwise layers, BERT's FFN); on those GEMMs this measured 1-9% faster than
    libdevice's erff (tl.erf) on an H100 (BENCHMARKS.md, eighth session). Where eager's 1 + erf(x) cancels
    (x below about -3) it keeps Phi's relative error small."""
    t = tl.fdiv(1.0, 1.0 + 0.3535533905932738 * tl.abs(x), ieee_rounding=False)
    p = 0.17087277 * t - 0.82215223
    p = p * t + 1.48851587
    p = p * t - 1.13520398
    p = p * t + 0.27886807
    p = p * t - 0.18628806
    p = p * t + 0.09678418
    p = p * t + 0.37409196
    p = p * t + 1.00002368
    p = p * t - 1.26551223
    half_erfc = 0.5 * t * tl.exp(p - 0.5 * x * x)
    return x * tl.where(x >= 0.0, 1.0 - half_erfc, half_erfc)
