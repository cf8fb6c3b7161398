"""The epilogue tree as Triton source, for every generated kernel (kernels/codegen.py, chain.py, shortcut.py,
max_pool.py, conv2d_image.py).

Entry points: `triton_params(tree, prefix)` (the operands' kernel parameters) and `triton_body(tree, ...)` (source
that loads them and computes the tree into a value). Each op's source comes from its `tl` in epilogue.OPS, beside
its reference math.
"""
from __future__ import annotations

from ..epilogue import ACC, OPS, UP, Const, Node, Operand, operands


def triton_params(tree: Node, prefix: str = "") -> list[str]:
    """Kernel parameters for the operands: a pointer and [S, P, C] strides each (names start with `prefix`, so
    that two epilogues can share a kernel: kernels/chain.py)."""
    return [f"{prefix}{p}{o.slot}" for o in operands(tree) for p in ("op", "op_sn", "op_sp", "op_sc")]


def triton_body(tree: Node, out: str = "y", tma_slots: tuple[int, ...] = (), prefix: str = "",
                given: dict[int, str] | None = None, out_ty: str = "tl.float32", swap: bool = False) -> str:
    """Source that loads the operands and assigns the epilogue value to `out` (and an aux node's to `aux_y`).

    It expects in scope: `acc` [BM, BC] fp32 (and for a paired tree `acc_up`, its up half: codegen's pairing),
    `offs_c` [BC], `mask_c` [BC], `s_idx` and `p_idx` [BM] (the sample and row of each output row), and `mask` [BM,
    BC]. A full operand whose slot is in `tma_slots` is a tensor descriptor of an [M, C] matrix whose rows are the
    output's, read as the [BM, BC] box at (row0, col0), which must be in scope too (boxes past the edges read zeros,
    as the masked loads do). The names it reads (parameters, as triton_params gives them) and defines (operand
    values, temporaries) start with `prefix`. An operand whose slot is in `given` is not loaded: its fp32 value is
    that expression, already in scope (its parameters are still taken, unread: kernels/shortcut.py computes a
    residual in the same kernel). `out_ty` is the element type (source) the value is stored or rounded to: the typed
    ops (GELU) compute to its precision, fp32's by default. With `swap` the tile is the transposed output's (a GEMM
    whose operands were swapped: kernels/launch.py's _swapped_plan): its rows are the output's channels and its
    columns the output's rows, all of one sample, so `p_idx` holds channels and `offs_c` rows. An operand keeps its
    [S, P, C] strides; a per-channel operand is then read along the tile's rows, under `row_ok` [BM] (in scope too),
    and a full one's P and C strides trade places.
    """
    lines = []
    op, v = f"{prefix}op", f"{prefix}v"
    for o in operands(tree):
        i = o.slot
        if given and i in given:
            lines.append(f"{v}{i} = {given[i]}")
        elif i in tma_slots:
            lines.append(f"{v}{i} = {op}{i}.load([row0, col0]).to(tl.float32)")
        elif swap and o.kind in ("c", "nc"):  # one sample: s_idx is 0
            lines.append(f"{v}{i} = tl.load({op}{i} + s_idx * {op}_sn{i} + p_idx * {op}_sc{i}, mask=row_ok, "
                         "other=0.0).to(tl.float32)[:, None]")
        elif swap:
            lines.append(f"{v}{i} = tl.load({op}{i} + s_idx[:, None] * {op}_sn{i} + p_idx[:, None] * {op}_sc{i} "
                         f"+ offs_c[None, :] * {op}_sp{i}, mask=mask, other=0.0).to(tl.float32)")
        elif o.kind == "c":
            lines.append(f"{v}{i} = tl.load({op}{i} + offs_c * {op}_sc{i}, mask=mask_c, other=0.0)"
                         ".to(tl.float32)[None, :]")
        else:
            rows = f"s_idx[:, None] * {op}_sn{i}" + (f" + p_idx[:, None] * {op}_sp{i}" if o.kind == "full" else "")
            lines.append(f"{v}{i} = tl.load({op}{i} + {rows} + offs_c[None, :] * {op}_sc{i}, mask=mask, other=0.0)"
                         ".to(tl.float32)")
    names: dict[Node, str] = {}

    def ev(n):
        if n == ACC:
            return "acc"
        if n == UP:
            return "acc_up"
        if isinstance(n, Operand):
            return f"{v}{n.slot}"
        if isinstance(n, Const):
            return repr(n.value)
        if n.name == "aux":
            lines.append(f"aux_y = {ev(n.args[0])}")
            return "aux_y"
        if n not in names:
            spec = OPS[n.name]
            expr = spec.tl(*[ev(a) for a in n.args], *n.params, *[out_ty] * spec.typed)
            names[n] = f"{prefix}t{len(names)}"
            lines.append(f"{names[n]} = {expr}")
        return names[n]

    lines.append(f"{out} = {ev(tree)}")
    return "\n".join(lines)
