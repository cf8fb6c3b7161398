# The swapped GEMM form (GemmConfig.swap / ConvConfig.swap, forty-fourth session) measured on the GPU machine,
# carrying .whl/ and .devcache/: `bash bench/swap_next.sh`. First the product's swapped configs beside the probe's
# kernel (bench/swap_product.py); then ResNet-50 and MobileNetV3-L at bs1, each in one process: the cached winners
# (made before the swapped candidates existed), a retune (every op measured again, the swapped candidates among the
# others; the new winners replace the cached ones), and the new winners, each profiled. Logs and JSON under $OUT;
# the new winners go to $OUT/resfuse_cache.tgz for .devcache/.
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "H100\|H200" || exit 3
source bench/gpu_env.sh
timeout 120 python bench/swap_product.py --out $OUT > $OUT/swap_product.log 2>&1
tail -12 $OUT/swap_product.log
timeout 420 python bench/ab.py --jobs resnet50:1,mobilenet_v3_large:1 --profile --out $OUT \
  --peers "rf+graphs,rf+graphs retune=True,rf+graphs" > $OUT/swap_retune.log 2>&1
tail -10 $OUT/swap_retune.log
bash bench/save_cache.sh
