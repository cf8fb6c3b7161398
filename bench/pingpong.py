"""GPU probe: a ping-pong GEMM in Gluon (Triton's low-level dialect), CUTLASS's Hopper schedule, on the GEMMs whose
epilogue our Triton kernels cannot hide (BERT's FFN1 + GELU, ConvNeXt's pointwise layers).

Entry point: `python bench/pingpong.py [--cases SUBSTR] [--configs I,J] [--ours I,IpP] [--bare] [--out DIR]`, on a
Hopper GPU with triton >= 3.6. Not a product kernel: Gluon has no interpreter, so this cannot run in CI (the house
rule). bench/pingpong_model.py patches it into a whole model.

The kernel is persistent, one program an SM, in three warp-specialised partitions:
- a producer warp issues the TMA loads of A and W tiles into a ring of `STAGES` shared-memory slots, tile after
  tile of the program's list, each slot guarded by a `ready` and an `empty` mbarrier;
- two consumer warpgroups take alternate tiles of that list. Each runs its tile's wgmma mainloop, then its
  epilogue (the bias, then GELU, or the residual, or the residual and relu; fp16; a bulk TMA store). The
  mainloops alternate strictly (the `turn` mbarriers), so one consumer's mainloop runs while the other's epilogue
  does: the epilogue leaves the tensor cores' critical path. This is what Triton's own warp specialisation did
  not give (BENCHMARKS.md, eighth and twenty-fifth sessions).
For each case (bench/persistent.py's GEMMs, and ResNet-50's 1x1 tails) it times (CUDA-graph replays, median,
bench/kernels.py's timer) every ping-pong config (with --bare also with the bias alone), resfuse's Triton GEMM at
the --ours configs of bench/persistent.py's list with both output stores, the unfused eager chain and the GEMM
alone on cuBLAS, checks every result against fp32, and writes DIR/pingpong.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse.kernels.activations import gelu_erf  # noqa: E402

EPI_GELU, EPI_RESIDUAL, EPI_RESIDUAL_RELU = 1, 2, 3
# ResNet-50's 1x1 tail convs at bs256 as GEMMs over NHWC rows, the batch norm folded into the weight and a shift:
# (name, M, N, K, signature), as bench/persistent.py's GEMMS
RESNET_TAILS = [(f"rn50 {name} 1x1 {k}>{n} +res relu", 256 * hw * hw, n, k, "relu(add(add(acc,c0),full1))")
                for name, hw, k, n in [("l1", 56, 64, 256), ("l2", 28, 128, 512), ("l3", 14, 256, 1024),
                                       ("l4", 7, 512, 2048)]]


@gluon.jit
def _tile(t, num_m, num_n, GROUP_M: gl.constexpr):
    """Tile t's (row block, column block), grouped along M as every resfuse GEMM orders them (L2 reuse of W)."""
    per_group = GROUP_M * num_n
    first_m = (t // per_group) * GROUP_M
    rows = gl.minimum(num_m - first_m, GROUP_M)
    return first_m + (t % per_group) % rows, (t % per_group) // rows


@gluon.jit
def _producer(a_desc, w_desc, a_bufs, w_bufs, ready, empty, M, N, K,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    num_m, num_n = gl.cdiv(M, BM), gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    it = 0
    for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pm, pn = _tile(t, num_m, num_n, GROUP_M)
        for kk in range(k_steps):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # a fresh barrier counts as released
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [pm * BM, kk * BK], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [pn * BN, kk * BK], ready.index(s), w_bufs.index(s))
            it += 1


@gluon.jit
def _consumer(cid: gl.constexpr, a_bufs, w_bufs, ready, empty, turn, c_smem, c_desc, bias_ptr, res_ptr, M, N, K,
              EPI: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """Consumer `cid` runs tiles cid, cid + 2, ... of the program's list. The mainloops alternate strictly: a
    consumer starts waiting on the ring only once the other has waited on every slot of its previous tile
    (`turn[cid]`, arrived by the other consumer). Without that, a consumer could wait on a slot whose previous
    fill is still pending, and an mbarrier's parity wait cannot tell those two fills apart."""
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    num_m, num_n = gl.cdiv(M, BM), gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    pid, programs = gl.program_id(0), gl.num_programs(0)
    local = cid  # the tile's position in this program's list, which the producer fills in order
    for t in range(pid + cid * programs, num_m * num_n, 2 * programs):
        pm, pn = _tile(t, num_m, num_n, GROUP_M)
        it = local * k_steps
        mbarrier.wait(turn.index(cid), ((local // 2) - 1 + cid) & 1)  # consumer 0's first tile: a fresh barrier
        acc = gl.zeros([BM, BN], gl.float32, layout)
        for kk in range(k_steps):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])  # the previous step's wgmma is done: release its slot
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=kk > 0)
            it += 1
        mbarrier.arrive(turn.index(1 - cid))  # the other consumer may wait on the ring now
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))

        cols = pn * BN + gl.arange(0, BN, gl.SliceLayout(0, layout))
        y = acc + gl.expand_dims(gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32), 0)
        if EPI == 1:
            y = gelu_erf(y)  # resfuse's @triton.jit GELU, called from Gluon: elementwise, no layouts
        if EPI >= 2:
            rows = pm * BM + gl.arange(0, BM, gl.SliceLayout(1, layout))
            offs = gl.expand_dims(rows, 1) * N + gl.expand_dims(cols, 0)
            mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
            y = y + gl.load(res_ptr + offs, mask=mask, other=0.0).to(gl.float32)
        if EPI == 3:
            y = gl.maximum(y, 0.0)
        tma.store_wait(0)  # the previous tile's bulk store has read c_smem
        c_smem.store(y.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [pm * BM, pn * BN], c_smem)
        local += 2
    tma.store_wait(0)


@gluon.jit
def _consumer_first(a_bufs, w_bufs, ready, empty, turn, c0, c_desc, bias_ptr, res_ptr, M, N, K,
                    EPI: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    _consumer(0, a_bufs, w_bufs, ready, empty, turn, c0, c_desc, bias_ptr, res_ptr, M, N, K, EPI, GROUP_M, STAGES)


@gluon.jit
def _consumer_second(a_desc, w_desc, a_bufs, w_bufs, ready, empty, turn, c1, c_desc, bias_ptr, res_ptr, M, N, K,
                     EPI: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    _consumer(1, a_bufs, w_bufs, ready, empty, turn, c1, c_desc, bias_ptr, res_ptr, M, N, K, EPI, GROUP_M, STAGES)


@gluon.jit
def _producer_worker(a_desc, w_desc, a_bufs, w_bufs, ready, empty, turn, c1, c_desc, bias_ptr, res_ptr, M, N, K,
                     EPI: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    _producer(a_desc, w_desc, a_bufs, w_bufs, ready, empty, M, N, K, GROUP_M, STAGES)


@gluon.jit
def pingpong_kernel(a_desc, w_desc, c_desc, bias_ptr, res_ptr, M, N, K, EPI: gl.constexpr,
                    GROUP_M: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    c0 = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    c1 = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    worker_args = (a_desc, w_desc, a_bufs, w_bufs, ready, empty, turn, c1, c_desc, bias_ptr, res_ptr, M, N, K,
                   EPI, GROUP_M, STAGES)
    gl.warp_specialize([
        (_consumer_first, (a_bufs, w_bufs, ready, empty, turn, c0, c_desc, bias_ptr, res_ptr, M, N, K,
                           EPI, GROUP_M, STAGES)),
        (_consumer_second, worker_args),
        (_producer_worker, worker_args),
    ], [4, 1], [CONSUMER_REGS, 24])


# (block_m, block_n, block_k, stages, group_m, consumer registers)
CONFIGS = [(128, 128, 64, 4, 8, 232), (128, 128, 64, 3, 8, 232), (128, 128, 64, 5, 8, 232),
           (128, 128, 32, 6, 8, 232), (128, 64, 64, 6, 8, 232), (128, 128, 64, 4, 16, 232),
           (64, 256, 64, 4, 8, 232), (64, 256, 64, 3, 8, 232)]


def launcher(a, wt, bias, res, out, epi: int, cfg, sms: int):
    """A callable that runs out = epilogue(a @ wt.T) with one config (a [M, K], wt nn.Linear's [N, K])."""
    bm, bn, bk, stages, group_m, regs = cfg
    f16 = gl.float16
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], f16))
    w_desc = TensorDescriptor.from_tensor(wt, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], f16))
    c_desc = TensorDescriptor.from_tensor(out, [bm, bn], gl.NVMMASharedLayout.get_default_for([bm, bn], f16))
    m, k = a.shape
    n = wt.shape[0]
    grid = (min(sms, triton.cdiv(m, bm) * triton.cdiv(n, bn)),)
    res_arg = res if res is not None else out

    def run():
        pingpong_kernel[grid](a_desc, w_desc, c_desc, bias, res_arg, m, n, k, epi, group_m, stages, regs,
                              num_warps=4, maxnreg=168)
    return run


def main(argv=None) -> None:
    import kernels as kb  # bench/kernels.py: the timer, the error and the ceilings
    import persistent  # bench/persistent.py: the GEMM cases and resfuse's Triton configs
    from resfuse import kernels
    from resfuse.kernels.matmul import GemmConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="", help="substring filter on bench/persistent.py's GEMM case names")
    p.add_argument("--configs", default="", help="comma list of CONFIGS indices (default: all)")
    p.add_argument("--ours", default="0,1", help="comma list of persistent.TILES indices for resfuse's kernel, "
                   "each with pP for P programs an SM (persistent)")
    p.add_argument("--bare", action="store_true", help="also time each ping-pong config with the bias alone")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    picks = [CONFIGS[int(i)] for i in args.configs.split(",")] if args.configs else CONFIGS
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    peak, bw = kb.measure_ceilings()
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}; ceilings: mm {peak / 1e12:.0f} TFLOP/s, "
          f"copy {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for case in [g for g in persistent.GEMMS + RESNET_TAILS if args.cases in g[0]]:
        name, m, n, k, sig = case
        t = persistent.gemm_tensors(case)
        _, _, ours, out3, ref, eager, alone, nbytes, flops = persistent.gemm_case(case, t)
        epi = EPI_GELU if "gelu" in sig else EPI_RESIDUAL_RELU if sig.startswith("relu") else EPI_RESIDUAL
        out = t["out"]
        row = {"case": name, "m": m, "n": n, "k": k, "sig": sig, "pingpong": {}, "bare": {}, "resfuse": {}}
        bare_ref = (t["a"].float() @ t["wt"].t().float() + t["bias"].float()).unsqueeze(0)
        for cfg in picks:
            for mode, code, expect in [("pingpong", epi, ref)] + ([("bare", 0, bare_ref)] if args.bare else []):
                try:
                    run = launcher(t["a"], t["wt"], t["bias"], t["res"] if code >= EPI_RESIDUAL else None, out,
                                   code, cfg, sms)
                    out.fill_(float("nan"))
                    run()
                    torch.cuda.synchronize()
                    err = kb.rel_err(out3, expect)
                    us = kb.bench(run)
                except Exception as e:  # noqa: BLE001  a config that fails is reported, not fatal to the sweep
                    print(f"  {name}: {mode} {cfg} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
                    continue
                row[mode][str(cfg)] = {"us": us, "err": err}
                print(f"  {name}: {mode} {cfg} {us:.1f} us, err {err:.1e}", flush=True)
        for pick in [o for o in args.ours.split(",") if o]:
            i, _, programs = pick.partition("p")
            bm, bn, bk, nw, ns = persistent.TILES[int(i)]
            cfg = GemmConfig(block_m=bm, block_n=bn, block_k=bk, group_m=8, split_k=1, num_warps=nw, num_stages=ns,
                             tma=True, persistent=int(programs or 0))
            for store in (False, True):
                kernels.set_options(tma_store=store)
                out.fill_(float("nan"))
                ours(cfg)
                err = kb.rel_err(out3, ref)
                us = kb.bench(lambda: ours(cfg))
                row["resfuse"][f"{cfg} tma_store={store}"] = {"us": us, "err": err}
                print(f"  {name}: resfuse {cfg} tma_store={store} {us:.1f} us, err {err:.1e}", flush=True)
        kernels.set_options(tma_store=True)
        row.update(eager_us=kb.bench(eager), alone_us=kb.bench(alone),
                   floor_us=max(flops / peak, nbytes / bw) * 1e6)
        rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pingpong.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": rows}, f, indent=1)
    print(f"\n{'case':32} {'pingpong':>9} {'bare':>7} {'resfuse':>9} {'cuBLAS':>9} {'eager':>9} {'floor':>8} "
          f"{'pp err':>8}  best ping-pong config")
    for r in rows:
        pp = min(r["pingpong"].items(), key=lambda kv: kv[1]["us"], default=(None, {"us": float("nan"), "err": 0}))
        rf = min((v["us"] for v in r["resfuse"].values()), default=float("nan"))
        bare = min((v["us"] for v in r["bare"].values()), default=float("nan"))
        print(f"{r['case'][:32]:32} {pp[1]['us']:9.1f} {bare:7.1f} {rf:9.1f} {r['alone_us']:9.1f} {r['eager_us']:9.1f} "
              f"{r['floor_us']:8.1f} {pp[1]['err']:8.1e}  {pp[0]}")


if __name__ == "__main__":
    main()
