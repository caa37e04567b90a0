"""The accelerator check's TPU path (benchmarks/chip_check.py --platform tpu) rehearsed on the CPU,
so that it cannot rot between lent machines: the TPU's program traced at tiny shapes (splash
interpreted), every section the chip runs in one call asked for, and each must produce its
figures with no error (``peers``: MaxText's side from canned log lines). On a chip:
`bash benchmarks/tpu_check.sh` (docs/production.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tpu_check_rehearsal_produces_every_sections_figures(tmp_path):
    out = tmp_path / "tpu_check.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "chip_check.py"), "--rehearse", "--platform", "tpu",
                        "--only", "env,matmul,bandwidth,parity,train,profile,peers",
                        "--remat", "none+model.logits_chunk=128",
                        "--peer-olmax-remat", "recipe,none+model.logits_chunk=128", "--no-xla-cost", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["errors"] == {} and res["platform"] == "tpu" and res["env"]["traced_for"] == "tpu"
    assert res["env"]["attention"] == "splash" and res["env"]["datasheet_bf16_tflops"] == 197.0
    for case in ("plain", "packed"):  # splash (interpreted) against the fp32 reference kernel
        assert res["parity"][f"{case}.float32"]["top1_agreement"] == 1.0
        assert res["parity"][f"{case}.float32"]["kl_max"] < 1e-5
        assert res["parity"][f"{case}.bfloat16"]["kl_mean"] < 1e-3
    rows = res["train"]["shapes"]["tiny"]
    assert set(rows) == {"recipe", "none+model.logits_chunk=128"}  # the recipe's own row, then the variant
    assert rows["recipe"]["remat"] == "full" and rows["none+model.logits_chunk=128"]["remat"] == "none"
    for row in rows.values():
        assert row["finite"] and row["step_seconds_median"] > 0 and 0 < row["mfu_vs_datasheet"] < 1
    assert res["train"]["best"]["tiny"]["remat"] in rows
    # profile: each part timed alone, and a trace kept beside the JSON (its device-op summaries
    # are the chip's; the CPU's trace has no XLA Ops thread)
    prof = res["profile"]
    assert prof["errors"] == {} and prof["remat"] == res["train"]["best"]["tiny"]["remat"]
    assert all(prof["seconds"][k] > 0 for k in ("step", "forward", "gradient", "optimizer_update"))
    assert (out.parent / prof["trace"]["file"]).is_file()
    # peers: MaxText's rows from canned log lines (run first, before the chip is opened), olmax's
    # rows reused from the train section (no compile of their own), and the ratios
    peers = res["peers"]
    assert set(peers["maxtext"]["rows"]) == {"full", "minimal", "minimal_with_context"}
    assert peers["maxtext"]["shape"]["seq"] == 128 and peers["maxtext"]["tokens_per_step"] == 256
    assert all(r["reused_from_train"] for r in peers["olmax"].values()) and peers["olmax"]["recipe"]["remat"] == "full"
    assert peers["ratios"]["at_full_remat"]["olmax_remat"] == "recipe"
    assert peers["ratios"]["at_each_best"]["olmax_over_maxtext"] > 0
