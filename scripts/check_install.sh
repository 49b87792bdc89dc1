#!/usr/bin/env bash
# `pip install .` (not editable) into a fresh venv on a GPU machine, then kimi's CUDA kernel tests run against the
# installed package from outside the checkout, building the CUDA extension from the installed package's csrc/ into a
# fresh cache. Logs in $OUT/install.log. Usage (device tool, carry .whl): bash scripts/check_install.sh
source scripts/device_env.sh || exit 1
log=$OUT/install.log
python3 -m venv --system-site-packages /tmp/kimi_venv >> $log 2>&1
/tmp/kimi_venv/bin/pip install -q --no-index --no-deps --no-build-isolation . >> $log 2>&1 || { echo "install failed"; tail -20 $log; exit 1; }
mkdir -p /tmp/kimi_installed_tests && cp tests/gpu/conftest.py tests/gpu/test_moe_int4_cuda.py /tmp/kimi_installed_tests/
cd /tmp/kimi_installed_tests
# the machine's own pytest (outside the venv), importing kimi from the venv's site-packages only
export PYTHONPATH=$(/tmp/kimi_venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"):/tmp/site
export KIMI_CSRC_CACHE=/tmp/kimi_csrc_fresh
python3 -c "import kimi, kimi.kernels.cuda as c; print('kimi from', kimi.__file__)" 2>&1 | tee -a $log
timeout ${T_INSTALL:-240} python3 -m pytest -q -p no:cacheprovider -m gpu test_moe_int4_cuda.py 2>&1 | tail -5 | tee -a $log
ls /tmp/kimi_csrc_fresh | tee -a $log
