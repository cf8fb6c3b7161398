"""The `resfuse` command: explain | bench | tune | cache.

  resfuse explain MODEL   the fusion report, a numerics check of resfuse against eager, and where the time
                          would go (the per-layer roofline floor on this device's measured ceilings)
  resfuse bench MODEL     resfuse against eager and torch.compile (resfuse/bench/run.py)
  resfuse tune MODEL      compile and run once with tuning on, filling the tuning cache; prints the wall time
  resfuse cache list | clear | export FILE | import FILE [--replace]
                          the tuning cache (<cache_dir>/tuning.sqlite; env RESFUSE_CACHE_DIR)

MODEL: a built-in name (default resnet50), an HF config name (hf-resnet50, hf-bert-base, ...), a
torchvision/timm name when installed, or path/to/file.py:factory (resfuse/bench/models.py).
"""
from __future__ import annotations

import argparse
import sys

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _explain_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="resnet50")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default fp16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default=None, help="default cuda when available, else cpu")
    p.add_argument("--no-fuse-epilogue", dest="fuse_epilogue", action="store_false")
    p.add_argument("--no-fuse-add-to-output", dest="fuse_add_to_output", action="store_false")
    p.add_argument("--top", type=int, default=10, help="layers to show in the time breakdown")


def explain(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    import resfuse
    from resfuse.bench import models, roofline

    console = Console()
    loaded = _load(args, "explain")
    if loaded is None:
        return 2
    model, inputs = loaded
    device, dtype = inputs[0].device, next(model.parameters()).dtype
    options = {"fuse_epilogue": args.fuse_epilogue, "fuse_add_to_output": args.fuse_add_to_output}
    console.print(f"[bold]{models.resolve(args.model)}[/bold] batch {args.batch}, {dtype}, {device}")
    console.print(resfuse.explain(model, *inputs, **options))

    torch._dynamo.reset()
    compiled = resfuse.compile(model, **options)
    with torch.no_grad():
        ref, out = model(*inputs), compiled(*inputs)
    err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
    paths = sorted({f.ran for f in compiled.resfuse_report.fusions})
    console.print(f"numerics: resfuse vs eager relative error {err:.2e} (paths that ran: {', '.join(paths)})")

    ceilings = roofline.measure_ceilings(device)
    total, layers = roofline.floor(model, inputs, ceilings)
    table = Table(title=f"where the time would go: per-layer floor {total * 1e3:.3f} ms on {device} "
                        f"({ceilings[0] / 1e9:.0f} GFLOP/s, {ceilings[1] / 1e9:.0f} GB/s measured)")
    for col in ("layer", "kind", "GFLOP", "MB", "floor us", "bound by"):
        table.add_column(col)
    for layer in sorted(layers, key=lambda l: -l.floor_s)[:args.top]:
        table.add_row(layer.name, layer.kind, f"{layer.flops / 1e9:.2f}", f"{layer.bytes / 1e6:.2f}",
                      f"{layer.floor_s * 1e6:.1f}", "compute" if layer.compute_s > layer.memory_s else "memory")
    console.print(table)
    return 0


def _load(args, command: str):
    from resfuse.bench import models

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float16 if device.type == "cuda" else torch.float32)
    try:
        return models.load(args.model, args.batch, dtype, device, image_size=args.image_size, seq=args.seq)
    except (models.UnknownModel, models.MissingPackage, FileNotFoundError) as e:
        print(f"resfuse {command}: {e}", file=sys.stderr)
        return None


def tune(args: argparse.Namespace) -> int:
    import time

    import resfuse

    loaded = _load(args, "tune")
    if loaded is None:
        return 2
    model, inputs = loaded
    if inputs[0].device.type != "cuda":
        print("resfuse tune: tuning measures CUDA kernels; on this CPU-only machine there is nothing to tune")
        return 0
    start = time.perf_counter()
    compiled = resfuse.compile(model, tuning=args.level, retune=args.retune, tuning_budget_s=args.budget)
    with torch.no_grad():
        compiled(*inputs)
    torch.cuda.synchronize()
    print(f"resfuse tune: {args.model} batch {args.batch}: first output after {time.perf_counter() - start:.1f} s "
          f"(capture, kernel builds and tuning at level {args.level})")
    return 0


def cache(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from resfuse.config import Config
    from resfuse.tuning.cache import TuningCache

    store = TuningCache(Path(Config.from_env().cache_dir) / "tuning.sqlite")
    if args.action == "list":
        table = Table(title=f"tuning cache {store.path}")
        for col in ("op", "shape", "dtypes", "epilogue", "gpu", "provider", "config", "best s"):
            table.add_column(col)
        for key, entry in store.entries():
            table.add_row(key["op"], str(key["shape"]), ",".join(key["dtypes"]), key["epilogue"], key["gpu"],
                          entry.provider, str(entry.config), f"{min(entry.times.values(), default=0):.3g}")
        Console().print(table)
    elif args.action == "clear":
        print(f"removed {store.clear()} entries from {store.path}")
    elif args.action == "export":
        print(f"exported {store.export(args.file)} entries to {args.file}")
    else:
        print(f"imported {store.import_(args.file, replace=args.replace)} entries from {args.file}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="resfuse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _explain_arguments(sub.add_parser("explain", help="fusion report, numerics, where the time would go"))
    from resfuse.bench import run as bench

    bench.add_arguments(sub.add_parser("bench", help="resfuse against eager and torch.compile"))
    t = sub.add_parser("tune", help="fill the tuning cache for a model")
    _explain_arguments(t)
    t.add_argument("--level", choices=["fast", "max"], default="fast")
    t.add_argument("--retune", action="store_true", help="measure again and replace cached entries")
    t.add_argument("--budget", type=float, default=600.0, help="tuning wall-clock budget in seconds")
    c = sub.add_parser("cache", help="list, clear, export or import the tuning cache")
    c.add_argument("action", choices=["list", "clear", "export", "import"])
    c.add_argument("file", nargs="?", help="the JSON file of export / import")
    c.add_argument("--replace", action="store_true", help="import: overwrite entries with the same key")
    args = parser.parse_args(argv)
    if args.command == "cache" and args.action in ("export", "import") and not args.file:
        parser.error(f"cache {args.action} needs a FILE")
    return {"explain": explain, "bench": bench.main, "tune": tune, "cache": cache}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
