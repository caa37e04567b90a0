#!/usr/bin/env bash
# olmax's runtime on a TPU VM that has Python, JAX and libtpu but no package registry (the lent
# v5e): installs benchmarks/tpu/requirements.txt from the VM's own index (TPU_INDEX, default
# file:///opt/pypi/simple) plus the wheels carried in .whl-tpu/ (`make tpu-wheels`), into the user
# site (after PYTHONPATH, so the VM's own JAX stays first; a `--target` folder where the user site is
# refused), then checks that olmax imports and sees the TPU. Prints the PYTHONPATH to use last.
#   eval "$(bash benchmarks/tpu/env.sh)"      # exports PYTHONPATH (src/ first)
set -euo pipefail
cd "$(dirname "$0")/../.."
wheels=.whl-tpu
index="${TPU_INDEX:-file:///opt/pypi/simple}"
[ -d "$wheels" ] || { echo "tpu/env.sh: no $wheels/: run 'make tpu-wheels' here and carry .whl-tpu" >&2; exit 2; }
t0=$SECONDS
pip=(env PIP_CONFIG_FILE=/dev/null python3 -m pip install -q --disable-pip-version-check --no-warn-script-location
     --index-url "$index" --find-links "$wheels" --only-binary=:all: -r benchmarks/tpu/requirements.txt)
extra=""
tmp="${TMPDIR:-/tmp}"
if ! "${pip[@]}" --user >&2 2>"$tmp/olmax-tpu-pip.log"; then
  echo "tpu/env.sh: the user site was refused ($(tail -1 "$tmp/olmax-tpu-pip.log")); installing into $tmp/olmax-site" >&2
  "${pip[@]}" --target "$tmp/olmax-site" >&2
  extra=":$tmp/olmax-site"
fi
path="$PWD/src${PYTHONPATH:+:$PYTHONPATH}$extra"
PYTHONPATH="$path" python3 - >&2 <<'PY'
import importlib.metadata as md, sys
import olmax, jax  # noqa: F401  (olmax first: it keeps JAX on the TPU runtime where one is)
for m in ("grain", "optax", "orbax.checkpoint", "tensorboardX", "zstandard", "jinja2", "tokenizers", "safetensors"):
    __import__(m)
print(f"tpu/env.sh: python {sys.version.split()[0]}, jax {jax.__version__} from {jax.__file__}, "
      f"backend {jax.default_backend()}, devices {jax.devices()}", file=sys.stderr)
PY
echo "tpu/env.sh: ready in $((SECONDS - t0)) s" >&2
echo "export PYTHONPATH='$path'"
