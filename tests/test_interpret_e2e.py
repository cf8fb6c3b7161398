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
