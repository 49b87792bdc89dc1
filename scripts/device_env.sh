# Sourced by the device scripts (scripts/*.sh) at the repository root of a GPU machine without a package index:
# installs the carried wheels (.whl, made by scripts/wheelhouse.sh; .whl_e2e: extra test wheels such as openai)
# into /tmp/site, sets PYTHONPATH (/tmp/site and the checkout), unpacks the carried JIT caches (.jitcache/humming.tgz,
# .jitcache/flashinfer.tgz, .jitcache/kimi_csrc.tgz: humming's, FlashInfer's and kimi's csrc/ builds; each saves the
# first use's compile), creates $OUT (default /tmp/out) and records the GPU's name, driver, memory and SM clock in
# $OUT/gpu.txt. Returns 1 when the wheels do not install.
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl $(ls .whl_e2e/*.whl 2>/dev/null) || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HUMMING_CACHE_DIR=/tmp/hcache KIMI_CSRC_CACHE=/tmp/kimi_csrc
[ -f .jitcache/humming.tgz ] && mkdir -p /tmp/hcache && tar xzf .jitcache/humming.tgz -C /tmp/hcache
[ -f .jitcache/flashinfer.tgz ] && mkdir -p ~/.cache && tar xzf .jitcache/flashinfer.tgz -C ~/.cache
[ -f .jitcache/kimi_csrc.tgz ] && mkdir -p /tmp/kimi_csrc && tar xzf .jitcache/kimi_csrc.tgz -C /tmp/kimi_csrc
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee $OUT/gpu.txt

# save_jit_caches: the JIT caches of this machine as $OUT/{humming,flashinfer,kimi_csrc}.tgz (carry them as
# .jitcache/ in the next call); three files of the eight a call brings back
save_jit_caches() {
  (cd /tmp/hcache 2>/dev/null && tar czf $OUT/humming.tgz .)
  (cd ~/.cache 2>/dev/null && [ -d flashinfer ] && tar czf $OUT/flashinfer.tgz flashinfer)
  (cd /tmp/kimi_csrc 2>/dev/null && tar czf $OUT/kimi_csrc.tgz .)
}
