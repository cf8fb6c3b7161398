"""Fake CUDA graphs for CPU tests of capture/cuda_graphs.py's CudaGraphed: `fake_cuda(monkeypatch)` stands
torch.cuda's streams and graphs in for CPU tensors (FakeGraph), `product(calls)` is a function whose capture
registers how to replay it, and `OnCudaGraphed` takes every input for a CUDA one. Used by tests/test_cuda_graphs.py,
tests/test_handouts.py and tests/test_fold_bn.py."""
import torch

from resfuse.capture.cuda_graphs import CudaGraphed


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: the function under capture registers how to recompute its
    output in place from the static inputs, and the copies made under capture (a handout's) are recorded, which
    is what replaying a real graph does. `made` counts captures of a graph of its own memory pool, `shared` those
    sharing another's (handouts)."""
    capturing = None
    made = shared = 0

    def __init__(self):
        self.work, self.copies = None, []

    def replay(self):
        self.work()
        for dst, src in self.copies:
            dst.copy_(src)

    def pool(self):
        return id(self)


class RecordCopies(torch.overrides.TorchFunctionMode):
    """Records the copies made under a fake capture once the function captured has registered its work (it does
    so last): a handout's copies of the function's outputs, not copies inside the function (its work redoes those)."""
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and FakeGraph.capturing is not None and FakeGraph.capturing.work is not None:
            FakeGraph.capturing.copies.append(args[:2])
        return func(*args, **(kwargs or {}))


def fake_cuda(monkeypatch):
    import contextlib

    class Stream:
        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def graph(g, pool=None):
        if pool is None:
            FakeGraph.made += 1
        else:
            FakeGraph.shared += 1
        FakeGraph.capturing = g
        with RecordCopies():
            yield
        FakeGraph.capturing = None

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    FakeGraph.made = FakeGraph.shared = 0


def product(calls: list, replay_adds=lambda batch: 0.0):
    """fn([x, w]) = [x * w], recording each call's batch; under a fake capture its graph recomputes x * w plus
    replay_adds(batch) in place (not zero: a graph that replays wrong)."""
    def fn(args):
        x, w = args
        calls.append(x.shape[0])
        out = x * w
        if FakeGraph.capturing is not None:
            extra = replay_adds(x.shape[0])
            FakeGraph.capturing.work = lambda: out.copy_(x * w + extra)
        return [out]
    return fn


class OnCudaGraphed(CudaGraphed):
    @staticmethod
    def _on_cuda(args):
        return True
