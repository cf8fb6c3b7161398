"""Each legality rule, broken by a small graph: the chain is not fused and the reason is recorded."""
import torch
import torch.nn.functional as F

from resfuse.passes import legality

from .helpers import bn, bn_params, conv_w, reasons, rel, run

aten = torch.ops.aten


def fused_patterns(report):
    return sorted(f.pattern for f in report.fusions)


def test_sole_consumer():
    x, w, p = torch.randn(2, 4, 6, 6), conv_w(4, 8), bn_params(8)

    def fn(x, w, *p):
        y = bn(F.conv2d(x, w, padding=1), *p)
        return torch.relu(y), torch.sigmoid(y)  # y has two consumers

    gm, report = run(fn, x, w, *p)
    assert fused_patterns(report) == ["conv2d_bn"]
    assert "2 consumers" in reasons(report)
    for a, b in zip(gm(x, w, *p), fn(x, w, *p)):
        assert rel(a, b) < 1e-5


def test_no_cycle_rule():
    x, w = torch.randn(1, 3, 5, 5), conv_w(3, 3)
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x, w: F.conv2d(x, w, padding=1) + torch.relu(F.conv2d(x, w, padding=1)).exp(),
                 tracing_mode="fake")(x, w)
    convs = [n for n in gm.graph.nodes if n.target == aten.convolution.default]
    exp = next(n for n in gm.graph.nodes if n.target == aten.exp.default)
    assert "cycle" in legality.no_cycle(exp, convs[1])
    assert legality.no_cycle(convs[0], convs[1]) is None


def test_broadcast_larger_than_output_is_refused():
    x, w, r = torch.randn(1, 4, 6, 6), conv_w(4, 4), torch.randn(3, 4, 6, 6)
    fn = lambda x, w, r: torch.relu(F.conv2d(x, w, padding=1)) * r  # noqa: E731  (broadcasts out to 3 samples)
    gm, report = run(fn, x, w, r)
    assert fused_patterns(report) == ["conv2d_relu"]
    assert "broadcasts the output" in reasons(report)
    assert rel(gm(x, w, r), fn(x, w, r)) < 1e-5


def test_dtype_change_is_refused():
    x, w, r = torch.randn(1, 4, 6, 6), conv_w(4, 4), torch.randn(1, 4, 6, 6, dtype=torch.float64)
    fn = lambda x, w, r: torch.relu(F.conv2d(x, w, padding=1)) * r  # noqa: E731  (promotes to float64)
    gm, report = run(fn, x, w, r)
    assert fused_patterns(report) == ["conv2d_relu"]
    assert "float64" in reasons(report)
    assert rel(gm(x, w, r), fn(x, w, r)) < 1e-5


def test_add_to_output_needs_matching_strides():
    x = torch.randn(2, 4, 6, 6).to(memory_format=torch.channels_last)
    w, r, p = conv_w(4, 8).to(memory_format=torch.channels_last), torch.randn(2, 8, 6, 6), bn_params(8)
    fn = lambda x, w, r, *p: torch.relu(bn(F.conv2d(x, w, padding=1), *p) + r)  # noqa: E731  r is NCHW
    gm, report = run(fn, x, w, r, *p)
    assert fused_patterns(report) == ["conv2d_bn"]
    assert "strides" in reasons(report)
    assert rel(gm(x, w, r, *p), fn(x, w, r, *p)) < 1e-5


def test_add_to_output_refuses_an_alias_of_the_producer_input():
    x, w = torch.randn(2, 4, 6, 6), conv_w(4, 4)
    fn = lambda x, w: torch.relu(F.conv2d(x, w, padding=1) + x)  # noqa: E731
    gm, report = run(fn, x, w)
    assert fused_patterns(report) == []
    assert "aliases the producer's input" in reasons(report)
    assert rel(gm(x, w), fn(x, w)) < 1e-5


def test_only_one_add_to_output_per_producer():
    x, w, r1, r2 = torch.randn(2, 4, 6, 6), conv_w(4, 4), torch.randn(2, 4, 6, 6), torch.randn(2, 4, 6, 6)
    fn = lambda x, w, r1, r2: (F.conv2d(x, w, padding=1) + r1) + r2  # noqa: E731
    gm, report = run(fn, x, w, r1, r2)
    assert fused_patterns(report) == ["conv2d_add"]
    assert "already absorbed an add" in reasons(report)
    assert rel(gm(x, w, r1, r2), fn(x, w, r1, r2)) < 1e-5


def test_mutation_is_refused():
    x, w, r = torch.randn(2, 4, 6, 6), conv_w(4, 4), torch.randn(2, 4, 6, 6)

    def fn(x, w, r):
        y = F.conv2d(x, w, padding=1) + r
        r.add_(1.0)  # the operand is mutated after the add reads it
        return y

    gm, report = run(fn, x, w, r.clone())
    assert fused_patterns(report) == []
    assert "mutated" in reasons(report)
    r1, r2 = r.clone(), r.clone()
    assert rel(gm(x, w, r1), fn(x, w, r2)) < 1e-5 and torch.equal(r1, r2)


def test_grouped_convs_fuse_and_1d_convs_are_reported():
    """A grouped conv (depthwise, or groups=2) fuses its epilogue (cuDNN runs the conv: our conv kernels are
    groups=1); a 1-D conv is refused with its reason."""
    for c_in, groups in ((4, 4), (6, 2)):
        x, w = torch.randn(2, c_in, 6, 6), torch.randn(4, c_in // groups, 3, 3)
        fn = lambda x, w: torch.relu(F.conv2d(x, w, padding=1, groups=groups))  # noqa: E731
        gm, report = run(fn, x, w)
        assert fused_patterns(report) == ["conv2d_relu"] and not report.rejected
        assert rel(gm(x, w), fn(x, w)) < 1e-5
    x1, w1 = torch.randn(2, 4, 9), torch.randn(4, 4, 3)
    gm, report = run(lambda x, w: torch.relu(F.conv1d(x, w)), x1, w1)
    assert fused_patterns(report) == [] and "2-D only" in reasons(report)


def test_one_pixel_outputs_fuse_whatever_their_size_one_strides():
    """A squeeze-excitation block's convs see 1x1 pixels. In channels_last the graph says the output's strides
    are (C, 1, C, C) and our op makes (C, 1, 1, 1): the same layout, since a dim of size 1 has none."""
    x = torch.randn(2, 12, 5, 7).to(memory_format=torch.channels_last)
    w1, b1 = conv_w(12, 4, k=1).to(memory_format=torch.channels_last), torch.randn(4)
    w2, b2 = conv_w(4, 12, k=1).to(memory_format=torch.channels_last), torch.randn(12)

    def fn(x, w1, b1, w2, b2):
        s = F.silu(F.conv2d(x.mean((2, 3), keepdim=True), w1, b1))
        return x * torch.sigmoid(F.conv2d(s, w2, b2))

    gm, report = run(fn, x, w1, b1, w2, b2)
    assert fused_patterns(report) == ["conv2d_bias_sigmoid", "conv2d_bias_silu"]
    assert "strides" not in reasons(report)
    assert rel(gm(x, w1, b1, w2, b2), fn(x, w1, b1, w2, b2)) < 1e-5


def test_same_strides_ignores_size_one_dims_only():
    t = torch.empty(2, 8, 1, 1)
    assert legality.same_strides(t, torch.empty(2, 8, 1, 1).to(memory_format=torch.channels_last))
    assert not legality.same_strides(torch.empty(2, 8, 3, 1), torch.empty(2, 8, 3, 1).to(memory_format=torch.channels_last))
    assert not legality.same_strides(t, torch.empty(2, 8, 1, 2))
