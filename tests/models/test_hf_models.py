"""Real third-party models (HF transformers, random weights) compiled with resfuse against eager, on CPU."""
import pytest
import torch
import transformers

import resfuse

pytestmark = pytest.mark.slow


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def compile_and_compare(model, *inputs, **config):
    torch._dynamo.reset()
    compiled = resfuse.compile(model, **config)
    with torch.no_grad():
        out, ref = compiled(*inputs), model(*inputs)
    out, ref = (out.logits, ref.logits) if hasattr(out, "logits") else (out.last_hidden_state, ref.last_hidden_state)
    return compiled.resfuse_report, rel(out, ref)


def test_resnet50_fuses_every_conv_bn_and_residual():
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(transformers.ResNetConfig()).eval()
    report, err = compile_and_compare(model, torch.randn(2, 3, 64, 64))
    assert err <= 1e-4
    convs = [f for f in report.fusions if f.anchor == "conv2d"]
    assert len(convs) == 53 and all(f.ops[0] == "bn" for f in convs)
    tails = [f for f in convs if f.ops == ["bn", "add", "relu"]]
    assert len(tails) == 16
    # the add goes into the last conv of each bottleneck (the 1x1 expansion), never into the shortcut
    assert all(f.shapes["inputs"][1][2:] == (1, 1) and f.shapes["inputs"][1][0] == 4 * f.shapes["inputs"][1][1]
               for f in tails)
    assert report.rejected == [] and {f.ran for f in report.fusions} == {"reference"}


def test_bert_base_fuses_biases_gelu_and_residual_adds():
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig()).eval()
    report, err = compile_and_compare(model, torch.randint(0, 1000, (2, 12)))
    assert err <= 1e-4
    gemms = [f for f in report.fusions if f.anchor == "gemm"]
    # every linear, q, k and v merged into one, plus the pooler
    assert len(gemms) == 12 * 4 + 1 and all(f.ops[0] == "bias" for f in gemms)
    assert sum("3 linears on" in r and "of 2304 outputs" in r for r in report.rewrites) == 12
    assert sum(f.ops == ["bias", "gelu"] for f in gemms) == 12
    assert sum(f.ops == ["bias", "add"] for f in gemms) == 24  # attention output and FFN output projections
    assert all("embedding" in r.reason for r in report.rejected)


def test_convnext_tiny_fuses_pointwise_chains_and_depthwise_convs():
    torch.manual_seed(0)
    model = transformers.ConvNextModel(transformers.ConvNextConfig()).eval()
    report, err = compile_and_compare(model, torch.randn(1, 3, 64, 64))
    assert err <= 1e-4
    assert sum(f.ops == ["bias", "gelu"] for f in report.fusions) == 18  # every block's MLP up-projection
    # the down-projection with layer scale and the block's residual add, which comes after the permute back to
    # NCHW (sink_permutes moves both above it); every shortcut is NHWC in memory like the GEMM (a permuted GEMM
    # output, or a conv over one)
    assert sum(f.ops == ["bias", "mul", "add"] for f in report.fusions) == 18
    assert report.rewrites == ["inference graph: 18 elementwise op(s) moved above a permute"]
    # every block's depthwise 7x7 conv absorbs its bias (cuDNN runs the conv, our epilogue kernel the bias)
    depthwise = [f for f in report.fusions if f.anchor == "conv2d" and f.shapes["inputs"][1][1] == 1]
    assert len(depthwise) == 18 and all(f.ops == ["bias"] for f in depthwise)


def test_small_resnet_fp16_runs_our_kernels_and_sums_each_shortcut_conv():
    """An HF ResNet of four one-block stages in fp16 channels_last, our kernels under the interpreter: each stage's
    downsampling block computes its shortcut conv inside its last conv (the sum form, both batch norms folded), and
    the logits match float64 eager."""
    torch.manual_seed(0)
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1])
    model = transformers.ResNetForImageClassification(config).eval()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):  # statistics a trained net could have, not the identity
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    model = model.half().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 64, 64).half().contiguous(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = resfuse.compile(model, interpret=True)
    with torch.no_grad():
        out = compiled(x).logits
        ref = model.double()(x.double()).logits
    assert rel(out.double(), ref) < 5e-3
    shortcuts = [f for f in compiled.resfuse_report.fusions if f.anchor == "conv2d_shortcut"]
    assert len(shortcuts) == 4 and {f.ran for f in shortcuts} == {"triton"}


def test_efficientnet_whose_convs_pad_valid_fuses():
    """HF's EfficientNet writes its pointwise and stride-2 depthwise convs with padding="valid", which ATen traces
    to one value for both dims; the passes once failed on it and ran the whole graph unfused. Its convs are
    re-drawn at He scale and its batch norms calibrated: HF's initialisation collapses the activations to 0."""
    from resfuse.bench.models import calibrate

    torch.manual_seed(0)
    config = transformers.EfficientNetConfig(image_size=64, width_coefficient=1.0, depth_coefficient=1.0,
                                             hidden_dim=1280)  # B0's sizes
    model = transformers.EfficientNetModel(config)
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(m.weight)
    calibrate(model, [torch.randn(4, 3, 64, 64) for _ in range(2)])
    model.eval()
    report, err = compile_and_compare(model, torch.randn(1, 3, 64, 64))
    assert report.errors == [] and err <= 1e-4
    convs = [f for f in report.fusions if f.anchor == "conv2d"]
    assert len(convs) == sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())  # every conv
    # each batch norm into its conv; the squeeze-excitation convs take their bias
    assert sum(f.ops[0] == "bn" for f in convs) == sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert all(f.ops[0] in ("bn", "bias") for f in convs)


def test_gpt2_fuses_its_written_out_gelu_into_the_mlp():
    """GPT-2 writes its activation (gelu_new) as eight elementwise ops; each MLP's up-projection fuses it."""
    torch.manual_seed(0)
    model = transformers.GPT2Model(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500)).eval()
    report, err = compile_and_compare(model, torch.randint(0, 500, (2, 12)))
    assert report.errors == [] and err <= 1e-4
    assert report.rewrites == ["inference graph: 2 gelu_new written out in elementwise ops, replaced by one op each"]
    up = [f for f in report.fusions if f.anchor == "gemm" and f.shapes["out"][-1] == 4 * 64]
    assert len(up) == 2 and all(f.ops == ["bias", "gelu"] for f in up)


def test_clip_vision_fuses_its_quick_gelu_into_the_mlp():
    """CLIP's QuickGELU, x * sigmoid(1.702 x), becomes silu(1.702 x) / 1.702: a chain each MLP's up-projection
    takes into its epilogue."""
    torch.manual_seed(0)
    config = transformers.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=32, patch_size=8)
    model = transformers.CLIPVisionModel(config).eval()
    report, err = compile_and_compare(model, torch.randn(2, 3, 32, 32))
    assert report.errors == [] and err <= 1e-4
    assert "inference graph: 2 quick_gelu written out in elementwise ops, replaced by one op each" in report.rewrites
    up = [f for f in report.fusions if f.anchor == "gemm" and f.shapes["out"][-1] == 128]
    assert len(up) == 2 and all(f.ops == ["bias", "mul", "silu", "div"] for f in up)


def test_t5_encoder_absorbs_residual_adds_behind_eval_dropout():
    """T5 adds each sublayer's output projection to the residual through an eval-mode dropout, a clone of the
    linear's view in the graph; the GEMM absorbs the add through both."""
    torch.manual_seed(0)
    config = transformers.T5Config(num_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16, vocab_size=500)
    model = transformers.T5EncoderModel(config).eval()
    report, err = compile_and_compare(model, torch.randint(0, 500, (2, 12)))
    assert report.errors == [] and err <= 1e-4
    # per layer: the attention's output projection and the FFN's down projection, neither with a bias
    assert sum(f.anchor == "gemm" and f.ops == ["add"] for f in report.fusions) == 4
    assert not any("clone" in r.reason for r in report.rejected)


SMALL = dict(vocab_size=500, hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
GATED = {  # model -> (its gated MLP's activation as the report labels it, the model)
    "llama": ("silu", lambda: transformers.LlamaModel(transformers.LlamaConfig(**SMALL))),
    "mistral": ("silu", lambda: transformers.MistralModel(transformers.MistralConfig(**SMALL))),
    "qwen2": ("silu", lambda: transformers.Qwen2Model(transformers.Qwen2Config(**SMALL))),
    "gemma": ("gelu", lambda: transformers.GemmaModel(transformers.GemmaConfig(**SMALL, head_dim=16))),
    "phi3": ("silu", lambda: transformers.Phi3Model(transformers.Phi3Config(**SMALL, pad_token_id=0))),  # one GEMM
    "t5-gated": ("gelu", lambda: transformers.T5EncoderModel(transformers.T5Config(  # gelu_new, written out
        vocab_size=500, d_model=64, d_ff=88, num_layers=2, num_heads=4, d_kv=16, feed_forward_proj="gated-gelu"))),
}


@pytest.mark.parametrize("name", GATED)
def test_a_gated_mlp_runs_as_one_gemm(name):
    """With fuse_glu: every layer's act(gate) * up is one GEMM of twice the output's columns, whether the model
    writes two projections (merge_linears joins them) or one it chunks (Phi-3)."""
    act, make = GATED[name]
    torch.manual_seed(0)
    report, err = compile_and_compare(make().eval(), torch.randint(0, 500, (2, 9)), fuse_glu=True)
    assert err <= 1e-4 and report.errors == []
    glus = [f for f in report.fusions if f.ops == [act, "mul"]]
    assert len(glus) == 2 and all(f.shapes["inputs"][1] == (64, 176) and f.shapes["out"] == (2, 9, 88) for f in glus)


FLAT_RESIDUALS = {  # models whose residual add runs on the tokens flattened to [B*S, H], then viewed back
    "opt": lambda: transformers.OPTModel(transformers.OPTConfig(
        vocab_size=500, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=64)),
    "qwen2-moe": lambda: transformers.Qwen2MoeModel(transformers.Qwen2MoeConfig(  # the shared expert's gate too
        **SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)),
}


@pytest.mark.parametrize("name", FLAT_RESIDUALS)
def test_a_residual_added_to_flattened_tokens_fuses_and_runs(name):
    """Both crashed at their first call at batch 2 (found by bench/hf_sweep.py): the GEMM absorbed the [B*S, H]
    residual add, then took the view back to [B, S, H] as its shape, which the residual does not broadcast to."""
    torch.manual_seed(0)
    report, err = compile_and_compare(FLAT_RESIDUALS[name]().eval(), torch.randint(0, 500, (2, 9)))
    assert err <= 1e-4 and report.errors == []
    assert any(f.anchor == "gemm" and "add" in f.ops for f in report.fusions)
