"""A dynamic batch dim: the graph dynamo captures with a symbolic batch is fused like a static one (the fused
ops take -1 for the batch in their shape arguments and resolve it at run time), for conv blocks in inference and
training and for a linear layer's [B, S, N] view; any other dynamic dim is refused with its reason."""
import copy

import torch

from resfuse.capture.backend import make_backend
from resfuse.config import Config
from resfuse.passes.report import Report

from .test_api import Block, rel


def compile_dynamic(model, **config):
    report = Report()
    torch._dynamo.reset()
    return torch.compile(model, backend=make_backend(Config(interpret=True, **config), report)), report


def batches(*sizes, shape=(5, 7, 6), channels_last=False):
    for n in sizes:
        x = torch.randn(n, *shape)
        x = x.to(memory_format=torch.channels_last) if channels_last else x
        torch._dynamo.mark_dynamic(x, 0)
        yield x


def test_inference_block_with_a_dynamic_batch_runs_fused_kernels():
    torch.manual_seed(0)
    block = Block(c=5).eval()
    compiled, report = compile_dynamic(block)
    with torch.no_grad():
        for x in batches(2, 3, 6):
            assert rel(compiled(x), block(x)) < 1e-4
    assert len(report.graphs) == 1  # one capture served every batch size
    assert len(report.fusions) == 4 and {f.ran for f in report.fusions} == {"triton"}
    assert not any("dynamic" in r.reason for r in report.rejected)


def test_training_with_a_dynamic_batch_matches_eager():
    """Forward batch norm + add + relu and backward dgrad + add + drelu, with the batch symbolic in both graphs
    (the dgrad op's input-shape argument carries -1)."""
    torch.manual_seed(1)
    block = Block(c=5).train().to(memory_format=torch.channels_last)
    twin = copy.deepcopy(block)
    compiled, report = compile_dynamic(block)
    for x in batches(2, 3, channels_last=True):
        x.requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        loss, ref = compiled(x).square().sum(), twin(x2).square().sum()
        loss.backward()
        ref.backward()
        assert rel(loss, ref) < 1e-5 and rel(x.grad, x2.grad) < 1e-4
    for p, q in zip(block.parameters(), twin.parameters()):
        assert rel(p.grad, q.grad) < 1e-4
    anchors = {(f.graph, f.anchor) for f in report.fusions}
    assert {("forward", "batch_norm"), ("backward", "conv2d_dgrad")} <= anchors


class Mlp(torch.nn.Module):
    def __init__(self, d=12):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def test_linear_view_with_a_dynamic_batch():
    torch.manual_seed(2)
    mlp = Mlp().eval()
    compiled, report = compile_dynamic(mlp)
    with torch.no_grad():
        for x in batches(2, 5, shape=(7, 12)):
            assert rel(compiled(x), mlp(x)) < 1e-4
    assert len(report.fusions) == 2 and {f.ran for f in report.fusions} == {"triton"}


def test_a_dynamic_non_batch_dim_is_refused_with_its_reason():
    block = Block(c=5).eval()
    compiled, report = compile_dynamic(block)
    with torch.no_grad():
        for h in (7, 9):
            x = torch.randn(2, 5, h, 6)
            torch._dynamo.mark_dynamic(x, 2)
            assert rel(compiled(x), block(x)) < 1e-5
    assert [f.anchor for f in report.fusions] == ["gemm"]  # the head after pooling is static; the convs are not
    assert any("only the leading (batch) dim may vary" in r.reason for r in report.rejected)


def test_a_dynamic_sequence_fuses_the_gemm_rows_but_not_the_view():
    """[B, S, H] with S dynamic: the GEMMs' rows (B*S) are a leading dim, so they fuse; the [B, S, N] view with
    a dynamic inner dim is not absorbed, so the residual add stays outside."""
    mlp = Mlp().eval()
    compiled, report = compile_dynamic(mlp)
    with torch.no_grad():
        for s in (7, 9):
            x = torch.randn(2, s, 12)
            torch._dynamo.mark_dynamic(x, 1)
            assert rel(compiled(x), mlp(x)) < 1e-4
    assert len(report.fusions) == 2 and not any("add" in f.ops and "full" in f.signature for f in report.fusions)


def test_resfuse_compile_recaptures_once_for_a_new_batch_size():
    """Without any mark, a second batch size recaptures once with a symbolic batch (torch.compile's dynamic=None),
    which stays fused; ten batch sizes never reach dynamo's recompile limit (8), past which the model would run
    eagerly without a word. dynamic=False captures each shape on its own."""
    import resfuse

    torch.manual_seed(1)
    block = Block(c=5).eval()
    for dynamic, captures in ((None, 2), (False, 3)):
        torch._dynamo.reset()
        compiled = resfuse.compile(block, dynamic=dynamic)
        sizes = range(2, 12) if dynamic is None else range(2, 5)
        with torch.no_grad():
            for n in sizes:
                x = torch.randn(n, 5, 7, 6)
                assert rel(compiled(x), block(x)) < 1e-4
        report = compiled.resfuse_report
        assert len(report.graphs) == captures
        assert len(report.fusions) == 4 * captures  # every capture fused all four ops, the symbolic one too
