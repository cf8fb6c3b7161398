"""precompile.py without a GPU: a real generated kernel recorded as the jit hook would see it, compiled for sm_90 by a
real worker process into a fresh Triton cache, then found there by the parent's own compile of the same
specialisation (no new cache entry). The parent side runs in a child process: this test session's Triton is in
interpreter mode, whose kernels cannot be compiled."""
import os
import subprocess
import sys
import textwrap

import pytest

from resfuse import kernels
from resfuse.tuning import precompile, workers

PARENT = textwrap.dedent('''
    import os, sys
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ["TRITON_CACHE_DIR"] = sys.argv[1]
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    import json
    from resfuse import kernels
    from resfuse.kernels import codegen
    from resfuse.kernels.elementwise import FAMILY
    from resfuse.tuning import precompile, workers

    kernels.set_options(cache_dir=sys.argv[2])
    kernel = codegen.load(FAMILY, "relu(add(acc,c0))")  # a generated module, imported by path
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):  # as Triton specialises a launch: 16-divisible ints marked
        if name in ("BM", "BN", "SPLIT_K", "PDL", "PREFETCH", "KV"):
            sig[name], consts[(i,)] = "constexpr", {"BM": 64, "BN": 64, "SPLIT_K": 1, "PDL": False, "PREFETCH": False,
                                                    "KV": 8}[name]
        elif name in ("out", "src", "op0", "ws", "tickets"):
            sig[name] = {"ws": "*fp32", "tickets": "*i32"}.get(name, "*fp16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("s_sc", "s_oc", "op_sc0"):
            sig[name], consts[(i,)] = "constexpr", 1
        else:
            sig[name] = "i32"
    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options({"num_warps": 4})
    data = json.dumps({"options": options.__dict__})  # the part of the hook's specialization_data _spec reads
    spec = precompile._spec(kernel, {"signature": sig, "constants": consts, "configs": [attrs],
                                     "specialization_data": data})
    assert spec is not None and spec["module"].startswith("resfuse_generated."), spec

    def make():
        @triton.jit
        def local(x):  # defined in a function, not reachable from its module: no spec
            pass
        return local
    assert precompile._spec(make(), {}) is None

    worker = workers.Worker()
    try:
        assert worker.ask(dict(spec, target=target)) is True
        wrong = dict(spec, target=target, name="no_such_kernel")
        assert worker.ask(wrong) is False  # reported on stderr, the worker lives on
        before = set(os.listdir(sys.argv[1]))
        assert before, "the worker wrote nothing to the cache"
        compiled = triton.compile(ASTSource(kernel, sig, consts, attrs), target=target, options=options.__dict__)
        assert compiled.asm["cubin"]
        assert set(os.listdir(sys.argv[1])) == before, "the parent compiled again: the cache keys differ"

        # record(): a real launch through Triton's jit with a stand-in driver (no GPU here), which Triton's
        # jit_cache_hook stops before it compiles; the recorded spec compiles on the worker like the one above
        import torch
        from triton.runtime import driver

        class Driver:  # what jit.run asks of the active driver before it compiles
            def get_current_device(self):
                return 0

            def get_current_stream(self, device):
                return 0

            def get_current_target(self):
                return target

        driver.set_active(Driver())
        t16 = lambda n: torch.zeros(n, dtype=torch.float16)  # noqa: E731
        ints = [64, 72, 64, 64 * 72, 9, 1, 64 * 72, 9, 1]  # M, N, RPS, s_ss, s_sp, s_sc, s_os, s_op, s_oc
        args = [t16(4608), torch.zeros(1), torch.zeros(1, dtype=torch.int32), t16(4608), *ints, t16(72), 0, 0, 1]
        assert len(args) == len(kernel.arg_names) - 6
        launch = lambda: kernel[(1,)](*args, BM=64, BN=64, KV=8, SPLIT_K=1, PDL=False, PREFETCH=False,  # noqa: E731
                                      num_warps=4)
        specs = precompile.record([launch, launch, lambda: 1 / 0])  # a repeat and a failure: one spec
        assert len(specs) == 1 and specs[0]["name"] == kernel.fn.__name__, specs
        assert specs[0]["target"] == target and specs[0]["constants"]
        assert worker.ask(specs[0]) is True
        assert triton.knobs.runtime.jit_cache_hook is None  # the hook is taken down again

        # the pool: precompile() records, queues on its own worker (a feeding thread) and waits
        kernels.set_options(compile_workers=1)
        assert precompile.precompile([launch]) == 1
        assert len(workers.POOLS["triton"]["workers"]) == 1 and not workers.POOLS["triton"]["broken"]
        assert precompile.precompile([launch]) == 1  # the same kernel: its first future, not a second compile
        assert len(workers.QUEUED) == 1
    finally:
        worker.close()
    print("ok")
''')


def test_worker_compiles_what_the_parent_then_finds(tmp_path):
    triton_cache, resfuse_cache = tmp_path / "triton", tmp_path / "resfuse"
    triton_cache.mkdir()
    script = tmp_path / "parent.py"  # a file: Triton reads a @jit function's source from it
    script.write_text(PARENT)
    done = subprocess.run([sys.executable, str(script), str(triton_cache), str(resfuse_cache)],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr[-3000:]


def test_switched_off_or_broken_records_nothing(monkeypatch):
    """compile_workers=0, or a pool that broke earlier in the process: no dry run (the callables never run)."""
    ran = []
    monkeypatch.setitem(workers.POOLS["triton"], "broken", False)
    kernels.set_options(compile_workers=0)
    try:
        assert precompile.precompile([lambda: ran.append(1)]) == 0
    finally:
        kernels.set_options(compile_workers=None)
    monkeypatch.setitem(workers.POOLS["triton"], "broken", True)
    assert precompile.precompile([lambda: ran.append(1)]) == 0
    assert ran == []


def test_options_back_to_tuples():
    assert precompile._tuples({"extern_libs": [["libdevice", "/p"]], "n": 4}) == {
        "extern_libs": (("libdevice", "/p"),), "n": 4}


@pytest.mark.parametrize("n, want", [(None, min(16, os.cpu_count() or 1)), (0, 0), (3, 3)])
def test_workers_wanted(n, want):
    kernels.set_options(compile_workers=n)
    try:
        assert workers.wanted() == want
    finally:
        kernels.set_options(compile_workers=None)


def _graph():
    """A rewritten graph with a fused conv (batch norm + relu) and a fused gemm (bias + gelu), on CPU."""
    import torch
    import torch.nn.functional as F

    from tests.passes import helpers

    kernels.set_options(interpret=True)  # the fused ops take our kernels (provider "triton") on CPU tensors

    def fn(x, w, bw, bb, mean, var, a, lw, lb):
        y = torch.relu(helpers.bn(F.conv2d(x, w, padding=1), bw, bb, mean, var))
        return y, F.gelu(F.linear(a, lw, lb))

    args = (torch.randn(2, 4, 5, 5), helpers.conv_w(4, 6), *helpers.bn_params(6), torch.randn(3, 8),
            torch.randn(16, 8), torch.randn(16))
    gm, _ = helpers.run(fn, *args, providers=("triton", "aten"), interpret=True)
    return gm


def test_calls_from_the_graph_shapes():
    import torch

    calls = list(precompile._calls(_graph(), device_type="cpu"))
    assert all(not isinstance(t, torch._subclasses.FakeTensor) for c in calls for t in (*c.inputs, *c.operands))
    assert [(c.op, tuple(c.out.shape)) for c in calls] == [("conv2d", (2, 6, 5, 5)), ("gemm", (3, 16))]
    conv, gemm = calls
    assert "relu" in conv.signature and conv.params == ([1, 1], [1, 1], [1, 1]) and len(conv.operands) == 4
    assert "gelu" in gemm.signature and gemm.inputs[0].shape == (3, 8) and gemm.inputs[1].shape == (8, 16)
    assert list(precompile._calls(_graph())) == []  # nothing on CUDA here
    from resfuse.tuning import choose

    asked = []

    def wanted(call):  # on the graph's fake tensors: the tuner's keys must be computable there
        assert isinstance(call.inputs[0], torch._subclasses.FakeTensor)
        asked.append((call.op, choose.key(call).op, choose.fast_key(call)[0]))
        return call.op == "gemm"

    only_gemm = list(precompile._calls(_graph(), wanted, device_type="cpu"))
    assert asked == [("conv2d",) * 3, ("gemm",) * 3] and [c.op for c in only_gemm] == ["gemm"]


def test_ahead_queues_the_candidates_of_ops_still_to_tune(monkeypatch):
    """Each op the tuner will measure has all its Triton candidates' callables dry-run (mainloop, run, variants),
    and the epilogue provider's; an op already decided is skipped."""
    from resfuse.tuning import choose

    calls = list(precompile._calls(_graph(), device_type="cpu"))
    monkeypatch.setattr(precompile, "_calls", lambda gm, wanted: (c for c in calls if wanted(c)))
    monkeypatch.setattr(choose, "needs_tuning", lambda call: call.op == "gemm")
    recorded = []  # a spec a callable, and the first again: a kernel two problems share is queued once
    monkeypatch.setattr(precompile, "record", lambda fns: recorded.append(list(fns)) or [*fns, *list(fns)[:1]])
    monkeypatch.setattr(workers, "QUEUED", {})
    monkeypatch.setattr(workers, "submit", lambda specs: [workers.QUEUED.setdefault(s, s) for s in specs])
    assert precompile._queue_graph(None) == len(recorded[0]) > 0
    assert len(recorded) == 1  # the conv, already decided, was not dry-run
    from resfuse import providers
    cands = providers.triton.candidates(calls[1], choose.level_now())
    epilogue_kernel = 1  # the epilogue provider's: cuDNN/cuBLAS, then our epilogue kernel
    assert len(recorded[0]) == sum(1 + (c.mainloop is not None) + len(c.variants) for c in cands) + epilogue_kernel
    assert recorded[0][-1].__code__ is providers.epilogue.candidates(calls[1], "fast")[0].triton_part.__code__


def test_scratch_keeps_a_views_layout_and_offset():
    import torch

    base = torch.randn(7, 10)
    for v in (base, base[1:, 2:8], base.t(), base[:, 3]):
        s = precompile._scratch(v)
        assert (s.shape, s.stride(), s.storage_offset(), s.dtype) == (v.shape, v.stride(), v.storage_offset(),
                                                                       v.dtype)


def test_a_dead_worker_resolves_every_queued_compile():
    """A worker that dies leaves no compile waited on forever: each queued future answers False, and the process
    compiles on threads from then on."""
    import concurrent.futures
    import queue
    import threading

    class Dead:
        def ask(self, spec):
            raise EOFError("the compile worker exited")

        def close(self):
            pass

    dead, jobs = Dead(), queue.Queue()
    pool = {"workers": [dead], "jobs": jobs, "broken": False, "idle_s": 60.0}
    threading.Thread(target=workers._feed, args=(dead, jobs, pool), daemon=True).start()
    futures = [concurrent.futures.Future() for _ in range(3)]
    for f in futures:
        jobs.put(({}, f))
    assert [f.result(timeout=30) for f in futures] == [False] * 3
    assert pool["broken"]


def test_idle_workers_leave_and_the_pool_starts_again(monkeypatch):
    """Workers left without work for their pool's idle_s exit (a cuDNN worker's GPU context with them); the next job
    starts the pool again, and it answers."""
    import time

    closed, started = [], []

    class Worker:
        def __init__(self):
            started.append(self)

        def ask(self, spec):
            return spec["n"] * 2

        def close(self):
            closed.append(self)

    monkeypatch.setattr(workers, "Worker", Worker)
    monkeypatch.setattr(workers, "QUEUED", {})
    monkeypatch.setitem(workers.POOLS, "cudnn", {"workers": None, "jobs": None, "broken": False, "idle_s": 0.05})
    kernels.set_options(compile_workers=2)
    try:
        key_of = lambda s: s["n"]  # noqa: E731
        assert [f.result(timeout=30) for f in workers.submit([{"n": 1}, {"n": 2}], "cudnn", key_of)] == [2, 4]
        assert len(started) == 2
        deadline = time.monotonic() + 30
        while workers.POOLS["cudnn"]["workers"] is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert workers.POOLS["cudnn"]["workers"] is None and sorted(map(id, closed)) == sorted(map(id, started))
        assert workers.submit([{"n": 3}], "cudnn", key_of)[0].result(timeout=30) == 6 and len(started) == 4
    finally:
        kernels.set_options(compile_workers=None)


def test_a_data_gradients_call_from_the_graph():
    """A training backward's fused data gradient gets the Call its op builds (ops/training.py)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from resfuse.ops import training

    kernels.set_options(interpret=True)
    g, w = torch.randn(2, 6, 5, 5), torch.randn(6, 4, 3, 3)
    dgrad = torch.ops.resfuse.conv2d_dgrad.default
    gm = make_fx(lambda g, w: dgrad(g, w, [], "acc", [2, 4, 5, 5], [1, 1], [1, 1], [1, 1], "triton"),
                 tracing_mode="fake")(g, w)
    (call,) = precompile._calls(gm, device_type="cpu")
    assert call.op == "conv2d_dgrad" and call.params == ([1, 1], [1, 1], [1, 1]) and call.signature == "acc"
    assert call.out == training.dgrad_out(g, w, [2, 4, 5, 5])
    assert [tuple(t.shape) for t in call.inputs] == [(2, 6, 5, 5), (6, 4, 3, 3)]


def _same_problems(built, run) -> bool:
    from resfuse.tuning import choose

    return [choose.fast_key(c) for c in built] == [choose.fast_key(c) for c in run]


def test_a_chains_three_calls_in_the_order_it_tunes_them(monkeypatch):
    """A chain of two 1x1 convs gives its first conv's call, its second's (on y as the chain lays it out), then its
    own: the problems its op builds on real tensors of the same layout, as choose sees them."""
    import torch
    import torch.nn.functional as F

    from resfuse.ops import chain
    from resfuse.tuning import choose
    from tests.passes import helpers

    kernels.set_options(interpret=True)

    def fn(x, w1, b1, w2, b2):
        y = torch.relu(F.conv2d(x, w1, b1))
        return y, torch.relu(F.conv2d(y, w2, b2))

    cl = torch.channels_last
    args = (torch.randn(2, 16, 3, 5).half().contiguous(memory_format=cl), helpers.conv_w(16, 32, 1).half(),
            torch.randn(32).half(), helpers.conv_w(32, 16, 1).half(), torch.randn(16).half())
    gm, _ = helpers.run(fn, *args, providers=("triton", "aten"), interpret=True)
    assert any(n.target == torch.ops.resfuse.conv2d_chain.default for n in gm.graph.nodes)
    built = list(precompile._calls(gm, device_type="cpu"))
    assert [c.op for c in built] == ["conv2d", "conv2d", "conv2d_chain"]
    first, second, whole = built
    assert second.inputs[0].shape == (2, 32, 3, 5) and second.inputs[0].is_contiguous(memory_format=cl)
    assert whole.inputs[0] is first.inputs[0]  # one scratch tensor a graph value
    seen = []
    monkeypatch.setattr(choose, "choose", lambda call: seen.append(call) or choose.HEURISTIC)
    for t in (*whole.inputs, *whole.operands):
        t.uniform_(0.5, 1.5)  # scratch memory: values for the kernels to read, not garbage
    chain.run_separate(whole)
    assert _same_problems(built[:2], seen)
    ops1, sig1, ops2, sig2 = chain.parts(whole)
    real = chain.call_of(*(t.clone(memory_format=torch.preserve_format) for t in whole.inputs[:2]), list(ops1),
                         sig1, whole.inputs[2].clone(), list(ops2), sig2)
    assert _same_problems([whole], [real])


def test_a_shortcut_ops_three_calls_in_the_order_it_tunes_them(monkeypatch):
    """A conv whose residual is a strided 1x1 conv's output gives the shortcut conv's call, the main conv's (its
    residual a scratch tensor laid out as the shortcut's output), then its own: the problems its op builds on real
    tensors, as choose sees them."""
    import torch
    import torch.nn.functional as F

    from resfuse.ops import shortcut
    from resfuse.tuning import choose
    from tests.passes import helpers

    kernels.set_options(interpret=True)

    def fn(y0, w0, w1, b1, x, w2, b2):  # the main path the deeper: FuseAddToOutput gives it the add
        return torch.relu(F.conv2d(torch.relu(F.conv2d(y0, w0)), w1, b1) + F.conv2d(x, w2, b2, stride=2))

    cl = torch.channels_last
    args = (torch.randn(2, 16, 3, 5).half().contiguous(memory_format=cl), helpers.conv_w(16, 16, 1).half(),
            helpers.conv_w(16, 32, 1).half(),
            torch.randn(32).half(), torch.randn(2, 8, 6, 10).half().contiguous(memory_format=cl),
            helpers.conv_w(8, 32, 1).half(), torch.randn(32).half())
    gm, _ = helpers.run(fn, *args, providers=("triton", "aten"), interpret=True)
    assert any(n.target == torch.ops.resfuse.conv2d_shortcut.default for n in gm.graph.nodes)
    built = list(precompile._calls(gm, device_type="cpu"))
    assert [c.op for c in built] == ["conv2d", "conv2d", "conv2d", "conv2d_shortcut"]
    short, main, whole = built[1:]
    assert short.params[0] == [2, 2] and main.params[0] == [1, 1]
    seen = []
    monkeypatch.setattr(choose, "choose", lambda call: seen.append(call) or choose.HEURISTIC)
    for t in (*whole.inputs, *whole.operands):
        t.uniform_(0.5, 1.5)  # scratch memory: values for the kernels to read, not garbage
    shortcut.run_separate(whole)
    assert _same_problems(built[1:3], seen)
    ops1, sig1, slot, ops2, sig2, stride = shortcut.parts(whole)
    y, w1, x, w2 = (t.clone(memory_format=torch.preserve_format) for t in whole.inputs)
    real = shortcut.call_of(y, w1, list(ops1), sig1, slot, x, w2, list(ops2), sig2, stride)
    assert _same_problems([whole], [real])


def test_the_aux_and_statistics_forms_carry_their_second_output():
    """conv2d_aux and gemm_aux calls carry a scratch aux output laid out as their node's, conv2d_dgrad_stats a
    scratch [2, C] fp32 sums tensor, as their ops pass them to the tuner."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    kernels.set_options(interpret=True)
    ops = torch.ops.resfuse
    x, w, a, b, g = (torch.randn(2, 4, 5, 5), torch.randn(6, 4, 3, 3), torch.randn(3, 8), torch.randn(8, 16),
                     torch.randn(2, 6, 5, 5))
    aux_sig = "relu(aux(add(acc,c0)))"

    def fn(x, w, c, a, b, d, g):
        return (ops.conv2d_aux.default(x, w, [c], aux_sig, [1, 1], [1, 1], [1, 1], "triton"),
                ops.gemm_aux.default(a, b, [d], aux_sig, [3, 16], "triton"),
                ops.conv2d_dgrad_stats.default(g, w, [], "acc", [2, 4, 5, 5], [1, 1], [1, 1], [1, 1], "triton"))

    gm = make_fx(fn, tracing_mode="fake")(x, w, torch.randn(6), a, b, torch.randn(16), g)
    conv, gemm, dgrad = precompile._calls(gm, device_type="cpu")
    assert (conv.op, gemm.op, dgrad.op) == ("conv2d", "gemm", "conv2d_dgrad")
    assert conv.aux.shape == (2, 6, 5, 5) and gemm.aux.shape == (3, 16) and conv.stats is None
    assert dgrad.stats.shape == (2, 4) and dgrad.stats.dtype == torch.float32 and dgrad.aux is None
    assert conv.signature == aux_sig and tuple(dgrad.out.shape) == (2, 4, 5, 5)


def test_cudnn_engine_configs_are_queued_a_job_each_and_waited_for(monkeypatch):
    """Each op the tuner will measure has one cuDNN build job an engine config the level times, on the cudnn pool,
    queued once however often it is asked for; cudnn_built waits for those of its call."""
    import concurrent.futures

    from resfuse import providers
    from resfuse.tuning import choose

    calls = list(precompile._calls(_graph(), device_type="cpu"))
    monkeypatch.setattr(precompile, "_calls", lambda gm, wanted: (c for c in calls if wanted(c)))
    monkeypatch.setattr(choose, "needs_tuning", lambda call: True)
    monkeypatch.setattr(precompile, "record", lambda fns: [])
    monkeypatch.setattr(providers.cudnn, "build_spec", lambda call, level: None if call.op == "gemm" else {
        "kind": "cudnn", "engines": 3, "op": call.op})
    monkeypatch.setattr(workers, "QUEUED", {})
    started, jobs = [], []
    monkeypatch.setattr(workers, "_start", lambda kind, n: started.append((kind, n)) or type(
        "Q", (), {"put": lambda _, job: jobs.append(job)})())
    kernels.set_options(compile_workers=8)
    try:
        assert precompile._queue_graph(None) == 3
        assert set(started) == {("cudnn", workers.CUDNN_WORKERS)}
        assert [spec["index"] for spec, _ in jobs] == [0, 1, 2] and all(s["op"] == "conv2d" for s, _ in jobs)
        for _, future in jobs:
            future.set_result(True)
        waited = []
        monkeypatch.setattr(concurrent.futures, "wait", lambda fs, timeout: waited.append(list(fs)))
        precompile.cudnn_built(calls[0], "fast")  # queued by the graph: waited for, not queued again
        assert len(jobs) == 3 and waited == [[f for _, f in jobs]]
        monkeypatch.setenv("CUDA_CACHE_DISABLE", "1")  # no JIT cache to hand the builds over: no job
        monkeypatch.setattr(workers, "QUEUED", {})
        assert precompile._queue_cudnn(calls[0], "fast") == [] and len(jobs) == 3
        monkeypatch.delenv("CUDA_CACHE_DISABLE")
        kernels.set_options(compile_workers=0)  # workers switched off: nothing queued, nothing started
        asked = len(started)
        assert precompile._queue_cudnn(calls[0], "fast") == [] and len(jobs) == 3 and len(started) == asked
    finally:
        kernels.set_options(compile_workers=None)
