"""FuseAddToOutput through an eval-mode dropout: T5 writes x + dropout(linear(h)), a clone of the linear's view in
the ATen graph; the GEMM absorbs the add and writes the sum where the clone was, under the interpreter."""
import pytest
import torch
import torch.nn as nn

from .helpers import against_float64, rel


class Sublayer(nn.Module):
    def __init__(self, width, bias):
        super().__init__()
        self.proj, self.dropout = nn.Linear(width, width, bias=bias), nn.Dropout(0.1)

    def forward(self, x, h):
        return x + self.dropout(self.proj(h))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 13])
def test_a_residual_add_behind_eval_dropout_joins_the_gemm(bias, rows):
    torch.manual_seed(rows + bias)
    layer = Sublayer(24, bias).eval()
    x, h = torch.randn(2, rows, 24), torch.randn(2, rows, 24)
    out, ref, report = against_float64(layer, x, h)
    assert report.errors == [] and report.rejected == []
    assert [(f.anchor, f.ops, f.ran) for f in report.fusions] == [("gemm", ["bias"] * bias + ["add"], "triton")]
    assert rel(out, ref) < 1e-5
