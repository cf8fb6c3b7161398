"""One dataclass of switches for every stage; the only module that reads the environment.

Entry point: `Config.from_env(**overrides)`, called once per compile by `resfuse.compile` / the backend.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "resfuse")


REMAINDERS = ("auto", "inductor", "eager")
PROVIDERS = ("triton", "cudnn", "epilogue", "aten")


@dataclasses.dataclass(frozen=True)
class Config:
    fuse_epilogue: bool = True
    "Absorb bias / BN / activations / binary ops into the conv or GEMM that produces their input."
    fuse_glu: bool = False
    ("In inference, a gated MLP's act(x @ Wg^T) * (x @ Wu^T) (SwiGLU, GeGLU) runs as one GEMM over a weight whose "
     "gate and up rows are interleaved, its epilogue pairing each tile's columns (with fuse_epilogue). Off: on an "
     "H200 held at its power limit, a TinyLlama-sized model took 7.7% longer a call with it (its kernels 2.4% less "
     "time, but at 1590 instead of 1665 MHz: more energy a call than cuBLAS's GEMM + Inductor's pass; BENCHMARKS.md). "
     "With its epilogue's divisions gone (forty-ninth session), 4 of its layers took 1.8% less GPU time and 1-3% "
     "more latency: still no win.")
    fuse_add_to_output: bool = True
    "OneFlow's FuseAddToOutput: a same-shape 2-input add is absorbed by the op that produces one operand."
    leave_adds_to_inductor: bool = False
    ("Where the conv/GEMM that would absorb a residual add (with its bias or none, nothing else) measures fastest on "
     "cuDNN/cuBLAS, tuned at capture, leave the add to Inductor (the remainder on CUDA), which adds it inside its "
     "consumer's kernel (a transformer's next norm), instead of a pass of its own after cuDNN/cuBLAS. Off: not yet "
     "measured on a GPU (a broader rule, every epilogue cuDNN/cuBLAS won, measured no gain: BENCHMARKS.md, tenth).")
    batch_norm_backward: bool = True
    ("Run training's batch-norm backward on resfuse's Triton kernel (three deterministic passes) instead of "
     "ATen's, where the fused ops run on Triton.")
    bn_backward_sums: bool = False
    ("Compute batch-norm backward's per-channel sums in the epilogue of the conv data gradient that produces its "
     "grad_out (with batch_norm_backward), instead of in a pass of their own over grad_out and x. Off: on an H100 "
     "the epilogue's extra read of x cost what the pass saved, and a ResNet-50 step got 1.3% slower (BENCHMARKS.md).")
    bn_backward_dual: bool = True
    ("Where two batch-norm backwards on resfuse's kernel share grad_out (a downsampling block's main and shortcut "
     "batch norms), run them as one (with batch_norm_backward), whose passes read grad_out once for both.")
    conv_stats: bool = True
    ("In training, compute a batch norm's statistics (per-channel sum and sum of squares) in the epilogue of the "
     "conv that produces its input, with cuDNN's conv + genstats graph (nvidia-cudnn-frontend), instead of in a "
     "pass of its own over the conv's output; where the batch norm runs on resfuse's kernel.")
    max_pool: bool = True
    ("Run max-pool and its backward on resfuse's Triton kernels instead of ATen's, where the fused ops run on "
     "Triton; a relu gradient right after the pool's is applied on the way out, and an inference pool computes "
     "the monotone epilogue (batch norm, relu) of the conv it reads.")
    shortcut_convs: bool = True
    ("In inference, where a fused 1x1 conv's residual is another fused 1x1 conv's output read by nothing else (a "
     "downsampling bottleneck's shortcut conv and batch norm), offer the tuner both as one kernel that computes the "
     "residual in registers instead of writing it and reading it back (where both batch norms fold into the weights, "
     "as one sum of the two convs); the tuner keeps it only where it measures faster.")
    chain_convs: bool = True
    ("In inference, where a fused 1x1 conv's output is read by another fused 1x1 conv (a bottleneck's tail and the "
     "next block's head), offer the tuner both as one kernel that multiplies each chunk of the first's output into "
     "the second's before it leaves the registers; the tuner keeps it only where it measures faster.")
    pad_channels: bool = True
    ("Where a conv left to cuDNN reads a 3-channel fp16 channels_last image (a CNN's stem), read it zero-padded to 4 "
     "channels, cast from fp32 in the same pass, instead of letting cuDNN pad it in a pass of its own before the "
     "conv and again before the weight gradient.")
    image_convs: bool = True
    ("In inference, where a conv left to cuDNN reads an image of at most 4 channels with no bias (a CNN's stem), "
     "run it as resfuse::image_conv instead: the image padded once, then an implicit GEMM over overlapping views "
     "of its rows (on an H100, ResNet-50's stem 1.8x faster than cuDNN at batch 1, 1.24x at 32, 1.07x at 256). It "
     "takes the place of pad_channels' padding there. Not tuned per shape: on Hopper GPUs only, where it was measured.")
    merge_linears: bool = True
    ("Merge linear layers that read the same input (attention's q, k and v) into one wider GEMM, before "
     "aot_autograd, so training's backward gets one data-gradient GEMM for them too.")
    hoist_constants: bool = True
    ("In inference, compute the values a graph derives from parameters alone (merged linears' concatenated weights, "
     "autocast's weight casts) outside it, once, and again only when a parameter changes in place or is replaced, "
     "instead of on every call. A write through `.data` is not seen.")
    providers: tuple[str, ...] = PROVIDERS
    ("Whose candidates the tuner measures for a fused op on CUDA: triton (our kernels), cudnn (cuDNN's fused "
     "graph), epilogue (cuDNN/cuBLAS, then our epilogue kernel), aten (cuDNN/cuBLAS, then the epilogue as torch ops). "
     "A pair of convs is always also offered as its two convs, each tuned under the same rule. A subset keeps its own "
     "entries in the tuning cache. An op none of them can run runs unfused; once the tuning budget is spent, an "
     "untuned op runs cuDNN/cuBLAS + our epilogue kernel whatever this says.")
    tuning: str = "fast"
    "Tuning level on CUDA: none (heuristic config), fast (a pruned space), max (exhaustive; slow)."
    tuning_budget_s: float = 120.0
    ("Wall-clock seconds a compile may spend tuning; past it, an untuned shape runs cuDNN/cuBLAS and our epilogue "
     "kernel (two launches), and a later compile tunes it. Tuned choices are cached on disk, so a model pays this "
     "once per machine (a cold ResNet-50 tuned for 75-135 s on an H100 once cuDNN's engine configs were timed too).")
    retune: bool = False
    "Measure again and replace cached tuning entries (force-retune)."
    interpret: bool = False
    "Run the Triton kernels under Triton's interpreter on CPU tensors (tests; env RESFUSE_INTERPRET=1)."
    pdl: bool = True
    ("Launch the generated kernels with programmatic dependent launch on Hopper and later (env RESFUSE_PDL=0 turns "
     "it off): a kernel's programs start while the previous kernel drains and wait for it before touching memory.")
    prefetch_weights: bool = True
    ("Let our conv and GEMM kernels ask L2 for their weight tile first, on Hopper and later, before they wait for "
     "the previous kernel (env RESFUSE_PREFETCH=0 turns it off): under programmatic dependent launch the weights "
     "then stream in while that kernel runs.")
    tma_store: bool = True
    ("Let the tuner try writing the outputs of the GEMM's TMA kernels (linear layers, 1x1 convs and their data "
     "gradients, fp16/bf16) by bulk tensor-descriptor stores, beside per-thread stores, on Hopper and later; it keeps "
     "the faster (env RESFUSE_TMA_STORE=0 turns them off, cached choices included).")
    compile_workers: int | None = None
    ("Processes that compile the tuner's Triton candidates ahead of their first launch, and build its cuDNN engine "
     "configs (tuning/precompile.py): None, up to 16 (one a CPU core), up to 4 of them for cuDNN; 0 compiles and "
     "builds them in the tuning process only (env RESFUSE_COMPILE_WORKERS).")
    split_k: int | None = None
    "Force a split-K factor for every GEMM/conv kernel; None lets the heuristic choose."
    cache_dir: str = dataclasses.field(default_factory=_default_cache_dir)
    "Where generated kernels and the tuning cache live (env RESFUSE_CACHE_DIR)."
    cuda_graphs: bool | None = None
    ("Replay compiled graphs through CUDA graphs. None (auto): inference graphs on CUDA, whose replays return "
     "outputs the caller owns, as eager's; True: training's forward and backward too (torch's CUDA graph trees, as "
     "reduce-overhead); False: none (each fused op then costs ~100-300 us of Python on the host).")
    remainder: str = "auto"
    ("What runs the ops no fusion absorbed: inductor (torch.compile's compiler fuses them, with our fused ops as "
     "calls), eager (ATen, op by op), or auto (inductor on CUDA, eager on CPU).")
    combo_kernels: bool = False
    ("In training graphs, let Inductor merge the remainder's independent small kernels (autocast's weight casts "
     "and their gradients' casts back to fp32) into combo kernels (its experimental combo_kernels). Off: worth "
     "0.09 ms of a 35 ms ResNet-50 bs256 step on an H100, and measured on no other model.")
    debug_dump: str | None = None
    "Folder to write the FX graph after each pass as NN-passname.txt (env RESFUSE_DUMP)."

    def __post_init__(self):
        if self.remainder not in REMAINDERS:
            raise ValueError(f"remainder={self.remainder!r}: choose from {', '.join(REMAINDERS)}")
        if not self.providers or set(self.providers) - set(PROVIDERS):
            raise ValueError(f"providers={self.providers!r}: one or more of {', '.join(PROVIDERS)}")

    @classmethod
    def from_env(cls, **overrides) -> "Config":
        env = {}
        if os.environ.get("RESFUSE_INTERPRET", "") not in ("", "0"):
            env["interpret"] = True
        if os.environ.get("RESFUSE_CACHE_DIR"):
            env["cache_dir"] = os.environ["RESFUSE_CACHE_DIR"]
        if os.environ.get("RESFUSE_PDL", "") == "0":
            env["pdl"] = False
        if os.environ.get("RESFUSE_PREFETCH", "") == "0":
            env["prefetch_weights"] = False
        if os.environ.get("RESFUSE_TMA_STORE", "") == "0":
            env["tma_store"] = False
        if os.environ.get("RESFUSE_COMPILE_WORKERS"):
            env["compile_workers"] = int(os.environ["RESFUSE_COMPILE_WORKERS"])
        if os.environ.get("RESFUSE_DUMP"):
            env["debug_dump"] = os.environ["RESFUSE_DUMP"]
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown resfuse option(s): {sorted(unknown)}")
        if "providers" in overrides:
            overrides["providers"] = tuple(overrides["providers"])
        return cls(**{**env, **overrides})
