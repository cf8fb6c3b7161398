"""A sweep of Hugging Face transformers architectures (tiny configs, random weights) compiled with resfuse on the CPU
against eager: which crash, which give wrong numbers, what fused and what fell back. Not a timing.

  TRITON_INTERPRET=1 python bench/hf_sweep.py [--only NAME ...] [--train] [--rejected] [--dtype fp32|fp16|bf16]

Each model (CASES) is built tiny (hidden 16-64, 1-2 layers a stage, vocab 500, images 32-64 px, batch 2, seq 12,
seed 0, batch norms given random statistics; text models get an attention mask padding one sequence), then run in
fp32 eval under no_grad, eagerly and through resfuse.compile(model, interpret=True) (our Triton kernels under
Triton's interpreter). One line a model: status (ok / wrong / crash), the largest relative error (norm of the
difference over the norm of eager's) over the output tensors and which output it was, the number of fusions and of
rejections, the time; under it the report's errors and notes (what fell back, and why), or for a crash the
innermost exception and its last frames (resfuse's first). "wrong" is an error above 1e-4. With --train, a few
models (TRAIN) instead run one training step (model.train(), dropout 0): outputs and every parameter's gradient
against eager's (check_train). --rejected also lists the passes' refusals. Models missing from the installed
transformers are skipped, and said so.

With --dtype fp16 or bf16 (eval only) the model and its floating inputs are cast to that dtype, and both eager and
resfuse are judged against a float64 reference (a copy of the model in float64, floating inputs in float64, integer
inputs as they are; fp32 where an op has no float64 kernel, MoE's grouped_mm), check_half: the line gives resfuse's
error and eager's, on the output where resfuse's is furthest over its bound, and "wrong" is resfuse's error above
max(2 x eager's, FLOOR[dtype]) on any output. A model whose eager run raises in that dtype on the CPU (an op without
a Half kernel), or gives a non-finite output, is skipped, with eager's reason. Under the interpreter a bf16 store
truncates fp32 toward zero (a GPU rounds to nearest even), which puts resfuse's bf16 error up to 3x eager's over a
deep model (BEiT, RegNet, PoolFormer: 'wrong' here, within 1.07x of eager's with the cast rounding to nearest): read
bf16 results with that in mind.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import math
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before torch and triton are imported

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import resfuse

WRONG = 1e-4
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FLOOR = {"fp16": 1e-3, "bf16": 8e-3}  # with --dtype: an error below this is never "wrong"
GRAD_FLOOR = 1e-3
B, SEQ, VOCAB = 2, 12, 500
LM = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "max_position_embeddings": 64, "use_cache": False}
VIT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
       "image_size": 32, "patch_size": 8}
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def image(size=32):
    return {"pixel_values": torch.randn(B, 3, size, size)}


def ids(**more):
    """Token ids (none a pad or special id: RoBERTa's positions count pads) and an attention mask that pads the
    second sequence's last 4 tokens."""
    mask = torch.ones(B, SEQ, dtype=torch.long)
    mask[1, -4:] = 0
    return {"input_ids": torch.randint(3, VOCAB, (B, SEQ)), "attention_mask": mask, **more}


# name -> (model class name, function of the class giving (model, its keyword inputs))
CASES = {
    "vit": ("ViTModel", lambda c: (c(transformers.ViTConfig(**VIT, **NO_DROPOUT)), image())),
    "deit": ("DeiTModel", lambda c: (c(transformers.DeiTConfig(**VIT, **NO_DROPOUT)), image())),
    "swin": ("SwinModel", lambda c: (c(transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4, mlp_ratio=2.0,
        drop_path_rate=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)), image())),
    "beit": ("BeitModel", lambda c: (c(transformers.BeitConfig(
        **VIT, **NO_DROPOUT, use_relative_position_bias=True, use_mean_pooling=True,
        drop_path_rate=0.0)), image())),  # its default, 0.1, drops residual branches at random in training
    "dinov2": ("Dinov2Model", lambda c: (c(transformers.Dinov2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, image_size=32, patch_size=8,
        **NO_DROPOUT)), image())),
    "mobilevit": ("MobileViTModel", lambda c: (c(transformers.MobileViTConfig(
        image_size=64, hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 16, 24, 32, 40, 48, 64], num_attention_heads=2,
        expand_ratio=2.0, hidden_dropout_prob=0.0)), image(64))),
    "mobilenetv2": ("MobileNetV2Model", lambda c: (c(transformers.MobileNetV2Config(
        image_size=64, depth_multiplier=0.25, min_depth=8, expand_ratio=2.0)), image(64))),
    "regnet": ("RegNetModel", lambda c: (c(transformers.RegNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8)), image())),
    "convnextv2": ("ConvNextV2Model", lambda c: (c(transformers.ConvNextV2Config(
        num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)), image())),
    "segformer": ("SegformerModel", lambda c: (c(transformers.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3],
        strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], drop_path_rate=0.0)), image())),
    "poolformer": ("PoolFormerModel", lambda c: (c(transformers.PoolFormerConfig(
        num_encoder_blocks=2, depths=[1, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
        padding=[2, 1], mlp_ratio=2.0, drop_path_rate=0.0)), image())),
    "levit": ("LevitModel", lambda c: (c(transformers.LevitConfig(
        image_size=64, hidden_sizes=[32, 48, 64], num_attention_heads=[2, 3, 4], depths=[1, 1, 1],
        key_dim=[8, 8, 8], mlp_ratio=[2, 2, 2], attention_ratio=[2, 2, 2])), image(64))),
    "distilbert": ("DistilBertModel", lambda c: (c(transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=64, hidden_dim=128, n_layers=2, n_heads=4, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0)), ids())),
    "roberta": ("RobertaModel", lambda c: (c(transformers.RobertaConfig(
        **{**LM, "max_position_embeddings": 66}, **NO_DROPOUT)), ids())),
    "albert": ("AlbertModel", lambda c: (c(transformers.AlbertConfig(
        **LM, embedding_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)), ids())),
    "electra": ("ElectraModel", lambda c: (c(transformers.ElectraConfig(**LM, embedding_size=32, **NO_DROPOUT)),
                                          ids())),
    "deberta-v2": ("DebertaV2Model", lambda c: (c(transformers.DebertaV2Config(
        **LM, **NO_DROPOUT, relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=16,
        max_relative_positions=32)), ids())),
    "mpnet": ("MPNetModel", lambda c: (c(transformers.MPNetConfig(**LM, **NO_DROPOUT)), ids())),
    "bart": ("BartModel", lambda c: (c(transformers.BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False)),
        ids(decoder_input_ids=torch.randint(3, VOCAB, (B, SEQ))))),
    "whisper-encoder": ("WhisperEncoder", lambda c: (c(transformers.WhisperConfig(
        d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128, num_mel_bins=16,
        max_source_positions=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)),
        {"input_features": torch.randn(B, 16, 32)})),
    "wav2vec2": ("Wav2Vec2Model", lambda c: (c(transformers.Wav2Vec2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, conv_dim=(32, 32),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        hidden_dropout=0.0, activation_dropout=0.0, attention_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0)),
        {"input_values": torch.randn(B, 400)})),
    "gpt-neox": ("GPTNeoXModel", lambda c: (c(transformers.GPTNeoXConfig(**LM)), ids())),
    "falcon": ("FalconModel", lambda c: (c(transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
        use_cache=False)), ids())),
    "opt": ("OPTModel", lambda c: (c(transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0, layerdrop=0.0,
        use_cache=False)), ids())),
    "bloom": ("BloomModel", lambda c: (c(transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, use_cache=False)), ids())),
    "mixtral": ("MixtralModel", lambda c: (c(transformers.MixtralConfig(
        **LM, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)), ids())),
    "qwen2-moe": ("Qwen2MoeModel", lambda c: (c(transformers.Qwen2MoeConfig(
        **LM, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64)), ids())),
    "stablelm": ("StableLmModel", lambda c: (c(transformers.StableLmConfig(**LM, num_key_value_heads=2)), ids())),
    "gemma2": ("Gemma2Model", lambda c: (c(transformers.Gemma2Config(
        **LM, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8)), ids())),
    "phi": ("PhiModel", lambda c: (c(transformers.PhiConfig(**LM, partial_rotary_factor=0.5)), ids())),
    "gpt-j": ("GPTJModel", lambda c: (c(transformers.GPTJConfig(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64, use_cache=False)), ids())),
    "codegen": ("CodeGenModel", lambda c: (c(transformers.CodeGenConfig(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64, n_ctx=64,
        use_cache=False)), ids())),
}
ENCODERS = {"WhisperEncoder": "whisper"}  # classes found in their modeling module, not at the top level
TRAIN = ["vit", "distilbert", "mobilenetv2", "regnet", "opt"]


def model_class(name):
    cls_name = CASES[name][0]
    if cls_name in ENCODERS:
        try:
            module = importlib.import_module("transformers.models.{0}.modeling_{0}".format(ENCODERS[cls_name]))
        except ImportError:
            return None
        return getattr(module, cls_name, None)
    return getattr(transformers, cls_name, None)


def build(name):
    torch.manual_seed(0)
    model, inputs = CASES[name][1](model_class(name))
    randomise_batch_norms(model)
    return model, inputs


@torch.no_grad()
def randomise_batch_norms(model):
    """Statistics and affine parameters a trained net could have: the identity would hide a wrong fold."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            if m.affine:
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)


def tensors(out, prefix="out"):
    """(name, tensor) for every floating tensor in a model's output (ModelOutput, tuple or tensor)."""
    if isinstance(out, torch.Tensor):
        return [(prefix, out)] if out.is_floating_point() else []
    if isinstance(out, dict):  # ModelOutput is an OrderedDict of its set fields
        return [t for k, v in out.items() for t in tensors(v, k)]
    if isinstance(out, (tuple, list)):
        return [t for i, v in enumerate(out) for t in tensors(v, f"{prefix}[{i}]")]
    return []  # caches and other objects


def rel(a, b):
    a, b = a.double(), b.double()
    d = (a - b).norm().item()
    n = b.norm().item()
    return d / n if n > 0 else d


def worst(pairs):
    """(largest relative error, its name) over (name, ours, eager's)."""
    errs = [(rel(a, b) if a.shape == b.shape else float("inf"), k) for k, a, b in pairs]
    return max(errs, default=(0.0, "-"))


def said(report, rejected: bool):
    """The report's errors and notes (what fell back, and why), and with `rejected` the distinct reasons of its
    rejections, counted; shortened."""
    out = [f"error: {e[:200]}" for e in report.errors] + [f"note: {n[:200]}" for n in report.notes]
    if rejected:
        reasons = {}
        for r in report.rejected:
            reasons[r.reason[:100]] = reasons.get(r.reason[:100], 0) + 1
        out += [f"rejected x{n}: {r}" for r, n in sorted(reasons.items(), key=lambda x: -x[1])]
    return out


def crash_lines(e):
    """The innermost exception of e's chain, and its last frames (resfuse's first, then the very last)."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if "/resfuse/" in f.filename][-5:]
    tail = [f for f in frames[-1:] if f not in ours]
    msg = " ".join(str(e).split())[:300]
    return [f"{type(e).__name__}: {msg}"] + [f"  {f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                                             for f in ours + tail]


def check_eval(name, build=build):
    model, inputs = build(name)
    model.eval()
    torch._dynamo.reset()
    compiled = resfuse.compile(model, interpret=True)
    with torch.no_grad():
        ref = model(**inputs)
        out = compiled(**inputs)
    ours, refs = tensors(out), tensors(ref)
    if [k for k, _ in ours] != [k for k, _ in refs]:
        raise AssertionError(f"outputs differ: {[k for k, _ in ours]} vs {[k for k, _ in refs]}")
    return worst([(k, a, b) for (k, a), (_, b) in zip(ours, refs)]), compiled.resfuse_report


class Skip(Exception):
    """Eager itself cannot run the model in the dtype asked for: not resfuse's failure."""


def cast(inputs, dtype):
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def check_half(name, dtype):
    """check_eval in fp16 or bf16: ((resfuse's error, eager's, the output's name, whether resfuse's is over
    max(2 x eager's, FLOOR[dtype])), report), both errors against the model in float64, on the output where resfuse's
    error is furthest over that bound. Raises Skip where eager raises or gives a non-finite output."""
    model, inputs = build(name)
    model.eval()
    wide = copy.deepcopy(model)
    with torch.no_grad():
        try:
            exact = tensors(wide.double()(**cast(inputs, torch.float64)))
        except RuntimeError:  # an op without a float64 kernel (MoE's grouped_mm): fp32's error is far below fp16's
            exact = tensors(wide.float()(**inputs))
    model.to(DTYPES[dtype])
    with torch.no_grad():
        inputs = cast(inputs, DTYPES[dtype])
        ref = eager_half(model, inputs)
        torch._dynamo.reset()
        compiled = resfuse.compile(model, interpret=True)
        ours = tensors(compiled(**inputs))
    return max(judge_half(ours, ref, exact, FLOOR[dtype]), key=lambda r: r[0])[1:], compiled.resfuse_report


def eager_half(model, inputs):
    """Eager's output tensors in half precision; Skip where eager raises or gives a non-finite output."""
    try:
        ref = tensors(model(**inputs))
    except Exception as e:
        raise Skip(f"eager: {crash_lines(e)[0][:150]}") from e
    bad = [k for k, t in ref if not t.isfinite().all()]
    if bad:
        raise Skip(f"eager: non-finite {bad[0]}")
    return ref


def judge_half(ours, ref, exact, floor: float, label: str = "") -> list:
    """(how far over its bound, resfuse's error, eager's, the output's name + label, whether over) for each output:
    both errors against `exact`, the bound max(2 x eager's, floor)."""
    if not [k for k, _ in ours] == [k for k, _ in ref] == [k for k, _ in exact]:
        raise AssertionError(f"outputs differ: {[k for k, _ in ours]} vs {[k for k, _ in ref]}")
    rows = []
    for (k, a), (_, b), (_, x) in zip(ours, ref, exact):
        err = rel(a, x) if a.shape == x.shape else float("inf")
        eager = rel(b, x)
        bound = max(2 * eager, floor)
        rows.append((err / bound if not math.isnan(err) else float("inf"), err, eager, k + label, not err <= bound))
    return rows


def check_train(name, build=build):
    """One training step: a fixed random weighting of every output tensor summed and backpropagated (a plain mean
    of a LayerNorm's output has a zero gradient), every parameter's gradient against eager's. A gradient that is
    zero in exact arithmetic (a key bias under softmax, a batch norm's shift before a training batch norm) is
    rounding noise in both, so each parameter's error is over max(its gradient's norm, GRAD_FLOOR times the largest
    one's); a parameter without a gradient counts as zeros (a compiled graph gives zeros where eager gives None)."""
    model, inputs = build(name)
    model.train()
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = resfuse.compile(model, interpret=True)
    ref, out = tensors(eager(**inputs)), tensors(compiled(**inputs))
    rng = torch.Generator().manual_seed(1)
    weights = [torch.randn(t.shape, generator=rng) / t.numel() for _, t in ref]
    sum((t.float() * w).sum() for (_, t), w in zip(ref, weights)).backward()
    sum((t.float() * w).sum() for (_, t), w in zip(out, weights)).backward()
    err, where = worst([(k, a.detach(), b.detach()) for (k, a), (_, b) in zip(out, ref)])
    params = dict(eager.named_parameters())
    grads = [(k, *(torch.zeros_like(q) if q.grad is None else q.grad for q in (p, params[k])))
             for k, p in model.named_parameters() if p.grad is not None or params[k].grad is not None]
    floor = GRAD_FLOOR * max((r.norm().item() for _, _, r in grads), default=0.0)
    errs = [((g - r).norm().item() / max(r.norm().item(), floor, 1e-30), k) for k, g, r in grads]
    return max([(err, where), *errs]), compiled.resfuse_report


def run(name, train, rejected, dtype="fp32"):
    t0 = time.perf_counter()
    try:
        if dtype != "fp32":
            (err, eager, where, wrong), report = check_half(name, dtype)
        else:
            (err, where), report = (check_train if train else check_eval)(name)
            eager, wrong = None, not err <= WRONG
    except Skip as e:
        print(f"{name:16s} skip   {time.perf_counter() - t0:.1f}s  {e}", flush=True)
        return "skip"
    except Exception as e:  # noqa: BLE001  one model failing must not stop the sweep
        lines = crash_lines(e)
        dashes = f"{'-':>9s} " * (1 if dtype == "fp32" else 2)
        print(f"{name:16s} crash  {dashes}{'-':>4s} {'-':>4s} {time.perf_counter() - t0:6.1f}s  {lines[0]}",
              flush=True)
        for line in lines[1:]:
            print(f"{'':16s} {line}", flush=True)
        return "crash"
    status = "wrong" if wrong else "ok"
    print(f"{name:16s} {status:6s} {err:9.1e} {'' if eager is None else f'{eager:9.1e} '}"
          f"{len(report.fusions):4d} {len(report.rejected):4d} "
          f"{time.perf_counter() - t0:6.1f}s  worst: {where}", flush=True)
    for line in said(report, rejected):
        print(f"{'':16s}   {line}", flush=True)
    return status


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", metavar="NAME", choices=list(CASES), help="these models only")
    p.add_argument("--train", action="store_true", help=f"one training step instead ({', '.join(TRAIN)})")
    p.add_argument("--rejected", action="store_true", help="also list what the passes refused to fuse, and why")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                   help="fp16/bf16: the model and inputs in that dtype, eager and resfuse against float64 (eval only)")
    args = p.parse_args()
    if args.train and args.dtype != "fp32":
        p.error("--train runs in fp32 only")
    names = args.only or (TRAIN if args.train else list(CASES))
    t0 = time.perf_counter()
    wide = args.dtype != "fp32"
    print(f"{'model':16s} {'status':6s} {'rel err':>9s} {'eager err ' if wide else ''}{'fus':>4s} {'rej':>4s} "
          f"{'time':>7s}  "
          f"({'train step: output and gradients' if args.train else 'eval, no_grad'}; {args.dtype}, CPU, interpret"
          f"{'; errors against float64' if wide else ''})")
    counts = {}
    for name in names:
        if model_class(name) is None:
            print(f"{name:16s} skip   {CASES[name][0]} not in transformers {transformers.__version__}", flush=True)
            counts["skip"] = counts.get("skip", 0) + 1
            continue
        status = run(name, args.train, args.rejected, args.dtype)
        counts[status] = counts.get(status, 0) + 1
        torch._dynamo.reset()
    print(f"\n{', '.join(f'{n} {s}' for s, n in counts.items())}; {time.perf_counter() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
