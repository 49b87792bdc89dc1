# Sourced by the device scripts (scripts/*.sh) at the repository root of a GPU machine without a package index:
# installs the carried wheels (.whl, made by scripts/wheelhouse.sh; .whl_e2e: extra test wheels such as openai)
# into /tmp/site, sets PYTHONPATH (/tmp/site and the checkout), points every kernel library at one cache folder
# (KIMI_CACHE_DIR=/tmp/kimi_cache with the libraries' own variables at its subfolders, as `kimi serve --cache-dir`
# lays it out: kimi/cache_dir.py) so in-process tests and served workers share it, unpacks the carried cache
# (.jitcache/kimi_cache.tgz: what an earlier call compiled), creates $OUT (default /tmp/out) and records the GPU's
# name, driver, memory and SM clock in $OUT/gpu.txt. Returns 1 when the wheels do not install.
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl $(ls .whl_e2e/*.whl 2>/dev/null) || return 1
# humming keys its kernel cache by its sources' mtimes, which a fresh install sets to now: pin them, so the carried
# cache stays valid across installs
find /tmp/site/humming -type f -exec touch -d 2026-01-01T00:00:00 {} +
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KIMI_CACHE_DIR=/tmp/kimi_cache
export KIMI_CSRC_CACHE=$KIMI_CACHE_DIR/csrc FLASHINFER_WORKSPACE_BASE=$KIMI_CACHE_DIR/flashinfer
export HUMMING_CACHE_DIR=$KIMI_CACHE_DIR/humming TRITON_CACHE_DIR=$KIMI_CACHE_DIR/triton
mkdir -p $KIMI_CACHE_DIR
[ -f .jitcache/kimi_cache.tgz ] && tar xzf .jitcache/kimi_cache.tgz -C $KIMI_CACHE_DIR
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee $OUT/gpu.txt

# save_jit_caches: the kernel cache of this machine as $OUT/kimi_cache.tgz (carry it as .jitcache/ in the next call)
save_jit_caches() {
  (cd $KIMI_CACHE_DIR && tar czf $OUT/kimi_cache.tgz .)
}
