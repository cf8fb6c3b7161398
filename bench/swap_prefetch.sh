# Did the swapped form's weight prefetch (matmul.gemm_swapped_prefetch) close its gap in the model? GPU machine,
# carrying .whl/ and .devcache/: `bash bench/swap_prefetch.sh`. Repeats the forty-fifth session's run 4: the tuning
# cache with ResNet-50 bs1's cuDNN winners within 6% given to our kernels (bench/cache_flip.py; among them the swapped
# 64x16 reduce of layer 3, which ran ~3 us slower in the model than alone), against the cache as it is, by GPU time
# a call (bench/cache_ab.py). Run 4, before the prefetch: +22.9 us a call. Then the same flip with prefetching off
# everywhere (RESFUSE_PREFETCH=0), which says what the prefetch is worth to the flipped kernels.
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "H100\|H200" || exit 3
source bench/gpu_env.sh
python bench/cache_flip.py /tmp/resfuse_cache /tmp/resfuse_cache_flipped --within 0.06 > $OUT/swap_prefetch_flips.log
timeout 200 python bench/cache_ab.py --against /tmp/resfuse_cache_flipped --out $OUT > $OUT/swap_prefetch.log 2>&1
grep "gpu_us\|latency_us\|error" $OUT/swap_prefetch.log
mkdir -p $OUT/off
RESFUSE_PREFETCH=0 timeout 200 python bench/cache_ab.py --against /tmp/resfuse_cache_flipped --out $OUT/off \
  > $OUT/swap_prefetch_off.log 2>&1
grep "gpu_us\|latency_us\|error" $OUT/swap_prefetch_off.log
