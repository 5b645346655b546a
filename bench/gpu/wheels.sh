#!/usr/bin/env bash
# The wheels bench/gpu/run.sh needs on a GPU machine that reaches no package registry (the lent
# H100/H200 of this workplace: its image has torch, transformers 5.17, accelerate, numpy,
# pyarrow, httpx, prometheus-client... but not these). Run HERE, where pip reaches PyPI:
#
#   bench/gpu/wheels.sh            # -> ./.whl/ (git-ignored), for CPython 3.12 on x86-64 Linux
#
# then carry .whl to the GPU machine with the checkout; run.sh installs them (--no-index,
# --no-deps) into /tmp/moeguard-site before measuring. Each pin is the version scripts/test
# installs or the one its environment resolved; only what the parts import and the image lacks
# (found by importing every part here and diffing against the image's package list).
#
# The device tool carries at most 64 MiB (checkout included) and polars' runtime alone is 51 MiB,
# so transformers 5.23 (13 MiB) is left out by default: the image's transformers (5.17 when last
# read) runs the Trainer parts and gpu.json records its version. WITH_TRANSFORMERS=1 adds it (then
# trim something else).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
WHEELS=(
  "polars==2.1.0" "polars-runtime-32==2.1.0"                             # the run store
  "starlette==1.10.0" "uvicorn==0.54.0" "orjson==3.13.0"                # the collector
  "torchtitan==0.3.0" "tyro==1.0.17" "docstring-parser==0.18.0" "typeguard==4.6.1"
  "torchdata==0.11.0" "spmd_types==0.2.3"                                # torchtitan's imports
  "datasets==4.7.0" "dill==0.4.0" "multiprocess==0.70.18"                # torchtitan.trainer imports it
)
[ "${WITH_TRANSFORMERS:-0}" = 1 ] && WHEELS+=("transformers==5.23.0") # scripts/test's pin
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_24_x86_64 --platform any -d .whl "${WHEELS[@]}"
ls .whl
kib=$(du -sk .whl | cut -f1)
echo "$((kib / 1024)) MiB in .whl (the device tool carries 64 MiB with the checkout)"
[ "$kib" -le $((58 * 1024)) ] || echo "warning: .whl is over 58 MiB: the checkout may not fit beside it" >&2
