# A call on a machine of 4 GPUs (kind nvidia-h200-x4; carrying .whl/ and .devcache/): `bash bench/first_call.sh
# [JOBS] [AFTER]`. The GPU tests on the last GPU (its own quarter of the cores), then the command AFTER there if
# given, while bench/models.py runs JOBS over the other three in lanes, cold-tuning whatever the carried cache lacks
# (a cache is keyed by the GPU's name: an H100's choices are not an H200's); then the tuning cache is saved for the
# next call.
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "H100\|H200" || exit 3
[ "$(nvidia-smi -L | wc -l)" -ge 4 ] || exit 4
source bench/gpu_env.sh
JOBS=${1:-resnet50:1,mobilenet_v3_large:1,resnet50:32,hf-bert-base:32,resnet50:256}
(CUDA_VISIBLE_DEVICES=3 taskset -c 48-63 timeout 330 python -m pytest -q -m requires_cuda tests -p no:cacheprovider \
  > $OUT/pytest_cuda.log 2>&1
 [ -n "$2" ] && CUDA_VISIBLE_DEVICES=3 taskset -c 48-63 timeout 200 bash -c "$2" > $OUT/after.log 2>&1) &
CUDA_VISIBLE_DEVICES=0,1,2 taskset -c 0-47 timeout 480 python bench/models.py --lanes 3 --budget-s 300 \
  --batch-peers "1=eager,reduce-overhead;256=eager,compile" --jobs "$JOBS" --out $OUT/zoo > $OUT/models.log 2>&1
wait
tail -3 $OUT/pytest_cuda.log
[ -n "$2" ] && grep -v "Warn\|warn" $OUT/after.log | tail -5
tail -18 $OUT/models.log
# the device sends back at most 8 files a call (and none nested deeper than its limit): the sweep's go as one
tar czf $OUT/zoo.tgz -C $OUT zoo && rm -rf $OUT/zoo
bash bench/save_cache.sh
