# Sourced by the device-call scripts in tests/gpu: installs the carried wheels (.whl, .whl_e2e) into /tmp/site,
# sets PYTHONPATH / HUMMING_CACHE_DIR, unpacks the carried JIT caches (.jitcache), creates $OUT (default /tmp/out)
# and records the GPU's name, memory and SM clock in $OUT/gpu.txt. Returns 1 when the wheels do not install.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl $(ls .whl_e2e/*.whl 2>/dev/null) || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HUMMING_CACHE_DIR=/tmp/hcache
[ -f .jitcache/humming.tgz ] && mkdir -p /tmp/hcache && tar xzf .jitcache/humming.tgz -C /tmp/hcache
[ -f .jitcache/flashinfer.tgz ] && mkdir -p ~/.cache && tar xzf .jitcache/flashinfer.tgz -C ~/.cache
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee $OUT/gpu.txt
