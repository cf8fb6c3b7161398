# ResNet-50 bs1 with CUDA graphs, the default providers beside our Triton kernels alone, each profiled (busy time,
# launches, one call's timeline): `bash bench/bs1_profile.sh` on the GPU machine, carrying .whl/ and .devcache/
# (which holds both forms' tuning choices). BENCHMARKS.md, forty-third session. Logs and ab.json under $OUT.
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "H100\|H200" || exit 3
source bench/gpu_env.sh
timeout 300 python bench/ab.py --jobs resnet50:1 --profile --out $OUT \
  --peers "rf+graphs,rf+graphs providers=['triton'],rf+graphs,rf+graphs providers=['triton']" > $OUT/bs1_profile.log 2>&1
tail -8 $OUT/bs1_profile.log
bash bench/save_cache.sh
