#!/usr/bin/env bash
# Download every wheel an offline x86-64 Linux GPU host with Python 3.12 needs to run kimi (air-gapped clusters),
# except PyTorch itself (install the CUDA build of your cluster first; 2.11 + CUDA 13 is what kimi was measured on).
# Usage: bash scripts/wheelhouse.sh [DIR]     (default .whl; `make wheelhouse` runs it)
# On the host (its CUDA PyTorch and numpy installed):
#               python3 -m pip install --no-index --no-deps DIR/*.whl
#               python3 -m pip install --no-index --no-deps --find-links DIR -e .     (in the kimi checkout)
#   --no-deps: the set is complete for kimi, but FlashInfer's metadata also asks for nvidia-cutlass-dsl (its CuTe-DSL
#   kernels, which kimi does not call; large), so `pip check` names that one. The ninja wheel's binary (bin/ninja)
#   must be on PATH: FlashInfer and kimi's csrc/ kernels are compiled at first use with nvcc.
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  -*) echo "wheelhouse.sh: unknown option $1 (usage: bash scripts/wheelhouse.sh [DIR])" >&2; exit 2 ;;
esac
dir=${1:-.whl}
py=${PYTHON:-python3}
mkdir -p "$dir"
plat=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 any; do
  plat+=(--platform "$p")
done
dl() { "$py" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$dir" "$@"; }
# GPU kernels, pinned as pyproject.toml's gpu extra (the versions of the snapshots); no dependency resolution (it would pull torch)
dl --no-deps flashinfer-python==0.6.4 apache-tvm-ffi==0.1.15.post2 nvidia-cudnn-frontend==1.32.0 \
  humming-kernels==0.1.20 tokenspeed-deepep==1.2.1.post20251110 ninja==1.13.2 "setuptools>=68"
# guided decoding: xgrammar, pinned as pyproject.toml (no resolution: it names torch and triton), and its
# dependencies (apache-tvm-ffi is above); it imports transformers, whose wheels the next line resolves
dl --no-deps xgrammar==0.2.9 pydantic pydantic_core annotated_types typing_inspection
# kimi's runtime dependencies (pyproject.toml, torch excepted) and the GPU set's (their metadata; torch, triton and
# numpy excepted: a CUDA PyTorch environment has them, EXTRA=numpy adds it; nvidia-cutlass-dsl left out: FlashInfer
# needs it only for its CuTe-DSL kernels, not the MLA / prefill / sampling ones kimi calls), transformers (xgrammar
# imports it), with their own dependencies (setuptools: the editable install's build backend); EXTRA="pkg ..." adds more
# shellcheck disable=SC2086
dl "safetensors>=0.4" "msgspec>=0.18" "pyzmq>=25" "uvicorn>=0.30" "starlette>=0.37" "tiktoken>=0.7" "jinja2>=3.1" \
  "tqdm>=4.60" "prometheus-client>=0.20" transformers click einops "packaging>=24.2" requests tabulate nvidia-ml-py \
  cuda-bindings \
  ${EXTRA:-}
# transformers' resolution brings numpy: left out as above unless EXTRA names it
case " ${EXTRA:-} " in *" numpy "*) ;; *) rm -f "$dir"/numpy-*.whl ;; esac
ls "$dir" | wc -l | sed 's/$/ wheels/'
du -sh "$dir"
