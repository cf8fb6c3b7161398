# Run at the end of a GPU call, after `source bench/gpu_env.sh`: saves the tuning cache (/tmp/resfuse_cache, the
# tuner's winners) to $OUT/resfuse_cache.tgz. Copy it into .devcache/ here and carry that folder: the next call's
# bench/gpu_env.sh unpacks it, so a fresh machine times the same choices instead of tuning again. (Triton's own
# kernel cache stays behind: 36 MB packed at ResNet-50 bs32, over what a call may send back.)
tar czf "$OUT/resfuse_cache.tgz" -C /tmp resfuse_cache && ls -la "$OUT/resfuse_cache.tgz"
