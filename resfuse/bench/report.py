"""The benchmark's outputs, from the result dict that run.py assembles (its schema is in run.py).

Entry points: `table(result)` (a rich Table), `write_json(result, path)`, `plot(result, path)` (a PNG
through matplotlib's Agg backend, so it needs no display). The last step of a benchmark run.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from rich.table import Table


def _finite_or_none(obj):
    # Strict JSON has no NaN or Infinity; an unusable error or a failed timing is written as null.
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj


def write_json(result: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_finite_or_none(result), indent=2, allow_nan=False) + "\n")


def _fmt(value, spec: str, missing: str = "-") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return missing
    return format(value, spec)


def table(result: dict) -> Table:
    floor_ms = result["floor"]["ms"]
    variants = [v for v in result["resfuse_variants"] if result["peers"].get(v, {}).get("status") == "ok"]
    t = Table(title=f"{result['model']} ({result['model_source']}) bs{result['batch']} {result['dtype']} "
                    f"on {result['device_name']} — floor {_fmt(floor_ms, '.3f')} ms")
    t.add_column("peer")
    t.add_column("ms (median)", justify="right")
    gpu = any(p.get("gpu_ms") is not None for p in result["peers"].values())  # CUDA: the GPU's part beside it
    if gpu:
        t.add_column("GPU ms", justify="right")
    mhz = any(p.get("clock") for p in result["peers"].values())  # NVML read: the SM clock over the timed calls
    if mhz:
        t.add_column("SM MHz", justify="right")
    t.add_column("items/s", justify="right")
    t.add_column("× floor", justify="right")
    for v in variants:
        t.add_column(f"{v} speedup", justify="right")
    t.add_column("first call s", justify="right")
    t.add_column("rel err", justify="right")
    t.add_column("max abs", justify="right")
    wide = result.get("eager_fp32_rel_err") is not None  # a low-precision run: each peer's error off fp32 too
    if wide:
        t.add_column("err vs fp32", justify="right")
    for name, peer in result["peers"].items():
        if peer["status"] != "ok":
            t.add_row(name, f"[red]{peer['status']}[/red]: {peer['error'][:60]}")
            continue
        speedups = [_fmt(peer["speedup_of_resfuse"].get(v), ".2f") + "×" for v in variants]
        t.add_row(name, _fmt(peer["latency_ms"], ".3f"), *[_fmt(peer.get("gpu_ms"), ".3f")] * gpu,
                  *[_fmt((peer.get("clock") or {}).get("sm_mhz"), ".0f")] * mhz,
                  _fmt(peer["throughput_items_per_s"], ",.0f"),
                  _fmt(peer["latency_ms"] / floor_ms if floor_ms else None, ".2f"), *speedups,
                  _fmt(peer["compile_s"], ".1f"), _fmt(peer["max_rel_err"], ".1e"),
                  _fmt(peer["max_abs_err"], ".1e"), *[_fmt(peer.get("fp32_rel_err"), ".1e")] * wide)
    return t


def profile_table(peer: str, rows: list[dict], top: int = 15) -> Table:
    """A peer's slowest kernels, titled with its launches and kernel time per iteration."""
    launches, busy = sum(r["calls"] for r in rows), sum(r["time_us"] for r in rows)
    t = Table(title=f"{peer}: {launches} launches, {busy:.1f} us of kernels per call")
    for col in ("kernel", "us", "calls", "share"):
        t.add_column(col, justify="left" if col == "kernel" else "right")
    for r in rows[:top]:
        t.add_row(r["name"][:80], f"{r['time_us']:.1f}", str(r["calls"]), f"{r['share']:.0%}")
    return t


def plot(result: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless: CI and the GPU machine have no display
    import matplotlib.pyplot as plt

    peers = [(n, p["latency_ms"]) for n, p in result["peers"].items() if p["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(peers) + 2), 4))
    colors = ["tab:orange" if n.startswith("resfuse") else "tab:blue" for n, _ in peers]
    bars = ax.bar([n for n, _ in peers], [ms for _, ms in peers], color=colors)
    ax.bar_label(bars, fmt="%.3g")
    floor_ms = result["floor"]["ms"]
    if floor_ms:
        ax.axhline(floor_ms, color="black", linestyle="--", label=f"roofline floor {floor_ms:.3g} ms")
        ax.legend()
    ax.set_ylabel("latency, median ms (lower is better)")
    ax.set_title(f"{result['model']} bs{result['batch']} {result['dtype']} — {result['device_name']}",
                 fontsize=10)
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
