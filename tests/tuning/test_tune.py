"""The tuner end to end under Triton's interpreter on tiny shapes: real candidates, injected timings."""
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from resfuse import kernels, providers
from resfuse.ops.fused import Output
from resfuse.tuning import choose as ch, select

SIG = "relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))"


@pytest.fixture(autouse=True)
def _interpret():
    kernels.set_options(interpret=True)


def conv_call():
    x, w = torch.randn(1, 4, 5, 5), torch.randn(6, 4, 3, 3)
    vecs = [torch.randn(6), torch.rand(6) + 0.5, torch.randn(6), torch.randn(6)]
    r = torch.randn(1, 6, 5, 5)
    return ch.Call("conv2d", (x, w), [*vecs, r], SIG, ([1, 1], [1, 1], [1, 1]),
                   Output.of([1, 6, 5, 5], torch.float32, x.device))


def bench_favouring(provider):
    """Run the candidate (so it is exercised) and time it by which provider module defined it."""
    def bench(fn):
        fn()
        return 1.0 if provider in fn.__code__.co_filename else 2.0
    return bench


def dgrad_call():
    """A stride-2 3x3 data gradient with the residual-block backward epilogue (skip-grad add, relu's gradient)."""
    grad_out, w = torch.randn(2, 6, 3, 3), torch.randn(6, 4, 3, 3)
    skip, relu_out = torch.randn(2, 4, 6, 6), torch.randn(2, 4, 6, 6).relu()
    return ch.Call("conv2d_dgrad", (grad_out, w), [skip, relu_out], "threshold_bwd[#0.0](add(acc,full0),full1)",
                   ([2, 2], [1, 1], [1, 1]), Output.of([2, 4, 6, 6], torch.float32, w.device))


@pytest.mark.parametrize("make", [conv_call, dgrad_call])
@pytest.mark.parametrize("winner", ["aten", "triton", "epilogue"])
def test_tune_runs_both_stages_and_keeps_the_fastest_correct(winner, make):
    lines = []
    call = make()
    entry = ch.tune(call, bench=bench_favouring(winner), level="fast", report=lines.append)
    assert entry.provider == winner
    assert {"aten", "aten+epilogue"} <= set(entry.times) and any(k.startswith("triton:") for k in entry.times)
    assert f"tuned {call.op}" in lines[0]


def test_wrong_kernel_is_never_chosen(monkeypatch):
    """A triton config that computes garbage loses to the ATen-based candidates even when it is 'faster'."""
    from resfuse.providers import triton as prov

    real = prov._launch
    monkeypatch.setattr(prov, "_launch", lambda call, sig, ops, out, cfg, *aux: real(call, sig, ops, out, cfg, *aux).mul_(2))
    entry = ch.tune(conv_call(), bench=bench_favouring("triton"), level="fast", report=lambda s: None)
    assert entry.provider in ("aten", "epilogue") and not any(k.startswith("triton:") for k in entry.times)


def test_choose_tunes_once_caches_and_force_retunes(tmp_path, monkeypatch):
    monkeypatch.setattr(ch, "_tunable", lambda device: True)
    calls = []
    monkeypatch.setattr(ch, "_bench", lambda fn: calls.append(fn) or bench_favouring("triton")(fn))
    monkeypatch.setattr(ch, "_CHOICES", {})
    ch.configure("fast", str(tmp_path), budget_s=600)
    call = conv_call()
    first = ch.choose(call)
    assert first.provider == "triton" and first.config is not None and calls
    n = len(calls)
    assert ch.choose(call) == first and len(calls) == n  # in-process hit
    ch._CHOICES.clear()
    assert ch.choose(call) == first and len(calls) == n  # cache hit, nothing measured
    monkeypatch.setattr(ch, "_bench", bench_favouring("aten"))
    ch.configure("fast", str(tmp_path), budget_s=600, force=True)
    assert ch.choose(call).provider == "aten"  # force-retune measured again and replaced the entry
    ch.configure("fast", str(tmp_path), budget_s=600, force=False)
    ch._CHOICES.clear()
    assert ch.choose(call).provider == "aten"
    monkeypatch.setattr(ch, "_bench", bench_favouring("triton"))
    ch.configure("fast", str(tmp_path / "other"), budget_s=600)
    assert ch.choose(call).provider == "triton"  # another cache: this process's choices are not carried into it
    # the chosen config really runs: the op's output equals the unfused math
    out = kernels.conv2d(*call.inputs, call.operands, SIG, *call.params, call.out.empty().fill_(float("nan")),
                         first.config)
    x, w = call.inputs
    m, v, g, b, r = call.operands
    ref = torch.relu(F.batch_norm(F.conv2d(x, w, padding=1), m, v, g, b, eps=1e-5) + r)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_budget_spent_runs_cudnn_with_our_epilogue_and_stores_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(ch, "_tunable", lambda device: True)
    monkeypatch.setattr(ch, "_CHOICES", {})
    ch.configure("fast", str(tmp_path), budget_s=0)
    assert ch.choose(conv_call()) == ch.UNTUNED
    assert ch._cache().entries() == []
    ch._STATE["spent_s"] = 1e9
    ch.configure("fast", str(tmp_path), budget_s=600)  # a new compile gets the whole budget again
    monkeypatch.setattr(ch, "_bench", bench_favouring("triton"))
    assert ch.choose(conv_call()).provider == "triton" and len(ch._cache().entries()) == 1


def test_a_model_switching_back_to_its_settings_keeps_budget_and_choices(tmp_path, monkeypatch):
    """configure(new_compile=False), what a compiled graph's call does when another compile's settings are current:
    no fresh budget, and nothing forgotten; after another model's compile into another cache, the choices come back
    from this model's cache, not from measuring again."""
    monkeypatch.setattr(ch, "_tunable", lambda device: True)
    monkeypatch.setattr(ch, "_CHOICES", {})
    monkeypatch.setattr(ch, "_bench", bench_favouring("triton"))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ch.configure("fast", a, budget_s=600)
    first = ch.choose(conv_call())
    ch.configure("none", b, budget_s=600)  # another model's compile: its own budget, another cache
    assert ch.choose(conv_call()) == ch.HEURISTIC and ch._STATE["spent_s"] == 0.0
    ch._STATE["spent_s"] = 1e9  # then its budget spent
    monkeypatch.setattr(ch, "_bench", bench_favouring("aten"))  # a measurement from here on would pick aten
    ch.configure("fast", a, budget_s=600, new_compile=False)  # the first model's next call
    assert ch.choose(conv_call()) == first and ch._STATE["spent_s"] == 1e9
    assert ch._cache().path.parent == tmp_path / "a"
    ch.configure("none", b, budget_s=600, new_compile=False)
    ch.configure("fast", a, budget_s=600, new_compile=False)
    assert ch.choose(conv_call()) == first  # the switches forgot nothing
    ch._CHOICES.clear()
    assert ch.choose(conv_call()) == first  # read back from its own cache


def test_every_provider_path_of_the_ops_gives_the_unfused_result(monkeypatch):
    """ops/fused.py dispatches a tuned choice of each provider; all agree with the float64 reference."""
    import resfuse  # noqa: F401  (registers the ops)
    from resfuse.ops import fused

    monkeypatch.setattr(fused, "_use_triton", lambda device, provider: True)
    call = conv_call()
    x, w = call.inputs
    m, v, g, b, r = call.operands
    ref = torch.relu(F.batch_norm(F.conv2d(x.double(), w.double(), padding=1), m.double(), v.double(), g.double(),
                                  b.double(), eps=1e-5) + r.double())
    gemm_a, gemm_b, bias = torch.randn(7, 5), torch.randn(5, 3), torch.randn(3)
    for provider in ("triton", "epilogue", "aten"):
        monkeypatch.setattr(ch, "choose", lambda call, p=provider: ch.Choice(p, None))
        monkeypatch.setattr("resfuse.tuning.choose.choose", lambda call, p=provider: ch.Choice(p, None))
        out = torch.ops.resfuse.conv2d(x, w, call.operands, SIG, [1, 1], [1, 1], [1, 1], "triton")
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
        out = torch.ops.resfuse.gemm(gemm_a, gemm_b, [bias], "gelu(add(acc,c0))", [7, 3], "triton")
        torch.testing.assert_close(out, F.gelu(gemm_a @ gemm_b + bias), rtol=1e-4, atol=1e-4)
        out, aux = torch.ops.resfuse.gemm_aux(gemm_a, gemm_b, [bias], "gelu(aux(add(acc,c0)))", [7, 3], "triton")
        torch.testing.assert_close(out, F.gelu(gemm_a @ gemm_b + bias), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(aux, gemm_a @ gemm_b + bias, rtol=1e-4, atol=1e-4)
        out, aux = torch.ops.resfuse.conv2d_aux(x, w, [], "silu(aux(acc))", [1, 1], [1, 1], [1, 1], "triton")
        pre = F.conv2d(x.double(), w.double(), padding=1)
        torch.testing.assert_close(out.double(), F.silu(pre), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(aux.double(), pre, rtol=1e-4, atol=1e-4)
        assert fused.PATHS[("conv2d", SIG, provider)] >= 1


@pytest.mark.parametrize("winner", ["aten", "triton", "epilogue"])
def test_tuning_an_op_with_an_aux_output_writes_scratch_only(winner):
    """Candidates write their own aux outputs: the op's (still unwritten: NaN) is left alone while tuning."""
    call = conv_call()
    aux = torch.full(call.out.shape, float("nan"))
    call = ch.Call(call.op, call.inputs, call.operands, "relu(add(aux(bn[#1e-05](acc,c0,c1,c2,c3)),full4))",
                   call.params, call.out, aux)
    entry = ch.tune(call, bench=bench_favouring(winner), level="fast", report=lambda s: None)
    assert entry.provider == winner and any(k.startswith("triton:") for k in entry.times)
    assert torch.isnan(aux).all()


def test_no_correct_candidate_runs_unfused_and_is_not_measured_again(tmp_path, monkeypatch):
    monkeypatch.setattr(ch, "_tunable", lambda device: True)
    monkeypatch.setattr(ch, "_CHOICES", {})
    monkeypatch.setattr(ch, "_reference", lambda call: call.out.empty().fill_(1e3))  # nobody matches
    calls = []
    monkeypatch.setattr(ch, "_bench", lambda fn: calls.append(fn) or 1.0)
    ch.configure("fast", str(tmp_path), budget_s=600)
    call = conv_call()
    assert ch.choose(call) == ch.UNFUSED
    n = len(calls)
    assert ch.choose(call) == ch.UNFUSED and len(calls) == n
    assert ch._cache().entries() == []


def test_a_reference_that_was_wrong_once_is_measured_again(monkeypatch):
    """Every candidate missing the reference is retried once from a fresh reference; twice wrong gives None."""
    real = ch._reference
    calls = []

    def flaky(call):
        calls.append(1)
        ref = real(call)
        return ref.zero_() if len(calls) == 1 else ref

    monkeypatch.setattr(ch, "_reference", flaky)
    lines = []
    entry = ch.tune(conv_call(), bench=bench_favouring("aten"), level="none", report=lines.append)
    assert entry is not None and entry.provider == "aten" and len(calls) == 2
    assert "over aten" in lines[0] and len(lines) == 1  # one line per op for the progress bar
    monkeypatch.setattr(ch, "_reference", lambda call: real(call).zero_())
    assert ch.tune(conv_call(), bench=bench_favouring("aten"), level="none", report=lines.append) is None
    assert "attempt 1" in lines[1] and "attempt 2" in lines[1] and len(lines) == 2


def test_report_says_when_aten_was_not_measured():
    def bench(fn):
        if "providers/aten" in fn.__code__.co_filename.replace("\\", "/"):
            raise RuntimeError("aten failed to launch")
        return bench_favouring("triton")(fn)

    lines = []
    entry = ch.tune(conv_call(), bench=bench, level="none", report=lines.append)
    assert entry.provider == "triton" and "aten" not in entry.times
    assert "aten not measured" in lines[0] and "nan" not in lines[0]


def test_triton_candidates_are_built_together_and_failures_left_to_select(monkeypatch):
    """compile_in_parallel hands every Triton candidate's callables (with and without its epilogue, and its variants)
    to the compile workers, then launches each from a thread pool before stage 1; a candidate that fails is ignored
    there, other providers are not touched."""
    import threading

    from resfuse.tuning.select import Candidate

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    ran, lock, precompiled = [], threading.Lock(), []
    monkeypatch.setattr(ch.precompile, "precompile", precompiled.append)  # the worker processes' part

    def job(name, fail=False):
        def fn():
            with lock:
                ran.append((name, threading.current_thread().name))
            if fail:
                raise RuntimeError("does not compile")
        return fn

    cands = [Candidate("triton", f"t{i}", {}, job(f"run{i}", fail=i == 1), job(f"bare{i}"),
                       (Candidate("triton", f"t{i}+bulk", {}, job(f"bulk{i}")),) * (i == 2)) for i in range(3)]
    cands.append(Candidate("epilogue", "aten+epilogue", {}, job("epilogue")))
    ch.compile_in_parallel(cands, torch.device("cuda"))
    assert sorted(n for n, _ in ran) == sorted([f"run{i}" for i in range(3)] + [f"bare{i}" for i in range(3)]
                                               + ["bulk2"])  # a variant is built too
    assert len(precompiled) == 1 and len(precompiled[0]) == 7  # the same jobs, handed to the workers first
    assert all(t != threading.main_thread().name for _, t in ran)
    ran.clear()
    ch.compile_in_parallel(cands, torch.device("cpu"))  # the interpreter: nothing to build, not thread-safe
    assert ran == []


def test_tma_gemm_candidates_carry_a_bulk_store_variant_that_computes_the_op():
    from resfuse.providers import triton as triton_provider
    a, w = torch.randn(40, 32).half(), (torch.randn(24, 32) / 6).half()  # a linear layer: B is the weight's [N, K].T
    call = ch.Call("gemm", (a, w.t()), [], "relu(acc)", ([40, 24],), Output.of([40, 24], a.dtype, a.device))
    found = triton_provider.candidates(call, "fast")
    tma = [c for c in found if c.config["tma"] and c.config["split_k"] == 1]
    assert tma and all(not c.variants for c in found if c not in tma)
    for c in tma:
        (v,) = c.variants
        assert v.mainloop is None and v.config == {**c.config, "tma_store": True}
    out = tma[0].variants[0].run()
    out.fill_(float("nan"))
    out = tma[0].variants[0].run()
    torch.testing.assert_close(out.double(), torch.relu(a.double() @ w.double().t()), rtol=2e-3, atol=2e-3)
    assert ("gemm_tma", "relu(acc)|out") in kernels.codegen._LOADED or \
        ("gemm_tma_persistent", "relu(acc)|out") in kernels.codegen._LOADED  # the bulk-store kernel ran


def test_a_versioned_op_keys_again_only_the_epilogues_that_hold_it(monkeypatch):
    """Bumping an op's version (epilogue.OpSpec.version) changes the tuning key of every epilogue with the op, a
    pair's second one too, and of no other: only those are measured again."""
    import dataclasses

    from resfuse import epilogue as epi

    def call(signature):
        return dataclasses.replace(conv_call(), signature=signature)
    sigs = ["gelu(add(acc,c0))", f"{SIG};gelu(acc)", SIG, "gelu_tanh(acc)"]
    before = [ch.key(call(s)) for s in sigs]
    monkeypatch.setitem(epi.OPS, "gelu", dataclasses.replace(epi.OPS["gelu"], version=epi.OPS["gelu"].version + 1))
    after = [ch.key(call(s)) for s in sigs]
    assert [b != a for b, a in zip(before, after)] == [True, True, False, False]


def test_a_cached_choice_that_is_wrong_here_is_measured_again(tmp_path, monkeypatch, capsys):
    """A cache can hold a choice an older check let through (a cuDNN engine config that wrote nothing): before its
    first use in a process it is checked as a candidate is, and measured again where it is wrong."""
    from resfuse.providers import triton as prov

    monkeypatch.setattr(ch, "_tunable", lambda device: True)
    monkeypatch.setattr(ch, "_CHOICES", {})
    monkeypatch.setattr(ch, "_bench", bench_favouring("triton"))
    ch.configure("fast", str(tmp_path), budget_s=600)
    call = conv_call()
    assert ch.choose(call).provider == "triton"
    ch._CHOICES.clear()
    monkeypatch.setattr(ch, "_bench", lambda fn: pytest.fail("a right cached choice was measured again"))
    assert ch.choose(call).provider == "triton"  # a right cached choice is kept, nothing measured
    ch._CHOICES.clear()
    monkeypatch.setattr(prov, "_launch", lambda call, sig, ops, out, cfg, *aux: out)  # our kernel now writes nothing
    monkeypatch.setattr(ch, "_bench", bench_favouring("aten"))
    assert ch.choose(call).provider == "triton"  # checked on this machine already: not checked again
    ch._CHOICES.clear()
    monkeypatch.setattr(ch, "machine", lambda device: "another GPU or driver")  # where the cache was carried to
    assert ch.choose(call).provider == "aten"
    assert "is wrong here" in capsys.readouterr().out
    assert ch._cache().get(ch.key(call)).provider == "aten"  # the wrong entry replaced
    assert ch._cache().lookup(ch.key(call), "another GPU or driver")[1]  # and its measured winner marked checked


def test_a_cached_choice_is_checked_once_a_machine(tmp_path, monkeypatch):
    """The check of a cached choice costs a warm start 2.8 s at ResNet-50 bs32 (fortieth session, H100): it runs
    once for each machine a choice is used on, and a choice the tuner measured here counts as checked."""
    monkeypatch.setattr(ch, "_tunable", lambda device: True)
    monkeypatch.setattr(ch, "_CHOICES", {})
    monkeypatch.setattr(ch, "_bench", bench_favouring("triton"))
    ch.configure("fast", str(tmp_path), budget_s=600)
    call = conv_call()
    ch.choose(call)
    checks = []
    real = select.check
    monkeypatch.setattr(select, "check", lambda *a, **k: checks.append(1) or real(*a, **k))
    monkeypatch.setattr(ch, "_bench", lambda fn: pytest.fail("a right cached choice was measured again"))
    for _ in range(2):  # two processes on the tuner's machine
        ch._CHOICES.clear()
        assert ch.choose(call).provider == "triton"
    assert checks == []
    monkeypatch.setattr(ch, "machine", lambda device: "another machine")
    for _ in range(2):  # two processes on another
        ch._CHOICES.clear()
        assert ch.choose(call).provider == "triton"
    assert checks == [1]


EPILOGUES = {  # signature -> its operands' shapes, from the output's channels k and shape
    "acc": lambda k, shape: [],
    "relu(add(acc,c0))": lambda k, shape: [torch.randn(k)],
    "silu(add(acc,c0))": lambda k, shape: [torch.randn(k)],
    "gelu(add(acc,c0))": lambda k, shape: [torch.randn(k)],
    "sigmoid(add(acc,c0))": lambda k, shape: [torch.randn(k)],
    "add(acc,full0)": lambda k, shape: [torch.randn(*shape)],
    SIG: lambda k, shape: [torch.randn(k), torch.rand(k) + 0.5, torch.randn(k), torch.randn(k), torch.randn(*shape)],
}


@settings(max_examples=int(os.environ.get("RESFUSE_EXAMPLES", 12)), deadline=None)
@given(n=st.integers(1, 3), c=st.integers(1, 13), hw=st.tuples(st.integers(1, 9), st.integers(1, 9)),
       k=st.integers(1, 11), r=st.sampled_from([1, 3]), stride=st.sampled_from([1, 2]),
       sig=st.sampled_from(sorted(EPILOGUES)))
def test_every_candidate_writes_its_whole_output(n, c, hw, k, r, stride, sig):
    """Each provider's candidates at the fast level, on odd shapes (1x1 images included), pass the tuner's check:
    a run over their own poisoned outputs matches the fp32 reference. One that leaves an element unwritten, as
    cuDNN's engine configs did for a 1x1 image, would be discarded, and a kernel of ours that did would fail here."""
    kernels.set_options(interpret=True)
    pad = r // 2
    out_shape = [n, k, (hw[0] + 2 * pad - r) // stride + 1, (hw[1] + 2 * pad - r) // stride + 1]
    x = torch.randn(n, c, *hw).contiguous(memory_format=torch.channels_last)
    w = torch.randn(k, c, r, r).contiguous(memory_format=torch.channels_last)
    call = ch.Call("conv2d", (x, w), EPILOGUES[sig](k, out_shape), sig, ([stride] * 2, [pad] * 2, [1, 1]),
                   Output.of(out_shape, torch.float32, x.device, torch.channels_last))
    reference = ch._reference(call)
    found = providers.candidates(call, "fast")
    assert {cand.provider for cand in found} >= {"triton", "aten", "epilogue"}
    wrong = {v.name: why for cand in found for v in (cand, *cand.variants)
             if (why := select.check(v, reference, 1e-4))}
    assert not wrong


def test_the_cached_check_finds_a_variant_choice(monkeypatch):
    """A shortlisted config's variant (its output by bulk stores) can be the cached choice: it is checked too."""
    call = conv_call()
    reference = ch._reference(call)
    scratch = torch.empty_like(reference)
    idle = select.Candidate("triton", "v", {"tma_store": True}, lambda: scratch)  # writes nothing
    base = select.Candidate("triton", "c", {"tma_store": False}, lambda: scratch.copy_(reference), variants=(idle,))
    monkeypatch.setattr(providers, "candidates", lambda call, level, allowed: [base])
    assert ch.cached_is_wrong(call, ch.Entry("triton", {"tma_store": False}, {}), "fast") is None
    assert "non-finite" in ch.cached_is_wrong(call, ch.Entry("triton", {"tma_store": True}, {}), "fast")
    assert ch.cached_is_wrong(call, ch.Entry("triton", {"tma_store": None}, {}), "fast") is None  # not offered


def test_a_subset_of_providers_is_all_that_is_measured_and_keeps_its_own_cache_entries(tmp_path, monkeypatch):
    """Config.providers: with triton alone, the tuner measures our kernels only, though ATen is timed faster, and
    stores that winner under its own key, which a later compile with every provider neither reads nor replaces."""
    monkeypatch.setattr(ch, "_tunable", lambda device: True)
    monkeypatch.setattr(ch, "_CHOICES", {})
    monkeypatch.setattr(ch, "_SETTINGS", dict(ch._SETTINGS))  # the subset is not left to the next test
    measured = []
    monkeypatch.setattr(ch, "_bench", lambda fn: measured.append(fn.__code__.co_filename)
                        or bench_favouring("aten")(fn))
    ch.configure("fast", str(tmp_path), budget_s=600, providers=("triton",))
    call = conv_call()
    assert ch.choose(call).provider == "triton"
    assert measured and all("triton" in f for f in measured)
    ch.configure("fast", str(tmp_path), budget_s=600)  # every provider: the subset's winner is not its answer
    assert ch.choose(call).provider == "aten"
    assert sorted(e.provider for _, e in ch._cache().entries()) == ["aten", "triton"]
    ch.configure("fast", str(tmp_path), budget_s=600, providers=("triton",))
    n = len(measured)
    assert ch.choose(call).provider == "triton" and len(measured) == n  # read back from the subset's own entry
    # a model compiled with every provider, called in turn (its settings entered, nothing forgotten): its own choice
    ch.configure("fast", str(tmp_path), budget_s=600, new_compile=False)
    assert ch.choose(call).provider == "aten" and len(measured) == n


def test_config_refuses_an_unknown_provider():
    from resfuse.config import Config

    with pytest.raises(ValueError, match="providers"):
        Config(providers=("triton", "cublas"))
    with pytest.raises(ValueError, match="providers"):
        Config(providers=())


def test_a_glu_is_tuned_on_our_kernel_and_cublas_plus_our_epilogue_kernel():
    """A GLU's call (epilogue.paired) has an output half the product's width. Its epilogue-free twins write the
    product unpaired, so they get an output of the product's width (written past the end of the op's own, they once
    faulted on an H200); the epilogue provider pairs cuBLAS's product in its own kernel; cuDNN's graph takes no
    paired tree; every candidate computes the op."""
    from resfuse.providers import triton as triton_provider
    a, w = torch.randn(37, 32).half(), (torch.randn(2 * 20, 32) / 6).half()
    sig = "mul(silu(acc),up)"
    call = ch.Call("gemm", (a, w.t()), [], sig, ([37, 20],), Output.of([37, 20], a.dtype, a.device))
    assert providers.cudnn.refusal(call) and providers.epilogue.refusal(call) is None
    acc = a.double() @ w.double().t()
    want = F.silu(acc[:, 0::2]) * acc[:, 1::2]
    found = triton_provider.candidates(call, "fast")
    for c in found[:3]:
        assert tuple(c.mainloop().shape) == (37, 40)
        torch.testing.assert_close(c.run().double(), want, rtol=2e-3, atol=2e-3)
    (two,) = providers.epilogue.candidates(call, "fast")
    torch.testing.assert_close(two.run().double(), want, rtol=2e-3, atol=2e-3)
    for winner in ("triton", "epilogue"):
        entry = ch.tune(call, bench=bench_favouring(winner), level="fast", report=lambda line: None)
        assert entry.provider == winner and "aten+epilogue" in entry.times
