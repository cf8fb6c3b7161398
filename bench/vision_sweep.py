"""A sweep of torchvision and timm image architectures (small widths or depths, random weights) compiled with resfuse
against eager: which crash, which give wrong numbers, what fused and what fell back. Not a timing. The sibling of
bench/hf_sweep.py, whose helpers it uses, for convolutional nets' blocks: grouped, depthwise and dilated convs,
pre-activation, concatenation, channel shuffle, squeeze-excitation, multi-branch (re-parameterisable) blocks, weight
standardisation, and the hybrids and ViTs.

  TRITON_INTERPRET=1 python bench/vision_sweep.py [--only NAME ...] [--train] [--rejected] [--jobs N]
  python bench/vision_sweep.py --device cuda [--library] [--jobs N] [--timeout 240] [--out DIR] [--only NAME ...]

Run it with a Python that has torchvision and timm (this machine: /tmp/tvenv/bin/python); a model whose package is
missing, or whose name this timm lacks, is skipped, and said so.

On the CPU (the default) each model (CASES) is built at 32-75 px, batch 2, seed 0, every batch norm given random
statistics and affine parameters, then run in fp32 eval under no_grad, eagerly and through
resfuse.compile(model, interpret=True) (our Triton kernels under Triton's interpreter): hf_sweep.check_eval. One
line a model: status, the largest relative error (norm of the difference over the norm of eager's) over the output
tensors and which output it was, the number of fusions and of rejections, the time; under it the report's errors
and notes (what fell back, and why), or for a crash the innermost exception and its last frames (resfuse's first).
With --train, a few models (TRAIN) instead run one training step (model.train(), dropout and drop-path 0), each at
an image size where its gradients are a stable function of its input (TRAIN's comment says why that matters):
outputs and every parameter's gradient against eager's (hf_sweep.check_train). --rejected also lists the passes'
refusals.

With --device cuda each model is built at 128-160 px, batch 2, and run in fp16, channels_last, compiled with
resfuse's defaults (CUDA graphs for inference) but tuning="none", the heuristic configs of our Triton kernels; with
--library, tuning_budget_s=0 and an empty tuning cache instead, so every fused op runs cuDNN/cuBLAS + our epilogue
kernel. The compiled model is called three times (the third replays a CUDA graph), and its first and third outputs
and eager's fp16 output are judged against the model run in fp32 on the GPU (TF32 off), as hf_sweep.check_half
judges against float64: the line gives resfuse's error and eager's on the output where resfuse's is furthest over
max(2 x eager's, 1e-3). --train is CPU only.

--jobs N runs N models at once, each in a process of its own (its own GPU where there are several), so that a crash
or a hang cannot stop the sweep: a model past --timeout seconds is killed. A line a model as each finishes, a table
of all of them last, and every row in OUT/vision_sweep_<device>[_library][_train].json (--out, default $OUT or '.'),
rewritten after each model. Without --jobs the models run one after another in this process (the JSON only with
--out).

Statuses: ok; wrong (fp32: an error above 1e-4; fp16: resfuse's error above max(2 x eager's, 1e-3) on any output);
crash (an exception: compile, first call, or the outputs' names differ; or the model's process died); timeout (its
process killed after --timeout s, --jobs only); skip (the package or the model is missing, or eager itself fails or
gives a non-finite output in fp16).
"""
from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _device() -> str:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", default="cpu")
    return pre.parse_known_args()[0].device


DEVICE = _device()
os.environ.setdefault("TRITON_INTERPRET", "1" if DEVICE == "cpu" else "0")  # before torch and triton are imported

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import resfuse
from bench import hf_sweep
from bench.hf_sweep import FLOOR, WRONG, Skip, crash_lines, said, tensors

B = 2


def timm_model(timm, name, px, **kw):
    """timm's `name` with its dropout 0 (drop_rate: some models read it with F.dropout, out of build's reach; not
    every model takes a drop_path_rate, so build zeroes their DropPath modules instead); a model that only takes its
    own image size (ViTs, MaxViT, CoAtNet) is built for `px`."""
    if not timm.is_model(name):
        raise Skip(f"{name} not in timm {timm.__version__}")
    cfg = timm.get_pretrained_cfg(name)
    if cfg is not None and cfg.fixed_input_size:
        kw.setdefault("img_size", px)
    return timm.create_model(name, pretrained=False, drop_rate=0.0, **kw)


def timm_cases(names, cpu_px: int, cuda_px: int) -> dict:
    """CASES entries of timm models built by name (timm_model), at these image sizes."""
    return {name: ("timm", lambda timm, px, name=name: timm_model(timm, name, px), cpu_px, cuda_px) for name in names}


def tv_resnext(tv, px):
    """ResNeXt-50 32x4d's blocks (grouped 3x3 convs, 32 groups), one a stage."""
    return tv.models.resnet.ResNet(tv.models.resnet.Bottleneck, [1, 1, 1, 1], groups=32, width_per_group=4)


def tv_convnext(tv, px):
    """torchvision's ConvNeXt blocks (permute, LayerNorm, Linear, layer scale), two stages of one block."""
    from torchvision.models.convnext import CNBlockConfig
    return tv.models.convnext.ConvNeXt([CNBlockConfig(32, 64, 1), CNBlockConfig(64, None, 1)],
                                       stochastic_depth_prob=0.0)


# name -> (package, function of the package and the image size giving the model, image px on the CPU, on CUDA).
# Under the interpreter a model's time goes with its channels, not its pixels (a kernel's programs loop over input
# channels and taps): the CPU images are the smallest each net takes, and the widths small where a knob allows.
CASES = {
    # torchvision
    "resnet18": ("torchvision", lambda tv, px: tv.models.resnet18(), 32, 128),
    "resnext-1111": ("torchvision", tv_resnext, 32, 128),
    "densenet-small": ("torchvision", lambda tv, px: tv.models.DenseNet(
        growth_rate=8, block_config=(2, 2), num_init_features=16), 32, 128),
    "squeezenet1_1": ("torchvision", lambda tv, px: tv.models.squeezenet1_1(), 64, 128),
    "shufflenet_v2_x0_5": ("torchvision", lambda tv, px: tv.models.shufflenet_v2_x0_5(), 32, 128),
    "mobilenet_v2-0.25": ("torchvision", lambda tv, px: tv.models.mobilenet_v2(width_mult=0.25), 32, 128),
    "mobilenet_v3_small-0.5": ("torchvision", lambda tv, px: tv.models.mobilenet_v3_small(width_mult=0.5), 32, 128),
    "mnasnet-0.25": ("torchvision", lambda tv, px: tv.models.MNASNet(alpha=0.25), 32, 128),
    "regnet_y_400mf": ("torchvision", lambda tv, px: tv.models.regnet_y_400mf(), 32, 128),
    "convnext-tv": ("torchvision", tv_convnext, 32, 128),
    "swin-tv": ("torchvision", lambda tv, px: tv.models.SwinTransformer(
        patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
        stochastic_depth_prob=0.0), 32, 128),
    "vit-tv": ("torchvision", lambda tv, px: tv.models.VisionTransformer(
        image_size=px, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128), 32, 128),
    "lraspp": ("torchvision", lambda tv, px: tv.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None), 64, 128),  # a dilated MobileNetV3-Large; a dict output
    # timm's test models (a few hundred thousand parameters each)
    **timm_cases((
        "test_byobnet", "test_coatnet", "test_convnext", "test_convnext2", "test_convnext3", "test_efficientnet",
        "test_efficientnet_evos", "test_efficientnet_gn", "test_efficientnet_ln", "test_mambaout", "test_maxvit",
        "test_nfnet", "test_resnet", "test_vit", "test_vit2", "test_vit3", "test_vit4", "test_vit_relpos"), 64, 160),
    # timm blocks the test models lack
    "resnetv2-preact": ("timm", lambda timm, px: timm_model(timm, "resnetv2_50", px, layers=[1, 1, 1, 1]), 32, 128),
    "resnetv2-bit": ("timm", lambda timm, px: timm.models.resnetv2.ResNetV2(layers=[1, 1, 1, 1]), 32, 128),
    **timm_cases(("ghostnet_050", "lcnet_050", "mixnet_s", "repvgg_a0", "ese_vovnet19b_dw", "hgnetv2_b0", "dla46_c",
                  "cs3darknet_s", "starnet_s050"), 32, 128),
    **timm_cases(("edgenext_xx_small", "mobilevit_xxs", "efficientvit_b0"), 64, 128),
}
# --train's models -> their image px. A training step's gradient is a discontinuous, and in small batch norms an
# ill-conditioned, function of the input (a ReLU or max-pool switch flips on a value within rounding of a tie, a
# batch norm normalizes the 2-8 values of a batch of 2 at a stride-32 net's last stage). These models at these sizes
# are stable: an input perturbed by a part in 10^6 (six draws) moved eager's own gradients by at most 3.3e-5. Others
# measured unstable, and fail check_train's 1e-4 against eager on rounding alone: DLA-46-C (2-6e-2 at 128 px),
# RegNetY-400MF (1.7-3.3e-2 at 128 px), ResNetV2-50 pre-activation (to 1.3e-2 at 64 and 128 px), ResNeXt (1e-2),
# RepVGG-A0 (8e-3), MobileNetV2 (7e-2), at 64 px; ShuffleNetV2 at 32 px (to 6e3). A model given with --only that is
# not here trains at its eval size.
TRAIN = {"resnet18": 64, "test_resnet": 64, "squeezenet1_1": 64, "test_efficientnet": 64, "test_convnext2": 64,
         "test_vit": 64, "swin-tv": 32, "test_nfnet": 64}


def package(name):
    """The module CASES[name] is built from, or None where it is not installed."""
    try:
        return importlib.import_module(CASES[name][0])
    except ImportError:
        return None


def build(name, px=None):
    """The model, in fp32 on the CPU, and its keyword inputs: a batch of images (px, else the case's size on this
    device), under the name of its forward's first parameter (hf_sweep's checks call model(**inputs)). Dropout and
    stochastic depth off."""
    _, make, cpu_px, cuda_px = CASES[name]
    px = px or (cpu_px if DEVICE == "cpu" else cuda_px)
    torch.manual_seed(0)
    model = make(package(name), px)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.dropout._DropoutNd) or type(m).__name__ == "StochasticDepth":
                m.p = 0.0  # nn.Dropout, torchvision's stochastic depth
            if type(m).__name__ == "DropPath":  # timm's
                m.drop_prob = 0.0
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) and not m.weight.any():
                m.reset_parameters()  # zero-initialised (torchvision ViT's head): the output would not tell
    hf_sweep.randomise_batch_norms(model)
    first = next(iter(inspect.signature(model.forward).parameters))
    return model, {first: torch.randn(B, 3, px, px)}


def check_cuda(name, library):
    """((resfuse's error, eager's, the output's name, whether resfuse's is over max(2 x eager's, FLOOR["fp16"])),
    report): the model in fp16 channels_last on the GPU, its compiled first and third calls and eager's against the
    model in fp32 (TF32 off), on the output and call where resfuse's error is furthest over that bound."""
    model, inputs = build(name)
    model.eval()
    wide = copy.deepcopy(model).cuda()
    (key, x), = inputs.items()
    exact_in, half_in = {key: x.cuda()}, {key: x.to("cuda", torch.float16, memory_format=torch.channels_last)}
    model.to(device="cuda", dtype=torch.float16, memory_format=torch.channels_last)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.no_grad():
            exact = tensors(wide(**exact_in))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    del wide
    with torch.no_grad():
        ref = hf_sweep.eager_half(model, half_in)
        torch._dynamo.reset()
        with tempfile.TemporaryDirectory() as cache:  # --library: no tuned choice from an earlier run applies
            options = {"tuning_budget_s": 0.0, "cache_dir": cache} if library else {"tuning": "none"}
            compiled = resfuse.compile(model, **options)
            calls = [tensors(compiled(**half_in)) for _ in range(3)]
        torch.cuda.synchronize()
    rows = [r for call in (1, 3) for r in hf_sweep.judge_half(calls[call - 1], ref, exact, FLOOR["fp16"],
                                                              f" (call {call})")]
    return max(rows, key=lambda r: r[0])[1:], compiled.resfuse_report


def check(name, train, rejected, library=False):
    """One model's row: status, errors, where, fusions, rejections, seconds, and what the report or the crash said."""
    row = {"model": name, "device": DEVICE, "train": train, "library": library}
    t0 = time.perf_counter()
    try:
        if package(name) is None:
            raise Skip(f"{CASES[name][0]} not installed")
        if DEVICE == "cuda":
            (err, eager, where, wrong), report = check_cuda(name, library)
        else:
            train_px = TRAIN.get(name) if train else None
            check_cpu = hf_sweep.check_train if train else hf_sweep.check_eval  # on this sweep's models
            (err, where), report = check_cpu(name, build=lambda n: build(n, train_px))
            eager, wrong = None, not err <= WRONG
    except Skip as e:
        return {**row, "status": "skip", "s": time.perf_counter() - t0, "said": [str(e)]}
    except Exception as e:  # noqa: BLE001  one model failing must not stop the sweep
        return {**row, "status": "crash", "s": time.perf_counter() - t0, "said": crash_lines(e)}
    return {**row, "status": "wrong" if wrong else "ok", "err": err, "eager_err": eager, "where": where,
            "fusions": len(report.fusions), "rejections": len(report.rejected), "s": time.perf_counter() - t0,
            "said": said(report, rejected)}


def lines(row):
    """A row as hf_sweep.run prints a model: its line, then what the report or the crash said, indented."""
    eager = "" if row["device"] == "cpu" else f"{row.get('eager_err', float('nan')):9.1e} "
    if row["status"] in ("ok", "wrong"):
        head = (f"{row['model']:22s} {row['status']:7s} {row['err']:9.1e} {eager}{row['fusions']:4d} "
                f"{row['rejections']:4d} {row['s']:6.1f}s  worst: {row['where']}")
        return [head] + [f"{'':22s}   {s}" for s in row["said"]]
    if row["status"] == "skip":
        return [f"{row['model']:22s} skip    {row['s']:.1f}s  {row['said'][0]}"]
    dashes = f"{'-':>9s} " * (1 if row["device"] == "cpu" else 2)
    head = f"{row['model']:22s} {row['status']:7s} {dashes}{'-':>4s} {'-':>4s} {row['s']:6.1f}s  {row['said'][0]}"
    return [head] + [f"{'':22s} {s}" for s in row["said"][1:]]


def header(args):
    wide = args.device == "cuda"
    mode = "train step: output and gradients" if args.train else "eval, no_grad"
    where = ("fp16 channels_last, CUDA, " + ("tuning budget 0: cuDNN/cuBLAS + our epilogue" if args.library
                                             else "tuning none: our heuristic configs")
             + "; errors against fp32") if wide else "fp32, CPU, interpret"
    return (f"{'model':22s} {'status':7s} {'rel err':>9s} {'eager err ' if wide else ''}{'fus':>4s} {'rej':>4s} "
            f"{'time':>7s}  ({mode}; {where})")


def child(name, args, slot, share):
    """CASES[name] checked by this script in a process of its own: its row, from the JSON file it writes; a process
    that died or ran past args.timeout gives a crash or timeout row, with the end of what it printed."""
    with tempfile.TemporaryDirectory() as tmp:
        row_file = Path(tmp, "row.json")
        argv = [sys.executable, __file__, "--only", name, "--device", args.device, "--row-file", str(row_file)]
        argv += ["--train"] * args.train + ["--rejected"] * args.rejected + ["--library"] * args.library
        env = dict(os.environ, OMP_NUM_THREADS=str(share), TORCHINDUCTOR_COMPILE_THREADS=str(share),
                   RESFUSE_COMPILE_WORKERS=str(max(1, share // 2)))
        gpus = args.gpus
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[slot % len(gpus)]
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # its own group: a timeout also ends its compile workers
        try:
            out, _ = proc.communicate(timeout=args.timeout)
            status = "crash"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            status = "timeout"
        if row_file.exists():
            return json.loads(row_file.read_text())
    why = f"its process ran past {args.timeout:.0f} s" if status == "timeout" else \
        f"its process exited with {proc.returncode}"
    return {"model": name, "device": args.device, "train": args.train, "library": args.library, "status": status,
            "s": time.perf_counter() - t0, "said": [why, *[s for s in out.splitlines() if s.strip()][-6:]]}


def rows_path(args, folder) -> Path:
    return Path(folder) / f"vision_sweep_{args.device}{'_library' * args.library}{'_train' * args.train}.json"


def in_processes(names, args):
    """names over args.jobs processes at a time, each printed as it finishes and written to the JSON; the rows in
    names' order."""
    path = rows_path(args, args.out or os.environ.get("OUT", "."))
    path.parent.mkdir(parents=True, exist_ok=True)
    share = max(1, len(os.sched_getaffinity(0)) // args.jobs)
    todo = list(enumerate(names))
    rows = {}
    lock = threading.Lock()

    def lane(slot):
        while True:
            with lock:
                if not todo:
                    return
                index, name = todo.pop(0)
            row = child(name, args, slot, share)
            with lock:
                rows[index] = row
                print("\n".join(lines(row)), flush=True)
                path.write_text(json.dumps([rows[i] for i in sorted(rows)], indent=1))

    threads = [threading.Thread(target=lane, args=(slot,)) for slot in range(args.jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"\n{header(args)}")
    for i in sorted(rows):
        print(lines(rows[i])[0])
    print(f"rows: {path}")
    return [rows[i] for i in sorted(rows)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", metavar="NAME", choices=list(CASES), help="these models only")
    p.add_argument("--train", action="store_true", help=f"one training step instead (default: {', '.join(TRAIN)})")
    p.add_argument("--rejected", action="store_true", help="also list what the passes refused to fuse, and why")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: fp32 under the interpreter; cuda: fp16 channels_last against fp32, tuning none")
    p.add_argument("--library", action="store_true",
                   help="cuda: tuning budget 0 and an empty cache, every fused op cuDNN/cuBLAS + our epilogue kernel")
    p.add_argument("--jobs", type=int, default=0, help="models at once, each in a process of its own (0: all here)")
    p.add_argument("--timeout", type=float, help="with --jobs: seconds a model may take (240 on CUDA, 600 on the CPU)")
    p.add_argument("--out", help="folder for the JSON of every row (default with --jobs: $OUT or '.')")
    p.add_argument("--row-file", help=argparse.SUPPRESS)  # a --jobs child's row goes here
    args = p.parse_args()
    if args.train and args.device != "cpu":
        p.error("--train runs on the CPU only")
    if args.library and args.device != "cuda":
        p.error("--library is for --device cuda")
    args.timeout = args.timeout or (240.0 if args.device == "cuda" else 600.0)
    names = args.only or list(TRAIN if args.train else CASES)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    args.gpus = ([g for g in visible.split(",") if g] if visible else [str(i) for i in range(torch.cuda.device_count())]
                 ) if args.device == "cuda" and args.jobs else []
    t0 = time.perf_counter()
    if args.row_file:
        row = check(names[0], args.train, args.rejected, args.library)
        print("\n".join(lines(row)), flush=True)
        Path(args.row_file).write_text(json.dumps(row))
        return
    print(header(args), flush=True)
    if args.jobs:
        rows = in_processes(names, args)
    else:
        rows = []
        for name in names:
            rows.append(check(name, args.train, args.rejected, args.library))
            print("\n".join(lines(rows[-1])), flush=True)
            torch._dynamo.reset()
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            rows_path(args, args.out).write_text(json.dumps(rows, indent=1))
    counts = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    print(f"\n{', '.join(f'{n} {s}' for s, n in counts.items())}; {time.perf_counter() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
