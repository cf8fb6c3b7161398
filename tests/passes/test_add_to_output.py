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


class FlatResidual(nn.Module):
    """OPT's decoder layer and Qwen2-MoE's expert sum: the residual add (Qwen2-MoE: a per-row gate first) on the
    tokens flattened to [B*S, H], then a view back to [B, S, H]."""

    def __init__(self, width, gated):
        super().__init__()
        self.fc, self.gate, self.gated = nn.Linear(width, width), nn.Linear(width, 1), gated

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        y = self.fc(torch.nn.functional.layer_norm(h, h.shape[-1:]))
        if self.gated:
            y = torch.sigmoid(self.gate(h)) * y
        return (h + y).view(x.shape)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_a_residual_read_by_the_products_rows_stops_the_view_back_to_the_batch(gated, batch):
    """The GEMM absorbs the [B*S, H] residual (and gate) add; the view to [B, S, H] after it then stays a view:
    the operands, read by the product's rows, do not broadcast to it where B > 1 (it crashed at the first call: the
    op's shape taken from the view, its operands still [B*S, H]). At B = 1 they do, and the view joins."""
    torch.manual_seed(batch + 3 * gated)
    out, ref, report = against_float64(FlatResidual(24, gated).eval(), torch.randn(batch, 13, 24))
    assert report.errors == []
    assert rel(out, ref) < 1e-5
    assert any(f.anchor == "gemm" and "add" in f.ops and f.ran == "triton" for f in report.fusions)
    stopped = [r for r in report.rejected if "does not broadcast to its view" in r.reason]
    assert bool(stopped) == (batch > 1), report.rejected
