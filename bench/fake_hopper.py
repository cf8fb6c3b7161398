"""Triton told that its driver is a Hopper GPU's, so that our kernels compile for sm_90 on a machine without one
(the CI machine, this one). Triton's JITFunction.run asks the driver only for a device, a stream and a target before
its compile hook; nothing is launched.

Entry point: `install()`, before any resfuse kernel is built, in a process of its own (the driver is process-wide):
tests/kernels/test_compiles_for_hopper.py and bench/chain_smem.py.
"""
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class FakeHopper:
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_active_torch_device(self): return torch.device("cpu")
    def is_active(self): return True


def install() -> None:
    driver.set_active(FakeHopper())
    from resfuse.kernels import plan
    plan._pdl_supported = lambda device: True  # the kernels' programmatic-dependent-launch branch, as on a Hopper GPU
    plan.prefetch_meta = lambda device, programs: {"PREFETCH": True}  # and their weight prefetch, at any grid
