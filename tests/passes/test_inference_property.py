"""Property test of the inference passes: random small residual CNNs (widths, strides, grouped and depthwise
convs, shortcut kinds, conv bias, activations before and after the residual add, a linear head, layouts, a static or dynamic batch) run
through resfuse with every pass on and off, on the reference path and through the Triton kernels under the
interpreter, and match eager within a few times eager's own float64 error."""
import copy
import os

import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import resfuse
from resfuse.capture.backend import make_backend
from resfuse.kernels.conv2d_depthwise import is_depthwise

ACTS = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "hardswish": nn.Hardswish, "none": nn.Identity}


class Block(nn.Module):
    def __init__(self, cin, cout, stride, bias, act, act_after, groups=1):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=bias, groups=groups), nn.BatchNorm2d(cout), ACTS[act](),
                                  nn.Conv2d(cout, cout, 1, bias=bias), nn.BatchNorm2d(cout))
        self.short = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        self.act_after = ACTS[act_after]()

    def forward(self, x):
        return self.act_after(self.body(x) + self.short(x))


@st.composite
def networks(draw):
    c = draw(st.sampled_from([3, 4, 8]))
    layers, cin = [], c
    for _ in range(draw(st.integers(1, 3))):
        cout = draw(st.sampled_from([cin, 4, 8]))
        groups = draw(st.sampled_from([g for g in (1, 2, cin) if cin % g == 0 and cout % g == 0]))  # cin: depthwise
        layers.append(Block(cin, cout, draw(st.sampled_from([1, 2])), draw(st.booleans()),
                            draw(st.sampled_from(sorted(ACTS))), draw(st.sampled_from(sorted(ACTS))), groups))
        cin = cout
    head = nn.Sequential(nn.Flatten(), nn.Linear(cin, 5), ACTS[draw(st.sampled_from(sorted(ACTS)))]())
    net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), head)
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):  # non-trivial statistics, so a wrong fold shows
            m.running_mean.normal_(0, 0.5), m.running_var.uniform_(0.5, 2.0), m.weight.data.normal_(1, 0.3)
    return c, net.eval(), draw(st.sampled_from([5, 8, 9])), draw(st.booleans())


EXAMPLES = int(os.environ.get("RESFUSE_EXAMPLES", 12))


@settings(max_examples=EXAMPLES, deadline=None)
@given(networks(), st.booleans(), st.booleans(), st.booleans(), st.integers(0, 2**16),
       st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
def test_random_residual_nets_infer_like_eager(net, epilogue, add_to_output, dynamic, seed, dtype):
    """Half precision too (bf16: the dtype CPU convs take): a GPU deploys fp16 and bf16 graphs, whose casts and
    rounding the fp32 graphs never show the passes."""
    check(net, seed, dynamic, dtype=dtype, fuse_epilogue=epilogue, fuse_add_to_output=add_to_output)


@settings(max_examples=max(1, EXAMPLES // 3), deadline=None)
@given(networks(), st.booleans(), st.integers(0, 2**16), st.sampled_from([torch.float32, torch.bfloat16]))
def test_random_residual_nets_infer_like_eager_through_the_triton_kernels(net, dynamic, seed, dtype):
    report = check(net, seed, dynamic, dtype=dtype, interpret=True)
    assert report.fusions
    for f in report.fusions:  # a grouped conv (but a depthwise forward) runs cuDNN (ATen on CPU) + our epilogue
        # kernel; the rest ours
        x_shape, w_shape = f.shapes["inputs"]  # (paths are counted per signature, which convs may share)
        ran = set(f.ran.split(","))
        grouped = f.anchor == "conv2d" and x_shape[1] != w_shape[1] and not is_depthwise(x_shape, w_shape)
        assert ran <= {"triton", "epilogue"} and ("epilogue" if grouped else "triton") in ran, f


def check(net, seed, dynamic, dtype=torch.float32, **config):
    c, body, size, channels_last = net
    torch.manual_seed(seed)
    x = torch.randn(3, c, size, size)
    with torch.no_grad():
        exact = copy.deepcopy(body).double()(x.double())  # from the fp32 weights and input
    body, x = body.to(dtype), x.to(dtype)
    if channels_last:
        body, x = body.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    report = resfuse.Report()
    torch._dynamo.reset()
    compiled = torch.compile(body, backend=make_backend(resfuse.Config(**config), report), dynamic=None if dynamic
                             else False)
    if dynamic:
        torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        ours, eager = compiled(x), body(x)
    body.float()
    assert not report.errors
    assert not any("dynamic" in r.reason for r in report.rejected)
    ours_err, eager_err = (ours.double() - exact).abs().max().item(), (eager.double() - exact).abs().max().item()
    floor = 1e-6 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps  # a few roundings of the value itself
    assert ours_err <= 4 * eager_err + floor * exact.abs().max().item(), (ours_err, eager_err)
    return report
