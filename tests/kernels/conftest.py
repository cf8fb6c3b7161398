"""Kernel tests run under Triton's interpreter on CPU tensors, with their own kernel cache directory.

The interpreter switch must be set before triton (and our kernel modules) are imported, because Triton
decides interpret-vs-compile when a function is decorated; hence this is done at conftest import time.
"""
import os
import tempfile

_CACHE = tempfile.mkdtemp(prefix="resfuse-kernel-tests-")
os.environ["RESFUSE_CACHE_DIR"] = _CACHE
# A GPU machine's `TRITON_INTERPRET=0 pytest -m requires_cuda tests` collects this folder too: left in compiled
# mode there (so the GPU tests' kernels compile), and these CPU-tensor tests are skipped.
INTERPRET = os.environ.get("TRITON_INTERPRET", "1") != "0"
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

from resfuse import kernels  # noqa: E402  (after the environment above, on purpose)

kernels.set_options(interpret=INTERPRET, cache_dir=_CACHE)

import pytest  # noqa: E402


def pytest_collection_modifyitems(items):
    # Masked-off lanes (padding, edge tiles) compute 0/0 and inf-inf in numpy; those values are never stored.
    for item in items:
        if "tests/kernels/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.filterwarnings("ignore::RuntimeWarning"))
            if not INTERPRET:
                item.add_marker(pytest.mark.skip(reason="TRITON_INTERPRET=0: kernel tests run under the interpreter"))
