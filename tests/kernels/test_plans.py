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
