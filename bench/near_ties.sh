# bench/near_ties.py on ResNet-50 and MobileNetV3-L at bs1 (GPU machine, carrying .whl/ and .devcache/):
# `bash bench/near_ties.sh`. Each model's near-tie choices within 10%, flipped one at a time and timed in the model;
# logs, JSON and each model's combined cache of the flips that gained (near_ties_cache_<model>.tgz) under $OUT.
# About 2-4 min a model on an H100 with a warm tuning cache.
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "H100\|H200" || exit 3
source bench/gpu_env.sh
for m in resnet50 mobilenet_v3_large; do
  timeout 270 python bench/near_ties.py --model $m --within 0.1 --out $OUT > $OUT/near_ties_$m.log 2>&1
  mv -f $OUT/near_ties_cache.tgz $OUT/near_ties_cache_$m.tgz 2>/dev/null
  grep -v "Warning\|warn" $OUT/near_ties_$m.log | tail -22
done
