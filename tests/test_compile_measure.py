"""``olmax compile --sweep --measure``: each candidate run and timed on this machine's devices
(here the CPU, at a model small enough to compile in seconds), ranked by its measured median,
beside XLA's estimate of the same compiled program and the ratio of the two; a candidate that
runs out of memory does not fit; bad input fails before anything compiles."""

from __future__ import annotations

import json

import pytest
from test_cli_contract import run as _run

from olmax import compile as oc
from olmax.recipes import get_recipe

# The tiny recipe cut to what compiles fastest on a CPU: one layer, unscanned, the reference
# attention, the loss over the whole sequence at once.
SMALL = ["model.vocab_size=256", "model.padded_vocab_size=256", "model.d_model=32", "model.n_layers=1",
         "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8", "model.mlp_hidden=64",
         "model.sliding_window=8", "model.scan_layers=false", "model.logits_chunk=null",
         "model.attention_impl=reference", "data.sequence_length=16", "train.global_batch_size=2"]


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def test_measured_sweep_runs_each_candidate_and_sets_xlas_estimate_beside_it(capsys):
    rc, out, err = _run(["compile", "tiny", "--sweep", "--measure", "--steps", "2", "--remat", "none,full",
                         "--micro-batches", "2", *_sets(SMALL), "--json"], capsys)
    assert rc == 0, err[-3000:]
    s = json.loads(out)
    assert s["measured"] and s["platform"] == "cpu" and s["steps"] == 2 and s["devices"] == 1
    # A CPU has no datasheet row: both rates were measured on it, and the JSON says so.
    assert s["rates"]["flops_source"] == s["rates"]["bytes_source"] == "measured"
    rows = {r["remat"]: r for r in s["rows"]}
    assert set(rows) == {"none", "full"}
    for r in rows.values():
        assert set(oc.MEASURED_KEYS) <= set(r)
        assert r["fits"] and r["micro_batch"] == 2 and r["accum_steps"] == 1 and len(r["step_seconds"]) == 2
        assert r["step_seconds_median"] > 0 and r["first_step_seconds"] >= r["compile_seconds"] > 0
        assert r["per_device_gib"] > 0 and r["memory_limit_gib"] is None  # the CPU states no limit
        # XLA's CPU cost analysis gives FLOPs and bytes but no time: the estimate is the roofline,
        # the larger of the two bounds, and the ratio is that over the measured median.
        assert r["optimal_seconds"] is None and r["estimate_by"] in ("flops", "bytes")
        assert r["estimated_seconds"] == r["roofline_seconds"] == max(r["roofline_flops_seconds"],
                                                                      r["roofline_bytes_seconds"])
        assert r["estimate_over_measured"] == pytest.approx(r["estimated_seconds"] / r["step_seconds_median"])
        assert r["attention_unseen_fraction"] == 0  # attention ran in XLA: nothing to price in
        assert r["estimate_with_attention_over_measured"] == r["estimate_over_measured"]
    # Full remat runs each layer's forward again: XLA counts more FLOPs for it than for none.
    assert rows["full"]["flops_per_device"] > rows["none"]["flops_per_device"]
    assert rows["full"]["model_flops_per_device"] == rows["none"]["model_flops_per_device"]
    # Ranked by the measurement: 1 is the fastest, and the best is it.
    fastest = min(rows.values(), key=lambda r: r["step_seconds_median"])
    assert sorted(r["rank"] for r in rows.values()) == [1, 2] and fastest["rank"] == 1
    assert sorted(r["rank_by_estimate"] for r in rows.values()) == [1, 2]
    assert s["best"] == fastest and s["best_by"] == "step_seconds_median"
    assert "measure: remat=none micro_batch=2 block=" in err and "s a step (median of 2)" in err  # progress
    oc.print_measured(s)  # the table: the ratio per row, the winner as --set flags
    table = capsys.readouterr().out
    assert "est/meas" in table and "<- best" in table and f"--set model.remat={fastest['remat']}" in table


def test_out_of_memory_does_not_fit_and_the_fastest_that_fits_wins(monkeypatch, capsys):
    """A candidate that runs out of memory (at compile or at run time) is a row that does not fit,
    its larger micro-batches are skipped, and the state it may have taken is made again."""
    import olmax.measure as om
    seconds = {("none", 1): 0.5, ("none", 2): None, ("full", 1): 0.9, ("full", 2): 0.7}
    made = []

    class State:
        mesh, plan = None, None
        spoiled = False

        def deleted(self):
            return self.spoiled

    def fake_state(cfg, batch=None):
        made.append(cfg.model.remat)
        st = State()
        st.mesh = __import__("olmax.sharding", fromlist=["make_mesh"]).make_mesh(cfg.mesh)
        return st

    def fake_time(cfg, state, steps):
        secs = seconds[(cfg.model.remat, cfg.train.micro_batch_size)]
        if secs is None:
            state.spoiled = True  # a run-time failure after the step took the donated state
            return {"oom": "RESOURCE_EXHAUSTED: out of memory", "oom_at": "run", "compiled_gib": {"need": 9.0}}
        return {"step_seconds_median": secs, "step_seconds": [secs], "compile_seconds": 1.0,
                "first_step_seconds": 1.5, "loss_last": 5.0, "compiled_gib": {"need": 1.0}}

    monkeypatch.setattr(om, "train_state", fake_state)
    monkeypatch.setattr(om, "time_step", fake_time)
    monkeypatch.setattr(om, "device_rates", lambda device=None: {"flops_per_second": 1e12, "flops_source": "datasheet",
                                                                 "bytes_per_second": 1e11, "bytes_source": "datasheet"})
    monkeypatch.setattr(oc, "step_estimate", lambda cfg, state, run, rates: {
        "estimated_seconds_with_attention": 1 / run["step_seconds_median"]})
    cfg = get_recipe("tiny", SMALL)
    s = oc.measured_sweep(cfg, remats=["none", "full@2", "full@1"], micro_batches=[2, 1], steps=1, progress=False)
    got = [(r["remat"], r["micro_batch"], r.get("fits"), r.get("oom_at"), r.get("skipped")) for r in s["rows"]]
    assert got == [("none", 2, False, "run", None), ("none", 1, True, None, None), ("full", 2, True, None, None),
                   ("full", 1, True, None, None)]
    assert made == ["none", "none"]  # made once, then again after the row that spoiled it, then carried
    assert (s["best"]["remat"], s["best"]["micro_batch"]) == ("none", 1)
    assert [r.get("rank") for r in s["rows"]] == [None, 1, 2, 3]
    assert [r.get("rank_by_estimate") for r in s["rows"]] == [None, 3, 2, 1]  # the estimate ranks them backwards
    # A micro-batch above one that did not fit is not run.
    seconds[("none", 1)] = None
    s = oc.measured_sweep(cfg, remats=["none"], micro_batches=[1, 2], steps=1, progress=False)
    assert s["rows"][0]["fits"] is False and s["rows"][1]["skipped"] and s["best"] is None
    oc.print_measured(s)
    assert "no candidate ran" in capsys.readouterr().out


@pytest.mark.parametrize("argv, said", [
    (["--sweep", "--measure", "--remat", "none,fastest"], "'fastest'"),
    (["--sweep", "--measure", "--remat", "full@0"], "'full@0'"),
    (["--measure"], "--measure goes with --sweep"),
    (["--sweep", "--measure", "--topology", "v5e-1"], "drop --topology"),
    (["--sweep", "--topology", "v5p-8", "--steps", "3"], "--steps goes with --sweep --measure"),
    (["--sweep", "--measure", "--micro-batches", "3"], "3 does not divide"),
    (["--sweep"], "--topology is required"),
])
def test_bad_measure_input_exits_2_naming_it(argv, said, capsys):
    rc, out, err = _run(["compile", "tiny", *argv, *_sets(SMALL), "--json"], capsys)
    assert rc == 2, (argv, out, err)
    assert said in json.loads(out.strip().splitlines()[-1])["error"], (argv, out)
