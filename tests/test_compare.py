"""Run comparison: reading and aligning JSONL / TSV / W&B CSV, gaps and deltas on known inputs,
the memorisation alarm on constructed runs, and the report with its plots."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from olmax.eval.alarm import AlarmConfig, MemorisationAlarm, check_memorisation, interp, judge
from olmax.eval.compare import (
    bin_edges,
    bin_gap,
    compare,
    gap,
    milestone_table,
    paired_delta,
    read_run,
    read_runs,
    window_gap,
)
from olmax.eval.runs import metric_rows, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def line(s: np.ndarray) -> np.ndarray:
    return 3.0 - 0.001 * s   # linear: interpolation between logged steps is exact


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------- reading and alignment


def test_formats_align_on_different_step_sets(tmp_path):
    ref_steps = np.arange(0, 1001, 10)
    tsv = tmp_path / "ref.tsv"
    tsv.write_text("step\tloss\n" + "".join(f"{s}\t{line(s)}\n" for s in ref_steps))
    # Our run logs at odd steps (5, 15, ...) and beyond the reference's last step.
    run_steps = np.arange(5, 1105, 10)
    rows = [{"step": int(s), "train/CE loss": float(line(s) + 0.01), "optim/LR (group 0)": 1e-3} for s in run_steps]
    rows.insert(3, {"step": 400, "eval/heldout/CE loss": 2.7, "eval/heldout/PPL": math.exp(2.7)})
    write_jsonl(tmp_path / "run" / "metrics.jsonl", rows)
    # W&B export: "_step", a prefixed loss column, __MIN/__MAX columns, sparse cells.
    csv_lines = ["_step,myrun - train/CE loss,myrun - train/CE loss__MIN,myrun - train/CE loss__MAX,"
                 "myrun - eval/heldout/CE loss"]
    for s in range(0, 1001, 20):
        ev = f"{2.7 - 0.02:.6f}" if s == 400 else ""
        csv_lines.append(f"{s},{line(s) - 0.02},0,9,{ev}")
    (tmp_path / "wandb.csv").write_text("\n".join(csv_lines) + "\n")

    ref = read_run(tsv)
    run = read_run(tmp_path / "run")
    wb = read_run(tmp_path / "wandb.csv")
    assert run.label == "run" and wb.label == "myrun" and ref.label == "ref"
    assert len(ref.steps) == 101 and len(run.steps) == len(run_steps) and len(wb.steps) == 51
    assert run.evals == {"eval/heldout/CE loss": {400: 2.7}, "eval/heldout/PPL": {400: math.exp(2.7)}}
    assert wb.evals == {"eval/heldout/CE loss": {400: pytest.approx(2.68)}}

    s, g = gap(run, ref)
    assert s[0] == 5 and s[-1] == 995          # steps past the reference's range are not extrapolated
    np.testing.assert_allclose(g, 0.01, atol=1e-12)
    s, g = gap(wb, ref)
    assert len(s) == 51
    np.testing.assert_allclose(g, -0.02, atol=1e-12)
    s, g = gap(ref, wb)                        # the other way round: the baseline is interpolated
    np.testing.assert_allclose(g, 0.02, atol=1e-12)
    assert read_run(tmp_path / "run" / "metrics.jsonl").label == "run"


def test_headerless_tsv_multi_run_csv_and_bad_inputs(tmp_path):
    (tmp_path / "golden.tsv").write_text("1\t3.5\n2\t3.25\n3\t3.0\n")
    r = read_run(tmp_path / "golden.tsv")
    assert r.steps.tolist() == [1, 2, 3] and r.loss.tolist() == [3.5, 3.25, 3.0]
    (tmp_path / "two.csv").write_text("Step,a - train/CE loss,b - train/CE loss\n1,2.0,2.5\n2,1.9,\n3,1.8,2.3\n")
    a, b = read_runs(tmp_path / "two.csv")
    assert (a.label, b.label) == ("a", "b") and b.steps.tolist() == [1, 3]
    (tmp_path / "nostep.csv").write_text("x,train/CE loss\n1,2\n")
    with pytest.raises(ValueError, match="no step column"):
        read_run(tmp_path / "nostep.csv")
    (tmp_path / "noloss.tsv").write_text("step\tlr\n1\t0.1\n")
    with pytest.raises(ValueError, match="no loss column"):
        read_run(tmp_path / "noloss.tsv")
    with pytest.raises(FileNotFoundError):
        read_run(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="holds 2 runs"):
        read_run(tmp_path / "two.csv")
    # A crashed writer's partial last line is ignored; a resumed run's repeated step keeps the last value.
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1, "train/CE loss": 3.0}\n{"step": 2, "train/CE loss": 2.0}\n'
                 '{"step": 2, "train/CE loss": 2.5}\n{"step": 3, "train/C')
    r = read_run(p)
    assert r.steps.tolist() == [1, 2] and r.loss.tolist() == [3.0, 2.5]
    # The verify checks read metrics.jsonl with the same parser and the same tolerance; a bad line
    # elsewhere is an error; the MaxText run's names are read under OLMo-core's.
    (tmp_path / "run2").mkdir()
    maxtext_named = p.read_text().replace('"step": 1,', '"step": 1, "perf/total_tokens": 8,')
    (tmp_path / "run2" / "metrics.jsonl").write_text(maxtext_named)
    rows = read_metrics(tmp_path / "run2")
    assert sorted(rows) == [1, 2] and rows[1]["throughput/total tokens"] == 8 and rows[2]["train/CE loss"] == 2.5
    p.write_text('{"step": 1}\n{"step": 2, "train/C\n{"step": 3}\n')
    with pytest.raises(ValueError, match="m.jsonl:2: not a JSON object"):
        metric_rows(p)


# --------------------------------------------------------------------------- gaps and deltas


def test_unreadable_tables_and_out_of_range_steps_name_the_file(tmp_path):
    """A CSV that is not UTF-8 names the file; a step past int64 names the file and line."""
    bad = tmp_path / "bad.csv"
    bad.write_bytes(b"\xffstep,train/CE loss\n1,2.0\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(bad))}: not a CSV or TSV text file"):
        read_runs(bad)
    big = tmp_path / "big.jsonl"
    big.write_text('{"step": 1, "train/CE loss": 3.0}\n{"step": 9223372036854775808, "train/CE loss": 2.0}\n')
    with pytest.raises(ValueError, match=rf"{re.escape(str(big))}:2: step 9223372036854775808 is out of range"):
        read_run(big)
    big.write_text('{"step": 1, "train/CE loss": 3.0}\n{"step": 1e300, "train/CE loss": 2.0}\n')
    with pytest.raises(ValueError, match=rf"{re.escape(str(big))}:2: step .* is out of range"):
        read_run(big)
    big.write_text('{"step": 9223372036854775807, "train/CE loss": 2.0}\n')  # the largest step is kept exactly
    assert read_run(big).steps.tolist() == [2**63 - 1]
    table = tmp_path / "big.csv"
    table.write_text("step,train/CE loss\n1,2.0\n\n99999999999999999999,1.0\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(table))}:4: step .* is out of range"):
        read_run(table)
    (tmp_path / "big.tsv").write_text("1\t2.0\n1e30\t1.0\n")
    with pytest.raises(ValueError, match=r"big.tsv:2: step .* is out of range"):
        read_run(tmp_path / "big.tsv")


def test_bins_window_and_paired_deltas_on_known_inputs():
    edges, width = bin_edges(1, 10, 2)
    assert width == 5 and edges.tolist() == [0, 5, 10]
    steps = np.arange(1, 11)
    bins = bin_gap(steps, steps.astype(float), edges, smooth=3)
    assert [b["mean"] for b in bins] == [3.0, 8.0]
    assert bins[0]["se"] == pytest.approx(math.sqrt(2.5) / math.sqrt(5))   # std ddof=1 of 1..5 / sqrt(5)
    assert [b["n"] for b in bins] == [5, 5]
    assert [b["smoothed"] for b in bins] == [5.5, 5.5]                     # centred mean of the two bins
    m, se, n = window_gap(steps, steps.astype(float), 10, 4)               # steps 7..10
    assert (m, n) == (8.5, 4) and se == pytest.approx(np.std([7, 8, 9, 10], ddof=1) / 2)
    d, se = paired_delta([1.0, 2.0, 3.0], [0.5, 1.5, 2.0])
    assert d == pytest.approx(2 / 3) and se == pytest.approx(np.std([0.5, 0.5, 1.0], ddof=1) / math.sqrt(3))


def test_milestone_table_deltas_and_uncertainty(tmp_path):
    def rows(offset: float, per_batch: list[float]) -> list[dict]:
        out = [{"step": s, "train/CE loss": float(line(s) + offset)} for s in range(1, 101)]
        ev = {"step": 100, "eval/heldout/CE loss": float(np.mean(per_batch)), "eval/other": 1.0 + offset}
        ev.update({f"eval/heldout/CE loss [batch {i}]": v for i, v in enumerate(per_batch)})
        return out + [ev]

    base = read_run(write_jsonl(tmp_path / "a.jsonl", rows(0.0, [2.0, 2.2, 2.4, 2.6])))
    run = read_run(write_jsonl(tmp_path / "b.jsonl", rows(-0.03, [1.95, 2.16, 2.35, 2.58])))
    assert base.per_batch["eval/heldout/CE loss"][100] == [2.0, 2.2, 2.4, 2.6]
    table = milestone_table([run], base, width=10)
    by = {r["metric"]: r for r in table}
    assert set(by) == {"train/CE loss", "eval/heldout/CE loss", "eval/other"}
    h = by["eval/heldout/CE loss"]["deltas"]["b"]
    d = np.array([1.95, 2.16, 2.35, 2.58]) - np.array([2.0, 2.2, 2.4, 2.6])
    assert h["delta"] == pytest.approx(d.mean())
    assert h["se"] == pytest.approx(d.std(ddof=1) / 2) and h["se_method"] == "paired per-batch"
    o = by["eval/other"]["deltas"]["b"]
    assert o["delta"] == pytest.approx(-0.03) and o["se"] is None
    t = by["train/CE loss"]["deltas"]["b"]
    assert t["delta"] == pytest.approx(-0.03) and t["se"] == pytest.approx(0.0, abs=1e-12)
    assert t["se_method"] == "window"


# --------------------------------------------------------------------------- the alarm


def curves(kind: str, seed: int = 0) -> tuple[dict, dict]:
    """Training loss every 10 steps to 2000 and held-out loss every 250 steps.

    reference: a smooth decay; repeated: training drops 0.06 below the reference from step 1200
    (memorising repeated instances) while held-out gets slightly worse; honest: both 0.05 / 0.04
    better; same: both equal the reference up to noise."""
    rng = np.random.default_rng(seed)
    steps = np.arange(10, 2001, 10)
    base = 2.0 + 2.0 * np.exp(-steps / 300)
    noise = rng.normal(0, 0.004, len(steps))
    hsteps = np.arange(250, 2001, 250)
    hbase = 2.1 + 2.0 * np.exp(-hsteps / 300)
    if kind == "reference":
        train, held = base + noise, hbase
    elif kind == "repeated":
        train, held = base + noise - 0.06 * np.clip((steps - 1200) / 100, 0, 1), hbase + 0.002
    elif kind == "honest":
        train, held = base + noise - 0.05, hbase - 0.04
    else:
        train, held = base + noise, hbase + 0.001
    return dict(zip(steps.tolist(), train.tolist())), dict(zip(hsteps.tolist(), held.tolist()))


def test_alarm_fires_on_repeated_data_and_stays_quiet_on_honest_runs():
    ref_t, ref_h = curves("reference")
    cfg = AlarmConfig()
    rep_t, rep_h = curves("repeated", 1)
    res = check_memorisation(rep_t, ref_t, rep_h, ref_h, cfg, label="repeated", window=200)
    assert res.fired and res.status == "memorisation"
    assert res.first_fired_step == 1500                      # the first held-out check after the drop
    assert "MEMORISATION ALARM" in res.message and "repeated" in res.message
    early = [c for c in res.checks if c.step < 1200]
    assert early and all(c.status == "ok" for c in early)
    for kind in ("honest", "same"):
        t, h = curves(kind, 2)
        r = check_memorisation(t, ref_t, h, ref_h, cfg, window=200)
        assert not r.fired and r.status == "ok", (kind, r.message)
    # Without a held-out reference, a training gain is reported as unverified, not as fine.
    r = check_memorisation(rep_t, ref_t, rep_h, None, cfg, window=200)
    assert not r.fired and r.status == "unverified" and "no held-out" in r.message


def test_alarm_rule_is_explicit():
    cfg = AlarmConfig(threshold=0.02, heldout_fraction=0.25, min_points=1)
    assert judge(-0.019, 10, None, cfg) == "ok"                # within the threshold: nothing to explain
    assert judge(-0.06, 10, 0.0, cfg) == "memorisation"         # train better, held-out flat
    assert judge(-0.06, 10, -0.014, cfg) == "memorisation"      # held-out kept < 25% of the gain
    assert judge(-0.06, 10, -0.016, cfg) == "ok"                # held-out kept > 25%: a real gain
    assert judge(-0.06, 10, None, cfg) == "unverified"
    assert judge(-0.06, 0, 0.0, AlarmConfig()) == "insufficient-data"
    assert interp([(0, 1.0), (10, 2.0)], 5) == 1.5 and interp([(0, 1.0), (10, 2.0)], 11) is None
    with pytest.raises(ValueError, match="threshold"):
        AlarmConfig(threshold=0.0)


def test_in_loop_hook(tmp_path):
    ref_t, ref_h = curves("reference")
    rep_t, rep_h = curves("repeated", 1)
    alarm = MemorisationAlarm(ref_t, ref_h, window=200, label="run")
    msgs = {s: alarm.update(s, loss, rep_h.get(s)) for s, loss in rep_t.items()}
    fired = {s: m for s, m in msgs.items() if m}
    assert sorted(fired) == [1500, 1750, 2000]                 # every held-out check after the drop
    assert all("MEMORISATION ALARM" in m for m in fired.values())
    assert alarm.status == "memorisation" and alarm.result().fired and alarm.result().first_fired_step == 1500
    honest_t, honest_h = curves("honest", 3)
    quiet = MemorisationAlarm(ref_t, ref_h, window=200)
    assert all(quiet.update(s, loss, honest_h.get(s)) is None for s, loss in honest_t.items())
    # A reference given as a file (our JSONL) brings its held-out curve along.
    rows = [{"step": s, "train/CE loss": v} for s, v in ref_t.items()]
    rows += [{"step": s, "eval/heldout/CE loss": v} for s, v in ref_h.items()]
    hook = MemorisationAlarm(str(write_jsonl(tmp_path / "ref.jsonl", rows)), window=200)
    assert any(hook.update(s, loss, rep_h.get(s)) for s, loss in rep_t.items())


# --------------------------------------------------------------------------- the report


def test_compare_writes_report_with_plots(tmp_path, capsys):
    ref_t, ref_h = curves("reference")
    tsv = tmp_path / "ai2.tsv"
    tsv.write_text("step\ttrain/CE loss\teval/heldout/CE loss\n" +
                   "".join(f"{s}\t{v}\t{ref_h.get(s, '')}\n" for s, v in ref_t.items()))
    for kind in ("repeated", "honest"):
        t, h = curves(kind, 5)
        rows = [{"step": s, "train/CE loss": v} for s, v in t.items()]
        rows += [{"step": s, "eval/heldout/CE loss": v} for s, v in h.items()]
        write_jsonl(tmp_path / kind / "metrics.jsonl", rows)
    out = tmp_path / "report"
    s = compare([str(tmp_path / "repeated"), str(tmp_path / "honest")], str(tsv), out=out, bins=20)
    assert s["baseline"] == "reference" and s["baseline_is_reference"]
    assert s["alarms"]["repeated"]["fired"] and not s["alarms"]["honest"]["fired"]
    assert s["gaps"]["honest"]["mean"] == pytest.approx(-0.05, abs=0.002)
    assert s["heldout_metric"] == "eval/heldout/CE loss"
    assert {r["step"] for r in s["milestones"]} == set(ref_h)
    for name in ("loss.png", "gap.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000
    md = (out / "report.md").read_text()
    assert "![loss.png](loss.png)" in md and "![gap.png](gap.png)" in md and "MEMORISATION ALARM" in md
    assert "| step | metric |" in md
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 2 and "class='alert'" in html
    assert json.loads((out / "summary.json").read_text())["files"]["report_html"] == str(out / "report.html")

    # The command line: --json prints the summary; --fail-on-alarm turns the alarm into exit 1.
    from olmax.eval.commands import register
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())  # eval and compare
    args = parser.parse_args(["compare", str(tmp_path / "repeated"), "--reference", str(tsv), "--labels", "rep",
                              "--out", str(tmp_path / "r2"), "--bins", "20", "--json", "--fail-on-alarm"])
    capsys.readouterr()
    assert args.func(args) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["alarms"]["rep"]["fired"]
    assert "MEMORISATION ALARM" in captured.err
    args = parser.parse_args(["compare", str(tmp_path / "honest"), "--out", str(tmp_path / "r3"), "--labels", "a", "b"])
    with pytest.raises(ValueError, match="2 labels for 1 inputs"):
        args.func(args)
