#!/usr/bin/env bash
# Rehearses benchmarks/gpu_check.sh here, the way the lent H200 will run it: a venv holding only
# the image's packages (benchmarks/gpu_image_requirements.txt), olmax NOT installed (the check
# takes it from src/ through PYTHONPATH), none of olmax's other requirements (grain,
# tensorboardX, zstandard, lm-eval, ...), then `gpu_check.sh --rehearse` (tiny shapes, CPU, the
# reference kernel for cuDNN), which must write a JSON with every section and no error.
#   make rehearse-gpu            (REHEARSE_PY=python3.11; REHEARSE_CLEAN=1 rebuilds the venv)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.rehearse-gpu
venv="$dir/venv"
req=benchmarks/gpu_image_requirements.txt
py="${REHEARSE_PY:-python3.11}"
start=$(date +%s)
stamp="$venv/.built-from-$(sha1sum "$req" | cut -c1-12)-$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [ "${REHEARSE_CLEAN:-0}" = 1 ] || [ ! -e "$stamp" ]; then
  rm -rf "$venv"
  "$py" -m venv "$venv"
  echo "rehearse-gpu: installing the image's packages into $venv ($("$venv/bin/python" --version))"
  "$venv/bin/pip" install --quiet -r "$req"
  touch "$stamp"
fi
# The venv must look like the image: no olmax, none of olmax's packages that the image lacks.
"$venv/bin/python" - <<'PYEOF'
import importlib.util as u, sys
absent = ["olmax", "grain", "tensorboardX", "zstandard", "lm_eval", "olmo_core", "libtpu", "datasets",
          "evaluate", "boto3", "moto", "portpicker"]
present = [m for m in absent if u.find_spec(m) is not None]
if present:
    sys.exit(f"rehearse-gpu: the venv holds {present}, which the image does not (or olmax installed)")
PYEOF
rm -rf "$dir/out"
OUT="$dir/out" PYTHON="$venv/bin/python" bash benchmarks/gpu_check.sh --rehearse
"$venv/bin/python" - "$dir/out/gpu_check.json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
need = {"env": ["device", "jax"], "matmul": ["tflops"], "bandwidth": ["gb_per_s"],
        "parity": ["kl_mean", "kl_max", "top1_agreement", "float32"],
        "train": ["step_seconds_median", "tokens_per_second", "mfu_vs_measured_matmul", "mfu_vs_datasheet",
                  "compiled_gib", "xla"],
        "train_remat": ["full", "policies"],
        "decode": ["batches"], "logprob_gap": ["default_precision", "float32_precision"],
        "generate_peer": ["batches"]}
bad = [f"{s}.{k}" for s, ks in need.items() for k in ks if r.get(s, {}).get(k) is None]
if r["errors"] or bad or not r["parity"]["reference"].startswith("transformers") or not r["train"]["finite"]:
    sys.exit(f"rehearse-gpu: FAILED: errors {r['errors']}, missing {bad}")
print(f"rehearse-gpu: PASSED ({r['seconds']})")
PYEOF
echo "rehearse-gpu: $(( $(date +%s) - start )) s in all"
