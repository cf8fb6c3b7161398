"""Markdown tables for BENCHMARKS.md from the JSON that bench/models.py writes (one row per model and batch).

Entry point: `python bench/tables.py bench/results/models_zoo_*_h100.json`. Rows are grouped by batch size and
keep the order of the files and jobs given; a (model, batch) seen twice keeps its last measurement. Each ratio
compares peers of the same job (one process), never across jobs. Where the JSON has errors against fp32 (the
thirty-ninth session's harness), a second table gives each peer's, and resfuse+graphs' over eager's: eager's is
what fp16/bf16 alone costs the model, so a ratio over 1 is rounding of resfuse's own.
"""
from __future__ import annotations

import json
import sys

PEERS = ("eager", "compile", "reduce-overhead", "resfuse", "resfuse+graphs")
OTHERS = ("eager", "compile", "reduce-overhead")  # what a user would run instead of resfuse
NOISY = 1.2  # resfuse+graphs' p90 over its fastest call past which a row says so (its min-p90 range)


def ms(result: dict, peer: str) -> float | None:
    p = result["peers"].get(peer, {})
    return p.get("latency_ms") if p.get("status") == "ok" else None


def row(r: dict) -> str:
    cells = [f"{v:.3f}" if (v := ms(r, p)) is not None else "-" for p in PEERS]
    others = {p: ms(r, p) for p in OTHERS if ms(r, p) is not None}
    best_peer = min(others, key=others.get) if others else None
    ours = ms(r, "resfuse+graphs")
    vs = f"**{others[best_peer] / ours:.2f}x** ({best_peer})" if best_peer and ours else "-"
    rf = r["peers"].get("resfuse+graphs", {})
    if ours and rf.get("latency_min_ms") and rf.get("latency_p90_ms", 0) / rf["latency_min_ms"] > NOISY:
        vs += f", noisy: {rf['latency_min_ms']:.3f}-{rf['latency_p90_ms']:.3f}"
    errs = [e for p in ("resfuse", "resfuse+graphs") if (e := r["peers"].get(p, {}).get("max_rel_err")) is not None]
    err = f"{max(errs):.1e}" if errs else "-"
    if any("vacuous" in note for note in r.get("notes", [])):
        err += " (vacuous)"
    if any(r["peers"].get(p, {}).get("within_bound") is False for p in ("resfuse", "resfuse+graphs")):
        err += " **over its bound**"
    first = r["peers"].get("resfuse", {}).get("compile_s")  # the variant that ran first: capture + cold tuning
    return (f"| {r['model']} | {r['batch']} | {r['floor']['ms']:.3f} | " + " | ".join(cells)
            + f" | {vs} | {err} | {'-' if first is None else f'{first:.0f}'} |")


def fp32_row(r: dict) -> str:
    def err(peer):
        e = r["peers"].get(peer, {}).get("fp32_rel_err")
        return "-" if e is None else f"{e:.1e}"
    ours, eager = r["peers"].get("resfuse+graphs", {}).get("fp32_rel_err"), r["eager_fp32_rel_err"]
    ratio = f"{ours / eager:.2f}" if ours is not None and eager else "-"
    return f"| {r['model']} | {r['batch']} | " + " | ".join(err(p) for p in PEERS) + f" | {ratio} |"


def main(paths: list[str]) -> int:
    results: dict[tuple, dict] = {}
    for path in paths:
        data = json.load(open(path))
        for r in data if isinstance(data, list) else []:  # a tuning-cache export beside them is skipped
            if "error" not in r:
                results[(r["model"], r["batch"])] = r
    batches = sorted({b for _, b in results})
    print("| model | bs | floor | " + " | ".join(PEERS)
          + " | resfuse+graphs vs best peer | rel err (worse of the two resfuse) | resfuse first call s |")
    print("| --- " * (len(PEERS) + 6) + "|")
    for batch in batches:
        for (model, b), r in results.items():
            if b == batch:
                print(row(r))
    against = [r for r in results.values() if r.get("eager_fp32_rel_err") is not None]
    if against:
        print("\nErrors against fp32 (TF32 off):\n")
        print("| model | bs | " + " | ".join(PEERS) + " | resfuse+graphs over eager |")
        print("| --- " * (len(PEERS) + 3) + "|")
        for r in sorted(against, key=lambda r: r["batch"]):
            print(fp32_row(r))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
