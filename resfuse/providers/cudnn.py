"""The cudnn provider: one cuDNN frontend graph per fused conv or GEMM, conv_fprop (or conv_dgrad, a training
backward's data gradient, or matmul, a 2-D product in fp16/bf16) followed by the epilogue's pointwise ops, run by
cuDNN's runtime-fusion engines as one kernel where they support it.

Entry points: `refusal(call)`, `candidates(call, level)`, `run(call, out, config)` (used by ops/fused.py). An
optional extra, `pip install resfuse[cudnn]` (the `nvidia-cudnn-frontend` package): without it every call is
refused with that reason. A graph is made once per (shapes, strides, dtypes, epilogue) and is offered only when
cuDNN's `check_support` passes; what cuDNN cannot fuse (or a missing op below) is refused, never run. Its
engine configs, ranked by cuDNN's heuristics, are candidates of their own: the tuner times the first few and
keeps the fastest by name (the choice's config {"engine": name}); each is built on its first run.

For inference, a conv whose epilogue starts with a batch norm is offered with that batch norm folded into its
weight instead (providers/fold_bn.py; the choice's config also holds {"fold_bn": True}): cuDNN then runs conv +
shift + relu at the bare conv's speed.

Training's conv + genstats graph (ops/training.py's conv2d_stats) is in providers/cudnn_stats.py.

The epilogue tree maps onto cuDNN pointwise nodes one to one: add/sub/mul/div, relu (also leaky, and clamp
as a clipped relu), gelu, gelu_tanh, sigmoid, tanh, silu (swish), relu's gradient (relu_backward with the
threshold as its lower clip), and inference batch norm written out as
(x - mean) * rsqrt(var + eps) * weight + bias. Operands are graph tensors with their own strides, broadcast
dims given as 1 (cuDNN's rule); constants are pass-by-value scalars. Intermediates and math are fp32.
"""
from __future__ import annotations

import functools
import math

import torch

from .. import epilogue as epi
from ..tuning.select import Candidate
from .fold_bn import fold_refusal, folded_call, folded_form

UNARY = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_approx_tanh", "sigmoid": "sigmoid", "tanh": "tanh",
         "silu": "swish"}
BINARY = ("add", "sub", "mul", "div")


@functools.lru_cache(maxsize=None)
def _cudnn():
    try:
        import cudnn
    except ImportError:
        return None
    return cudnn


def _unsupported(tree: epi.Node) -> str | None:
    if tree == epi.UP:
        return "a GLU's paired columns (the graph's pointwise nodes map the matmul's columns 1:1)"
    if isinstance(tree, epi.Op) and tree.name == "aux":
        return "an aux output (the graph would need its intermediate as a second output)"
    if isinstance(tree, epi.Op):
        if tree.name not in UNARY and tree.name not in BINARY and tree.name not in ("bn", "leaky_relu", "clamp",
                                                                                   "float32", "threshold_bwd"):
            return f"epilogue op {tree.name} has no cuDNN pointwise form here"
        return next((why for why in map(_unsupported, tree.args) if why), None)
    return None


def _gemm_refusal(call) -> str | None:
    a, b = call.inputs
    if a.dim() != 2 or b.dim() != 2:
        return "a batched product (the graph's matmul is built for [M, K] @ [K, N])"
    if a.dtype not in (torch.float16, torch.bfloat16):
        return f"a {a.dtype} product (fp16/bf16 only: an fp32 matmul's TF32 setting is ATen's, not the graph's)"
    if a.shape[0] * a.shape[1] * b.shape[1] == 0:
        return "an empty product"
    out = call.out
    if list(out.strides) != [math.prod(out.shape[i + 1:]) for i in range(len(out.shape))]:
        return "an output that is not [M, N] in contiguous rows"
    kinds = {o.slot: o.kind for o in epi.operands(epi.parse(call.signature))}
    for slot, t in enumerate(call.operands):
        if _operand3(t, a.shape[0], b.shape[1], kinds[slot]) is None:
            return f"operand {slot} ({kinds[slot]}, {tuple(t.shape)}) is neither a column vector nor an [M, N] view"
    return None


# bench/cudnn_engines.py (H200, cuDNN 9.19, frontend 1.32): for a conv on a 1x1 image (EfficientNet-B0's
# squeeze-excitation, 32x480 > 20 and 32x1152 > 48 channels) 12 of the 13 engine configs wrote nothing.
ONE_PIXEL = "a conv on a 1x1 image (cuDNN's engine configs for it left their output unwritten)"


def refusal(call) -> str | None:
    if call.op not in ("conv2d", "conv2d_dgrad", "gemm"):
        return "cuDNN graphs are built for conv2d forward and data gradient and for 2-D GEMMs only"
    if call.op == "gemm":
        why = _gemm_refusal(call)
        if why:
            return why
    elif (call.inputs[0].shape[1] if call.op == "conv2d" else call.out.shape[1]) != call.inputs[1].shape[1]:
        return "grouped convolution (the graph's conv is built for groups=1)"
    elif call.op == "conv2d" and tuple(call.inputs[0].shape[2:]) == (1, 1):
        return ONE_PIXEL
    if call.out.device.type != "cuda":
        return f"cuDNN needs a CUDA device, not {call.out.device}"
    if _cudnn() is None:
        return "nvidia-cudnn-frontend is not installed (pip install resfuse[cudnn])"
    return _unsupported(epi.parse(call.signature))


def _operand4(t: torch.Tensor, out_shape, kind: str) -> torch.Tensor:
    """The operand as a 4-D tensor broadcastable to the conv output (a 1-D per-channel vector lies on dim 1)."""
    if kind == "c" and t.dim() == 1:
        return t.view(1, -1, 1, 1)
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t


def _operand3(t: torch.Tensor, m: int, n: int, kind: str) -> torch.Tensor | None:
    """A GEMM's operand as a 3-D view broadcastable to the [1, M, N] product: a column vector as [1, 1, N], a full
    operand as [1, M, N]; None where it is neither (or its strides do not merge into that view)."""
    shape = {"c": (1, 1, n), "full": (1, m, n)}.get(kind)
    if shape is None or t.numel() != math.prod(shape) or (kind == "c" and t.shape[-1] != n):
        return None
    try:
        return t.view(shape)
    except RuntimeError:
        return None


def _planned(g):
    """The graph validated, with its ranked plan list (heuristics A, then the fallback list) and no plan built;
    raises where cuDNN has no engine for it (check_support)."""
    cudnn = _cudnn()
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    return g


def _build(g) -> tuple:
    """(the graph, its workspace bytes), built with the first plan of its ranked list that builds."""
    _planned(g).build_plans()
    return g, g.get_workspace_size()


class Plan:
    """A cuDNN graph for one problem, its ranked engine configs (built on first use), and how to bind a call's
    tensors to it. A GEMM's tensors are 3-D ([1, M, K] @ [1, K, N] -> [1, M, N], cuDNN's matmul), a conv's 4-D."""

    def __init__(self, call):
        cudnn = _cudnn()
        types = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16,
                 torch.float32: cudnn.data_type.FLOAT}
        io = types[call.inputs[0].dtype]
        self.handle = cudnn.create_handle()
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)
        self.gemm = call.op == "gemm"
        self.rank = 3 if self.gemm else 4
        # x: the image, the data gradient's grad_out, or the product's A; w: the filter, or the product's B
        x, w = (t.unsqueeze(0) if self.gemm else t for t in call.inputs)
        self.x = g.tensor(dim=list(x.shape), stride=list(x.stride()), data_type=io, name="x")
        self.w = g.tensor(dim=list(w.shape), stride=list(w.stride()), data_type=io, name="w")
        f32 = cudnn.data_type.FLOAT
        if self.gemm:
            acc = g.matmul(A=self.x, B=self.w, compute_data_type=f32, name="matmul")
        else:
            stride, padding, dilation = call.params
            conv = {"padding": list(padding), "stride": list(stride), "dilation": list(dilation),
                    "compute_data_type": f32}
            if call.op == "conv2d":
                acc = g.conv_fprop(image=self.x, weight=self.w, name="conv", **conv)
            else:  # the input's shape is not implied by grad_out's (stride > 1): it is the output's
                acc = g.conv_dgrad(loss=self.x, filter=self.w, name="dgrad", **conv)
                acc.set_dim(list(call.out.shape)).set_stride(list(call.out.strides))
        tree = epi.parse(call.signature)
        self.kinds = {o.slot: o.kind for o in epi.operands(tree)}
        self.operands = {}  # slot -> graph tensor, for the operands the tree reads
        for slot in self.kinds:
            tn = self._operand(call, slot)
            self.operands[slot] = g.tensor(dim=list(tn.shape), stride=list(tn.stride()),
                                           data_type=types[call.operands[slot].dtype], name=f"op{slot}")
        self.scalars, self.host_scalars = {}, {}
        y = self._emit(g, tree, acc)
        y.set_output(True).set_data_type(types[call.out.dtype])
        if self.gemm:
            m, n = call.inputs[0].shape[0], call.inputs[1].shape[1]
            y.set_dim([1, m, n]).set_stride([m * n, n, 1])
        else:
            y.set_dim(list(call.out.shape)).set_stride(list(call.out.strides))
        self.y = y
        self.graph = _planned(g)
        self.engines = [g.get_plan_name_at_index(i) for i in range(g.get_execution_plan_count())]
        self.built = {}  # engine config name (None: the ranked list's first) -> (its index, workspace bytes)
        self.stream = None  # the raw CUDA stream the handle was last set to

    def _operand(self, call, slot: int) -> torch.Tensor:
        t = call.operands[slot]
        if self.gemm:
            return _operand3(t, call.inputs[0].shape[0], call.inputs[1].shape[1], self.kinds[slot])
        return _operand4(t, call.out.shape, self.kinds[slot])

    def _scalar(self, g, value: float):
        t = self.scalars.get(value)
        if t is None:  # a pass-by-value scalar, bound to a host tensor at execute
            ones = [1] * self.rank
            t = self.scalars[value] = g.tensor(dim=ones, stride=ones, is_pass_by_value=True,
                                               data_type=_cudnn().data_type.FLOAT, name=f"k{len(self.scalars)}")
            self.host_scalars[value] = torch.full(ones, float(value), dtype=torch.float32)
        return t

    def _emit(self, g, node, acc):
        if node == epi.ACC:
            return acc
        if isinstance(node, epi.Operand):
            return self.operands[node.slot]
        if isinstance(node, epi.Const):
            return self._scalar(g, node.value)
        args = [self._emit(g, a, acc) for a in node.args]
        if node.name in BINARY:
            return getattr(g, node.name)(a=args[0], b=args[1])
        if node.name == "bn":  # (x - mean) * rsqrt(var + eps) * weight + bias
            x, mean, var, weight, bias = args
            inv = g.rsqrt(input=g.add(a=var, b=self._scalar(g, node.params[0])))
            return g.add(a=g.mul(a=g.mul(a=g.sub(a=x, b=mean), b=inv), b=weight), b=bias)
        if node.name == "leaky_relu":
            return g.relu(input=args[0], negative_slope=node.params[0])
        if node.name == "clamp":
            lo, hi = node.params
            return g.relu(input=args[0], lower_clip=lo, upper_clip=None if hi == float("inf") else hi)
        if node.name == "float32":  # the output tensor's data type says it
            return args[0]
        if node.name == "threshold_bwd":  # relu's gradient: the incoming gradient where y > threshold, else 0
            return g.relu_backward(loss=args[0], input=args[1], lower_clip=node.params[0])
        if node.name == "silu":
            return g.swish(input=args[0], swish_beta=1.0)
        return getattr(g, UNARY[node.name])(input=args[0])

    def run(self, call, out: torch.Tensor, engine: str | None = None) -> torch.Tensor:
        """The graph on `call` into `out`, with the named engine config (built on first use), or the ranked list's
        first where `engine` is None or not in the list (a tuning cache entry of another cuDNN version)."""
        built = self.built.get(engine)
        if built is None:
            index = self.engines.index(engine) if engine in self.engines else 0
            self.graph.build_plan_at_index(index)
            built = self.built[engine] = (index, self.graph.get_workspace_size_plan_at_index(index))
        index, workspace_bytes = built
        follow_stream(self, out.device)
        binding = {self.x: call.inputs[0], self.w: call.inputs[1], self.y: out}
        for slot, tensor in self.operands.items():
            binding[tensor] = self._operand(call, slot)
        for value, tensor in self.scalars.items():
            binding[tensor] = self.host_scalars[value]
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=out.device) if workspace_bytes else None
        self.graph.execute_plan_at_index(binding, workspace, index=index, handle=self.handle)
        return out


def follow_stream(plan, device: torch.device) -> None:
    """Set `plan.handle`'s stream to the current one, where it changed since `plan.stream` (the handle is the plan's
    alone, so its stream changes only here); cuDNN runs the graph on it."""
    stream = torch._C._cuda_getCurrentRawStream(device.index)  # Inductor's own call: no Stream object
    if stream != plan.stream:
        _cudnn().set_stream(plan.handle, stream)
        plan.stream = stream


_PLANS: dict = {}


def _plan(call, fold: bool = False) -> Plan:
    from ..tuning.choose import fast_key

    k = (fast_key(call), fold)
    if k not in _PLANS:
        ran = folded_call(call) if fold else call
        if ran is None:
            raise ValueError("the batch norm folded into the weight overflows the weight's dtype")
        _PLANS[k] = Plan(ran)
    return _PLANS[k]


def run(call, out: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """The graph on `call` into `out`, with the engine config that `config` names (the tuner's choice). With
    config["fold_bn"], the graph of its batch norm folded into the conv's weight, or while that fold overflows
    the weight's dtype (after an update of the parameters), the unfused ATen path."""
    config = config or {}
    if not config.get("fold_bn"):
        return _plan(call).run(call, out, config.get("engine"))
    folded = folded_call(call)
    if folded is None:
        from . import aten
        return aten.run(call, out)
    return _plan(call, True).run(folded, out, config.get("engine"))


ENGINES = {"none": 1, "fast": 3, "max": None}  # how many of cuDNN's ranked engine configs a level times


def candidates(call, level: str) -> list[Candidate]:
    """One candidate per engine config that the level times (bench/cudnn_plans.py on an H100, 24 ResNet-50
    layers and 4 BERT GEMMs: the ranked list's first was the fastest on 5; the best of its first 3 summed to
    1716 us over the 24 layers other than the stem, the best of all 1697, the first alone 1883; each engine
    config took 0.2-0.8 s to build).
    Where the batch norm can be folded, only the folded graph: the written-out one runs the same conv with more
    epilogue math. Each engine config is built on its first run, inside the tuner's budget."""
    from ..tuning.choose import fast_key

    for fold in (True, False) if fold_refusal(call) is None else (False,):
        try:
            plan = _plan(call, fold)
            break
        except Exception as e:  # no engine for this graph (check_support), or the fold overflows: refused
            _PLANS.pop((fast_key(call), fold), None)
            print(f"resfuse: cudnn provider refused {call.signature}{' folded' if fold else ''} on "
                  f"{tuple(call.out.shape)}: {type(e).__name__}: {str(e)[:160]}")
    else:
        return []
    scratch = call.out.empty()  # never the live output (OneFlow #9452)
    name = "cudnn+fold_bn" if fold else "cudnn"
    found = []
    for engine in plan.engines[:ENGINES[level]]:
        config = {"fold_bn": True, "engine": engine} if fold else {"engine": engine}
        found.append(Candidate("cudnn", f"{name}:{engine}", config,
                               lambda config=config: run(call, scratch, config)))
    return found


def build_spec(call, level: str) -> dict | None:
    """What a compile worker needs to build the engine configs that `candidates` offers for `call`
    (tuning/precompile.py): the call's shapes, strides and dtypes (no data), whether its batch norm is folded, how
    many engine configs the level times, the device. None where the provider refuses the call or the level times
    every engine config (their number is known only from the graph)."""
    if refusal(call) is not None or ENGINES[level] is None:
        return None

    def layout(t):
        return tuple(t.shape), tuple(t.stride()), t.dtype

    return {"kind": "cudnn", "op": call.op, "inputs": [layout(t) for t in call.inputs],
            "operands": [layout(t) for t in call.operands], "signature": call.signature, "params": call.params,
            "out": call.out, "fold": fold_refusal(call) is None, "engines": ENGINES[level],
            "device": call.out.device.index}


def build_engine(spec: dict) -> bool:
    """In a compile worker: build engine config spec["index"] of the graph `candidates` would make from the spec
    (folded where the fold is offered and cuDNN supports it), on meta tensors. Its runtime-compiled kernel lands in
    the CUDA driver's JIT cache on disk, where the tuning process's own build of the same graph finds it. False
    where there is no such engine config."""
    from ..tuning.choose import Call

    if spec["device"] is not None:  # a tensor's device always has its index; a bare "cuda" is the current one
        torch.cuda.set_device(spec["device"])

    def meta(layout):
        return torch.empty_strided(layout[0], layout[1], dtype=layout[2], device="meta")

    call = Call(spec["op"], tuple(map(meta, spec["inputs"])), [*map(meta, spec["operands"])], spec["signature"],
                spec["params"], spec["out"])
    for fold in (True, False) if spec["fold"] else (False,):
        try:
            plan = Plan(folded_form(call) if fold else call)
            break
        except Exception:  # noqa: BLE001  not supported folded: candidates() offers the written-out graph then
            continue
    else:
        return False
    if spec["index"] >= len(plan.engines):
        return False
    plan.graph.build_plan_at_index(spec["index"])
    return True
