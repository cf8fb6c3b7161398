"""The inference batch norm folded into a conv's weight, for the cudnn provider (providers/cudnn.py) and the shortcut
kernel's sum form (ops/shortcut.py).

Entry points: `fold_refusal(call)`, `folded_call(call)` (the call with its weight folded and its epilogue's bn node
replaced by a shift, or None while that fold overflows the weight's dtype), `folded_form(call)` (its shapes alone),
and for a CUDA-graphed inference graph `recording_folds()` and `FoldWatch` (capture/cuda_graphs.py), which keep the
folded weights in step with in-place updates of the parameters. Folded, cuDNN runs conv + shift + relu at the bare
conv's speed (its ConvBiasAct engines; bench/cudnn_check.py --forms), where the batch norm written out runs slower.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref

import torch

from .. import epilogue as epi
from ..capture.cuda_graphs import versions


def fold_refusal(call) -> str | None:
    """Why the batch norm of this conv's epilogue cannot be folded into its weight (the module's docstring says
    why one would), or None."""
    if call.op != "conv2d":
        return "only a conv's weight can carry a batch norm"
    w = call.inputs[1]
    if w.dtype not in (torch.float16, torch.bfloat16):
        return f"a {w.dtype} weight"
    found = _folded(call.signature, len(call.operands))
    if found is None:
        return "no batch norm reads the accumulator"
    if any(call.operands[o.slot].shape != (w.shape[0],) for o in found[1].args[1:]):
        return "batch-norm vectors that are not one value per output channel"
    return None


class Fold:
    """A conv's weight with its inference batch norm folded in, w * scale per output channel, and the shift
    bias - mean * scale (scale = weight * rsqrt(var + eps)), computed in fp32 from the five source tensors.
    It is kept while the sources keep their addresses and version counters (an in-place update, an optimizer
    step or load_state_dict, bumps the counter) and folded again in place otherwise, so that a CUDA graph that
    reads the folded tensors at their addresses stays right: capture/cuda_graphs.py records the folds a graph
    reads (`recording_folds`) and checks them before each replay (`FoldWatch`). An un-graphed call also sees a
    storage swapped in under a source (`p.data = t`, which bumps no counter) by its address; a write into a
    source through `.data` is not seen. The sources are held weakly: a model's parameters are not kept alive by
    this cache."""

    def __init__(self, w: torch.Tensor, vectors, eps: float):
        self.refs, self.eps = [weakref.ref(t) for t in (w, *vectors)], eps
        self.w = torch.empty_like(w)  # w's strides (channels_last stays channels_last)
        self.shift = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
        self.seen, self.fits = None, True
        self.refresh()

    def holds(self, sources) -> bool:
        """Are these the tensors folded? (Their layout, storage and contents: `refresh`.)"""
        return all(r() is t for r, t in zip(self.refs, sources))

    def _laid_out_as(self, w: torch.Tensor) -> bool:
        return w.shape == self.w.shape and w.stride() == self.w.stride() and w.dtype == self.w.dtype

    def refresh(self) -> bool:
        """Fold again if a source changed; False once a source is gone, or the weight's layout is no longer the
        folded one's (a storage of another shape swapped in), and the entry is then dropped. A fold
        whose weight overflows its dtype (a huge scale: a tiny variance, a large batch-norm weight) is marked
        `fits = False`, and the conv runs unfolded while it stays so: one read back per refold, outside a
        CUDA-graph capture (whose warm-up call has already folded and checked)."""
        sources = [r() for r in self.refs]
        if any(t is None for t in sources) or not self._laid_out_as(sources[0]):
            return False
        state = versions(sources)
        if state is not None:  # a storage swapped under the same tensor (`p.data = ...`) changes its address
            state += [t.data_ptr() for t in sources]
            if state == self.seen:
                return True
        w, mean, var, weight, bias = sources
        scale = weight.float() * torch.rsqrt(var.float() + self.eps)
        folded = w.float() * scale.view(-1, *[1] * (w.dim() - 1))
        self.w.copy_(folded)
        self.shift.copy_(bias.float() - mean.float() * scale)
        self.seen = state
        if not (w.is_cuda and torch.cuda.is_current_stream_capturing()):
            fits = bool((folded.abs() <= torch.finfo(w.dtype).max).all() & torch.isfinite(self.shift).all())
            if self.fits and not fits:
                print(f"resfuse: a batch norm folded into the {w.dtype} conv weight {tuple(w.shape)} overflows it; "
                      "the conv runs unfolded (cuDNN's on ATen, a shortcut kernel with two epilogues) until its "
                      "parameters fit again")
            self.fits = fits
        return True


_FOLDS: dict = {}  # (the sources' ids, eps) -> Fold
_RECORDING: list[list] = []  # the lists recording_folds() fills


def folded_call(call):
    """`call` with its conv's batch norm folded: the folded weight, the epilogue's bn node replaced by a shift
    (a new last operand, fp32); its Fold made or refreshed. None while the folded weight overflows its dtype."""
    _, bn = _folded(call.signature, len(call.operands))
    w = call.inputs[1]
    sources = (w, *(call.operands[o.slot] for o in bn.args[1:]))
    key = (*map(id, sources), bn.params[0])  # the same tensors (holds), laid out and stored as folded (refresh)
    fold = _FOLDS.get(key)
    if fold is None or not fold.holds(sources) or not fold.refresh():
        for stale in [k for k, f in _FOLDS.items() if not f.refresh()]:  # sources gone, or another weight layout
            del _FOLDS[stale]
        fold = _FOLDS[key] = Fold(w, sources[1:], bn.params[0])
    if not fold.fits:
        return None
    for used in _RECORDING:
        used.append(fold)
    return folded_form(call, fold.w, fold.shift)


def folded_form(call, w: torch.Tensor | None = None, shift: torch.Tensor | None = None):
    """`call` as folded_call gives it, with `w` as its weight and `shift` as its new last operand; without them, an
    unfolded weight and an empty shift: the folded call's shapes and dtypes, for a graph built from them alone (a
    compile worker's, providers/cudnn.py)."""
    signature, _ = _folded(call.signature, len(call.operands))
    w = call.inputs[1] if w is None else w
    shift = torch.empty(w.shape[0], dtype=torch.float32, device=w.device) if shift is None else shift
    return dataclasses.replace(call, inputs=(call.inputs[0], w), operands=[*call.operands, shift],
                               signature=signature)


@functools.lru_cache(maxsize=None)
def _folded(signature: str, shift: int) -> tuple[str, epi.Op] | None:
    """(the folded signature, its operand `shift` the shift, and the batch-norm node it replaced), or None where no
    batch norm reads the accumulator: epilogue.fold_bn, once per signature (every folded call asks)."""
    found = epi.fold_bn(epi.parse(signature), shift)
    return None if found is None else (str(found[0]), found[1])


@contextlib.contextmanager
def recording_folds():
    """Collects the Folds that the ops called inside read (a CUDA-graph capture's, for its FoldWatch)."""
    used: list = []
    _RECORDING.append(used)
    try:
        yield used
    finally:
        _RECORDING.remove(used)


class FoldWatch:
    """The Folds one CUDA graph reads, and their sources' version counters: `refresh()`, before each replay,
    compares the counters in one pass (a bs1 replay's host time is the latency) and folds again on a change.
    It holds the sources, as the graph's static inputs already do."""

    def __init__(self, folds):
        self.folds = list({id(f): f for f in folds}.values())
        self.sources = [t for f in self.folds for t in (r() for r in f.refs) if t is not None]
        self.versions = versions(self.sources)

    def refresh(self) -> bool:
        """False when a fold the graph reads overflows its dtype after this refold: the graph must be captured
        again, with the conv unfolded (`run`)."""
        now = versions(self.sources)
        if now is not None and now == self.versions:
            return True
        for fold in self.folds:
            fold.refresh()
        self.versions = now
        return all(fold.fits for fold in self.folds)
