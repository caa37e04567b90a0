#!/usr/bin/env bash
# GPU checks on a machine with an NVIDIA GPU (CI never has one): installs jax with the CUDA
# plugin next to olmax if JAX does not already see a GPU, then runs benchmarks/gpu_check.py
# (bf16 logit parity through cuDNN attention; MFU of 8 layers of the 7B at 8192 context).
#   bash benchmarks/gpu_check.sh [OUT_DIR]        (results in OUT_DIR/gpu_check.json)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-.}}"
[ $# -gt 0 ] && shift
mkdir -p "$out"
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi unavailable"
if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
  cuda=12
  if nvidia-smi 2>/dev/null | grep -q "CUDA Version: 1[3-9]"; then cuda=13; fi
  echo "installing jax[cuda$cuda]==0.10.2 and olmax" >&2
  "$PY" -m pip install -q "jax[cuda$cuda]==0.10.2"
  "$PY" -c 'import olmax' 2>/dev/null || "$PY" -m pip install -q --no-deps -e .
  "$PY" -m pip install -q optax orbax-checkpoint pyyaml ml_dtypes safetensors 2>/dev/null || true
fi
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}"
PYTHONUNBUFFERED=1 "$PY" benchmarks/gpu_check.py --out "$out/gpu_check.json" "$@"
