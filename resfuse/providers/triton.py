"""The triton provider: our generated kernels, one candidate per config of the level's space.

Each candidate has an epilogue-free twin (signature "acc") for stage 1, but those of our kernels of two convs; at the
fast level a TMA GEMM's candidate also has a variant that writes its output by bulk stores (space.bulk_store_twin),
timed in stage 2 if the candidate is shortlisted. All write to scratch buffers.
"""
from __future__ import annotations

import dataclasses

from .. import epilogue as epi, kernels
from ..kernels import chain, shortcut
from ..kernels.conv2d_depthwise import is_depthwise
from ..tuning import space
from ..tuning.select import Candidate


def refusal(call) -> str | None:
    if not kernels.available(call.out.device):
        return f"no Triton kernels on {call.out.device}"
    if call.op == "conv2d" and call.inputs[0].shape[1] != call.inputs[1].shape[1] and not is_depthwise(
            *(t.shape for t in call.inputs)):
        return "grouped convolution that is not depthwise"
    if call.op == "conv2d_dgrad" and call.out.shape[1] != call.inputs[1].shape[1]:
        return "grouped convolution's data gradient"
    if call.op == "conv2d_chain":
        return chain.refusal(*call.inputs) or chain.unaligned(*call.inputs)
    if call.op == "conv2d_shortcut":
        y, w1, x, w2 = call.inputs
        return shortcut.refusal(y, w1, x, w2, call.params[2]) or chain.unaligned(y, w1, w2)
    return None


def _launch(call, signature: str, operands, out, config, aux=None, stats=None):
    if call.op == "conv2d":
        return kernels.conv2d(*call.inputs, operands, signature, *call.params, out, config, aux)
    if call.op == "conv2d_dgrad":
        return kernels.conv2d_dgrad(*call.inputs, operands, signature, *call.params, out, config, stats)
    return kernels.gemm(*call.inputs, operands, signature, out, config, aux)


def candidates(call, level: str) -> list[Candidate]:
    if call.op in ("conv2d_chain", "conv2d_shortcut"):
        return _pair_candidates(call, level)
    scratch, bare, own = call.out.empty(), _bare_output(call).empty(), call.scratch()

    def candidate(cfg, mainloop: bool) -> Candidate:
        variants = () if not mainloop or level != "fast" else tuple(
            candidate(twin, False) for twin in [space.bulk_store_twin(call, cfg)] if twin is not None)
        return Candidate(
            "triton", "triton:" + ",".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items()),
            dataclasses.asdict(cfg),
            run=lambda: _launch(call, call.signature, call.operands, scratch, cfg, own.aux, own.stats),
            mainloop=(lambda: _launch(call, "acc", [], bare, cfg)) if mainloop else None, variants=variants)

    return [candidate(cfg, True) for cfg in space.configs(call, level)]


def _bare_output(call):
    """What the epilogue-free twin writes: the op's output, or for a GLU's (epilogue.paired) the whole product, twice
    as wide, its columns unpaired."""
    from ..ops.fused import Output

    if not epi.paired(epi.parse(call.signature)):
        return call.out
    return Output.of((*call.out.shape[:-1], call.inputs[1].shape[-1]), call.out.dtype, call.out.device)


def _pair_candidates(call, level: str) -> list[Candidate]:
    """The configs of our kernel of two convs (a chain, or a conv and its residual's), stage 2 only: with the
    epilogues removed it would compute something else (the second conv's input or residual without its
    epilogue), so there is no epilogue-free twin to time first. A sum-form config of the shortcut kernel reads its
    batch norms' values to fold them; its dry run (precompile.py, on scratch tensors) launches the same kernel from
    the shapes alone."""
    from ..ops import chain as chain_op, shortcut as shortcut_op

    if call.op == "conv2d_chain":
        y, z = chain_op.y_output(call).empty(), call.out.empty()
        return [_candidate(cfg, lambda cfg=cfg: chain_op.run_chain(call, cfg, y, z))
                for cfg in space.configs(call, level)]
    z = call.out.empty()
    return [_candidate(cfg, lambda cfg=cfg: shortcut_op.run_kernel(call, cfg, z),
                       (lambda cfg=cfg: shortcut_op.run_kernel(call, cfg, z, values=False)) if cfg.fold else None)
            for cfg in space.configs(call, level)]


def _candidate(cfg, run, triton_part=None) -> Candidate:
    return Candidate("triton", "triton:" + ",".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items()),
                     dataclasses.asdict(cfg), run=run, triton_part=triton_part)
