"""Shared test set-up.

CI has no GPU, so Triton runs in interpreter mode for the whole test process. TRITON_INTERPRET is set here,
before anything imports triton (torch._dynamo does, at import), because Triton's own @jit helpers are
decorated at that import and would otherwise stay compiled-mode functions. Whether a compiled model's fused
ops then take the Triton kernels or the reference path on CPU is still each compile's `interpret` option.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI draws the same examples every run (Hypothesis's advice for CI: a red build must mean a change broke
# something); HYPOTHESIS_PROFILE=explore draws fresh ones, with RESFUSE_EXAMPLES for more where a test reads it.
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _resfuse_cache(tmp_path, monkeypatch):
    """Every test gets its own resfuse cache directory."""
    monkeypatch.setenv("RESFUSE_CACHE_DIR", str(tmp_path / "resfuse-cache"))
