"""End to end through the Triton kernels: a compiled block whose fused ops run under Triton's interpreter."""
import torch

import resfuse

from .test_api import Block, rel


def test_compiled_block_runs_triton_kernels_under_the_interpreter():
    torch.manual_seed(1)
    block = Block(c=5).eval()
    x = torch.randn(2, 5, 7, 6)
    torch._dynamo.reset()
    compiled = resfuse.compile(block, interpret=True)
    with torch.no_grad():
        out, ref = compiled(x), block(x)
    assert rel(out, ref) < 1e-4
    report = compiled.resfuse_report
    assert len(report.fusions) == 4
    assert {f.ran for f in report.fusions} == {"triton"} and {f.provider for f in report.fusions} == {"triton"}


def test_training_step_runs_batch_norm_and_dgrad_kernels_under_the_interpreter():
    """A channels_last training step whose forward batch norm (+ add + relu) and backward dgrads (+ relu
    gradient, + the skip-gradient add) run our Triton kernels; gradients and running stats equal eager's."""
    import copy

    torch.manual_seed(2)
    block = Block(c=5).train().to(memory_format=torch.channels_last)
    twin = copy.deepcopy(block)
    x = torch.randn(2, 5, 7, 6).to(memory_format=torch.channels_last).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    compiled = resfuse.compile(block, interpret=True)
    loss = compiled(x).square().sum()
    loss.backward()
    ref = twin(x2).square().sum()
    ref.backward()
    assert rel(loss, ref) < 1e-5
    assert rel(x.grad, x2.grad) < 1e-4  # dgrad(c1) + dgrad(cs): the skip-gradient add, absorbed
    for (name, p), q in zip(block.named_parameters(), twin.parameters()):
        assert rel(p.grad, q.grad) < 1e-4, name
    for (name, b), c in zip(block.named_buffers(), twin.buffers()):
        assert rel(b.float(), c.float()) < 1e-5, name
    from torch.profiler import ProfilerActivity, profile

    from resfuse.ops import PATHS

    def bn_calls():
        return sum(n for (op, _, path), n in PATHS.items() if op == "batch_norm" and path == "triton")

    before = bn_calls()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled(x).sum().backward()
    calls = {e.key: e.count for e in prof.key_averages()}
    # the fused batch norms replaced ATen's (only the shortcut's, which absorbed nothing, still runs)
    assert calls.get("aten::_native_batch_norm_legit_functional") == 1 and bn_calls() - before == 2
    report = compiled.resfuse_report
    ran = {(f.anchor, f.ran) for f in report.fusions}
    assert ("batch_norm", "triton") in ran and ("conv2d_dgrad", "triton") in ran
    assert any(f.anchor == "batch_norm" and f.ops == ["add", "relu"] for f in report.fusions)
    assert any(f.anchor == "conv2d_dgrad" and f.ops[0] == "add" for f in report.fusions)
