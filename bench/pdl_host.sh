# Does programmatic dependent launch cost the host at batch 1? On the GPU machine, carrying .whl/ and .devcache/:
# `bash bench/pdl_host.sh`. graph.replay()'s host us per node of each launch kind, PDL on and off
# (bench/graph_launch.py); then ResNet-50 and MobileNetV3-L bs1 with CUDA graphs, PDL on and off alternated beside
# reduce-overhead, each with its latency, host time a call and (profiled) GPU busy time (bench/ab.py). BENCHMARKS.md,
# forty-fourth session. Logs and JSON under $OUT.
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "H100\|H200" || exit 3
source bench/gpu_env.sh
timeout 120 python bench/graph_launch.py --out $OUT > $OUT/graph_launch.log 2>&1
tail -14 $OUT/graph_launch.log
timeout 420 python bench/ab.py --jobs resnet50:1,mobilenet_v3_large:1 --profile --out $OUT \
  --peers "rf+graphs,rf+graphs pdl=False,reduce-overhead,rf+graphs,rf+graphs pdl=False" > $OUT/ab_pdl.log 2>&1
tail -16 $OUT/ab_pdl.log
bash bench/save_cache.sh
