"""The tuner's Triton kernels compiled in worker processes, ahead of their first launch.

Entry point: `precompile(fns)`, which choose.compile_in_parallel calls before it launches each candidate once.
`python -m resfuse.tuning.precompile` is the worker.

Why: a cold tuning is mostly Triton compiles. MobileNetV3 bs32 on an H100 host (16 cores) compiled 759 kernels in
134 of its 215 s first call; on compile_in_parallel's threads each compile waited on the GIL for about a third of
its time (bench/tune_profile.py, BENCHMARKS.md).

How:
- `precompile` runs each callable once with Triton's `jit_cache_hook` set. The hook records what each launch
  would compile (the @jit function's module, its specialisation and options) and declines the compile, so the
  dry run neither compiles nor launches anything.
- The records go to a pool of worker processes started with `sys.executable -m` (never the user's script, which
  multiprocessing's spawn would re-import). Each worker calls `triton.compile` for the parent's GPU target,
  without a GPU context. Triton's on-disk cache (TRITON_CACHE_DIR, inherited) then holds every kernel.
- The callables' real first runs, on compile_in_parallel's threads, find their kernels there.
- Anything a worker cannot rebuild (a kernel defined in a function, an unpicklable argument, a dead worker) is
  compiled on the threads as before: a cache miss costs time, never a wrong kernel.

Switch: `Config.compile_workers` (env RESFUSE_COMPILE_WORKERS; 0 keeps compiling on threads only).
"""
from __future__ import annotations

import atexit
import concurrent.futures
import importlib
import importlib.util
import inspect
import json
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading

_POOL: dict = {"workers": None, "idle": None, "broken": False}
_LOCK = threading.Lock()


def workers_wanted() -> int:
    from ..kernels import options
    n = options().get("compile_workers")
    return min(16, os.cpu_count() or 1) if n is None else max(0, int(n))


def precompile(fns) -> int:
    """Compile in worker processes every Triton kernel the callables would launch; returns how many compiled."""
    if workers_wanted() == 0 or _POOL["broken"]:
        return 0
    specs = record(fns)
    idle = _start(workers_wanted())
    if not specs or idle is None:
        return 0

    def send(spec):
        worker = idle.get()
        try:
            return worker.ask(spec)
        except (OSError, EOFError, pickle.PickleError, struct.error):
            _POOL["broken"] = True  # a dead worker: this process compiles on threads from now on
            return False
        finally:
            idle.put(worker)

    with concurrent.futures.ThreadPoolExecutor(len(_POOL["workers"])) as threads:
        return sum(bool(ok) for ok in threads.map(send, specs))


def record(fns) -> list[dict]:
    """What each callable's launches would compile, one spec per distinct kernel; nothing compiles or runs."""
    import triton
    from triton.runtime import driver

    if not hasattr(triton, "knobs"):  # triton < 3.4: no jit_cache_hook to record with
        return []
    try:
        target = driver.active.get_current_target()
    except RuntimeError:  # no GPU driver
        return []
    found = {}

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        spec = _spec(fn.jit_function, compile)
        if spec is not None:
            found.setdefault(compile["specialization_data"], spec)
        return True  # declined: jit.run returns without compiling or launching

    knobs = triton.knobs.runtime
    previous, knobs.jit_cache_hook = knobs.jit_cache_hook, hook
    try:
        for fn in fns:
            try:
                fn()
            except Exception:  # noqa: BLE001  the real run meets the same error and reports it
                pass
    finally:
        knobs.jit_cache_hook = previous
    return [dict(spec, target=target) for spec in found.values()]


def _spec(jit, compile: dict) -> dict | None:
    """The picklable description of one compile: where the @jit function lives and how it is specialised."""
    fn = jit.fn
    name, module = fn.__name__, sys.modules.get(fn.__module__)
    if module is None or getattr(module, name, None) is not jit:
        return None  # not a module-level kernel: a worker could not find it
    data = json.loads(compile["specialization_data"])
    spec = {"module": fn.__module__, "path": inspect.getsourcefile(fn), "name": name,
            "signature": compile["signature"], "constants": compile["constants"], "attrs": compile["configs"][0],
            "options": _tuples(data["options"])}
    try:
        pickle.dumps(spec)
    except Exception:  # noqa: BLE001  e.g. a constexpr of a type pickle does not know
        return None
    return spec


def _tuples(value):
    """JSON's lists back to the tuples Triton's options hold (its cache key hashes them)."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


class _Worker:
    """One `python -m resfuse.tuning.precompile` process: a pickled spec in, a pickled bool out, each framed by
    its length."""

    def __init__(self):
        env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "resfuse.tuning.precompile"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)

    def ask(self, spec: dict) -> bool:
        _send(self.proc.stdin, spec)
        return _receive(self.proc.stdout)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except Exception:  # noqa: BLE001
            self.proc.kill()


def _start(n: int):
    """The idle-worker queue, with `n` workers started on first use (one import of triton and torch each)."""
    with _LOCK:
        if _POOL["workers"] is None:
            try:
                _POOL["workers"] = [_Worker() for _ in range(n)]
            except OSError:
                _POOL["broken"] = True
                return None
            _POOL["idle"] = queue.Queue()
            for w in _POOL["workers"]:
                _POOL["idle"].put(w)
            atexit.register(_stop)
        return _POOL["idle"]


def _stop() -> None:
    for w in _POOL["workers"] or ():
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
    """In a worker: compile one recorded kernel into Triton's on-disk cache."""
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
    triton.compile(ASTSource(jit, spec["signature"], spec["constants"], spec["attrs"]), target=spec["target"],
                   options=options.__dict__)
    return True


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
            print(f"resfuse precompile: {spec.get('module')}.{spec.get('name')}: {type(e).__name__}: "
                  f"{str(e)[:300]}", file=sys.stderr)
            ok = False
        _send(replies, ok)


if __name__ == "__main__":
    _serve()
