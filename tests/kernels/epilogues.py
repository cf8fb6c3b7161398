"""Test helpers: random epilogue trees (hypothesis), operand tensors for them, and float64 references.

Entry points: `forced_split(n)` (a context manager), `trees()` (a strategy of (tree, slot roles)),
`poisoned_aux(tree, out)` and `check_aux(...)` (the aux output), `make_operand(role, kind, out_shape, channel_dim)`, `with_layout(t, how)`,
`reference(acc64, tree, operands, channel_dim)`, `assert_close(out, ref, dtype)` and `glu(tree, gate)` (a GLU's
paired tree).
"""
from __future__ import annotations

import contextlib
import math

import torch
from hypothesis import strategies as st

from resfuse import epilogue as epi
from resfuse import kernels
from resfuse.epilogue import ACC, Const, Op, Operand

UNARY = sorted(n for n, s in epi.OPS.items() if s.arity == 1 and n not in ("aux", "float32"))  # markers
ARITH = ("add", "sub", "mul", "div")
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _unary(draw, node):
    name = draw(st.sampled_from(UNARY))
    if name == "leaky_relu":
        return Op(name, (node,), (draw(st.sampled_from([0.01, 0.1, 0.2])),))
    if name == "clamp":
        lo = draw(st.sampled_from([-math.inf, -1.0, -0.25, 0.0]))
        hi = draw(st.sampled_from([math.inf, 0.5, 1.0, 6.0]))
        return Op(name, (node,), (lo, hi))
    return Op(name, (node,))


@st.composite
def trees(draw, kinds=("c", "nc", "full"), max_steps=4, aux=False):
    """A random epilogue over acc, and each operand slot's role: "any", "positive" or "denominator". With
    aux, one step (before, between or after the others) may mark its value for the aux output."""
    node, roles = ACC, []
    steps = draw(st.integers(1, max_steps))
    save_at = draw(st.integers(-1, steps)) if aux else -1  # -1: no aux node

    def operand(kind, role):
        roles.append((kind, role))
        return Operand(len(roles) - 1, kind)

    for i in range(steps + 1):
        if i == save_at:
            node = Op("aux", (node,))
        if i == steps:
            break
        step = draw(st.sampled_from(["unary", "binary", "binary", "bn", "drelu", "normalized"]))
        if step == "normalized":  # plus an operand normalized per channel: a folded shortcut batch norm
            args = (operand(draw(st.sampled_from(kinds)), "any"), operand("c", "any"), operand("c", "any"),
                    operand("c", "any"))
            node = Op("add", (node, Op("normalize", args)))
        elif step == "drelu":  # relu's gradient, masked by a (forward) tensor of any kind
            node = Op("threshold_bwd", (node, operand(draw(st.sampled_from(kinds)), "any")),
                      (draw(st.sampled_from([0.0, 0.5])),))
        elif step == "unary":
            node = _unary(draw, node)
        elif step == "bn":
            args = (operand("c", "any"), operand("c", "positive"), operand("c", "any"), operand("c", "any"))
            node = Op("bn", (node, *args), (draw(st.sampled_from([1e-5, 1e-3])),))
        else:
            name = draw(st.sampled_from(ARITH))
            if draw(st.booleans()):
                other = Const(draw(st.sampled_from([0.5, -1.5, 3.0])))
            else:
                other = operand(draw(st.sampled_from(kinds)), "denominator" if name == "div" else "any")
            # acc-side / operand only for div: operand / acc-side could divide by ~0
            swap = name != "div" and draw(st.booleans())
            node = Op(name, (other, node) if swap else (node, other))
    return node, roles


def glu(tree, gate: str, up_first: bool = False):
    """`tree` with its accumulator replaced by a GLU's pairing (epilogue.paired): gate(acc) times the up half, or the
    up half times gate(acc)."""
    pair = (Op(gate, (ACC,)), epi.UP)
    base = Op("mul", pair[::-1] if up_first else pair)

    def swap(n):
        return base if n == ACC else Op(n.name, tuple(map(swap, n.args)), n.params) if isinstance(n, Op) else n
    return swap(tree)


def _values(shape, role, dtype):
    if role == "positive":
        v = torch.rand(shape) + 0.5
    elif role == "denominator":
        v = (torch.rand(shape) * 1.5 + 0.5) * (torch.randint(0, 2, shape) * 2 - 1)
    else:
        v = torch.randn(shape)
    return v.to(dtype)


def make_operand(role: str, kind: str, out_shape, channel_dim: int, dtype, layout: int = 0) -> torch.Tensor:
    """A tensor broadcastable to out_shape that has the [S, P, C] structure of `kind`.

    `layout` picks the strides of a full tensor: 0 contiguous, 1 channels-last/transposed, 2 strided slice.
    """
    ndim = len(out_shape)
    cdim = channel_dim % ndim
    if kind == "c":
        shape = [1] * ndim
        shape[cdim] = out_shape[cdim]
        if ndim == 4 and layout % 2:
            shape = shape[1:]  # [C, 1, 1], the common conv-bias form
        return _values(shape, role, dtype)
    if kind == "nc":
        shape = [1] * ndim
        shape[0], shape[cdim] = out_shape[0], out_shape[cdim]
        return _values(shape, role, dtype)
    if layout == 0:
        return _values(list(out_shape), role, dtype)
    if layout == 1:  # channels innermost for conv, column-major for gemm
        perm = list(range(ndim))
        perm.remove(cdim)
        perm.append(cdim) if ndim == 4 else perm.insert(len(perm) - 1, cdim)
        base = _values([out_shape[i] for i in perm], role, dtype)
        return base.permute([perm.index(i) for i in range(ndim)])
    big = _values([s * 2 if i == ndim - 1 else s for i, s in enumerate(out_shape)], role, dtype)
    return big[..., ::2]


def with_layout(t: torch.Tensor, how: str) -> torch.Tensor:
    """`t` as "contiguous", "channels_last" (channels innermost, any rank) or "strided" (a slice of a larger
    tensor along the last dim, so every dim is strided)."""
    if how == "channels_last":
        if t.dim() == 4:
            return t.contiguous(memory_format=torch.channels_last)
        return t.movedim(1, -1).contiguous().movedim(-1, 1)
    if how == "strided":
        return torch.cat([t, t], dim=-1)[..., ::2]
    return t.contiguous()


def descriptor_slots(tree, operands, out_shape, channel_dim: int, split: int) -> tuple:
    """The operand slots the GEMM's TMA families read through tensor descriptors: full fp16/bf16 operands whose
    rows, the output's, form one row-major matrix with 16-byte aligned rows; none when the reduction is split."""
    return tuple(o.slot for o, t in zip(epi.operands(tree), operands)
                 if o.kind == "full" and split == 1 and _descriptor_matrix(t, out_shape, channel_dim))


def output_descriptor(out: torch.Tensor, channel_dim: int, split: int) -> bool:
    """Whether the GEMM's TMA families write `out` by bulk stores: as descriptor_slots' operands, no split."""
    return split == 1 and _descriptor_matrix(out, out.shape, channel_dim)


def _descriptor_matrix(t: torch.Tensor, out_shape, channel_dim: int) -> bool:
    """t (fp16/bf16) is one row-major matrix of the output's rows, its base and rows 16-byte aligned."""
    v = epi.rows3(t, out_shape, channel_dim)
    matrix = v.reshape(-1, v.shape[-1])  # a view only where the rows merge
    row = matrix.stride(0) if matrix.shape[0] > 1 else matrix.shape[1]  # one row: any stride would do
    return (t.dtype != torch.float32 and matrix.data_ptr() == t.data_ptr() and v.stride(-1) == 1
            and row * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0)


def reference(acc64: torch.Tensor, tree, operands, channel_dim: int) -> torch.Tensor:
    """The epilogue in float64 on a float64 accumulator, as [S, P, C] (a GLU's accumulator has 2C channels)."""
    acc3 = epi.rows3(acc64, acc64.shape, channel_dim)
    out_shape = list(acc64.shape)
    out_shape[channel_dim] //= 1 + epi.paired(tree)
    ops3 = [epi.rows3(t.double(), out_shape, channel_dim) for t in operands]
    return epi.reference(tree, acc3, ops3)


def poisoned_aux(tree, out: torch.Tensor) -> torch.Tensor | None:
    """A NaN-filled aux output laid out like `out` (in the inputs' dtype), or None when the tree has no aux."""
    if epi.aux_value(tree) is None:
        return None
    return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype).fill_(float("nan"))  # padded as out is


def check_aux(aux, acc64, tree, operands, channel_dim: int, dtype) -> None:
    """The aux output holds the value under the tree's aux node (nothing to check without one)."""
    if aux is None:
        return
    ref = reference(acc64, epi.aux_value(tree), operands, channel_dim)
    assert_close(epi.rows3(aux, aux.shape, channel_dim), ref, dtype)


def assert_close(out3: torch.Tensor, ref3: torch.Tensor, dtype, slack: float | torch.Tensor = 0.0) -> None:
    """out3 within the dtype's tolerance of the float64 reference, plus `slack`: the error eager itself makes where
    the inputs are ill-conditioned for the dtype (a caller that passes it measures it)."""
    assert not torch.isnan(out3).any(), "unwritten (NaN-poisoned) or NaN output"
    err = (out3.double() - ref3).abs()
    bound = TOL[dtype] * (1.0 + ref3.abs()) + slack
    bad = err > bound
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} elements off; worst error "
                           f"{float(err.max()):.3g}, tol {TOL[dtype]}")


@contextlib.contextmanager
def forced_split(value):
    """kernels.options()['split_k'] = value inside the block (a context, since hypothesis reruns the body)."""
    before = kernels.options()["split_k"]
    kernels.set_options(split_k=value)
    try:
        yield
    finally:
        kernels.set_options(split_k=before)
