"""GPU sweep for issue 5: `resfuse bench` over the issue's models and batch sizes, channels_last, fp16 (--dtype).

Entry point: `python bench/models.py [--jobs resnet50:1,resnet50:32 ...] [--budget-s 540] [--out DIR]`.
Runs on the GPU machine (CI never runs it). Each (model, batch) job is one `resfuse.bench.run.benchmark`
call, i.e. eager, torch.compile (default and reduce-overhead), resfuse and resfuse+graphs in one process
run. All results go to one JSON list, rewritten after every job so that a run cut off by its time limit
still leaves what it measured; a compact table prints last.

Jobs run in priority order (resnet50 at every batch first, then every model at bs32, then bs1, then bs256)
and a job is started only while the time budget has room for one more like the last: a 10-minute device
call cannot compile every model in every mode, so run it more than once with --jobs to cover the rest.

Each job runs in a Python process of its own (--in-process: all in this one). Jobs that shared a process
inherited the earlier ones' compiled graphs, caches and garbage: MobileNetV3 bs1 under resfuse+graphs measured
1.033 ms as the third job of a process and 0.285 ms alone (twenty-third session, H100), its peers unmoved.

--lanes N runs N job processes at once on a machine of N GPUs: lane i has GPU i (the i-th of CUDA_VISIBLE_DEVICES
where that is set, so a sweep can share a machine with other work) and the i-th N-th of the CPUs this process may
use (its compile workers too), so no lane's host-bound peer shares cores with another lane's compiles. Each lane
measures its own GPU's ceilings with its first job. Each job's output goes to OUT/lane<i>.log.

--batch-peers "1=eager,reduce-overhead;256=eager,compile" gives some batch sizes their own peers (the zoo tables
leave compile out at bs1, where it ran 4-10x slower than reduce-overhead, and reduce-overhead out at bs256, where
it equals compile); other batches take --peers.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, no install needed

from resfuse.bench import report, run  # noqa: E402

MODELS = ["resnet50", "resnet18", "resnext50_32x4d", "wide_resnet50_2", "mobilenet_v3_large",
          "efficientnet_b0", "convnext_tiny", "regnety_040", "hf-resnet50", "hf-bert-base", "hf-vit-base"]
BATCHES = (32, 1, 256)


def default_jobs() -> list[tuple[str, int]]:
    jobs = [("resnet50", b) for b in BATCHES]
    for batch in BATCHES:
        jobs += [(m, batch) for m in MODELS if m != "resnet50"]
    return jobs


def parse_jobs(spec: str) -> list[tuple[str, int]]:
    jobs = []
    for item in spec.split(","):
        name, _, batch = item.strip().rpartition(":")
        jobs.append((name, int(batch)))
    return jobs


def bench_args(name: str, batch: int, peers: str, iters: int, ceilings: str | None,
               device: str, profile: bool, dtype: str = "fp16") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    run.add_arguments(parser)
    argv = [name, "--batch", str(batch), "--dtype", dtype, "--device", device, "--peers", peers,
            "--iters", str(iters), "--seq", "384", "--image-size", "224"]
    if ceilings:
        argv += ["--ceilings", ceilings]
    if profile:
        argv.append("--profile")
    args = parser.parse_args(argv)
    args.argv = argv
    return args


def peers_for(batch: int, opts: argparse.Namespace) -> str:
    for item in filter(None, (opts.batch_peers or "").split(";")):
        at, _, peers = item.partition("=")
        if int(at) == batch:
            return peers
    return opts.peers


def one_job(name: str, batch: int, opts: argparse.Namespace, ceilings: str | None, lane: int | None = None) -> dict:
    """One job's result dict, measured here (--in-process) or by this script in a child process, whose own
    output (a models.json, the ResNet-50 bs32 plot) goes to OUT/jobs/MODEL_bsBATCH; a lane's child runs on the
    lane's GPU and CPUs, its output appended to OUT/lane<i>.log."""
    if opts.in_process:
        return run.benchmark(bench_args(name, batch, peers_for(batch, opts), opts.iters, ceilings, opts.device,
                                        opts.profile, opts.dtype))
    out = Path(opts.out) / "jobs" / f"{name.replace('/', '_').replace(':', '_')}_bs{batch}"
    argv = [sys.executable, __file__, "--in-process", "--jobs", f"{name}:{batch}", "--peers", peers_for(batch, opts),
            "--iters", str(opts.iters), "--device", opts.device, "--dtype", opts.dtype, "--out", str(out),
            "--budget-s", "inf"]
    argv += ["--profile"] * opts.profile + (["--ceilings", ceilings] if ceilings else [])
    if lane is None:
        rc = subprocess.run(argv).returncode
    else:
        cpus = sorted(os.sched_getaffinity(0))
        share = len(cpus) // opts.lanes
        mine = cpus[lane * share:(lane + 1) * share]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        gpu = visible.split(",")[lane] if visible else str(lane)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, TORCHINDUCTOR_COMPILE_THREADS=str(share),
                   RESFUSE_COMPILE_WORKERS=str(max(1, share // 2)))
        with open(Path(opts.out) / f"lane{lane}.log", "a") as log:
            log.write(f"\n=== {name} bs{batch} ===\n")
            log.flush()
            rc = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: os.sched_setaffinity(0, mine)).returncode
    found = json.loads((out / "models.json").read_text()) if (out / "models.json").exists() else []
    return found[0] if found else {"model": name, "batch": batch, "error": f"its process exited with {rc}"}


def compact(results: list[dict]) -> str:
    cols = ["eager", "compile", "reduce-overhead", "resfuse", "resfuse+graphs"]
    head = (f"{'model':<20}{'bs':>4}{'floor':>8}" + "".join(f"{c[:9]:>10}" for c in cols)
            + f"{'c/rf':>7}{'ro/rfg':>8}{'rfg GPU':>8}{'GPU ro/rfg':>11}{'rf err':>9}  paths")
    lines = [head, "-" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['model']:<20}{r['batch']:>4}  failed: {r['error'][:80]}")
            continue
        p = r["peers"]

        def ms(name):
            peer = p.get(name, {})
            return peer.get("latency_ms") if peer.get("status") == "ok" else None

        def gpu(name):
            peer = p.get(name, {})
            return peer.get("gpu_ms") if peer.get("status") == "ok" else None

        def ratio(a, b, of=ms):
            return f"{of(a) / of(b):.2f}" if of(a) and of(b) else "-"

        cells = "".join(f"{ms(c):>10.3f}" if ms(c) else f"{p.get(c, {}).get('status', '-')[:9]:>10}"
                        for c in cols)
        err = p.get("resfuse", {}).get("max_rel_err")
        flag = "!" if any(p.get(v, {}).get("within_bound") is False for v in ("resfuse", "resfuse+graphs")) else ""
        paths = ",".join(f"{k}:{v}" for k, v in p.get("resfuse", {}).get("paths", {}).items()) or "-"
        lines.append(f"{r['model']:<20}{r['batch']:>4}{r['floor']['ms']:>8.3f}{cells}"
                     f"{ratio('compile', 'resfuse'):>7}{ratio('reduce-overhead', 'resfuse+graphs'):>8}"
                     f"{'-' if gpu('resfuse+graphs') is None else format(gpu('resfuse+graphs'), '.3f'):>8}"
                     f"{ratio('reduce-overhead', 'resfuse+graphs', gpu):>11}"
                     f"{('-' if err is None else format(err, '.1e')) + flag:>9}  {paths}")
    lines.append("ms = median latency; c/rf = compile ms / resfuse ms; ro/rfg = reduce-overhead ms / "
                 "resfuse+graphs ms (>1: resfuse faster); rfg GPU = resfuse+graphs' GPU ms a call, the host's pace "
                 "left out, and GPU ro/rfg the ratio of the two peers' (where ro/rfg is lower, the host set the pace); "
                 "rf err = ||resfuse - eager|| / ||eager||, ! where a resfuse variant's error is over its bound")
    return "\n".join(lines)


def in_lanes(jobs: list[tuple[str, int]], opts: argparse.Namespace) -> list[dict]:
    """The jobs over opts.lanes lanes, each taking the next job as it frees; results in the jobs' order."""
    todo: queue.Queue = queue.Queue()
    for index, job in enumerate(jobs):
        todo.put((index, job))
    done: dict[int, dict] = {}
    lock = threading.Lock()
    start = time.perf_counter()

    def lane(i: int) -> None:
        ceilings = opts.ceilings
        while time.perf_counter() - start < opts.budget_s:
            try:
                index, (name, batch) = todo.get_nowait()
            except queue.Empty:
                return
            t0 = time.perf_counter()
            try:
                result = one_job(name, batch, opts, ceilings, lane=i)
            except Exception as e:  # as in the sequential sweep: one job failing must not end its lane
                traceback.print_exc()
                result = {"model": name, "batch": batch, "error": f"{type(e).__name__}: {e}"}
            if c := result.get("ceilings"):
                ceilings = ceilings or f"{c['matmul_flops_per_s']},{c['copy_bytes_per_s']}"
            result["job_s"], result["lane"] = time.perf_counter() - t0, i
            print(f"lane {i}: {name} bs{batch} done in {result['job_s']:.0f} s", flush=True)
            with lock:
                done[index] = result
                ordered = [done[k] for k in sorted(done)]
                (Path(opts.out) / "models.json").write_text(json.dumps(report._finite_or_none(ordered), indent=1))

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(opts.lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    left = [f"{m}:{b}" for k, (m, b) in enumerate(jobs) if k not in done]
    if left:
        print(f"budget: skipped {', '.join(left)}", flush=True)
    return [done[k] for k in sorted(done)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", help="comma list of model:batch (default: the issue's sweep, prioritised)")
    parser.add_argument("--peers", default="eager,compile,reduce-overhead")
    parser.add_argument("--batch-peers", help='per-batch peers, e.g. "1=eager,reduce-overhead;256=eager,compile"')
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--budget-s", type=float, default=540.0, help="start no job past this (seconds)")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    parser.add_argument("--dtype", default="fp16", choices=sorted(run.DTYPES))
    parser.add_argument("--profile", action="store_true", help="top kernels of compile and resfuse in the JSON")
    parser.add_argument("--in-process", action="store_true", help="every job in this process, not one each")
    parser.add_argument("--ceilings", help="matmul FLOP/s,copy B/s to reuse (default: the first job measures them)")
    parser.add_argument("--lanes", type=int, default=1, help="job processes at once, one GPU and CPU share each")
    opts = parser.parse_args()
    jobs = parse_jobs(opts.jobs) if opts.jobs else default_jobs()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    if opts.lanes > 1:
        results = in_lanes(jobs, opts)
        print("\n" + compact(results), flush=True)
        return 0
    results: list[dict] = []
    ceilings = opts.ceilings  # else measured by the first job, then reused so every job shares one pair
    start, last = time.perf_counter(), 0.0
    for index, (name, batch) in enumerate(jobs):
        elapsed = time.perf_counter() - start
        if elapsed + last > opts.budget_s:
            print(f"budget: skipped {', '.join(f'{m}:{b}' for m, b in jobs[index:])}", flush=True)
            break
        t0 = time.perf_counter()
        print(f"\n=== {name} bs{batch} (t={elapsed:.0f}s) ===", flush=True)
        try:
            result = one_job(name, batch, opts, ceilings)
            if c := result.get("ceilings"):
                ceilings = ceilings or f"{c['matmul_flops_per_s']},{c['copy_bytes_per_s']}"
        except Exception as e:  # one model failing to load or trace must not end the sweep
            traceback.print_exc()
            result = {"model": name, "batch": batch, "error": f"{type(e).__name__}: {e}"}
        result["job_s"] = last = time.perf_counter() - t0
        results.append(result)
        (out / "models.json").write_text(json.dumps(report._finite_or_none(results), indent=1))
        if name == "resnet50" and batch == 32 and "error" not in result:
            report.plot(result, out / "resnet50_bs32.png")
    print("\n" + compact(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
