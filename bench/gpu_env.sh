# Source on the GPU machine before a bench script: `source bench/gpu_env.sh`.
# Our code and the carried cuDNN frontend wheel (.whl/, git-ignored) on the path; real Triton kernels (no
# interpreter); .pyc files written outside the image's read-only site-packages, as on a user's machine; a
# tuning cache per machine, kept between calls while the machine stays warm (RESFUSE_CACHE_DIR to override).
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pyc
unset PYTHONDONTWRITEBYTECODE
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site"
export RESFUSE_CACHE_DIR="${RESFUSE_CACHE_DIR:-/tmp/resfuse_cache}"
# A fresh machine starts from the caches an earlier call saved (bench/save_cache.sh), carried as .devcache/
# (git-ignored): the tuner's winners, so a call times instead of tuning again.
for f in .devcache/*.tgz; do  # each holds one folder of /tmp, unpacked unless a warm machine has it already
  [ -e "$f" ] && [ ! -d "/tmp/$(basename "$f" .tgz)" ] && tar xzf "$f" -C /tmp
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
