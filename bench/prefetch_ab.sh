# The weight prefetch (Config.prefetch_weights) off and on, alternated in one process per model, on the GPU
# machine: `bash bench/prefetch_ab.sh` (BENCHMARKS.md, forty-second session). Logs under $OUT.
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "H100\|H200" || exit 3
source bench/gpu_env.sh
P="rf+graphs prefetch_weights=False,rf+graphs,rf+graphs prefetch_weights=False,rf+graphs"
for job in resnet50:1 resnet50:32 hf-bert-base:32; do
  timeout 200 python bench/ab.py --jobs $job --peers "$P" --out $OUT/${job/:/_} > $OUT/prefetch_ab_${job/:/_}.log 2>&1
  tail -1 $OUT/prefetch_ab_${job/:/_}.log
done
bash bench/save_cache.sh
