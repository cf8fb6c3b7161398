"""The tuning space per level: what the triton provider offers for a GEMM, TMA mainloop variants included."""
import dataclasses

import torch

from resfuse.ops.fused import Output
from resfuse.tuning import space
from resfuse.tuning.choose import Call


def gemm_call(a, b):
    return Call("gemm", (a, b), [], "acc", ([a.shape[0], b.shape[1]],),
                Output.of([a.shape[0], b.shape[1]], a.dtype, a.device))


def test_fast_level_offers_tma_variants_only_where_descriptors_can_read():
    aligned = gemm_call(torch.randn(100, 64).half(), torch.randn(96, 64).half().t())  # a linear layer's weight.T
    everything = space.configs(aligned, "fast")
    offered = [c for c in everything if not c.swap]  # 100 rows: the swapped configs too, on pointers
    assert [c for c in everything if c.swap] and not any(c.tma for c in everything if c.swap)
    # the fast tiles run on the TMA mainloop; only the heuristic default keeps its pointer twin
    assert [c.tma for c in offered].count(False) == 1 and not offered[0].tma and sum(c.tma for c in offered) >= 2
    assert sum(c.tma for c in offered) == len(offered) - 1
    persistent = [c for c in offered if c.persistent]
    assert persistent and all(c.tma and c.split_k == 1 and c.persistent == 2 for c in persistent)
    misaligned = gemm_call(torch.randn(100, 60).half(), torch.randn(60, 90).half())  # 120-byte rows
    assert not any(c.tma for c in space.configs(misaligned, "fast"))
    assert space.configs(aligned, "none") == [space.configs(aligned, "fast")[0]] and not space.configs(aligned, "none")[0].tma


def test_max_level_drops_tma_points_for_batched_products():
    a, b = torch.randn(2, 64, 64).half(), torch.randn(2, 64, 64).half()
    call = Call("gemm", (a, b), [], "acc", ([2, 64, 64],), Output.of([2, 64, 64], a.dtype, a.device))
    found = space.configs(call, "max")
    assert found and not any(c.tma for c in found)


def test_stride_1_channels_last_convs_get_tma_variants_and_the_others_do_not():
    def conv_call(x, w, padding, stride=1):
        oh = (x.shape[2] + 2 * padding[0] - w.shape[2]) // stride + 1
        out = Output.of([x.shape[0], w.shape[0], oh, oh], x.dtype, x.device, torch.channels_last)
        return Call("conv2d", (x, w), [], "acc", ([stride, stride], padding, [1, 1]), out)

    cl = torch.channels_last
    x = torch.randn(2, 64, 7, 7).half().contiguous(memory_format=cl)
    one = conv_call(x, torch.randn(256, 64, 1, 1).half(), [0, 0])  # a GEMM
    w3 = torch.randn(64, 64, 3, 3).half().contiguous(memory_format=cl)
    for call in (one, conv_call(x, w3, [1, 1])):  # the GEMM, and the 3x3 conv on its box mainloop
        offered = space.configs(call, "fast")
        assert [c.tma for c in offered].count(False) == 1 and len(offered) >= 3
        # persistent twins only where the conv is a plain GEMM (the persistent kernel is the GEMM's)
        assert any(c.persistent for c in offered) == (call is one)
    assert not any(c.tma for c in space.configs(conv_call(x, w3, [1, 1], stride=2), "fast"))
    assert not any(c.tma for c in space.configs(conv_call(x.contiguous(), w3, [1, 1]), "fast"))


def test_few_rows_of_one_sample_get_swapped_configs_and_the_others_do_not(monkeypatch):
    """A 1x1 conv of one image of at most SWAP_ROWS pixels, or a 2-D product of that many rows, is also offered
    swapped, in SWAP_TILES, split by the heuristic's rule (an H100's 132 SMs) and unsplit, all on pointers; two
    images, more pixels, a 3x3 conv or a batched product are not (`none` never is)."""
    monkeypatch.setattr(space, "sm_count", lambda device: 132)
    def conv_call(x, w, padding=(0, 0)):
        oh = x.shape[2] + 2 * padding[0] - w.shape[2] + 1
        out = Output.of([x.shape[0], w.shape[0], oh, oh], x.dtype, x.device, torch.channels_last)
        return Call("conv2d", (x, w), [], "acc", ([1, 1], list(padding), [1, 1]), out)

    def image(n, c, hw):
        return torch.randn(n, c, hw, hw).half().contiguous(memory_format=torch.channels_last)

    w1 = torch.randn(512, 2048, 1, 1).half()
    bs1 = conv_call(image(1, 2048, 7), w1)  # ResNet-50's layer 4 reduce at batch 1
    swapped = [c for c in space.configs(bs1, "fast") if c.swap]
    assert sorted((c.block_m, c.block_n, c.split_k) for c in swapped) == [(64, 16, 1), (64, 16, 4), (64, 32, 1),
                                                                          (64, 32, 8)]
    assert all(not (c.tma or c.persistent or c.tma_store) for c in swapped)
    assert not any(c.swap for c in space.configs(bs1, "none"))
    for other in (conv_call(image(2, 2048, 7), w1), conv_call(image(1, 2048, 17), w1),
                  conv_call(image(1, 64, 7), torch.randn(64, 64, 3, 3).half().contiguous(
                      memory_format=torch.channels_last), (1, 1))):
        assert not any(c.swap for c in space.configs(other, "fast"))
    assert any(c.swap for c in space.configs(gemm_call(torch.randn(49, 256).half(), torch.randn(256, 64).half()),
                                             "fast"))
    batched = Call("gemm", (torch.randn(2, 8, 64).half(), torch.randn(64, 64).half()), [], "acc", ([2, 8, 64],),
                   Output.of([2, 8, 64], torch.half, torch.device("cpu")))
    assert not any(c.swap for c in space.configs(batched, "fast"))


def test_1x1_dgrads_get_tma_and_persistent_variants_and_the_others_do_not():
    def dgrad_call(grad_out, w, stride, padding, hw):
        out = Output.of([grad_out.shape[0], w.shape[1], *hw], grad_out.dtype, grad_out.device, torch.channels_last)
        return Call("conv2d_dgrad", (grad_out, w), [], "acc", ([stride, stride], padding, [1, 1]), out)

    cl = torch.channels_last
    g = torch.randn(2, 64, 7, 7).half().contiguous(memory_format=cl)
    one = space.configs(dgrad_call(g, torch.randn(64, 256, 1, 1).half(), 1, [0, 0], (7, 7)), "fast")
    assert [c.tma for c in one].count(False) == 1 and any(c.persistent for c in one)
    assert all(c.split_k == 1 for c in one if c.persistent)
    w3 = torch.randn(64, 64, 3, 3).half().contiguous(memory_format=cl)
    for call in (dgrad_call(g, w3, 1, [1, 1], (7, 7)),  # 3x3: the implicit-GEMM mainloop only
                 dgrad_call(g, torch.randn(64, 256, 1, 1).half(), 2, [0, 0], (13, 13)),  # the strided downsample
                 dgrad_call(g.contiguous(), torch.randn(64, 256, 1, 1).half(), 1, [0, 0], (7, 7))):  # NCHW grad_out
        assert not any(c.tma or c.persistent for c in space.configs(call, "fast"))


def test_bulk_store_twins_only_for_unsplit_tma_gemms_into_fp16_or_bf16():
    """space.bulk_store_twin: the TMA GEMM configs' twin that writes the output by bulk stores; none for pointer or
    split configs, fp32 outputs, convs that are not plain GEMMs, or with the option off."""
    from resfuse import kernels
    aligned = gemm_call(torch.randn(100, 64).half(), torch.randn(96, 64).half().t())
    offered = space.configs(aligned, "fast")
    twins = {c: space.bulk_store_twin(aligned, c) for c in offered}
    assert all((t is not None) == (c.tma and c.split_k == 1) for c, t in twins.items())
    assert all(t.tma_store and t == c.__class__(**{**c.__dict__, "tma_store": True}) for c, t in twins.items() if t)
    assert not any(c.tma_store for c in offered)  # the fast level's own configs store per thread
    fp32 = gemm_call(torch.randn(100, 64), torch.randn(96, 64).t())
    assert not any(space.bulk_store_twin(fp32, c) for c in space.configs(fp32, "fast"))
    cl = torch.channels_last
    x = torch.randn(2, 64, 7, 7).half().contiguous(memory_format=cl)
    w3 = torch.randn(64, 64, 3, 3).half().contiguous(memory_format=cl)
    out = Output.of([2, 64, 7, 7], x.dtype, x.device, cl)
    box = Call("conv2d", (x, w3), [], "acc", ([1, 1], [1, 1], [1, 1]), out)  # the 3x3 box mainloop: no [M, N] rows
    assert not any(space.bulk_store_twin(box, c) for c in space.configs(box, "fast"))
    from resfuse.kernels.conv2d_fprop import ConvConfig, ConvProblem
    bulk = ConvConfig(tma=True, tma_store=True)
    assert bulk.check(ConvProblem(2, 64, 64, 1, 1, 7, 7, 2, 132))
    assert not bulk.check(ConvProblem(2, 64, 64, 3, 3, 7, 7, 2, 132))  # the box mainloop writes no [M, N] rows
    one = Call("conv2d", (x, torch.randn(256, 64, 1, 1).half()), [], "acc", ([1, 1], [0, 0], [1, 1]),
               Output.of([2, 256, 7, 7], x.dtype, x.device, cl))  # a 1x1 conv: the GEMM, its twins
    assert any(space.bulk_store_twin(one, c) for c in space.configs(one, "fast"))
    kernels.set_options(tma_store=False)
    try:
        assert not any(space.bulk_store_twin(aligned, c) for c in offered)
    finally:
        kernels.set_options(tma_store=True)


def test_a_fused_conv_over_an_image_gets_the_image_conv_as_a_candidate():
    def conv_call(x, w, signature="relu(add(acc,c0))", layout=torch.channels_last):
        oh = (x.shape[2] + 2 - w.shape[2]) // 2 + 1
        out = Output.of([x.shape[0], w.shape[0], oh, oh], x.dtype, x.device, layout)
        return Call("conv2d", (x, w), [torch.randn(w.shape[0]).half()], signature, ([2, 2], [1, 1], [1, 1]), out)

    cl = torch.channels_last
    image = torch.randn(2, 3, 16, 16).half().contiguous(memory_format=cl)
    stem = conv_call(image, torch.randn(32, 3, 3, 3).half())
    for level in ("fast", "max"):
        assert [c for c in space.configs(stem, level) if c.image] == [
            dataclasses.replace(space.configs(stem, "none")[0], image=True)]
    assert not any(c.image for c in space.configs(stem, "none"))
    wide = torch.randn(32, 3, 3, 9).half()  # 9 taps: past the kernel's 8
    others = [conv_call(torch.randn(2, 8, 16, 16).half().contiguous(memory_format=cl), torch.randn(32, 8, 3, 3).half()),
              conv_call(image, torch.randn(32, 3, 3, 3).half(), layout=torch.contiguous_format),
              conv_call(image, torch.randn(32, 3, 3, 3).half(), "aux(relu(add(acc,c0)))")]
    for call in others:
        assert not any(c.image for c in space.configs(call, "fast")), call
    assert space.image_refusal(others[1]) == "an output that is not dense channels_last"
    assert "second output" in space.image_refusal(others[2])
    assert "8 wide" in conv2d_image_refusal(image, wide)


def conv2d_image_refusal(x, w):
    from resfuse.kernels import conv2d_image
    return conv2d_image.refusal(x, w, (2, 2), (1, 1), (1, 1), 1)


def test_a_conv_whose_tiles_under_fill_the_gpu_gets_32_row_tiles_split_for_their_own_count(monkeypatch):
    from resfuse.kernels.conv2d_fprop import ConvConfig

    monkeypatch.setattr(space, "sm_count", lambda device: 132)  # an H100's SMs, on CPU tensors

    def conv(n, c, k, side, r):
        cl = torch.channels_last
        x = torch.randn(n, c, side, side).half().contiguous(memory_format=cl)
        w = torch.randn(k, c, r, r).half().contiguous(memory_format=cl)
        out = Output.of([n, k, side, side], x.dtype, x.device, cl)
        return Call("conv2d", (x, w), [], "acc", ([1, 1], [r // 2] * 2, [1, 1]), out)

    def few_rows(call):
        return [c for c in space.configs(call, "fast") if (c.block_m, c.block_n) == (32, 64)]

    # ResNet-50 at batch 1: layer 4's 3x3 conv (16 tiles, 72 blocks of 64 channels: split 8), layer 3's (28 tiles,
    # 36 blocks: split 4, the cap of 132 // 28), layer 4's 1x1 2048 > 512 (a GEMM: on the TMA mainloop)
    assert few_rows(conv(1, 512, 512, 7, 3)) == [ConvConfig(32, 64, 64, 8, 8, False, 4, 3)]
    assert few_rows(conv(1, 256, 256, 14, 3)) == [ConvConfig(32, 64, 64, 8, 4, False, 4, 3)]
    assert few_rows(conv(1, 2048, 512, 7, 1)) == [ConvConfig(32, 64, 64, 8, 8, False, 4, 3, tma=True)]
    assert few_rows(conv(32, 64, 64, 56, 3)) == []  # layer 1 at batch 32: 784 default tiles fill the GPU
