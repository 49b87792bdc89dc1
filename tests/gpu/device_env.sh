# Sourced by the device-call scripts in tests/gpu: installs the carried wheels (.whl, .whl_e2e) and FlashMLA's library
# (.sgk) into /tmp/site, sets PYTHONPATH / HUMMING_CACHE_DIR, unpacks the carried JIT caches (.jitcache), creates $OUT
# (default /tmp/out)
# and records the GPU's name, memory and SM clock in $OUT/gpu.txt. Returns 1 when the wheels do not install.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl $(ls .whl_e2e/*.whl 2>/dev/null) || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HUMMING_CACHE_DIR=/tmp/hcache
[ -f .jitcache/humming.tgz ] && mkdir -p /tmp/hcache && tar xzf .jitcache/humming.tgz -C /tmp/hcache
[ -f .jitcache/flashinfer.tgz ] && mkdir -p ~/.cache && tar xzf .jitcache/flashinfer.tgz -C ~/.cache
# FlashMLA (kimi.ops.attention_flashmla): the sglang-kernel 0.4.6 wheel is 377 MB, over a call's carry limit, so
# only its library file travels (.sgk/flashmla_ops.abi3.so.gz, 1.9 MB), unpacked where the installed package
# would put it; kimi reads nothing else of the package
[ -f .sgk/flashmla_ops.abi3.so.gz ] && mkdir -p /tmp/site/sgl_kernel && gunzip -c .sgk/flashmla_ops.abi3.so.gz > /tmp/site/sgl_kernel/flashmla_ops.abi3.so
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee $OUT/gpu.txt
