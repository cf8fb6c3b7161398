"""No kernel calls triton.language's own @jit helpers (tl.zeros, tl.cdiv, tl.sum, ...): Triton decorates them when
it is first imported, so where that happened before resfuse turned the interpreter on (a script that imports torch,
then compiles with interpret=True, without TRITON_INTERPRET in its environment) they stay compiled-mode functions
and every interpreted kernel that calls one fails. The conftest sets TRITON_INTERPRET before anything imports
triton, so the kernel tests cannot see it; this reads the sources, the generated kernels' templates included."""
import re
from pathlib import Path

import triton.language as tl
from triton.runtime.jit import KernelInterface

import resfuse.kernels

HELPERS = sorted(name for name in dir(tl) if isinstance(getattr(tl, name), KernelInterface))  # jit or interpreted


def test_kernels_call_no_jit_helper_of_triton_language():
    assert {"zeros", "cdiv", "sum"} <= set(HELPERS)  # what the scan looks for exists in this triton
    calls = re.compile(r"\btl\.(" + "|".join(HELPERS) + r")\(")
    found = [f"{path.name}:{i}: {line.strip()}"
             for path in sorted(Path(resfuse.kernels.__file__).parent.glob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if calls.search(line) and not line.lstrip().startswith(("#", '"'))]
    assert not found, "use the builtins (tl.full, tiles.cdiv, activations' sums):\n" + "\n".join(found)
