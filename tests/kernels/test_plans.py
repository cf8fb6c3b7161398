"""Launch plans: cached per shapes/strides/config, reused across calls, correct for operands that need a copy."""
import torch
import torch.nn.functional as F

from resfuse.kernels import launch

SIG = "relu(add(add(acc,c0),full1))"


def test_plan_is_reused_and_non_view_operands_are_rebuilt_each_call():
    x, w, bias = torch.randn(2, 4, 5, 6), torch.randn(3, 4, 3, 3), torch.randn(3)
    before = len(launch._PLANS)
    for _ in range(2):
        r = torch.randn(2, 3, 6, 5).transpose(2, 3)  # [S, P, C] of this is not a view: a copy per call
        out = torch.full((2, 3, 5, 6), float("nan"))
        launch.conv2d(x, w, [bias, r], SIG, [1, 1], [1, 1], [1, 1], out)
        ref = torch.relu(F.conv2d(x.double(), w.double(), bias.double(), padding=1) + r.double())
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    assert len(launch._PLANS) == before + 1
    plan = next(reversed(launch._PLANS.values()))
    assert plan.operand_strides[0] is not None and plan.operand_strides[1] is None


def test_a_cached_plan_keeps_no_tensor_of_the_call_that_built_it():
    """Plans live for the process: one that held its first call's output (the TMA descriptors' closure once did)
    kept every tuning candidate's scratch output alive, GBs at batch 256."""
    import gc
    import weakref

    cl = torch.channels_last
    x = torch.randn(2, 16, 5, 3).contiguous(memory_format=cl)
    w = torch.randn(8, 16, 1, 1)
    g = torch.randn(2, 8, 5, 3).contiguous(memory_format=cl)
    for tma_persistent in (0, 2):
        cfg = launch.GemmConfig(16, 16, 16, 2, 1, 4, 2, tma=True, persistent=tma_persistent)
        runs = (lambda out: launch.conv2d(x, w, [], "relu(acc)", [1, 1], [0, 0], [1, 1], out, cfg),
                lambda out: launch.conv2d_dgrad(g, w, [], "acc", [1, 1], [0, 0], [1, 1], out, cfg))
        for run, shape in zip(runs, ((2, 8, 5, 3), (2, 16, 5, 3))):
            before = len(launch._PLANS)
            out = torch.empty(shape).contiguous(memory_format=cl)
            run(out)
            assert len(launch._PLANS) == before + 1 and next(reversed(launch._PLANS.values())).prepare is not None
            ref = weakref.ref(out)
            del out
            gc.collect()
            assert ref() is None, "the plan keeps its first output alive"
