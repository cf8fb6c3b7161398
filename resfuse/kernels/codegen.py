"""Epilogue code generation: one small Triton kernel per (kernel family, epilogue signature).

Entry point: `load(family, signature) -> kernel`, called by launch.py. The kernel calls its family's shared
@triton.jit mainloop (gemm.py, conv2d_fprop.py), reduces split-K partials (split_k.py), applies the epilogue
in fp32 (source from epilogue_source.triton_body) and stores in the output's dtype (and, for an epilogue with an aux
node, that node's value to the second output `aux`, at the same offsets; for a bn_stats root, each tile's
column sums of g and g * (x - mean), over the g it stored, to column `row_block` of the fp32 [2, C, stats_rows]
`stats`). Only this glue is generated;
the mainloops are written once. The source is written under <cache_dir>/kernels/<family>_<hash>.py and
imported from there, because Triton reads a kernel's source file, and so that a user can read what ran.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

from .. import epilogue as epi
from .activations import HELPERS
from .epilogue_source import triton_body, triton_params

# bump when the generated glue or a mainloop's calling convention changes, or when a family takes on ops whose
# cached winners were chosen without it (3: depthwise convs; 4: persistent GEMMs; 5: mainloops return row_block;
# 6: the GEMM's TMA families read full operands through descriptors; 7: the aten provider's lone bias as addmm
# and the cudnn provider's matmul graphs, candidates the cached winners never met; 8: each of cuDNN's first engine
# configs is its own candidate, and its winner's name is kept; 9: an inference batch norm is one multiply-add per
# element, and the chain kernel of two 1x1 convs is a candidate; 10: the TMA GEMMs' bulk-store variants; 11: split
# launches keep their tickets (no zeroing kernel) and a conv that under-fills the GPU gets 32-row tiles)
TEMPLATE_VERSION = 11

_LOADED: dict[tuple[str, str], object] = {}
_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Family:
    """What codegen needs to know to wrap a mainloop.

    The mainloop takes `args` then `constexprs` (which must include BM, BN and SPLIT_K) and returns
    (acc, tile, pid_k, s_idx, p_idx, row_ok, out_rows, offs_c, row_block): the fp32 partial [BM, BN], the tile
    number (the split-K ticket index), the split index, each row's sample and row within sample, which rows
    exist, each row's element offset in `out`, the output channels, and the tile's block of rows (tiles with
    one row_block cover the same rows; the blocks, numbered from 0, partition the output's rows). The kernel also
    takes `n_cols` (the channel count, already in args) and `s_out_c` (the output's channel stride).
    A persistent family names in `loop` the arg that holds its tile count: each program then walks the tiles
    program_id, program_id + programs, ... and its mainloop takes the tile number first. The loop is flattened
    with the mainloop's reduction loop (tl.range(flatten=True)), so that Triton's pipeliner may issue the next
    tile's loads during this tile's epilogue; a long epilogue (GELU) still measured as not overlapped.
    A family whose output rows are numbered 0..M-1 in one [M, n_cols] grid (the GEMM's TMA mainloops) names in
    `origin` the call, a function of its module, that gives a tile's first row and column from `tile` and its
    args: its full epilogue operands may then be read through TMA descriptors (`tma_slots`), whose bulk copies
    measured 10-30% faster than pointer loads on ResNet-50's 1x1 convs (bench/epilogue_prefetch.py).
    A family whose channel count is a multiple of a constexpr names it in `col_vec`: the channel mask then compares
    whole groups of that many channels, which keeps the loads and stores of a channel count such as 72 vectorised.
    A family that reads a weight names in `prefetch` the call, a function of its module over the kernel's args,
    that asks L2 for the program's weight tile (tiles.prefetch_rows); it runs first, where the constexpr PREFETCH
    is on (plan.prefetch_meta), before the kernel waits for the previous one. `swap_prefetch` is the same for the
    swapped variant (its weight is the product's other operand).
    """
    name: str
    module: str
    mainloop: str
    args: tuple[str, ...]
    constexprs: tuple[str, ...]
    n_cols: str
    s_out_c: str
    loop: str | None = None
    origin: str | None = None
    col_vec: str | None = None
    prefetch: str | None = None
    swap_prefetch: str | None = None


# A GLU's tile (epilogue.paired): the accumulator's columns alternate gate and up (passes/glu.py interleaves the
# weight's rows), so each pair of columns is one output channel. Splitting the [BM, BN] tile into its even and odd
# columns halves it; the channel indices follow, told to the compiler as BN // 2 consecutive ones from a multiple of
# BN // 2, which it cannot see through the split and the division, and the masks are computed again over them (a
# split mask's constancy is lost too). Without both, it stored one element a thread (bench/glu_kernels.py).
def _pairing(family: Family) -> str:
    half = f"({family.n_cols} // 2)"
    col_mask = f"offs_c // {family.col_vec} < {half} // {family.col_vec}" if family.col_vec else f"offs_c < {half}"
    return f"""acc, acc_up = tl.split(tl.reshape(acc, (BM, BN // 2, 2)))
offs_c = tl.max_contiguous(tl.multiple_of(tl.split(tl.reshape(offs_c, (BN // 2, 2)))[0] // 2, BN // 2), BN // 2)
mask_c = {col_mask}
mask = row_ok[:, None] & mask_c[None, :]
if SPLIT_K > 1:
    mask = mask & last
"""


def kernel_source(family: Family, signature: str, tma_slots: tuple[int, ...] = (), out_tma: bool = False,
                  swap: bool = False) -> str:
    """The generated kernel's source; the full operands in `tma_slots` are tensor descriptors (Family.origin), and
    with `out_tma` so is `out`: an [M, N] matrix the tile is written to by one bulk store, clipped at its edges,
    which leaves the warps to go on to the next tile while the copy drains (no split of the reduction). With `swap`
    the mainloop computes the transposed output, its rows the output's channels (epilogue_source.triton_body's swap)."""
    if (tma_slots or out_tma) and family.origin is None:
        raise ValueError(f"family {family.name} has no tile origin: its operands cannot be read through TMA")
    tree = epi.parse(signature)
    aux = epi.aux_value(tree) is not None  # a second output, laid out like `out`
    stats = epi.stats_node(tree)
    if swap and (stats or tma_slots or out_tma):
        raise ValueError("a swapped tile sums no statistics and reads no operand through TMA")
    paired = epi.paired(tree)
    if paired and (swap or stats or aux or tma_slots or out_tma):
        raise ValueError("a paired (GLU) tile has half the accumulator's columns: no swap, statistics, aux output "
                         "or TMA operands")
    params = ["out", *(["aux"] if aux else []), *(["stats", "stats_rows"] if stats else []), "ws", "tickets",
              *family.args, family.s_out_c, *triton_params(tree)]
    params += [f"{c}: tl.constexpr" for c in (*family.constexprs, "PDL", "PREFETCH")]
    call_args = ", ".join([*(["tile_id"] if family.loop else []), *family.args, *family.constexprs])
    aux_store = (f"tl.store(aux + out_rows[:, None] + offs_c[None, :] * {family.s_out_c}, "
                 "aux_y.to(aux.dtype.element_ty), mask=mask)") if aux else ""
    stats_store = ""
    out_ty = "out.dtype" if out_tma else "out.dtype.element_ty"  # a descriptor's dtype is its element type
    if stats:
        x, mean = (f"v{o.slot}" for o in stats.args[1:])
        stats_store = f"""# batch-norm backward's partial sums over the g just stored, as its own pass would read g
g_st = tl.where(mask, y.to({out_ty}).to(tl.float32), 0.0)
st = stats + offs_c * stats_rows + row_block  # [2, C, rows]: the sum over rows runs along contiguous memory
tl.store(st, sum_rows(g_st), mask=stat_ok)
tl.store(st + {family.n_cols} * stats_rows, sum_rows(g_st * ({x} - {mean})), mask=stat_ok)"""
    origin = f"row0, col0 = {family.origin}  # the tile's box in the TMA operands\n" if tma_slots or out_tma else ""
    col_mask = f"offs_c < {family.n_cols}"
    if family.col_vec:  # whole vectors of col_vec channels: the same mask, which Triton's loads and stores vectorise
        col_mask = f"offs_c // {family.col_vec} < {family.n_cols} // {family.col_vec}"
    store = f"tl.store(out + out_rows[:, None] + offs_c[None, :] * {family.s_out_c}, y.to({out_ty}), mask=mask)"
    if out_tma:  # clipped at the matrix's edges, so no mask; a split's partial sums would need one
        store = f'tl.static_assert(SPLIT_K == 1)\nout.store([row0, col0], y.to({out_ty}))'
    tile_body = f"""acc, tile, pid_k, s_idx, p_idx, row_ok, out_rows, offs_c, row_block = {family.mainloop}({call_args})
{origin}mask_c = {col_mask}
mask = row_ok[:, None] & mask_c[None, :]
stat_ok = mask_c
if SPLIT_K > 1:
    # Every split stores its partial; the last to arrive sums them all and runs the epilogue once.
    acc, last = split_k_reduce(acc, ws, tickets, tile, pid_k, BM, BN, SPLIT_K)
    mask = mask & last
    stat_ok = stat_ok & last
{_pairing(family) if paired else ""}# epilogue: {signature}
{triton_body(tree, out="y", tma_slots=tma_slots, out_ty=out_ty, swap=swap)}
{store}
{aux_store}
{stats_store}"""
    if family.loop:
        tile_body = (f"for tile_id in tl.range(tl.program_id(0), {family.loop}, tl.num_programs(0), flatten=True):\n"
                     + _indent(tile_body))
    tile_body = "dependent_launch(PDL)  # programmatic dependent launch: wait for the producer\n" + tile_body
    prefetch = family.swap_prefetch if swap else family.prefetch
    if prefetch:
        tile_body = f"if PREFETCH:  # the weight tile into L2 while the producer runs\n    {prefetch}\n" + tile_body
    param_lines = "\n".join(f"    {p}," for p in params)
    imports = ", ".join([family.mainloop, *([family.origin.split("(")[0]] if tma_slots or out_tma else []),
                         *([prefetch.split("(")[0]] if prefetch else [])])
    return f'''"""Generated by resfuse.kernels.codegen (template version {TEMPLATE_VERSION}); do not edit.

Family: {family.name}{" (swapped)" if swap else ""}. Epilogue: {signature}
"""
import triton
import triton.language as tl

from {family.module} import {imports}
from resfuse.kernels.activations import {", ".join(HELPERS)}
from resfuse.kernels.split_k import split_k_reduce
from resfuse.kernels.tiles import dependent_launch


@triton.jit
def resfuse_{family.name}(
{param_lines}
):
{_indent(tile_body)}'''


def _indent(source: str) -> str:
    return textwrap.indent(source, "    ")


def _cache_dir() -> Path:
    from . import options
    base = options()["cache_dir"]
    if base is None:
        from ..config import Config
        base = Config.from_env().cache_dir
    return Path(base) / "kernels"


def _write_if_changed(path: Path, source: str) -> None:
    if path.exists() and path.read_text() == source:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    # write-then-rename, so a concurrent process never imports a half-written file
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(source)
    os.replace(tmp, path)


def load(family: Family, signature: str, tma_slots: tuple[int, ...] = (), out_tma: bool = False,
         swap: bool = False):
    """The generated kernel for this family and epilogue (its full operands in `tma_slots`, and with `out_tma` its
    output, through tensor descriptors; with `swap`, for the transposed output), built on first use and cached
    in-process."""
    return load_source(family.name, variant(signature, tma_slots, out_tma, swap),
                       lambda: kernel_source(family, signature, tma_slots, out_tma, swap))


def variant(signature: str, tma_slots: tuple[int, ...] = (), out_tma: bool = False, swap: bool = False) -> str:
    """The in-process cache's name for a kernel of this signature whose operands in `tma_slots` (and with
    `out_tma`, whose output) are descriptors, or (`swap`) whose tile is the transposed output's."""
    return (signature + (f"|tma{','.join(map(str, tma_slots))}" if tma_slots else "")
            + ("|out" if out_tma else "") + ("|swap" if swap else ""))


def load_source(family: str, signature: str, source):
    """The kernel `resfuse_<family>` that `source()` writes for `signature` (a kernel not built on a Family's
    template: max_pool.py's; or a variant of the signature), built on first use and cached in-process."""
    key = (family, signature)
    with _LOCK:
        if key in _LOADED:
            return _LOADED[key]
        digest = hashlib.sha256(f"{family}|{signature}|{TEMPLATE_VERSION}".encode()).hexdigest()[:16]
        path = _cache_dir() / f"{family}_{digest}.py"
        _write_if_changed(path, source())
        name = f"resfuse_generated.{family}_{digest}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # Triton resolves the kernel's globals through its module
        spec.loader.exec_module(module)
        _LOADED[key] = getattr(module, f"resfuse_{family}")  # the profiler's name for it
        return _LOADED[key]
