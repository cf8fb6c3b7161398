"""Shared test set-up.

CI has no GPU, so Triton runs in interpreter mode for the whole test process. TRITON_INTERPRET is set here,
before anything imports triton (torch._dynamo does, at import), because Triton's own @jit helpers are
decorated at that import and would otherwise stay compiled-mode functions. Whether a compiled model's fused
ops then take the Triton kernels or the reference path on CPU is still each compile's `interpret` option.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# oneDNN, torch's CPU conv library, computes a wrong weight gradient for a 1x1 stride-2 conv in channels_last with
# fewer than 8 input channels (relative error 0.2-0.6 on 2 threads in torch 2.13 and 2.14), and with one thread it
# writes past its buffer and corrupts the heap (uxlfoundation/oneDNN#6035, open). Tests judge resfuse against
# eager's own error on CPU, so a wrong eager gradient would widen a bound until it cannot fail, and a corrupted
# heap crashes the run. Every CPU conv here runs ATen's own implementation instead.
torch.backends.mkldnn.enabled = False

# CI draws the same examples every run (Hypothesis's advice for CI: a red build must mean a change broke
# something); HYPOTHESIS_PROFILE=explore draws fresh ones, with RESFUSE_EXAMPLES for more where a test reads it.
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _resfuse_cache(tmp_path, monkeypatch):
    """Every test gets its own resfuse cache directory."""
    monkeypatch.setenv("RESFUSE_CACHE_DIR", str(tmp_path / "resfuse-cache"))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts with Dynamo's caches empty: one that compiles a module class an earlier test compiled in
    the same process (nn.Sequential) must capture its own graph, not reuse the earlier one's or pass Dynamo's
    recompile limit and run eagerly, whichever tests pytest-xdist happened to give its process."""
    torch._dynamo.reset()


def pytest_collection_modifyitems(items):
    """A test skipped without a CUDA GPU is a GPU test: it gets the requires_cuda mark, which the GPU machine's run
    selects (`pytest -m requires_cuda tests`), even where only its skipif says so. Five cuDNN tests carried the skipif
    alone, were never selected there, and one of them had failed unseen since the forty-sixth session."""
    for item in items:
        if any("CUDA GPU" in m.kwargs.get("reason", "") for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.requires_cuda)
