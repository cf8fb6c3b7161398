"""The epilogue IR: one small frozen tree per fused op, and everything derived from it.

A tree has five kinds of node: `Acc` (the conv/GEMM accumulator), `Up` (a GLU's other half: see below), `Operand`
(a tensor argument: a per-channel vector "c", a per-(sample, channel) vector "nc", or a "full" tensor with its own
strides), `Const`, and `Op` (a unary or binary op from OPS, with float parameters). From a tree we derive:
  str(tree) / parse()   the canonical signature, passed to the custom ops and used as the cache key;
  pattern_ops()         the op labels from the accumulator outwards, e.g. ["bn", "add", "relu"];
  reference()           the math in torch, on [samples, rows, channels] views (see rows3);
  aux_value()           the subtree an "aux" node marks: its value is the op's second output (training saves it);
  stats_node()          a root "bn_stats" node: the op also reduces batch-norm backward's two sums per channel;
  triton_body()         Triton source that loads the operands and computes the tree (kernels/epilogue_source.py,
                        from each op's `tl` in OPS).

Every fused output is seen as a [S, P, C] array: S samples, P rows per sample, C channels. A conv output
[N, K, OH, OW] is [N, OH*OW, K]; an mm output [M, N] is [1, M, N]; a bmm output [B, M, N] is [B, M, N]. An
operand is any tensor that broadcasts to the output; rows3() gives its [S, P, C] strides, and a zero stride
is a broadcast.

A paired tree (one that reads `Up`, e.g. SwiGLU's mul(silu(acc), up)) is a gated linear unit's: the GEMM's weight
interleaves the gate's and the up projection's output channels (passes/glu.py), so the accumulator has twice the
output's channels, and output channel j reads the gate's value at column 2j (`acc`) and the up's at 2j + 1 (`up`).
Every operand is the output's shape; `reference` pairs the columns, the kernels split each tile's accumulator.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Callable, Union

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class Acc:
    def __str__(self):
        return "acc"


@dataclasses.dataclass(frozen=True)
class Up:
    def __str__(self):
        return "up"


@dataclasses.dataclass(frozen=True)
class Operand:
    slot: int
    kind: str  # "c" per channel, "nc" per (sample, channel), "full"

    def __str__(self):
        return f"{self.kind}{self.slot}"


@dataclasses.dataclass(frozen=True)
class Const:
    value: float

    def __str__(self):
        return f"#{self.value!r}"


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    args: tuple
    params: tuple = ()

    def __str__(self):
        p = f"[{','.join(f'#{float(v)!r}' for v in self.params)}]" if self.params else ""
        return f"{self.name}{p}({','.join(map(str, self.args))})"


Node = Union[Acc, Up, Operand, Const, Op]
ACC = Acc()
UP = Up()
LONE_BIAS = Op("add", (ACC, Operand(0, "c")))  # a conv's or a linear layer's bias, and nothing after it


# ---- the op table: reference math and Triton source, side by side --------------------------------------
def _tanh_tl(x: str) -> str:
    # Triton's interpreter has no libdevice; this form is exact to fp32 rounding on both paths:
    # a short series near 0 (where 1 - exp(-2|x|) cancels) and the exp form elsewhere.
    return (f"tl.where(tl.abs({x}) < 0.0625, {x} * (1.0 - {x} * {x} / 3.0 + 2.0 * {x} * {x} * {x} * {x} / 15.0), "
            f"tl.where({x} < 0.0, -1.0, 1.0) * (1.0 - tl.exp(-2.0 * tl.abs({x}))) / (1.0 + tl.exp(-2.0 * tl.abs({x}))))")


def _clamp_tl(x: str, lo: float, hi: float) -> str:
    nan = "propagate_nan=tl.PropagateNan.ALL"
    out = x
    if lo != -math.inf:
        out = f"tl.maximum({out}, {lo!r}, {nan})"
    if hi != math.inf:
        out = f"tl.minimum({out}, {hi!r}, {nan})"
    return out


def _small(t: torch.Tensor) -> torch.Tensor:
    """A broadcast [S, P, C] operand view without its stride-0 dims (so math on it stays vector-sized)."""
    for d in range(t.dim() - 1):
        if t.stride(d) == 0 and t.shape[d] > 1:
            t = t.narrow(d, 0, 1)
    return t


def _bn_ref(x, m, v, w, b, eps):
    # as eager's kernel does it: a per-channel scale and shift, then one pass over x (the unfused ATen path
    # runs this on full activations; evaluated term by term it took ~10x eager's batch norm)
    scale = _small(w) * torch.rsqrt(_small(v) + eps)
    return torch.addcmul(_small(b) - _small(m) * scale, x, scale)


def _bn_tl(x: str, scale: str, m: str, b: str) -> str:
    # as _bn_ref: a scale and shift per channel, computed on the [1, C] vectors (the compiler merges the two
    # copies of the scale), then one multiply-add per element instead of a subtract and two multiplies and an add
    return f"({x} * {scale} + ({b} - {m} * {scale}))"


@dataclasses.dataclass(frozen=True)
class OpSpec:
    arity: int
    ref: Callable  # (*tensors, *params) -> tensor
    tl: Callable  # (*source strings, *params) -> source string; typed: (*source strings, *params, out_ty)
    typed: bool = False  # tl also takes the stored value's element type (source), which sets its precision
    # bumped when the op's Triton code changes speed: the tuner measures again the epilogues that hold it, and only
    # those (tuning/choose.key; codegen.TEMPLATE_VERSION re-tunes everything)
    version: int = 0


OPS: dict[str, OpSpec] = {
    "add": OpSpec(2, lambda a, b: a + b, lambda a, b: f"({a} + {b})"),
    "sub": OpSpec(2, lambda a, b: a - b, lambda a, b: f"({a} - {b})"),
    "mul": OpSpec(2, lambda a, b: a * b, lambda a, b: f"({a} * {b})"),
    "div": OpSpec(2, lambda a, b: a / b, lambda a, b: f"({a} / {b})"),
    "relu": OpSpec(1, torch.relu, lambda x: _clamp_tl(x, 0.0, math.inf)),
    "clamp": OpSpec(1, lambda x, lo, hi: torch.clamp(x, lo, hi), _clamp_tl),
    "leaky_relu": OpSpec(1, lambda x, a: F.leaky_relu(x, a), lambda x, a: f"tl.where({x} > 0.0, {x}, {x} * {a!r})"),
    # 1: a shorter fit for fp16/bf16 outputs
    "gelu": OpSpec(1, F.gelu, lambda x, ty: f"gelu_erf({x}, {ty})", typed=True, version=1),  # kernels/activations.py
    # 1 each: no IEEE division for fp16/bf16 outputs (kernels/activations.py); gelu_tanh as x * sigmoid(2u), which
    # does not cancel where 1 + tanh(u) does
    "gelu_tanh": OpSpec(1, lambda x: F.gelu(x, approximate="tanh"), lambda x, ty: (
        f"logistic_div({x}, 1.5957691216057308 * ({x} + 0.044715 * {x} * {x} * {x}), {ty})"), typed=True, version=1),
    "silu": OpSpec(1, F.silu, lambda x, ty: f"logistic_div({x}, {x}, {ty})", typed=True, version=1),
    "sigmoid": OpSpec(1, torch.sigmoid, lambda x, ty: f"logistic_div(1.0, {x}, {ty})", typed=True, version=1),
    "hardswish": OpSpec(1, F.hardswish, lambda x, ty: f"sixth({x} * {_clamp_tl(f'({x} + 3.0)', 0.0, 6.0)}, {ty})",
                        typed=True, version=1),
    "hardsigmoid": OpSpec(1, F.hardsigmoid, lambda x, ty: f"sixth({_clamp_tl(f'({x} + 3.0)', 0.0, 6.0)}, {ty})",
                          typed=True, version=1),
    "tanh": OpSpec(1, torch.tanh, _tanh_tl),
    # relu's gradient (aten.threshold_backward): the incoming gradient where the forward input y was above the
    # threshold, else 0; params: threshold
    "threshold_bwd": OpSpec(2, lambda g, y, t: torch.where(y <= t, torch.zeros_like(g), g),
                            lambda g, y, t: f"tl.where({y} <= {t!r}, 0.0, {g})"),
    # the output is stored in fp32 (the epilogue math already is): mixed-precision graphs add an fp16/bf16 GEMM
    # or conv to an fp32 tensor, which promotes; only ever the root of a tree (see out_dtype)
    "float32": OpSpec(1, lambda x: x, lambda x: x),
    # the value of its argument, which the fused op also stores to its second output, the aux output: the
    # pre-activation that a training graph saves for the activation's backward (at most one per tree)
    "aux": OpSpec(1, lambda x: x, lambda x: x),
    # the value of its first argument g, a batch norm's output gradient; the op also reduces, per channel, sum(g)
    # and sum(g * (x - mean)) over the g it stores (rounded to the output dtype), x and mean its second and third
    # arguments: the partial sums of that batch norm's backward (kernels/batch_norm_bwd.py). Only ever the root.
    "bn_stats": OpSpec(3, lambda g, x, mean: g, lambda g, x, mean: g),
    # inference batch norm over per-channel mean, var, weight, bias; params: eps
    "bn": OpSpec(5, lambda x, m, v, w, b, eps: _bn_ref(x, m, v, w, b, eps), lambda x, m, v, w, b, eps: _bn_tl(
        x, f"({w} * tl.rsqrt({v} + {eps!r}))", m, b)),
    # training batch norm's affine step over per-channel mean, scale (invstd * weight) and shift (bias), as
    # kernels/batch_norm.py applies it: a residual block's shortcut batch norm, folded into the main path's
    # batch norm, normalizes its input here (passes/shortcut_bn.py); the reference, as bn's, folds the per-channel
    # terms first and makes one pass over x
    "normalize": OpSpec(4, lambda x, m, s, t: torch.addcmul(_small(t) - _small(m) * _small(s), x, _small(s)),
                        lambda x, m, s, t: f"(({x} - {m}) * {s} + {t})"),
}
BINARY = frozenset(n for n, s in OPS.items() if s.arity == 2)


def op_versions(signature: str) -> str:
    """The versioned ops in a signature (or in a pair's 'sig1;sig2') with their versions, '' when none: part of
    a tuning key."""
    names, stack = set(), [parse(part) for part in signature.split(";")]
    while stack:  # a loop, as operands() walks a tree
        n = stack.pop()
        if isinstance(n, Op):
            names.add(n.name)
            stack.extend(n.args)
    return "".join(f"+{name}{OPS[name].version}" for name in sorted(names) if OPS[name].version)


# ---- structure --------------------------------------------------------------------------------------------
def contains_acc(node: Node) -> bool:
    return node == ACC or (isinstance(node, Op) and any(contains_acc(a) for a in node.args))


def paired(node: Node) -> bool:
    """Does the tree read a GLU's up half (its accumulator then holds the gate's and the up's columns, interleaved)?"""
    return node == UP or (isinstance(node, Op) and any(paired(a) for a in node.args))


def operands(node: Node) -> list[Operand]:
    """The tree's operands in slot order (each slot once). A loop, not a nested recursive function: that would be
    a reference cycle on every call, left for the garbage collector (fused ops call this per launch)."""
    found: dict[int, Operand] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, Operand):
            found[n.slot] = n
        elif isinstance(n, Op):
            stack.extend(reversed(n.args))
    return [found[s] for s in sorted(found)]


def label(op: Op) -> str:
    """The name a user sees for one epilogue step."""
    if op.name == "add" and any(isinstance(a, Operand) and a.kind == "c" for a in op.args):
        return "bias"
    if op.name == "clamp":
        return "relu6" if tuple(op.params) == (0.0, 6.0) else "clamp"
    return {"gelu_tanh": "gelu", "threshold_bwd": "drelu", "float32": "to_fp32", "aux": "save",
            "bn_stats": "bn_sums", "normalize": "bn"}.get(op.name, op.name)


def pattern_ops(node: Node) -> list[str]:
    """Labels along the path from the accumulator to the root, innermost first."""
    if not isinstance(node, Op):
        return []
    inner = next(a for a in node.args if contains_acc(a))
    return pattern_ops(inner) + [label(node)]


def full_adds(node: Node) -> int:
    """How many same-shape tensor adds the tree holds (FuseAddToOutput allows one per producer); a full operand
    that a folded batch norm normalizes still counts."""
    if not isinstance(node, Op):
        return 0
    own = node.name == "add" and any(normalized_operand(a) or (isinstance(a, Operand) and a.kind == "full")
                                     for a in node.args)
    return int(own) + sum(full_adds(a) for a in node.args)


def fold_bn(tree: Node, slot: int) -> tuple[Node, Op] | None:
    """Inference's weight folding: (the tree with its batch norm of the accumulator, bn[eps](acc, mean, var,
    weight, bias), replaced by a shift, add(acc, c<slot>), and that bn node), or None where no batch norm reads
    the accumulator. The conv's weight then carries the scale weight * rsqrt(var + eps) per output channel and
    the shift is bias - mean * scale (providers/fold_bn.py's Fold)."""
    found: list[Op] = []
    folded = _shift_for_bn(tree, slot, found)
    return (folded, found[0]) if found else None


def _shift_for_bn(n: Node, slot: int, found: list) -> Node:
    if isinstance(n, Op) and n.name == "bn" and n.args[0] == ACC:
        found.append(n)
        return Op("add", (ACC, Operand(slot, "c")))
    return Op(n.name, tuple(_shift_for_bn(a, slot, found) for a in n.args), n.params) if isinstance(n, Op) else n


def normalized_operand(node: Node) -> Operand | None:
    """The full operand that `node`, a normalize step, normalizes, or None."""
    if isinstance(node, Op) and node.name == "normalize" and isinstance(node.args[0], Operand):
        return node.args[0]
    return None


def aux_value(node: Node) -> Node | None:
    """The subtree whose value the op stores as its aux output, or None when the tree has no aux node."""
    if not isinstance(node, Op):
        return None
    if node.name == "aux":
        return node.args[0]
    return next((v for v in map(aux_value, node.args) if v is not None), None)


def stats_node(tree: Node) -> Op | None:
    """The root bn_stats node, or None (the op then has no statistics output)."""
    return tree if isinstance(tree, Op) and tree.name == "bn_stats" else None


def stats_reference(tree: Node, y3: torch.Tensor, ops3: list[torch.Tensor]) -> torch.Tensor:
    """The [2, C] sums a bn_stats root asks for, from the op's stored output y3 ([S, P, C]), in fp32 or wider."""
    x_node, mean_node = tree.args[1:]
    g = y3.to(torch.promote_types(y3.dtype, torch.float32)).reshape(-1, y3.shape[-1])
    x = ops3[x_node.slot].to(g.dtype).reshape(-1, y3.shape[-1])
    mean = ops3[mean_node.slot][0, 0].to(g.dtype)
    return torch.stack([g.sum(0), (g * (x - mean)).sum(0)])


MONOTONE = frozenset({"add", "sub", "mul", "div", "bn", "relu", "clamp", "leaky_relu", "sigmoid", "tanh",
                      "hardsigmoid"})


def monotone_refusal(node: Node) -> str | None:
    """Why the tree may not be monotone in acc within one channel of one sample (None: it is). Every step on
    the path from acc must be a monotone op of one argument on that path (acc not a divisor), and every other
    argument a constant or a per-channel (or per sample and channel) operand. Rounding keeps each step
    monotone, so this holds for the computed values too (kernels/max_pool.py relies on it)."""
    if node == ACC:
        return None
    if not isinstance(node, Op) or node.name not in MONOTONE:
        return f"{label(node) if isinstance(node, Op) else node} is not monotone"
    if node.name == "leaky_relu" and node.params[0] < 0:
        return "leaky_relu with a negative slope is not monotone"
    on_path = [i for i, a in enumerate(node.args) if contains_acc(a)]
    if len(on_path) != 1 or (node.name == "div" and on_path != [0]):
        return f"{node.name} of acc with acc" if len(on_path) != 1 else "a division by acc is not monotone"
    for i, a in enumerate(node.args):
        if i != on_path[0] and not (isinstance(a, Const) or (isinstance(a, Operand) and a.kind in ("c", "nc"))):
            return f"{node.name} with an operand that varies within a channel"
    return monotone_refusal(node.args[on_path[0]])


def out_dtype(tree: Node, default: torch.dtype) -> torch.dtype:
    """The fused output's dtype: fp32 under a root float32 marker, else the anchor's (`default`)."""
    return torch.float32 if isinstance(tree, Op) and tree.name == "float32" else default


def without_cast(tree: Node) -> Node:
    return tree.args[0] if isinstance(tree, Op) and tree.name == "float32" else tree


# ---- signature round trip ---------------------------------------------------------------------------------
_TOKEN = re.compile(r"\s*(?:(?P<num>#[^,()\]]+)|(?P<name>[a-z_]+\d*)|(?P<punct>[\[\](),]))")


@functools.lru_cache(maxsize=None)
def parse(signature: str) -> Node:
    """Inverse of str(tree)."""
    tokens = [m.group(m.lastgroup) for m in _TOKEN.finditer(signature)]
    pos = 0

    def take():
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def node():
        tok = take()
        if tok.startswith("#"):
            return Const(float(tok[1:]))
        if tok == "acc":
            return ACC
        if tok == "up":
            return UP
        leaf = re.fullmatch(r"(c|nc|full)(\d+)", tok)
        if leaf:
            return Operand(int(leaf.group(2)), leaf.group(1))
        params = []
        if tokens[pos] == "[":
            take()
            while tokens[pos] != "]":
                params.append(float(take()[1:]))
                if tokens[pos] == ",":
                    take()
            take()
        assert take() == "(", signature
        args = [node()]
        while take() == ",":
            args.append(node())
        if tok not in OPS or len(args) != OPS[tok].arity:
            raise ValueError(f"bad epilogue signature {signature!r} at {tok!r}")
        return Op(tok, tuple(args), tuple(params))

    tree = node()
    if pos != len(tokens):
        raise ValueError(f"trailing tokens in epilogue signature {signature!r}")
    return tree


# ---- the [samples, rows, channels] view ------------------------------------------------------------------
def rows3(t: torch.Tensor, out_shape, channel_dim: int) -> torch.Tensor:
    """View `t` (broadcastable to out_shape) as [S, P, C]; broadcast dims get stride 0."""
    t = t.expand(out_shape).movedim(channel_dim, -1)
    if t.dim() == 2:
        return t.unsqueeze(0)
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])  # not -1: ambiguous for a 0 batch


def operand_views(tree: Node, tensors, out_shape, channel_dim: int) -> list[torch.Tensor]:
    """[S, P, C] views of a fused op's operands. A 1-D "c" operand (conv bias, BN statistics) lies along the
    channel dim, which numpy broadcasting alone would not give for a conv's [N, C, H, W]."""
    nd = len(out_shape)
    views = []
    for o, t in zip(operands(tree), tensors):
        if o.kind == "c" and t.dim() == 1:
            t = t.view([-1 if d == channel_dim % nd else 1 for d in range(nd)])
        views.append(rows3(t, out_shape, channel_dim))
    return views


def operand_kind(t3: torch.Tensor) -> str:
    s_n, s_p, _ = t3.stride()
    if s_p == 0 or t3.shape[1] == 1:
        return "c" if (s_n == 0 or t3.shape[0] == 1) else "nc"
    return "full"


def reference(tree: Node, acc3: torch.Tensor, ops3: list[torch.Tensor]) -> torch.Tensor:
    """Evaluate the tree on an [S, P, C] accumulator, in acc3's dtype ([S, P, 2C] for a paired tree: output channel
    j's gate at column 2j, its up half at 2j + 1)."""
    up = None
    if paired(tree):
        acc3, up = acc3[..., 0::2], acc3[..., 1::2]
    return _evaluate(tree, acc3, ops3, up).expand_as(acc3)


def _evaluate(n: Node, acc3: torch.Tensor, ops3: list[torch.Tensor], up: torch.Tensor | None) -> torch.Tensor:
    # module level: a nested recursive function would hold acc3 and the operands in a reference cycle until
    # the garbage collector ran (tensors of every unfused or CPU call kept alive past it)
    if n == ACC:
        return acc3
    if n == UP:
        return up
    if isinstance(n, Operand):
        return ops3[n.slot].to(acc3.dtype)
    if isinstance(n, Const):
        return torch.tensor(n.value, dtype=acc3.dtype)
    return OPS[n.name].ref(*[_evaluate(a, acc3, ops3, up) for a in n.args], *n.params)
