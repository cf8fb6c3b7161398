"""cuda_graphs=True: replays match eager for fresh inputs, parameters are read in place (GPU only)."""
import pytest
import torch

import resfuse
from resfuse.capture.cuda_graphs import CudaGraphed

from .test_api import Block, rel


def test_cpu_inputs_run_the_function_as_it_is():
    seen = []
    wrapped = CudaGraphed(lambda *a: seen.append(a) or [a[0] * 2])
    x = torch.randn(3)
    assert torch.equal(wrapped(x)[0], x * 2) and len(seen) == 1 and wrapped.graph is None


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_replay_matches_eager_on_fresh_inputs():
    torch.manual_seed(0)
    block = Block().eval().cuda().half().to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = resfuse.compile(block, cuda_graphs=True, tuning="none")
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 8, 9, 7, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)
            assert rel(compiled(x).float(), block(x).float()) < 5e-3
