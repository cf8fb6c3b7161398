"""The compile worker processes of precompile.py: their pools, the jobs' framing, and the worker's own loop.

Entry points: `submit(specs, kind, key_of)` (each job's future, a job queued once however often it is asked
for), `wanted()` (how many workers a pool may start), `POOLS` and `QUEUED` (the state precompile.py reads), and
`python -m resfuse.tuning.workers`, the worker: it compiles a recorded Triton kernel (`compile_spec`) or builds a
cuDNN engine config (providers/cudnn.build_engine) per job, and answers whether it did. A worker is started with
`sys.executable -m`, never through multiprocessing, whose spawn would re-import the user's script; a Triton worker
has no GPU context, a cuDNN worker has one (at most CUDNN_WORKERS of them). Idle workers exit, dead ones break
their pool, and at exit every worker is killed (precompile.py's docstring says why each).
"""
from __future__ import annotations

import atexit
import concurrent.futures
import importlib
import importlib.util
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading

# a pool of workers per kind of job: Triton compiles (no GPU context), cuDNN engine builds (a GPU context each);
# idle_s: a worker without work this long exits (precompile.py's docstring says why)
POOLS: dict = {kind: {"workers": None, "jobs": None, "broken": False, "idle_s": idle_s}
                for kind, idle_s in (("triton", 60.0), ("cudnn", 15.0))}
_LOCK = threading.Lock()
QUEUED: dict = {}  # a kernel's specialisation, or ("cudnn", problem, engine index) -> the future of its build
CUDNN_WORKERS = 4  # at most: each holds a CUDA context (a few hundred MB of GPU memory) while it lives


def wanted() -> int:
    """How many Triton workers a pool may start: Config.compile_workers, or one a core up to 16."""
    from ..kernels import options
    n = options().get("compile_workers")
    return min(16, os.cpu_count() or 1) if n is None else max(0, int(n))


def submit(specs, kind: str = "triton", key_of=lambda s: (s["module"], s["name"], s["specialization"])) -> list:
    """Each spec's compile future: the one queued before for the same kernel, or a new one; none with the workers
    switched off."""
    n = wanted() if kind == "triton" else min(CUDNN_WORKERS, wanted())
    if not specs or n == 0:
        return []
    futures = []
    with _LOCK:  # one hold: no idle worker retires between the pool's start and the jobs' arrival
        jobs = _start(kind, n)
        if jobs is None:
            return []
        for spec in specs:
            key = key_of(spec)
            if key not in QUEUED:
                QUEUED[key] = concurrent.futures.Future()
                jobs.put((spec, QUEUED[key]))
            futures.append(QUEUED[key])
    return futures


def _feed(worker, jobs: queue.Queue, pool: dict) -> None:
    """A daemon thread's loop: hand its worker the queued specs one by one. Daemon threads, so that compiles still
    queued (an op the budget left untuned) never hold up the interpreter's exit. Left without work for idle_s,
    the worker exits, and the thread with it; the pool starts again with the next job."""
    while True:
        try:
            spec, future = jobs.get(timeout=pool["idle_s"])
        except queue.Empty:
            with _LOCK:  # the lock submit puts jobs under: an empty queue stays empty while the worker leaves
                if jobs.empty():
                    worker.close()
                    pool["workers"].remove(worker)
                    pool["workers"] = pool["workers"] or None
                    return
            continue
        if pool["broken"]:
            future.set_result(False)
            continue
        try:
            future.set_result(worker.ask(spec))
        except Exception:  # noqa: BLE001  a dead worker: this process compiles on threads from now on
            pool["broken"] = True
            future.set_result(False)


class Worker:
    """One `python -m resfuse.tuning.workers` process: a pickled spec in, a pickled bool out, each framed by
    its length."""

    def __init__(self):
        env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "resfuse.tuning.workers"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)

    def ask(self, spec: dict) -> bool:
        _send(self.proc.stdin, spec)
        return _receive(self.proc.stdout)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _start(kind: str, n: int):
    """Under _LOCK: the job queue of a kind of job, with `n` workers and their feeding threads started where none
    runs (one import of triton and torch a worker)."""
    pool = POOLS[kind]
    if pool["broken"]:
        return None
    if pool["workers"] is None:
        try:
            pool["workers"] = [Worker() for _ in range(n)]
        except OSError:
            pool["broken"] = True
            return None
        pool["jobs"] = queue.Queue()
        for i, w in enumerate(pool["workers"]):
            threading.Thread(target=_feed, args=(w, pool["jobs"], pool), name=f"resfuse-{kind}-{i}",
                             daemon=True).start()
    return pool["jobs"]


@atexit.register
def _stop() -> None:
    """At exit: the workers are killed, mid-compile or not (Triton writes its cache files whole, by rename; the
    CUDA driver its JIT cache's entries likewise)."""
    for pool in POOLS.values():
        for w in list(pool["workers"] or ()):
            w.close()


def _send(stream, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream):
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the compile worker exited")
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


def compile_spec(spec: dict) -> bool:
    """In a worker: compile one recorded kernel into Triton's on-disk cache, or build one cuDNN engine config."""
    if spec.get("kind") == "cudnn":
        from ..providers import cudnn

        return cudnn.build_engine(spec)
    compiled(spec)
    return True


def compiled(spec: dict):
    """One recorded Triton kernel compiled (into Triton's on-disk cache): its CompiledKernel (bench/chain_smem.py
    reads its shared memory)."""
    import triton
    from triton.compiler import ASTSource, make_backend

    if spec["module"] in sys.modules:
        module = sys.modules[spec["module"]]
    elif spec["module"].startswith("resfuse_generated."):  # codegen.load_source's files, imported by path
        loaded = importlib.util.spec_from_file_location(spec["module"], spec["path"])
        module = importlib.util.module_from_spec(loaded)
        sys.modules[spec["module"]] = module  # Triton resolves the kernel's globals through its module
        loaded.loader.exec_module(module)
    else:
        module = importlib.import_module(spec["module"])
    jit = getattr(module, spec["name"])
    options = make_backend(spec["target"]).parse_options(dict(spec["options"]))
    return triton.compile(ASTSource(jit, spec["signature"], spec["constants"], spec["attrs"]), target=spec["target"],
                          options=options.__dict__)


def _serve() -> None:
    """The worker's loop: until its stdin closes, compile each spec it is sent and answer whether it compiled.
    Its stdout is the reply channel; whatever else writes to stdout (a print, a C library) goes to stderr."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer
    while True:
        try:
            spec = _receive(requests)
        except EOFError:
            return
        try:
            ok = compile_spec(spec)
        except Exception as e:  # noqa: BLE001  the parent compiles it itself
            what = (f"cuDNN {spec['op']} {spec['signature']} engine config {spec['index']}"
                    if spec.get("kind") == "cudnn" else f"{spec.get('module')}.{spec.get('name')}")
            print(f"resfuse precompile: {what}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
            ok = False
        _send(replies, ok)


if __name__ == "__main__":
    _serve()
