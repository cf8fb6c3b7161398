"""A tiny end-to-end `resfuse bench` on CPU: eager and resfuse, then the JSON schema and the PNG."""
import argparse
import copy
import json
import textwrap
import threading
import time

import pytest
import torch

from resfuse.bench import report, run, timing

MODEL = textwrap.dedent("""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, c=8):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.conv2, self.bn2 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(y)) + x)

    def make(batch, image_size):
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), Block(), Block()), torch.randn(batch, 3, image_size, image_size)
""")


def parse(argv):
    parser = argparse.ArgumentParser()
    run.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    (tmp / "tiny.py").write_text(MODEL)
    args = parse([f"{tmp / 'tiny.py'}:make", "--batch", "2", "--image-size", "8", "--device", "cpu",
                  "--peers", "eager", "--iters", "3", "--json", str(tmp / "out.json"),
                  "--plot", str(tmp / "out.png"), "--profile"])
    assert run.main(args) == 0
    return tmp, json.loads((tmp / "out.json").read_text())


NUMBER = (int, float)
PEER_FIELDS = {"status": str, "latency_ms": NUMBER, "latency_min_ms": NUMBER, "latency_p90_ms": NUMBER,
               "throughput_items_per_s": NUMBER, "compile_s": NUMBER, "x_floor": NUMBER,
               "max_rel_err": NUMBER, "max_abs_err": NUMBER, "first_rel_err": NUMBER, "late_rel_err": NUMBER,
               "speedup_of_resfuse": dict}


def test_json_schema(bench):
    _, result = bench
    top = {"schema": str, "created": str, "model": str, "model_source": str, "batch": int, "dtype": str,
           "device": str, "device_name": str, "channels_last": bool, "versions": dict, "timing": dict,
           "ceilings": dict, "floor": dict, "resfuse_variants": list, "peers": dict, "profile": dict,
           "notes": list}
    for key, kind in top.items():
        assert isinstance(result[key], kind), key
    assert result["schema"] == "resfuse-bench/1"
    assert set(result["versions"]) >= {"torch", "triton", "python", "cuda"}
    assert isinstance(result["versions"]["torch"], str)
    assert result["timing"]["method"] == "perf_counter" and result["timing"]["iters"] == 3
    assert all(isinstance(result["ceilings"][k], float) and result["ceilings"][k] > 0
               for k in ("matmul_flops_per_s", "copy_bytes_per_s"))
    floor = result["floor"]
    assert floor["ms"] > 0 and isinstance(floor["flops"], int) and isinstance(floor["bytes"], int)
    assert floor["layers"] >= 5 and floor["top_layers"][0]["kind"] in ("compute", "memory")
    assert any("speed needs a CUDA GPU" in note for note in result["notes"])
    assert "eager_fp32_rel_err" in result and result["eager_fp32_rel_err"] is None  # an fp32 run: nothing wider
    assert all(p["fp32_rel_err"] is None for p in result["peers"].values())


def test_peers_eager_and_resfuse(bench):
    _, result = bench
    assert list(result["peers"]) == ["eager", "resfuse"]  # CPU: no resfuse+graphs
    for name, peer in result["peers"].items():
        assert peer["status"] == "ok", (name, peer.get("error"))
        for key, kind in PEER_FIELDS.items():
            assert isinstance(peer[key], kind), (name, key)
    assert result["peers"]["resfuse"]["within_bound"] is True and "err_bound" not in result["peers"]["eager"]
    assert all(peer["gpu_ms"] is None for peer in result["peers"].values())  # CPU: no GPU time to give
    assert all(peer["clock"] is None and peer["gpu_ms_clock"] is None for peer in result["peers"].values())
    assert not {"GPU ms", "SM MHz"} & {c.header for c in report.table(result).columns}
    resfuse, eager = result["peers"]["resfuse"], result["peers"]["eager"]
    assert resfuse["max_rel_err"] < 1e-4  # fp32: resfuse must compute eager's function
    assert eager["speedup_of_resfuse"]["resfuse"] == pytest.approx(eager["latency_ms"] / resfuse["latency_ms"])
    assert sum(resfuse["paths"].values()) > 0  # its fused ops ran, and the JSON says through which path
    assert result["profile"]["resfuse"] and {"name", "time_us", "calls", "share"} <= set(result["profile"]["resfuse"][0])


def test_plot_is_a_png(bench):
    tmp, _ = bench
    data = (tmp / "out.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5_000


def test_peer_list():
    assert run._peer_list("eager,compile", cuda=False, cuda_graphs=None) == ["eager", "compile", "resfuse"]
    assert run._peer_list("max-autotune", cuda=True, cuda_graphs=None) == [
        "eager", "max-autotune", "resfuse", "resfuse+graphs"]
    assert run._peer_list("", cuda=True, cuda_graphs=False) == ["eager", "resfuse"]
    with pytest.raises(SystemExit, match="unknown peer"):
        run._peer_list("eager,fast", cuda=False, cuda_graphs=None)


def test_profile_lists_every_kernel(bench):
    _, result = bench
    rows = result["profile"]["resfuse"]
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)  # all of them, not a top few
    assert [r["time_us"] for r in rows] == sorted((r["time_us"] for r in rows), reverse=True)
    table = report.profile_table("resfuse", rows, top=2)
    assert table.title.startswith(f"resfuse: {sum(r['calls'] for r in rows)} launches")
    assert table.row_count == min(2, len(rows))


@pytest.mark.parametrize("forward, why", [
    (lambda x: x @ torch.ones(4, 5), None),
    (lambda x: x[:, :1] * 0 + torch.arange(5.0), "does not depend on the input"),  # RegNetY collapsed in fp16
    (lambda x: x * 0 + 2, "constant or non-finite"),
    (lambda x: x / 0, "constant or non-finite"),
])
def test_vacuous_outputs_are_named(forward, why):
    sets = timing.input_sets((torch.randn(3, 4),))
    found = run.vacuous(forward, sets, timing.run_once(forward, sets[0]))
    assert found is None if why is None else why in found


def test_the_error_column_checks_a_call_after_the_timed_ones(tmp_path, monkeypatch):
    """resfuse+graphs' first call runs before its CUDA graph is captured: a peer right on its first call and wrong on
    every later one (a graph that replays wrong) must show its error, not the first call's zero."""
    (tmp_path / "tiny.py").write_text(MODEL)
    build = run._build

    def wrong_after_first(name, model):
        fn, calls = build(name, model), []

        def call(*inputs):
            calls.append(1)
            out = fn(*inputs)
            return out if len(calls) == 1 else out + 1
        return call
    monkeypatch.setattr(run, "_build", wrong_after_first)
    args = parse([f"{tmp_path / 'tiny.py'}:make", "--batch", "2", "--image-size", "8", "--device", "cpu",
                  "--peers", "eager", "--iters", "3", "--json", str(tmp_path / "out.json")])
    assert run.main(args) == 0
    result = json.loads((tmp_path / "out.json").read_text())
    peer = result["peers"]["eager"]
    assert peer["max_rel_err"] > 0.1
    assert peer["first_rel_err"] == 0 and peer["late_rel_err"] > 0.1  # and the JSON says which call it was
    ours = result["peers"]["resfuse"]  # a resfuse peer over its bound is called wrong in the notes
    assert ours["within_bound"] is False and ours["err_bound"] == run.MODEL_TOLERANCE[torch.float32]
    assert any("resfuse's relative error" in note and "over its bound" in note for note in result["notes"])


def test_eager_off_fp32_measures_the_dtype_and_widens_the_bound():
    """A random-init ResNet-50 calibrated was off fp64 by 4.5e-2 in fp16 on its own: a peer as far off eager is not
    wrong. The harness runs a copy of the model in fp32 (TF32 off); twice eager's error against it joins the bound."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3)).eval()
    x = torch.randn(2, 3, 9, 9)
    assert run._fp32_outputs(model, (x,)) is None  # already fp32
    low, xb = copy.deepcopy(model).to(torch.bfloat16), x.to(torch.bfloat16)
    wide = run._fp32_outputs(low, (xb,))
    truth = timing.run_once(copy.deepcopy(low).double(), (xb.double(),))
    assert wide[0].dtype == torch.float32 and timing.output_error(wide, truth)[0] < 1e-6
    assert 1e-4 < timing.output_error(timing.run_once(low, (xb,)), wide)[0] < 5e-2
    assert low[0].weight.dtype == torch.bfloat16  # the harness's model is left as it was
    low.lock = threading.Lock()  # a model that cannot be deep-copied gets no fp32 errors, and no crash
    assert run._fp32_outputs(low, (xb,)) is None

    def result(ours, eager_own):
        return {"resfuse_variants": ["resfuse"], "eager_fp32_rel_err": eager_own,
                "peers": {"eager": {"status": "ok", "max_rel_err": 0.0},
                          "resfuse": {"status": "ok", "max_rel_err": ours}}}
    r = result(0.08, 0.05)
    assert run._bound_errors(r, torch.float16) == [] and r["peers"]["resfuse"]["err_bound"] == pytest.approx(0.1)
    r = result(0.08, None)
    assert "over its bound" in run._bound_errors(r, torch.float16)[0] and not r["peers"]["resfuse"]["within_bound"]
    r = result(0.05, None)  # a broken compiled peer does not widen the bound: the closest one counts
    r["peers"].update({"compile": {"status": "ok", "max_rel_err": 0.3},
                       "reduce-overhead": {"status": "ok", "max_rel_err": 1e-3}})
    assert run._bound_errors(r, torch.float16)
    assert r["peers"]["resfuse"]["err_bound"] == run.MODEL_TOLERANCE[torch.float16]


def test_a_bf16_run_reports_each_peers_error_against_fp32(tmp_path):
    (tmp_path / "tiny.py").write_text(MODEL)
    args = parse([f"{tmp_path / 'tiny.py'}:make", "--batch", "2", "--image-size", "8", "--device", "cpu",
                  "--dtype", "bf16", "--peers", "eager", "--iters", "2", "--json", str(tmp_path / "out.json")])
    assert run.main(args) == 0
    result = json.loads((tmp_path / "out.json").read_text())
    eager, ours = result["peers"]["eager"], result["peers"]["resfuse"]
    assert 0 < result["eager_fp32_rel_err"] < 5e-2 and eager["fp32_rel_err"] == result["eager_fp32_rel_err"]
    assert 0 < ours["fp32_rel_err"] < 5e-2 and ours["err_bound"] >= 2 * result["eager_fp32_rel_err"]
    assert "err vs fp32" in [c.header for c in report.table(result).columns]


def test_host_us_is_the_median_of_one_call_each():
    """One slow call in nine does not move the median; the time is per call, in us."""
    waits = iter([0.02] + [0.002] * 8)
    calls = []

    def fn(x):
        calls.append(x)
        time.sleep(next(waits))

    us = timing.host_us(fn, ("input",), torch.device("cpu"), calls=9)
    assert calls == ["input"] * 9
    assert 2000 <= us < 15000


def test_the_table_gives_the_gpu_time_where_a_peer_has_one(bench):
    _, result = bench
    result = copy.deepcopy(result)
    result["peers"]["resfuse"]["gpu_ms"] = 0.2615
    columns = report.table(result).columns
    gpu = next(c for c in columns if c.header == "GPU ms")
    assert list(gpu.cells) == ["-", "0.262"]  # eager has none


def test_gpu_ms_queues_fewer_calls_where_the_queue_cannot_hold_20(monkeypatch):
    asked = []

    def gpu_us(fn, sets, calls):
        asked.append(calls)
        if calls > 4:
            raise RuntimeError("the host never enqueued")
        return {4: 300.0}[calls] + len(asked)  # 301, 302, ... : the median of five is the third

    monkeypatch.setattr(timing, "gpu_us", gpu_us)
    assert run._gpu_ms(None, []) == pytest.approx(0.304)
    assert asked == [20, 4, 4, 4, 4, 4]
    monkeypatch.setattr(timing, "gpu_us", lambda fn, sets, calls: (_ for _ in ()).throw(RuntimeError("sync")))
    assert run._gpu_ms(None, []) is None


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_us_leaves_the_host_out():
    """A call that sleeps 2 ms on the host and launches a kernel of a known length: gpu_us gives the kernel's time,
    latency the host's; a call that syncs has no GPU time of its own to give."""
    cycles = 2_000_000
    torch.cuda._sleep(cycles)  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    kernel_us = start.elapsed_time(end) * 1e3

    def call(x):
        time.sleep(0.002)
        torch.cuda._sleep(cycles)
        return x

    sets = [(torch.zeros(1, device="cuda"),)]
    us = timing.gpu_us(call, sets, calls=5, sleep_cycles=40 * cycles)
    assert 0.8 * kernel_us < us < 1.2 * kernel_us + 5
    assert timing.latency(call, sets, torch.device("cuda"), 5).median_ms * 1e3 > 2000
    with pytest.raises(RuntimeError, match="never enqueued"):
        timing.gpu_us(lambda x: torch.cuda.synchronize(), sets, calls=2, tries=2)


def test_a_peer_timed_at_the_power_limit_is_noted_with_its_clocks():
    held = {"sm_mhz": 1740.0, "max_mhz": 1980, "limited": 0.37}  # H200, BERT bs32: the clock falls within the run
    peers = {"compile": {"status": "ok", "clock": held, "gpu_ms_clock": {**held, "sm_mhz": 1650.0}},
             "reduce-overhead": {"status": "ok", "clock": {**held, "sm_mhz": 1935.0}},  # 98% of the highest
             "resfuse": {"status": "ok", "clock": {**held, "limited": 0.0}},  # a low clock, no limit: an idle GPU
             "eager": {"status": "error", "error": "boom", "clock": held},
             "max-autotune": {"status": "ok", "clock": {**held, "max_mhz": None}},  # under half the reads limited
             "resfuse+graphs": {"status": "ok", "clock": {**held, "max_mhz": None, "limited": 0.9},
                                "gpu_ms_clock": None}}
    lines = run.clock_limited({"peers": peers})
    assert [line.split()[0] for line in lines] == ["compile", "resfuse+graphs"]
    assert lines[0].endswith("SM clock 1740 of 1980 MHz over its timed calls, 1650 MHz over its GPU ms")
    assert lines[1].endswith("SM clock 1740 MHz over its timed calls")


def test_clocks_summarise_their_reads():
    clocks = timing.Clocks(torch.device("cpu"))
    assert clocks.summary() is None
    with clocks:  # CPU: nothing to read, and no thread
        pass
    assert clocks.reads == [] and clocks.summary() is None
    clocks.reads, clocks.max_mhz = [(1980, 0x0), (1650, 0x4), (1605, 0x4), (1700, 0x1)], 1980  # 0x1: idle, no limit
    assert clocks.summary() == {"sm_mhz": 1675.0, "max_mhz": 1980, "limited": 0.5}
    reader = timing.Clocks(torch.device("cpu"), every_s=0.001)
    reader._read = lambda: (1605, 0x4)  # NVML's part, injected: the thread reads until the block ends
    with reader:
        time.sleep(0.05)
    reads = len(reader.reads)
    assert reads >= 2 and reader.summary() == {"sm_mhz": 1605, "max_mhz": None, "limited": 1.0}
    time.sleep(0.01)
    assert len(reader.reads) == reads  # stopped with the block


def test_a_peer_whose_latency_passes_its_gpu_time_is_noted_host_bound():
    peers = {"eager": {"status": "ok", "latency_ms": 4.1, "gpu_ms": 1.2},
             "reduce-overhead": {"status": "ok", "latency_ms": 0.449, "gpu_ms": 0.444},
             "resfuse+graphs": {"status": "ok", "latency_ms": 0.302, "gpu_ms": 0.262},  # 1.15x: the line
             "compile": {"status": "error", "error": "boom"},
             "resfuse": {"status": "ok", "latency_ms": 3.0, "gpu_ms": None}}  # CPU: no GPU time, no note
    lines = run.host_bound({"peers": peers})
    assert [line.split()[0] for line in lines] == ["eager", "resfuse+graphs"]
    assert "4.100 ms a call for 1.200 ms of GPU work" in lines[0]
