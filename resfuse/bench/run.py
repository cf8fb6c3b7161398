"""`resfuse bench MODEL`: resfuse against eager and torch.compile in one run, next to the roofline floor.

Entry points: `add_arguments(parser)` and `main(args) -> exit code`, wired into resfuse/cli.py;
`benchmark(args) -> result dict` for scripts and tests. Order of a run: models.load -> roofline ceilings and
floor -> each peer built, called once (first-call time, numerics vs eager), timed, optionally profiled ->
report (rich table, JSON, PNG).

Peers: eager (always; it is the numerics reference), then those in --peers among compile (torch.compile
default), reduce-overhead (CUDA graphs), max-autotune (slow to compile, so opt-in), then resfuse
(`resfuse.compile(model, cuda_graphs=False)`, always) and on CUDA resfuse+graphs (`cuda_graphs=True`, which
for inference is what `resfuse.compile(model)` does on CUDA; --no-cuda-graphs drops it). One failing peer is
recorded with its error and the run goes on.

JSON schema ("schema": "resfuse-bench/1"); every time is the median unless its name says otherwise:
  schema str, created str (ISO 8601 UTC), argv list[str] | null
  model str, model_source str ("torchvision:resnet50", "hf-resnet50", "file:...")
  batch int, dtype str ("fp16" | "bf16" | "fp32"), device str, device_name str, channels_last bool,
  image_size int | null, seq int | null
  versions {python, torch, triton, transformers, torchvision, timm, cuda, cudnn, resfuse: str | null}
  timing {method: "cuda-events" | "perf_counter", iters int, warmup int, input_sets int, cudnn_benchmark bool}
  ceilings {matmul_flops_per_s float, copy_bytes_per_s float, matmul_dtype str, source "measured" | "given"}
  floor {ms float, flops int, bytes int, layers int, compute_bound_layers int,
         top_layers list[{name str, kind "compute"|"memory", flops int, bytes int, floor_us float, ops list[str]}],
         seconds_to_measure float}
  resfuse_variants list[str]  (the resfuse peers this run attempted)
  peers {name: {status "ok" | "error" | "skipped", error str | null,
                latency_ms, latency_min_ms, latency_p90_ms, throughput_items_per_s, compile_s (first-call wall
                time: compilation and tuning included), x_floor (latency / floor), max_rel_err
                (||out - ref|| / ||ref|| vs eager, the worse of the first call and a call after the timed ones:
                resfuse+graphs' first call runs before its CUDA graph is captured), max_abs_err: float | null,
                first_rel_err, late_rel_err (the two calls' relative errors apart: which one went wrong),
                fp32_rel_err (the first call's against the model run in fp32, TF32 off: null for an fp32 model;
                beside eager_fp32_rel_err it says whether a peer is further from the exact answer than eager),
                err_bound, within_bound (resfuse peers only: the dtype's tolerance, or twice the closest compiled
                peer's error or eager_fp32_rel_err, whichever is largest, and whether max_rel_err stays within it),
                gpu_ms (CUDA only, else null: the GPU's time a call with the host's pace left out, calls
                queued behind a sleep; latency_ms above it means the host set the pace, as at batch 1 on a
                busy host), clock, gpu_ms_clock ({sm_mhz, max_mhz, limited: float} | null: the SM clock read
                through NVML over the timed calls and over gpu_ms's calls, and the share of reads with a power or
                thermal limit on; null on CPU or without NVML; a limited clock slows a heavy peer's latency),
                speedup_of_resfuse {resfuse variant: this peer's latency / the variant's latency},
                paths {path: calls} (resfuse peers only: which implementation ran, e.g. triton, reference)}}
  eager_fp32_rel_err float | null (eager's first output against the model run in fp32 with TF32 off: the error the
                   dtype alone gives this model; null for an fp32 model)
  profile {peer: list[{name str, time_us float (per iteration), calls int, share float}]}  (with --profile: every
          kernel, slowest first; the calls add up to the launches per iteration)
  notes list[str] (a CPU run's, errors over their bound, peers whose latency passes their GPU time: host-bound,
             peers timed at the GPU's power or thermal limit)
"""
from __future__ import annotations

import argparse
import copy
import datetime
import importlib.metadata
import math
import platform
import sys
import time
import traceback

import torch

from . import models, report, roofline, timing

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
OPTIONAL_PEERS = ("eager", "compile", "reduce-overhead", "max-autotune")
DEFAULT_PEERS = "eager,compile,reduce-overhead"
PROFILED = ("eager", "compile", "resfuse", "resfuse+graphs")  # --profile: what eager, torch.compile and resfuse launch
CPU_NOTE = ("CPU run: these numbers check that the harness and the peers work; speed needs a CUDA GPU "
            "(timed with time.perf_counter, not CUDA events)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help=f"one of {', '.join(models.names())}, or path/to/file.py:factory")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default fp16 on CUDA, fp32 on CPU")
    parser.add_argument("--device", default=None, help="default cuda when available, else cpu")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="also time resfuse with cuda_graphs=True (default: on for CUDA)")
    parser.add_argument("--peers", default=DEFAULT_PEERS,
                        help=f"comma list from {','.join(OPTIONAL_PEERS)}; resfuse (and eager) always run")
    parser.add_argument("--json", metavar="FILE", help="write the result as JSON (schema in run.py)")
    parser.add_argument("--plot", metavar="FILE.png", help="bar chart of latencies with the floor")
    parser.add_argument("--profile", action="store_true",
                        help="torch.profiler's kernels for eager, torch.compile and resfuse: the top ones printed, "
                             "all in the JSON")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per peer (default 100 CUDA, 5 CPU)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--seq", type=int, default=384, help="sequence length of text models")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--cudnn-benchmark", action=argparse.BooleanOptionalAction, default=True,
                        help="let cuDNN pick conv algorithms by timing (every peer's convs use cuDNN)")
    parser.add_argument("--ceilings", metavar="FLOPS,BYTES", default=None,
                        help="matmul FLOP/s and copy bytes/s to use instead of measuring them (e.g. 686e12,3.0e12)")


def main(args: argparse.Namespace) -> int:
    """Exit code: 0 when resfuse ran, 1 when it failed (the other peers still report), 2 for a bad model."""
    try:
        result = benchmark(args)
    except (models.UnknownModel, models.MissingPackage, FileNotFoundError) as e:
        print(f"resfuse bench: {e}", file=sys.stderr)
        return 2
    return 0 if result["peers"]["resfuse"]["status"] == "ok" else 1


def benchmark(args: argparse.Namespace) -> dict:
    from rich.console import Console

    # Piped output (CI logs, the GPU machine) would otherwise wrap the table at 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=150)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    dtype_name = args.dtype or ("fp16" if cuda else "fp32")
    iters = args.iters or (100 if cuda else 5)
    peers = _peer_list(args.peers, cuda, args.cuda_graphs)
    notes = [] if cuda else [CPU_NOTE]
    if args.cuda_graphs and not cuda:
        notes.append("--cuda-graphs ignored: CUDA graphs need a CUDA device")
    text = models.is_text(args.model)
    result = {
        "schema": "resfuse-bench/1",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": getattr(args, "argv", None),
        "model": args.model, "model_source": models.resolve(args.model), "batch": args.batch,
        "dtype": dtype_name, "device": str(device), "device_name": _device_name(device),
        "channels_last": args.channels_last,
        "image_size": None if text else args.image_size, "seq": args.seq if text else None,
        "versions": _versions(),
        "resfuse_variants": [p for p in peers if p.startswith("resfuse")],
        "peers": {}, "profile": {}, "notes": notes,
    }
    if result["model_source"] != args.model:
        notes.append(f"{args.model} resolved to {result['model_source']}")
    for note in notes:
        console.print(f"[yellow]note:[/yellow] {note}")

    # Without it eager (and every cuDNN conv any peer falls back to) runs heuristic algorithms.
    torch.backends.cudnn.benchmark = bool(getattr(args, "cudnn_benchmark", True))
    model, inputs = models.load(args.model, args.batch, DTYPES[dtype_name], device,
                                channels_last=args.channels_last, image_size=args.image_size, seq=args.seq)
    sets = timing.input_sets(inputs)
    result["timing"] = {"method": "cuda-events" if cuda else "perf_counter", "iters": iters,
                        "warmup": max(3, iters // 10), "input_sets": len(sets),
                        "cudnn_benchmark": torch.backends.cudnn.benchmark}
    _floor(result, model, inputs, device, DTYPES[dtype_name], args)
    console.print(f"floor {result['floor']['ms']:.3f} ms over {result['floor']['layers']} layers")

    refs = timing.run_once(model, inputs)
    late_refs = timing.run_once(model, sets[-1])  # eager's output for the call checked after the timed ones
    wide = _fp32_outputs(model, inputs)
    result["eager_fp32_rel_err"] = None if wide is None else timing.output_error(refs, wide)[0]
    if result["eager_fp32_rel_err"] is not None:
        console.print(f"eager's own relative error against the model in fp32: {result['eager_fp32_rel_err']:.1e}")
    if why := vacuous(model, sets, refs):
        notes.append(f"{why}: the error columns are vacuous for this model")
        console.print(f"[yellow]note:[/yellow] {notes[-1]}")
    for name in peers:
        console.print(f"[bold]{name}[/bold] ...")
        result["peers"][name] = _measure(name, model, sets, (refs, late_refs, wide), device, iters, args, result)
        _free(device)
    _speedups(result)
    for line in _bound_errors(result, DTYPES[dtype_name]):
        notes.append(line)
        console.print(f"[red]{line}[/red]")
    for line in host_bound(result) + clock_limited(result):
        notes.append(line)
        console.print(f"[yellow]note:[/yellow] {line}")
    for name, rows in result["profile"].items():
        console.print(report.profile_table(name, rows))
    console.print(report.table(result))
    if args.json:
        report.write_json(result, args.json)
        console.print(f"wrote {args.json}")
    if args.plot:
        report.plot(result, args.plot)
        console.print(f"wrote {args.plot}")
    return result


def vacuous(model, sets: list[tuple], refs: list[torch.Tensor]) -> str | None:
    """Why eager's outputs cannot tell a right peer from a wrong one, or None. A random-init model can collapse
    in low precision: to a constant, to non-finite values, or to outputs that no longer depend on the input
    (timm's RegNetY-4.0GF in fp16 at bs32 and bs256: every peer matched eager to the bit). Then any peer
    matches eager. The second input set tells the last case."""
    flat = [r.double() for r in refs if r.is_floating_point()]
    if not flat or all(r.numel() < 2 or r.std().item() == 0 or not torch.isfinite(r).all() for r in flat):
        return "eager output is constant or non-finite"
    if len(sets) > 1 and all(torch.equal(a, b) for a, b in zip(refs, timing.run_once(model, sets[1]))):
        return "eager output does not depend on the input"
    return None


def _peer_list(spec: str, cuda: bool, cuda_graphs: bool | None) -> list[str]:
    asked = [p.strip() for p in spec.split(",") if p.strip() and not p.strip().startswith("resfuse")]
    unknown = sorted(set(asked) - set(OPTIONAL_PEERS))
    if unknown:
        raise SystemExit(f"unknown peer(s) {unknown}; choose from {','.join(OPTIONAL_PEERS)} "
                         "(resfuse always runs)")
    peers = ["eager"] + [p for p in OPTIONAL_PEERS[1:] if p in asked] + ["resfuse"]
    if cuda and cuda_graphs is not False:
        peers.append("resfuse+graphs")
    return peers


def _build(name: str, model: torch.nn.Module):
    if name == "eager":
        return model
    torch._dynamo.reset()  # each peer compiles from scratch, not from the previous peer's cache entries
    if name == "compile":
        return torch.compile(model)
    if name in ("reduce-overhead", "max-autotune"):
        return torch.compile(model, mode=name)
    import resfuse  # lazily: the harness must load (and run its other peers) without the compiler

    return resfuse.compile(model, cuda_graphs=name == "resfuse+graphs")


def _measure(name, model, sets, references, device, iters, args, result) -> dict:
    refs, late_refs, wide = references  # eager's outputs on the first and last input sets; fp32's on the first
    paths_before = _paths()
    try:
        fn = _build(name, model)
        m = timing.measure(fn, sets, refs, late_refs, device, iters)
        off_fp32 = None if wide is None else timing.output_error(m.outs, wide)[0]
        gpu_ms, gpu_clock = None, None
        if device.type == "cuda":
            with timing.Clocks(device) as clocks:
                gpu_ms = _gpu_ms(fn, sets)
            gpu_clock = clocks.summary()
        if args.profile and name in PROFILED:
            result["profile"][name] = timing.kernels(fn, sets, device)
    except Exception as e:  # a peer that fails to compile or run is a result, not the end of the run
        traceback.print_exc(file=sys.stderr)
        first_line = (str(e).strip().splitlines() or [""])[0]
        return {"status": "error", "error": f"{type(e).__name__}: {first_line}"[:500]}
    lat = m.latency
    entry = {
        "status": "ok", "error": None, "latency_ms": lat.median_ms, "latency_min_ms": lat.min_ms,
        "latency_p90_ms": lat.p90_ms, "throughput_items_per_s": args.batch / (lat.median_ms / 1e3),
        "compile_s": m.first_s, "x_floor": lat.median_ms / result["floor"]["ms"] if result["floor"]["ms"] else None,
        "max_rel_err": m.rel_err, "max_abs_err": m.abs_err, "first_rel_err": m.first_err[0],
        "late_rel_err": m.late_err[0],
        "fp32_rel_err": off_fp32, "gpu_ms": gpu_ms, "clock": lat.clock, "gpu_ms_clock": gpu_clock,
        "speedup_of_resfuse": {},
    }
    if name.startswith("resfuse"):
        after = _paths()
        entry["paths"] = {p: after.get(p, 0) - paths_before.get(p, 0) for p in after
                          if after.get(p, 0) != paths_before.get(p, 0)}
    return entry


def _gpu_ms(fn, sets: list[tuple], repeats: int = 5) -> float | None:
    """The median of `repeats` GPU times a call (timing.gpu_us), in ms, over 20 calls queued, or 4 or 1 where the
    GPU's launch queue cannot hold 20 (eager launches hundreds of kernels a call); None for a peer whose calls
    wait on the GPU (a sync inside the call), which never lets the host run ahead."""
    for calls in (20, 4, 1):
        try:
            return sorted(timing.gpu_us(fn, sets, calls) for _ in range(repeats))[repeats // 2] / 1e3
        except RuntimeError:
            continue
    return None


def _paths() -> dict[str, int]:
    """Calls per implementation path (triton, reference, ...) of resfuse's fused ops so far."""
    try:
        from resfuse.ops import PATHS
    except ImportError:  # resfuse not importable: only the non-resfuse peers run, nothing to count
        return {}
    totals: dict[str, int] = {}
    for (_op, _sig, path), calls in PATHS.items():
        totals[path] = totals.get(path, 0) + calls
    return totals


def _speedups(result: dict) -> None:
    variants = {v: result["peers"][v]["latency_ms"] for v in result["resfuse_variants"]
                if result["peers"][v]["status"] == "ok"}
    for peer in result["peers"].values():
        if peer["status"] == "ok":
            peer["speedup_of_resfuse"] = {v: peer["latency_ms"] / ms for v, ms in variants.items()}


# A whole model's relative error against eager that a compiler may reach: fp16 and tf32 keep 10 mantissa bits, bf16 7.
# torch.compile itself reaches 7e-3 on a random-init MobileNetV3 in fp16, so twice a compiled peer's error also counts.
MODEL_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 8e-2, torch.float32: 1e-2}


def _fp32_outputs(model, inputs) -> list[torch.Tensor] | None:
    """The model's outputs run in fp32 with TF32 off, on a copy: what the dtype's rounding is measured against (a
    random-init network can be ill-conditioned). None where the model already runs in fp32, or where an fp32 copy
    cannot be made or run (it does not fit in memory beside the model, or the model cannot be deep-copied)."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    if not params or params[0].dtype == torch.float32:
        return None
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        wide = copy.deepcopy(model).float()
        return timing.run_once(wide, tuple(x.float() if x.is_floating_point() else x for x in inputs))
    except Exception:  # noqa: BLE001  out of memory, or a model that cannot be copied: no fp32 errors, no crash
        return None
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _bound_errors(result: dict, dtype: torch.dtype) -> list[str]:
    """Each resfuse peer's err_bound and within_bound set (see the schema); a line for each one over its bound."""
    compiled = [p["max_rel_err"] for name, p in result["peers"].items() if not name.startswith("resfuse")
                and name != "eager" and p["status"] == "ok" and p["max_rel_err"] is not None]
    # the closest compiled peer's error (one broken peer must not widen it), and eager's own against fp32
    noise = [min(compiled, default=None), result.get("eager_fp32_rel_err")]
    bound = max([MODEL_TOLERANCE[dtype]] + [2 * e for e in noise if e is not None and math.isfinite(e)])
    lines = []
    for name in result["resfuse_variants"]:
        peer = result["peers"][name]
        if peer["status"] != "ok":
            continue
        err = peer["max_rel_err"] if peer["max_rel_err"] is not None else math.inf
        peer["err_bound"], peer["within_bound"] = bound, err <= bound
        if not peer["within_bound"]:
            lines.append(f"{name}'s relative error {err:.1e} is over its bound {bound:.1e} (the dtype's tolerance, or "
                         "twice a compiled peer's error or eager's own off fp32): a wrong result, please report it")
    return lines


HOST_BOUND = 1.15  # latency over GPU time past which a peer's row is the host's pace, not its GPU work


def host_bound(result: dict) -> list[str]:
    """A note for each peer whose latency passes its GPU time by HOST_BOUND or more: the host set the pace (Python,
    Dynamo's guards, launches, or a busy machine), and speedups on that row compare hosts, not kernels."""
    lines = []
    for name, peer in result["peers"].items():
        gpu = peer.get("gpu_ms")
        if peer["status"] == "ok" and gpu and peer["latency_ms"] > HOST_BOUND * gpu:
            lines.append(f"{name} is host-bound: {peer['latency_ms']:.3f} ms a call for {gpu:.3f} ms of GPU work")
    return lines


SLOWED = 0.97  # a limited median SM clock under this share of the GPU's highest: the peer's note says so


def slowed(clock: dict) -> bool:
    """A power or thermal limit held the clock down: some reads say so and the median is under SLOWED of the highest
    (without the highest, half the reads)."""
    if not clock["limited"]:
        return False
    return clock["sm_mhz"] < SLOWED * clock["max_mhz"] if clock["max_mhz"] else clock["limited"] >= 0.5


def clock_limited(result: dict) -> list[str]:
    """A note for each peer that the GPU's power or thermal limit slowed: its latency is at the clock that limit
    left, which a lighter peer, or one whose host leaves the GPU idle between calls, does not pay. Its GPU ms, timed
    over a few calls after its latency, can be at another clock: the note gives both."""
    lines = []
    for name, peer in result["peers"].items():
        clock, gpu_clock = peer.get("clock"), peer.get("gpu_ms_clock")
        if peer["status"] != "ok" or not clock or not slowed(clock):
            continue
        top = f" of {clock['max_mhz']:.0f}" if clock["max_mhz"] else ""
        line = (f"{name} ran at the GPU's power or thermal limit: SM clock {clock['sm_mhz']:.0f}{top} MHz over its "
                f"timed calls")
        if gpu_clock:
            line += f", {gpu_clock['sm_mhz']:.0f} MHz over its GPU ms"
        lines.append(line)
    return lines


def _floor(result, model, inputs, device, dtype, args) -> None:
    t0 = time.perf_counter()
    if getattr(args, "ceilings", None):
        ceilings = tuple(float(v) for v in args.ceilings.split(","))
    else:
        ceilings = roofline.measure_ceilings(device, dtype if device.type == "cuda" else None)
    seconds, layers = roofline.floor(model, inputs, ceilings)
    result["ceilings"] = {"matmul_flops_per_s": ceilings[0], "copy_bytes_per_s": ceilings[1],
                          "matmul_dtype": str(dtype if device.type == "cuda" else torch.float32),
                          "source": "given" if getattr(args, "ceilings", None) else "measured"}
    top = sorted(layers, key=lambda layer: layer.floor_s, reverse=True)[:10]
    result["floor"] = {
        "ms": seconds * 1e3, "flops": sum(layer.flops for layer in layers),
        "bytes": sum(layer.bytes for layer in layers), "layers": len(layers),
        "compute_bound_layers": sum(layer.bound == "compute" for layer in layers),
        "top_layers": [{"name": layer.name, "kind": layer.kind, "flops": layer.flops, "bytes": layer.bytes,
                        "floor_us": layer.floor_s * 1e6, "ops": layer.ops} for layer in top],
        "seconds_to_measure": time.perf_counter() - t0,
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU ({torch.get_num_threads()} threads)"


def _versions() -> dict:
    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "torch": torch.__version__, "triton": version("triton"),
            "transformers": version("transformers"), "torchvision": version("torchvision"),
            "timm": version("timm"), "cuda": torch.version.cuda,
            "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None,
            "resfuse": version("resfuse")}


def _free(device: torch.device) -> None:
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m resfuse.bench.run", description=__doc__.split("\n")[0])
    add_arguments(_parser)
    _args = _parser.parse_args()
    _args.argv = sys.argv[1:]
    sys.exit(main(_args))
