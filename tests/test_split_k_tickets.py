"""Split-K's kept tickets (kernels/split_k.py): every launch leaves its tickets at zero, so one zeroed buffer serves a
stream's launches one after another, and a captured graph's launches replay after replay. Under the interpreter the
kernel's reset runs on a kept CPU buffer (resfuse keeps none there); on the GPU (`TRITON_INTERPRET=0 pytest -m
requires_cuda tests/test_split_k_tickets.py`) on the stream's buffer and a graph's own, with the output poisoned
before every call."""
import pytest
import torch
import torch.nn.functional as F

from resfuse.capture.cuda_graphs import CudaGraphed
from resfuse.kernels import launch, split_k
from resfuse.kernels.conv2d_fprop import ConvConfig

from .kernel_devices import DEVICES, skip_unless_available


def _conv(device, split):
    """A split fp16 conv with an epilogue (relu(acc + bias)), its float64 reference, and a call that poisons out
    first."""
    torch.manual_seed(0)
    cl = torch.channels_last
    x = torch.randn(2, 32, 5, 7, device=device).half().contiguous(memory_format=cl)
    w = (torch.randn(24, 32, 3, 3, device=device) / 17).half().contiguous(memory_format=cl)
    bias = torch.randn(24, device=device).half()
    ref = F.relu(F.conv2d(x.double(), w.double(), bias.double(), 1, 1))
    out = torch.empty(2, 24, 5, 7, device=device, dtype=torch.float16).contiguous(memory_format=cl)
    cfg = ConvConfig(16, 16, 16, 2, split, False, 4, 2)

    def run():
        out.fill_(float("nan"))
        return launch.conv2d(x, w, [bias], "relu(add(acc,c0))", [1, 1], [1, 1], [1, 1], out, cfg)
    return run, ref, out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", [2, 3, 8])
def test_split_launches_leave_their_tickets_at_zero(device, split, monkeypatch):
    skip_unless_available(device)
    run, ref, out = _conv(device, split)
    if device == "cpu":  # resfuse keeps no buffer for the interpreter: this test keeps one, to run the kernel's reset
        kept = torch.zeros(split_k.KEPT_TICKETS, dtype=torch.int32)
        monkeypatch.setattr(split_k, "_kept", lambda _device: kept)
    else:
        kept = split_k._kept(out.device)
    for _ in range(3):
        assert_close(run(), ref)
        assert not kept.any(), "a split launch left a ticket drawn"


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_a_captured_graph_keeps_its_own_tickets():
    """CudaGraphed's capture takes a buffer of its own (not the stream's, which a replay may run beside): replays
    stay correct, the buffer stays at zero, and eager calls between the replays keep the stream's buffer at zero."""
    skip_unless_available("cuda")
    run, ref, out = _conv("cuda", 4)
    graphed = CudaGraphed(lambda inputs: [run()])
    x = torch.zeros(1, device="cuda")  # a copied input: the graph refreshes it, nothing reads it
    for i in range(4):  # call 1 eager, call 2 captures, then replays
        assert_close(graphed([x + i])[0], ref)
        assert_close(run(), ref)  # eager, on the current stream
    tickets = graphed.last.tickets
    assert tickets is not None and not tickets.any()
    assert not split_k._kept(out.device).any()


def assert_close(out, ref):
    """fp16 output against the float64 reference: the output's rounding and fp32 sums in another order."""
    torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)


def test_launches_of_other_sizes_share_one_kept_buffer(monkeypatch):
    """A kept buffer serves plans of any tile count in turn (each takes its first `tiles` tickets), and a launch of
    more tiles than it holds zeroes a buffer of its own (interpreter, the kept buffer given by the test)."""
    skip_unless_available("cpu")
    kept, asked = torch.zeros(split_k.KEPT_TICKETS, dtype=torch.int32), []
    monkeypatch.setattr(split_k, "_kept", lambda device: asked.append(device) or kept)
    small, small_ref, _ = _conv("cpu", 3)
    torch.manual_seed(1)
    a, b = torch.randn(70, 96).half(), (torch.randn(96, 40) / 10).half()
    out = torch.empty(70, 40, dtype=torch.float16)

    def gemm():  # 5 x 3 tiles of 16 x 16, split 4: more tickets than the conv's
        out.fill_(float("nan"))
        return launch.gemm(a, b, [], "relu(acc)", out, launch.GemmConfig(16, 16, 16, 2, 4, 4, 2))
    for _ in range(2):
        assert_close(small(), small_ref)
        assert_close(gemm(), torch.relu(a.double() @ b.double()))
        assert not kept.any()
    assert len(asked) == 4  # every launch of both took its tickets from the kept buffer
    monkeypatch.setattr(split_k, "KEPT_TICKETS", 4)  # now fewer than either launch's tiles: their own buffers
    assert split_k.buffers(out, 15, 4, 16, 16)[1].data_ptr() != kept.data_ptr()
    assert_close(gemm(), torch.relu(a.double() @ b.double()))


def test_kept_stream_buffers_are_made_once_and_bounded(monkeypatch):
    """One buffer a stream, made on first use and the same object after; past MAX_STREAMS streams the oldest goes
    (CPU tensors stand in for the device's, the keys for streams)."""
    monkeypatch.setattr(split_k, "_STREAMS", {})
    monkeypatch.setattr(split_k, "MAX_STREAMS", 3)
    made = []

    def make():
        made.append(torch.zeros(split_k.KEPT_TICKETS, dtype=torch.int32))
        return made[-1]
    first = split_k._stream_buffer(("dev", 1), make)
    assert split_k._stream_buffer(("dev", 1), make) is first and len(made) == 1
    for stream in (2, 3, 4):
        split_k._stream_buffer(("dev", stream), make)
    assert list(split_k._STREAMS) == [("dev", 2), ("dev", 3), ("dev", 4)]
    assert split_k._stream_buffer(("dev", 1), make) is not first and len(made) == 5


def test_a_streams_kept_buffer_is_zeroed_on_split_ks_own_stream(monkeypatch):
    """_zeroed_for allocates and zeroes on a thread and inside a stream of its own (not the launch's thread, whose
    allocations graph trees may route to their pool), then makes the launch's stream wait and records the buffer's
    use there. CUDA's streams are faked (CPU tensors), as in tests/test_cuda_graphs.py."""
    import contextlib
    import threading

    log, current = [], []

    class Stream:
        def __init__(self, device=None):
            self.device = torch.device("cpu")

        def wait_stream(self, other):
            log.append(("wait", self, other))

    @contextlib.contextmanager
    def stream(s):
        current.append(s)
        yield
        current.pop()

    made = torch.zeros

    def zeros(*args, **kwargs):
        log.append(("zeros", current[-1] if current else None, threading.get_ident() != caller))
        return made(*args, **kwargs)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: log.append(("record", s)), raising=False)
    monkeypatch.setattr(split_k, "_ALLOC_STREAMS", {})
    launch_stream, caller = Stream(), threading.get_ident()
    tickets = split_k._zeroed_for(launch_stream)
    own = split_k._ALLOC_STREAMS[torch.device("cpu")]
    assert own is not launch_stream and not tickets.any() and tickets.numel() == split_k.KEPT_TICKETS
    assert log == [("zeros", own, True), ("wait", launch_stream, own), ("record", launch_stream)]
    split_k._zeroed_for(Stream())
    assert split_k._ALLOC_STREAMS == {torch.device("cpu"): own}  # one own stream a device
