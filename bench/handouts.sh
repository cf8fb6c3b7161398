# CUDA-graph outputs handed out from graphs that copy them inside (capture/cuda_graphs.py, _Handout), against the
# copy after the replay (handouts=0), alternated: `bash bench/handouts.sh` on the GPU machine, carrying .whl/ and
# .devcache/. The GPU tests first. BENCHMARKS.md, forty-fourth session. Logs and ab.json under $OUT.
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "H100\|H200" || exit 3
source bench/gpu_env.sh
timeout 300 python -m pytest -q -m requires_cuda tests -p no:cacheprovider > $OUT/pytest_cuda.log 2>&1
tail -3 $OUT/pytest_cuda.log
timeout 400 python bench/ab.py --jobs resnet50:1,mobilenet_v3_large:1,resnet50:32 --profile --out $OUT \
  --peers "rf+graphs,rf+graphs handouts=0,rf+graphs,rf+graphs handouts=0,reduce-overhead" > $OUT/ab_handouts.log 2>&1
tail -20 $OUT/ab_handouts.log
bash bench/save_cache.sh
