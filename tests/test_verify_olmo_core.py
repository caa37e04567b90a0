"""``olmax verify olmo-core``: per-step training parity with OLMo-core.

The 100-step run is the parity target: identical global instance ids and |delta CE| <= 1e-4 at
every step, olmax starting from OLMo-core's own initial weights. The other tests show the check
follows skip-step decisions and names the first differing quantity.
"""

from __future__ import annotations

import argparse
import json

import olmo_core  # noqa: E402,F401  (the test extras: ai2-olmo-core; a missing install fails, never skips)
import pytest

from olmax.verify import olmo_core as v  # noqa: E402


@pytest.mark.integration
def test_parity_with_olmo_core_100_steps(tmp_path):
    out = tmp_path / "parity"
    r = v.run_parity(steps=100, out=out)
    assert r["steps"] == 100
    assert r["batches_identical"], r["first_difference"]
    assert r["max_abs_ce_diff"] <= 1e-4, r["first_difference"]
    assert r["ok"], r["first_difference"]
    assert r["first_difference"] is None
    # The loss really moves (a flat loss would make the comparison vacuous) ...
    assert r["ce"]["olmo_core"]["last"] < r["ce"]["olmo_core"]["first"] - 0.5
    # ... and the lr goes through warmup and the cosine (20 warmup steps, alpha_f 0.1 at step 100).
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert len(rows) == 100
    lr = [row["lr"][1] for row in rows]
    assert lr[0] == pytest.approx(1e-3 / 20) and max(lr) == pytest.approx(1e-3) and lr[-1] == pytest.approx(1e-4)
    # 300 instances, batches of 8: epochs of 37 batches, so steps 38 and 75 start a reshuffled epoch.
    ids = [tuple(row["batch"][1]) for row in rows]
    assert len(set(i for b in ids[:37] for i in b)) == 296
    assert ids[37] != ids[0] and ids[74] != ids[37]
    assert json.loads((out / "report.json").read_text())["ok"] is True


@pytest.mark.integration
def test_sft_parity_with_olmo_core_100_steps(tmp_path):
    """OLMo-core's SFT data path (its NumpyPackedFSLDataset with label masks and document
    lengths, its intra-document RoPE; the block-diagonal mask supplied to its CPU attention) against
    olmax's packing, label masks and document masking: same instances, |delta CE| <= 1e-4 at lr 1e-4."""
    out = tmp_path / "sft"
    r = v.run_parity(steps=100, out=out, sft=True, log=None)
    assert r["sft"] and r["batches_identical"], r["first_difference"]
    assert r["max_abs_ce_diff"] <= 1e-4 and r["ok"], r["first_difference"]
    assert r["ce"]["olmo_core"]["last"] < r["ce"]["olmo_core"]["first"] - 0.05  # it trains
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    lr = [row["lr"][1] for row in rows]  # linear warmup (3 steps) to 1e-4, then linear decay to 0
    assert max(lr) == pytest.approx(1e-4) and lr[-1] < 2e-6


@pytest.mark.integration
@pytest.mark.parametrize("olmax_only", ["data.document_masking=false", "data.label_mask_paths="])
def test_sft_parity_catches_attention_across_documents_and_unmasked_labels(olmax_only):
    # Controls: olmax attending across packed documents, or counting the prompt tokens, must fail.
    r = v.run_parity(steps=4, sft=True, olmax_overrides=[olmax_only], log=None)
    assert r["batches_identical"] and not r["ok"]
    assert r["first_difference"]["step"] == 1 and r["first_difference"]["quantity"] in ("loss", "grad_norm")


@pytest.mark.integration
def test_parity_with_a_layer_count_not_a_multiple_of_4():
    # OLMo-core's olmo3 builders make the last layer full attention: s, s, s, f, f at 5 layers.
    r = v.run_parity(steps=8, overrides=["model.n_layers=5"])
    assert r["ok"] and r["batches_identical"] and r["max_abs_ce_diff"] <= 1e-4, r["first_difference"]


def test_parity_through_skipped_steps():
    # A short rolling window and 1 sigma make skip-step fire within a few dozen steps: both sides
    # must skip the same steps (params, moments and Adam step unchanged; lr and data advance).
    r = v.run_parity(steps=26, overrides=["optim.skip_step.window=16", "optim.skip_step.min_history=8",
                                          "optim.skip_step.sigma_factor=1"], log=None)
    assert r["steps_skipped"]["olmo_core"], "no step was skipped: the test no longer exercises skip-step"
    assert r["steps_skipped"]["olmax"] == r["steps_skipped"]["olmo_core"]
    assert r["ok"], r["first_difference"]


@pytest.mark.integration
def test_cli_reports_first_difference_and_exits_1(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    v.register(parser.add_subparsers())
    args = parser.parse_args(["olmo-core", "--steps", "3", "--olmax-set", "optim.lr=1.1e-3", "--json",
                              "--out", str(tmp_path / "neg")])
    assert args.func(args) == 1
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] is False
    assert r["batches_identical"] is True
    fd = r["first_difference"]
    assert (fd["step"], fd["quantity"]) == (1, "lr")
    assert fd["olmax"] == pytest.approx(1.1e-3 / 20) and fd["olmo_core"] == pytest.approx(1e-3 / 20)
    for key in ("steps", "max_abs_ce_diff", "max_abs_grad_norm_diff", "max_abs_lr_diff", "batches_identical"):
        assert key in r


def _trace(**kw) -> v.Trace:
    t = v.Trace()
    for s in range(1, 4):
        t.ids[s] = [s, s + 10]
        t.lr[s], t.grad_norm[s], t.ce[s], t.z_loss[s], t.skipped[s] = 1e-3 * s, 2.0, 6.0 - s, 4e-4, 0.0
    for name, (step, value) in kw.items():
        getattr(t, name)[step] = value
    return t


@pytest.mark.parametrize("change, quantity", [
    ({"ids": (2, [2, 13])}, "batch"),
    ({"lr": (2, 2.1e-3)}, "lr"),
    ({"grad_norm": (2, 2.01)}, "grad_norm"),
    ({"ce": (2, 4.0 + 2e-4)}, "loss"),
    ({"ce": (2, float("nan"))}, "loss"),
    ({"skipped": (2, 1.0)}, "step_skipped"),
])
def test_compare_names_the_first_differing_quantity(change, quantity):
    r = v.compare(_trace(**change), _trace(), 3)
    assert r["ok"] is False
    assert (r["first_difference"]["step"], r["first_difference"]["quantity"]) == (2, quantity)
    assert r["batches_identical"] is (quantity != "batch")


def test_compare_within_tolerance_and_missing_steps():
    r = v.compare(_trace(ce=(3, 3.0 + 9e-5)), _trace(), 3)
    assert r["ok"] is True and r["first_difference"] is None
    assert r["max_abs_ce_diff"] == pytest.approx(9e-5)
    short = _trace()
    del short.ce[3]
    r = v.compare(short, _trace(), 3)
    assert r["ok"] is False and r["first_difference"] == {"step": 3, "quantity": "loss", "olmax": None,
                                                         "olmo_core": 3.0}
