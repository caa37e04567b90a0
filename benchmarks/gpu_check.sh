#!/usr/bin/env bash
# The accelerator check (benchmarks/chip_check.py) on a GPU, as the lent H200 runs it: that machine's own Python
# (python3: jax + the CUDA plugin, torch, transformers, optax, orbax, ...), no registry, no
# install of anything; olmax comes from this working tree through PYTHONPATH=src.
#
#   bash benchmarks/gpu_check.sh [--rehearse] [--only SECTIONS]
#
# Writes $OUT/gpu_check.json (rewritten after every section) and $OUT/gpu_check.log; without
# $OUT, runs/gpu_check/. --rehearse: tiny shapes on the CPU, the reference kernel for cuDNN
# (make rehearse-gpu runs it in a venv built like the image). PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs/gpu_check}"
mkdir -p "$out"
PY="${PYTHON:-python3}"
rehearse=0
for a in "$@"; do [ "$a" = "--rehearse" ] && rehearse=1; done
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "$rehearse" = 1 ]; then
  export JAX_PLATFORMS=cpu
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi unavailable"
  # JAX takes 60% of the GPU up front (the train section peaks at 44 GiB of the H200's 140);
  # the rest is torch's: generate_peer runs transformers on the same GPU.
  export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.6}"
fi
# Fail in seconds, not after a compile, when the interpreter lacks what the check needs.
"$PY" - <<'EOF'
import sys, importlib.util as u
need = ["jax", "numpy", "optax", "orbax.checkpoint", "yaml", "ml_dtypes", "safetensors"]
missing = [m for m in need if u.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: {sys.executable} lacks {', '.join(missing)}")
import olmax, jax
print(f"gpu_check: python {sys.version.split()[0]} at {sys.executable}, jax {jax.__version__}, "
      f"olmax from {olmax.__file__}, backend {jax.default_backend()}", flush=True)
EOF
set -o pipefail
"$PY" benchmarks/chip_check.py --platform gpu --out "$out/gpu_check.json" "$@" 2>&1 | tee "$out/gpu_check.log"
