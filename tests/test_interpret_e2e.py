"""End to end through the Triton kernels: a compiled block whose fused ops run under Triton's interpreter."""
import copy

import pytest
import torch

import resfuse

from .test_api import Block, rel


def test_compiled_block_runs_triton_kernels_under_the_interpreter():
    torch.manual_seed(1)
    block = Block(c=5).eval()
    x = torch.randn(2, 5, 7, 6)
    torch._dynamo.reset()
    compiled = resfuse.compile(block, interpret=True)
    with torch.no_grad():
        out, ref = compiled(x), block(x)
    assert rel(out, ref) < 1e-4
    report = compiled.resfuse_report
    assert len(report.fusions) == 4
    assert {f.ran for f in report.fusions} == {"triton"} and {f.provider for f in report.fusions} == {"triton"}


def test_training_step_runs_batch_norm_and_dgrad_kernels_under_the_interpreter():
    """A channels_last training step whose forward batch norm (+ add + relu) and backward dgrads (+ relu
    gradient, + the skip-gradient add) run our Triton kernels; gradients and running stats equal eager's."""
    import copy

    torch.manual_seed(2)
    block = Block(c=5).train().to(memory_format=torch.channels_last)
    block.bs.bias.data.normal_()  # the folded shortcut batch norm's shift shows in the output
    twin = copy.deepcopy(block)
    x = torch.randn(2, 5, 7, 6).to(memory_format=torch.channels_last).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    compiled = resfuse.compile(block, interpret=True)
    loss = compiled(x).square().sum()
    loss.backward()
    ref = twin(x2).square().sum()
    ref.backward()
    assert rel(loss, ref) < 1e-5
    assert rel(x.grad, x2.grad) < 1e-4  # dgrad(c1) + dgrad(cs): the skip-gradient add, absorbed
    for (name, p), q in zip(block.named_parameters(), twin.parameters()):
        assert rel(p.grad, q.grad) < 1e-4, name
    for (name, b), c in zip(block.named_buffers(), twin.buffers()):
        assert rel(b.float(), c.float()) < 1e-5, name
    from torch.profiler import ProfilerActivity, profile

    from resfuse.ops import PATHS

    def bn_calls(anchor):
        return sum(n for (op, _, path), n in PATHS.items() if op == anchor and path == "triton")

    before = bn_calls("batch_norm"), bn_calls("batch_norm_backward"), bn_calls("batch_norm_stats")
    dual_before = PATHS[("batch_norm_backward", "dual", "triton")]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled(x).sum().backward()
    calls = {e.key: e.count for e in prof.key_averages()}
    # the fused batch norms replaced ATen's; the shortcut's is folded into b2's: only its statistics run, and
    # b2's epilogue normalizes the shortcut conv's output
    assert "aten::_native_batch_norm_legit_functional" not in calls and bn_calls("batch_norm") - before[0] == 2
    assert bn_calls("batch_norm_stats") - before[2] == 1
    (main,) = [f for f in compiled.resfuse_report.fusions if f.graph == "forward" and "add" in f.ops]
    assert "normalize(full0,c1,c2,c3)" in main.signature
    assert len(main.sources) == 4 and main.sources[-1].startswith("_native_batch_norm")  # bn, add, relu, folded bn
    # all three batch-norm backwards ran our kernel, none ATen's; b2's and the shortcut's share grad_out and ran as
    # one call that reads it once
    assert "aten::native_batch_norm_backward" not in calls and bn_calls("batch_norm_backward") - before[1] == 2
    assert PATHS[("batch_norm_backward", "dual", "triton")] - dual_before == 1
    report = compiled.resfuse_report
    ran = {(f.anchor, f.ran) for f in report.fusions}
    assert ("batch_norm", "triton") in ran and ("conv2d_dgrad", "triton") in ran
    assert any(f.anchor == "batch_norm" and f.ops == ["add", "relu"] for f in report.fusions)
    assert any(f.anchor == "conv2d_dgrad" and f.ops[0] == "add" for f in report.fusions)
    assert "backward graph: 3 batch-norm backward(s) on resfuse's kernel" in report.rewrites
    assert "backward graph: 1 pair(s) of batch-norm backwards with one grad_out run as one, reading it once" in (
        report.rewrites)


def test_interpreter_switch_after_triton_was_imported():
    """RESFUSE_INTERPRET=1 in a process that imported triton first (torch._dynamo does): the kernels must use
    no Triton @jit helper (triton 3.7's tl.zeros is one), or they fail inside the interpreter. Runs in a fresh
    process without TRITON_INTERPRET, unlike the rest of the suite."""
    import os
    import subprocess
    import sys

    script = (
        "import torch, triton, resfuse\n"
        "from tests.test_api import Block, rel\n"
        "torch.manual_seed(0)\n"
        "block = Block(c=5).eval()\n"
        "x = torch.randn(2, 5, 7, 6)\n"
        "compiled = resfuse.compile(block)\n"
        "with torch.no_grad():\n"
        "    assert rel(compiled(x), block(x)) < 1e-4\n"
        "assert {f.ran for f in compiled.resfuse_report.fusions} == {'triton'}\n"
        # a training step: the batch-norm, dgrad and max-pool kernels (forward and backward) run too
        "import copy\n"
        "from tests.test_inductor_remainder import SqueezeExcite\n"
        "net = SqueezeExcite().train().to(memory_format=torch.channels_last)\n"
        "twin = copy.deepcopy(net)\n"
        "x = torch.randn(2, 6, 9, 7).to(memory_format=torch.channels_last)\n"
        "compiled = resfuse.compile(net)\n"
        "compiled(x).square().sum().backward()\n"
        "twin(x).square().sum().backward()\n"
        "for p, q in zip(net.parameters(), twin.parameters()):\n"
        "    assert rel(p.grad, q.grad) < 1e-4\n"
        "from resfuse.ops import PATHS\n"
        "assert {('max_pool2d', 'triton'), ('max_pool2d_backward', 'triton')} <= {(op, path) for op, _, path in PATHS}\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"RESFUSE_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_batched_product_viewed_as_4d_keeps_its_view_outside():
    """bmm [B*H, S, T] viewed as [B, H, S, T] (attention scores): the kernel writes a batched product as
    [B, M, N] only, so the view is not absorbed; the bias and relu are, and the values match eager."""
    class Scores(torch.nn.Module):
        def forward(self, q, k, bias):
            return torch.relu(torch.bmm(q, k).view(2, 3, 5, 6) + bias)

    torch.manual_seed(3)
    q, k, bias = torch.randn(6, 5, 8), torch.randn(6, 8, 6), torch.randn(6)
    torch._dynamo.reset()
    compiled = resfuse.compile(Scores(), interpret=True)
    with torch.no_grad():
        assert rel(compiled(q, k, bias), Scores()(q, k, bias)) < 1e-5


@pytest.mark.parametrize("bn_sums", [False, True])
def test_grouped_and_depthwise_convs_fuse_forward_and_data_gradient(bn_sums):
    """A grouped (groups=4) and a depthwise conv in a training step: their forward epilogues and their data
    gradients (with relu's gradient, the skip-gradient add and, with bn_backward_sums, the sums of the batch norm
    before them) fuse and run cuDNN + our epilogue kernel (ATen's conv on CPU), while the groups=1 ops run our
    kernels; gradients equal eager's."""
    import copy

    class Grouped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            nn = torch.nn
            self.c0, self.b0 = nn.Conv2d(8, 8, 1, bias=False), nn.BatchNorm2d(8)  # a bias before BN: 0 gradient
            self.c1, self.b1 = nn.Conv2d(8, 8, 3, padding=1, groups=4, bias=False), nn.BatchNorm2d(8)
            self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8)

        def forward(self, x):
            x = torch.relu(self.b0(self.c0(x)))
            return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + x)

    torch.manual_seed(5)
    model = Grouped().train()
    twin, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    torch._dynamo.reset()
    compiled = resfuse.compile(model, interpret=True, bn_backward_sums=bn_sums)
    x = torch.randn(2, 8, 5, 5)
    from resfuse.ops import PATHS
    sums_before, plain_before = (PATHS[("batch_norm_backward", s, "triton")] for s in ("sums", ""))
    for net, inp in ((compiled, x), (twin, x), (exact, x.double())):
        net(inp.clone()).square().sum().backward()

    def err(p, q):
        return ((p.grad.double() - q.grad).norm() / q.grad.norm()).item()

    # judged against float64 as the property tests judge: BN weight gradients are sums that cancel, where fp32
    # eager itself is 1e-3 off; ours may differ from float64 a few times more (other summation orders)
    for (name, p), q, r in zip(model.named_parameters(), twin.parameters(), exact.parameters()):
        assert err(p, r) <= 10 * err(q, r) + 1e-6, name
    dgrads = {f.shapes["inputs"][1][1]: (f.ops, f.ran) for f in compiled.resfuse_report.fusions
              if f.anchor == "conv2d_dgrad"}
    sums = ["bn_sums"] if bn_sums else []
    assert dgrads[1] == (["drelu", *sums], "epilogue")  # depthwise: weight [8, 1, 3, 3]
    assert dgrads[2] == (["add", "drelu", *sums], "epilogue")  # groups=4, absorbing the skip-gradient add
    # the batch norms' backward took those sums instead of computing them (the last one's grad_out is relu's)
    assert (PATHS[("batch_norm_backward", "sums", "triton")] - sums_before, PATHS[("batch_norm_backward", "", "triton")]
            - plain_before) == ((2, 1) if bn_sums else (0, 3))


class _Stem(torch.nn.Module):
    """ResNet's stem: conv -> batch norm -> relu -> max-pool, then a conv (channels_last)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3, stride=2, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(6)
        self.pool = torch.nn.MaxPool2d(3, 2, 1)
        self.head = torch.nn.Conv2d(6, 4, 1)

    def forward(self, x):
        return self.head(self.pool(torch.relu(self.bn(self.conv(x)))))


def test_max_pool_runs_our_kernels_in_inference_and_training():
    """The stem's pool runs our kernels: in inference without writing indices and computing the conv's batch
    norm and relu itself, in training with window codes for indices, and its backward with relu's gradient
    applied on the way out; outputs and gradients equal eager's."""
    import copy

    from resfuse.ops import PATHS

    torch.manual_seed(3)
    stem = _Stem().to(memory_format=torch.channels_last)
    twin = copy.deepcopy(stem)
    x = torch.randn(2, 3, 13, 11).to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    PATHS.clear()
    compiled = resfuse.compile(stem.eval(), interpret=True)
    with torch.no_grad():
        assert rel(compiled(x), twin.eval()(x)) < 1e-5
    assert PATHS[("max_pool2d", "relu(bn[#1e-05](acc,c0,c1,c2,c3))", "triton")] == 1
    assert ("inference graph: 1 max-pool op(s) on resfuse's kernels (1 computing the epilogue of the conv before "
            "it)") in compiled.resfuse_report.rewrites
    assert sorted(f.pattern for f in compiled.resfuse_report.fusions) == ["conv2d_bias", "max_pool2d_bn_relu"]

    torch._dynamo.reset()
    compiled = resfuse.compile(stem.train(), interpret=True)
    loss = compiled(x).square().sum()
    loss.backward()
    ref = twin.train()(x).square().sum()
    ref.backward()
    assert rel(loss, ref) < 1e-5
    for (name, p), q in zip(stem.named_parameters(), twin.parameters()):
        assert rel(p.grad, q.grad) < 1e-4, name
    assert PATHS[("max_pool2d", "window codes", "triton")] == 1
    assert PATHS[("max_pool2d_backward", "window codes", "triton")] == 1
    rewrites = compiled.resfuse_report.rewrites
    assert "forward graph: 1 max-pool op(s) on resfuse's kernels" in rewrites
    assert "backward graph: 1 max-pool op(s) on resfuse's kernels (1 with relu's gradient)" in rewrites


def test_max_pool_switch_off_keeps_aten():
    from resfuse.ops import PATHS

    torch._dynamo.reset()
    PATHS.clear()
    compiled = resfuse.compile(_Stem().eval(), interpret=True, max_pool=False)
    with torch.no_grad():
        compiled(torch.randn(1, 3, 9, 9))
    assert not any(op == "max_pool2d" for op, _, _ in PATHS) and not compiled.resfuse_report.rewrites


class _SavedPreActivations(torch.nn.Module):
    """conv + bias -> silu and linear + bias -> gelu in training: both activations' backward read their input."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 5, 3, padding=1)
        self.fc = torch.nn.Linear(5, 7)

    def forward(self, x):
        y = torch.nn.functional.silu(self.conv(x))
        return torch.nn.functional.gelu(self.fc(y.mean((2, 3))))


def test_saved_pre_activations_become_aux_outputs_of_the_fused_kernels():
    import copy

    from resfuse.ops import PATHS

    torch.manual_seed(4)
    model = _SavedPreActivations().train()
    twin = copy.deepcopy(model)
    x = torch.randn(2, 3, 6, 5)
    torch._dynamo.reset()
    PATHS.clear()
    compiled = resfuse.compile(model, interpret=True)
    loss = compiled(x).square().sum()
    loss.backward()
    ref = twin(x).square().sum()
    ref.backward()
    assert rel(loss, ref) < 1e-5
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert rel(p.grad, q.grad) < 1e-4, name
    saved = {(f.anchor, tuple(f.ops), f.ran) for f in compiled.resfuse_report.fusions if f.graph == "forward"}
    assert ("conv2d", ("bias", "save", "silu"), "triton") in saved
    assert ("gemm", ("bias", "save", "gelu"), "triton") in saved
    assert PATHS[("conv2d", "silu(aux(add(acc,c0)))", "triton")] == 1


class SqueezeExcite(torch.nn.Module):
    def __init__(self, c: int, squeezed: int):
        super().__init__()
        self.reduce, self.expand = torch.nn.Conv2d(c, squeezed, 1), torch.nn.Conv2d(squeezed, c, 1)

    def forward(self, x):
        s = torch.nn.functional.silu(self.reduce(x.mean((2, 3), keepdim=True)))
        return x * torch.sigmoid(self.expand(s))


def test_squeeze_excitation_convs_of_one_pixel_run_triton_kernels_under_the_interpreter():
    """EfficientNet's and MobileNet's SE convs: channels_last 1x1-pixel outputs, fused with bias and activation."""
    torch.manual_seed(3)
    block = SqueezeExcite(c=20, squeezed=6).eval().to(memory_format=torch.channels_last)
    x = torch.randn(3, 20, 5, 4).to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = resfuse.compile(block, interpret=True)
    with torch.no_grad():
        out, ref = compiled(x), block.double()(x.double())
    assert rel(out, ref) < 1e-5
    report = compiled.resfuse_report
    assert sorted(f.pattern for f in report.fusions) == ["conv2d_bias_sigmoid", "conv2d_bias_silu"]
    assert {f.ran for f in report.fusions} == {"triton"}


def test_shortcut_batch_norm_read_elsewhere_is_not_folded():
    """The shortcut batch norm's output also leaves the block: it must still be computed, so the main path's
    batch norm reads it as before (the fold's sole-consumer rule) and the refusal says why."""
    torch.manual_seed(3)
    block = Block(c=4).train()
    block.bs.bias.data.normal_()

    def forward(x):
        s = block.bs(block.cs(x))
        y = block.b2(block.c2(torch.relu(block.b1(block.c1(x)))))
        return torch.relu(y + s), s * 2

    twin = copy.deepcopy(block)
    x = torch.randn(2, 4, 5, 5)
    torch._dynamo.reset()
    compiled = resfuse.compile(forward, interpret=True)
    out, ref = compiled(x), (torch.relu(twin.b2(twin.c2(torch.relu(twin.b1(twin.c1(x))))) + twin.bs(twin.cs(x))),
                            twin.bs(twin.cs(x)) * 2)
    assert rel(out[0], ref[0]) < 1e-5 and rel(out[1], ref[1]) < 1e-5
    report = compiled.resfuse_report
    assert not any("normalize(" in f.signature for f in report.fusions)
    assert any("shortcut batch norm not folded" in r.reason and "2 consumers" in r.reason for r in report.rejected)
