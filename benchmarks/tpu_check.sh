#!/usr/bin/env bash
# The accelerator check (benchmarks/chip_check.py) on a TPU VM, as the lent v5e runs it: the VM's
# own Python, JAX and libtpu; olmax's other runtime packages installed from the VM's index plus the
# carried wheels (benchmarks/tpu/env.sh; `make tpu-wheels` fills .whl-tpu/, which the device call
# carries); olmax from this working tree through PYTHONPATH=src.
#
#   bash benchmarks/tpu_check.sh [--rehearse] [--only SECTIONS] [chip_check.py's flags]
#
# Writes $OUT/tpu_check.json (rewritten after every section) and $OUT/tpu_check.log; without $OUT,
# runs/tpu_check/. --rehearse: tiny shapes on this CPU, the TPU's program traced, splash
# interpreted, in the current environment (no install).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs/tpu_check}"
mkdir -p "$out"
PY="${PYTHON:-python3}"
rehearse=0
for a in "$@"; do [ "$a" = "--rehearse" ] && rehearse=1; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "$rehearse" = 1 ]; then
  export JAX_PLATFORMS=cpu PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
else
  eval "$(bash benchmarks/tpu/env.sh)"
fi
"$PY" benchmarks/chip_check.py --platform tpu --out "$out/tpu_check.json" "$@" 2>&1 | tee "$out/tpu_check.log"
