"""resfuse::conv2d_shortcut: a fused 1x1 conv whose residual operand is another fused 1x1 conv's output, as one op.

    conv2d_shortcut(y, w1, operands1, epilogue1, slot, x, w2, operands2, epilogue2, stride, provider) -> z
    r = conv2d(x, w2, operands2, epilogue2, stride)    z = conv2d(y, w1, operands1 with r at `slot`, epilogue1)

passes/shortcut_conv.py puts it into inference graphs in place of a downsampling bottleneck's two resfuse::conv2d
calls (its shortcut conv, and its last conv, which absorbed the residual add). On the GPU the tuner (op
"conv2d_shortcut") measures our kernel (kernels/shortcut.py: r is never written) against the two convs as each was
tuned on its own (provider "separate"), and the faster runs. Elsewhere, and wherever the kernel refuses the shapes,
the two convs run as two ops. PATHS records "triton" or "separate".

The kernel has two forms. With two epilogues, it computes r's tile, applies the shortcut's epilogue and holds r in
registers for the main one. Where both epilogues are batch norms and the main one adds r to its own (a ResNet's
relu(bn1(acc) + r)), the sum form folds both into the weights (`summed`), so that both reductions share one
accumulator: relu(y @ (w1 * s1) + x @ (w2 * s2) + t1 + t2). That leaves the registers for wider tiles; it measured
1.2-2.2x over the two convs on ResNet-50's blocks, against 1.0-1.7x for the two-epilogue form (BENCHMARKS.md,
thirty-second session).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import torch

from .. import epilogue as epi
from . import fused, library
from .chain import ONE, run_pair

UNPADDED = ([0, 0], [1, 1])  # the shortcut conv's padding and dilation


def call_of(y, w1, operands1, epilogue1, slot, x, w2, operands2, epilogue2, stride):
    """The tuner's description of one such pair: inputs (y, w1, x, w2), both epilogues' operands in one list,
    params (how many are the first's, the residual's slot in the first, the shortcut's stride), the two
    signatures joined by ";", and z as its output."""
    from ..tuning.choose import Call

    return Call("conv2d_shortcut", (y, w1, x, w2), [*operands1, *operands2], f"{epilogue1};{epilogue2}",
                (len(operands1), slot, list(stride)), _output(y, w1, epilogue1))


def _output(y, w1, epilogue1) -> fused.Output:
    return _cached_output(tuple(y.shape), y.stride(), y.dtype, y.device, tuple(w1.shape), w1.stride(), epilogue1)


@functools.lru_cache(maxsize=None)
def _cached_output(y_shape, y_strides, dtype, device, w1_shape, w1_strides, epilogue1) -> fused.Output:
    """The main conv's output, as conv2d(y, w1) lays it out; cached, as call_of runs on every call."""
    def meta(shape, strides):
        return torch.empty_strided(shape, strides, dtype=dtype, device="meta")
    out = fused.conv_output(meta(y_shape, y_strides), meta(w1_shape, w1_strides), epilogue1, *ONE)
    return fused.Output(out.shape, out.strides, out.dtype, device)


def parts(call):
    """(operands1, epilogue1, slot, operands2, epilogue2, stride) of a Call; operands1 without the residual."""
    n, slot, stride = call.params
    epilogue1, epilogue2 = call.signature.split(";")
    return call.operands[:n], epilogue1, slot, call.operands[n:], epilogue2, stride


def run_kernel(call, config, z: torch.Tensor | None = None, values: bool = True) -> torch.Tensor:
    """Our kernel with `config` (None: its heuristic default, the sum form's where the op folds), into z (allocated
    when None). A config with `fold` runs the sum form (`summed`), or where that does not apply or a fold overflows,
    the two epilogues. Without `values`, the sum form's kernel on unfolded weights and unset shifts: what
    precompile's dry run compiles, the launch of the same kernel, not its result."""
    from .. import kernels
    from ..tuning import space

    ops1, sig1, slot, ops2, sig2, stride = parts(call)
    y, w1, x, w2 = call.inputs
    z = call.out.empty() if z is None else z
    config = config or space.module(call).default_config(space.problem(call))
    if config.fold:
        one = summed(call, values)
        if one is not None:
            w1, w2, operands, signature = one
            return kernels.conv2d_shortcut(y, w1, operands, signature, None, x, w2, [], None, stride, z, config)
        config = dataclasses.replace(config, fold=False)
    return kernels.conv2d_shortcut(y, w1, ops1, sig1, slot, x, w2, ops2, sig2, stride, z, config)


def summed(call, values: bool = True):
    """(w1, w2, operands, signature) of the pair as one sum of convs, bn1(y @ w1) + bn2(x @ w2) = y @ (w1 * s1) +
    x @ (w2 * s2) + (t1 + t2): both batch norms folded into their weights (providers/fold_bn.py's Folds, which a
    CUDA graph keeps in step with the parameters), their shifts added in the epilogue. None where the epilogues
    are not of that form (`summed_tree`) or a fold overflows fp16. The residual is then not rounded to fp16 before
    the add, as the unfused path rounds it: closer to the float64 value, not bit-equal to eager's. Without `values`,
    unfolded weights and unset shifts of the same shapes (fold_bn.folded_form)."""
    from ..providers import fold_bn

    found = _fold_parts(call)
    if found is None:
        return None
    tree, halves = found
    fold = fold_bn.folded_call if values else fold_bn.folded_form
    main, short = (fold(half) for half in halves)
    if main is None or short is None:
        return None
    operands = [main.operands[o.slot] if o.slot < len(main.operands) else short.operands[-1]
                for o in epi.operands(tree)]
    return main.inputs[1], short.inputs[1], operands, _compact(tree)


def foldable(call) -> bool:
    """Can the op run as the sum form (its epilogues' form, and both batch norms' vectors one value a channel)?"""
    return _fold_parts(call) is not None


def _fold_parts(call) -> tuple | None:
    """(the sum form's tree, the pair's two convs as fused conv2d Calls: the main one with y standing in for its
    residual, then the shortcut) where the op can run as the sum form, else None."""
    from ..providers import fold_bn

    ops1, sig1, slot, ops2, sig2, stride = parts(call)
    tree = summed_tree(sig1, slot, len(ops1) + 1, sig2)
    if tree is None:
        return None
    y, w1, x, w2 = call.inputs
    halves = (fused.call_of("conv2d", (y, w1), [*ops1[:slot], y, *ops1[slot:]], sig1, ONE),
              fused.call_of("conv2d", (x, w2), ops2, sig2, (stride, *UNPADDED)))
    return None if any(map(fold_bn.fold_refusal, halves)) else (tree, halves)


@functools.lru_cache(maxsize=None)
def summed_tree(signature1: str, slot: int, shift: int, signature2: str) -> epi.Node | None:
    """The main epilogue as the sum form's: its batch norm folded (operand `shift` its shift), and
    add(shift form, residual) replaced by add(add(acc, c<shift>), c<shift + 1>), the shortcut's folded shift. None
    unless the shortcut's epilogue is its batch norm alone and the main's adds the residual straight to its batch
    norm, the accumulator and the residual read nowhere else (a downsampling bottleneck's relu(bn(acc) + r))."""
    tree2 = epi.parse(signature2)
    if not (isinstance(tree2, epi.Op) and tree2.name == "bn" and tree2.args[0] == epi.ACC):
        return None
    found = epi.fold_bn(epi.parse(signature1), shift)
    if found is None:
        return None
    folded, residual = found[0], {epi.Operand(slot, "full"), epi.Operand(slot, "nc")}
    norm = epi.Op("add", (epi.ACC, epi.Operand(shift, "c")))
    both = epi.Op("add", (norm, epi.Operand(shift + 1, "c")))

    def merge(n):
        if isinstance(n, epi.Op) and n.name == "add" and len({*n.args} & residual) == 1 and norm in n.args:
            return both
        return epi.Op(n.name, tuple(map(merge, n.args)), n.params) if isinstance(n, epi.Op) else n

    tree = merge(folded)
    if _count(tree, epi.ACC) != 1 or _count(folded, epi.ACC) != 1 or any(o.slot == slot for o in epi.operands(tree)):
        return None
    return tree


def _count(n, leaf) -> int:
    return (n == leaf) + (sum(_count(a, leaf) for a in n.args) if isinstance(n, epi.Op) else 0)


def _compact(tree) -> str:
    """The tree with its operands numbered 0, 1, ... in slot order (the kernel's operand list holds those alone)."""
    index = {o.slot: i for i, o in enumerate(epi.operands(tree))}

    def renumber(n):
        if isinstance(n, epi.Operand):
            return epi.Operand(index[n.slot], n.kind)
        return epi.Op(n.name, tuple(map(renumber, n.args)), n.params) if isinstance(n, epi.Op) else n
    return str(renumber(tree))


def run_separate(call, provider: str = "triton") -> torch.Tensor:
    """The two fused convs as two ops, each as the tuner chose for it on its own."""
    ops1, sig1, slot, ops2, sig2, stride = parts(call)
    y, w1, x, w2 = call.inputs
    r = fused._conv2d(x, w2, ops2, sig2, stride, *UNPADDED, provider, None)
    return fused._conv2d(y, w1, [*ops1[:slot], r, *ops1[slot:]], sig1, *ONE, provider, None)


def reference(call) -> torch.Tensor:
    """The unfused ATen computation of both convs, in the call's dtypes (the tuner upcasts them)."""
    ops1, sig1, slot, ops2, sig2, stride = parts(call)
    y, w1, x, w2 = call.inputs
    r = fused.conv2d_reference(x, w2, ops2, sig2, stride, *UNPADDED,
                               fused.conv_output(x, w2, sig2, stride, *UNPADDED).empty())
    return fused.conv2d_reference(y, w1, [*ops1[:slot], r, *ops1[slot:]], sig1, *ONE, call.out.empty())


def conv2d_shortcut_impl(y: torch.Tensor, w1: torch.Tensor, operands1: Sequence[torch.Tensor], epilogue1: str,
                         slot: int, x: torch.Tensor, w2: torch.Tensor, operands2: Sequence[torch.Tensor],
                         epilogue2: str, stride: Sequence[int], provider: str) -> torch.Tensor:
    call = call_of(y, w1, list(operands1), epilogue1, slot, x, w2, list(operands2), epilogue2, list(stride))
    return run_pair(call, provider, run_kernel, run_separate)


conv2d_shortcut = library.Op("conv2d_shortcut", conv2d_shortcut_impl)


@conv2d_shortcut.register_fake
def _(y, w1, operands1, epilogue1, slot, x, w2, operands2, epilogue2, stride, provider):
    # not through call_of: its cached layout helper cannot hash a graph's symbolic batch
    return fused.conv_output(y, w1, epilogue1, *ONE).empty()
