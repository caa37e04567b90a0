"""Metric sinks: JSONL rows and resume truncation, TensorBoard tags read back by TensorBoard, progress."""

from __future__ import annotations

import io
import json

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from olmax.metrics.sinks import (METRIC_NAMES, JsonlSink, MetricsLogger, ProgressBar, TensorBoardSink,
                                 named)


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_rows_and_scalar_types(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLogger([JsonlSink(path)])
    log.log(1, {"train/CE loss": 2.5, "optim/LR (group 0)": np.float32(1.5e-4), "throughput/total tokens": 4096,
                "optim/step skipped": jnp.asarray(False), "throughput/MFU": None, "train/Z loss": jnp.float32(0.25)})
    log.log(2, {"train/CE loss": jnp.asarray(2.25, jnp.bfloat16)})
    log.close()
    got = rows(path)
    assert got[0] == {"step": 1, "train/CE loss": 2.5, "optim/LR (group 0)": float(np.float32(1.5e-4)),
                      "throughput/total tokens": 4096, "optim/step skipped": 0, "train/Z loss": 0.25}
    assert isinstance(got[0]["throughput/total tokens"], int) and "throughput/MFU" not in got[0]
    assert got[1] == {"step": 2, "train/CE loss": 2.25}
    with pytest.raises(ValueError, match="not a scalar"):
        MetricsLogger([]).log(3, {"x/y": np.zeros(2)})


def test_jsonl_resume_truncates_rows_past_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for s in range(1, 8):
        sink.write(s, {"train/CE loss": 10.0 - s})
    sink.close()
    with open(path, "a") as f:
        f.write('{"step": 8, "train/CE lo')  # the crashed run died mid-line
    # Resume from checkpoint 5: rows 6..8 belong to the lost steps and are redone.
    sink = JsonlSink(path)
    sink.truncate_after(5)
    assert [r["step"] for r in rows(path)] == [1, 2, 3, 4, 5]
    for s in range(6, 9):
        sink.write(s, {"train/CE loss": 10.0 - s})
    sink.close()
    assert rows(path) == [{"step": s, "train/CE loss": 10.0 - s} for s in range(1, 9)]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
    # Appending without truncation (resume exactly where the file ends) keeps everything.
    sink = JsonlSink(path)
    sink.write(9, {"train/CE loss": 1.0})
    sink.close()
    assert [r["step"] for r in rows(path)] == list(range(1, 10))


def test_jsonl_unterminated_tail_is_dropped_on_open(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "a/b": 1.0}\n{"step": 2, "a/')
    sink = JsonlSink(path)
    sink.write(2, {"a/b": 2.0})
    sink.close()
    assert rows(path) == [{"step": 1, "a/b": 1.0}, {"step": 2, "a/b": 2.0}]


def test_metric_names_each_value_once():
    assert METRIC_NAMES["ce_loss"] == "train/CE loss" and METRIC_NAMES["lr"] == "optim/LR (group 0)"
    out = named({"ce_loss": 1.0, "step_skipped": 0, "total_tokens": 8, "eval/heldout loss": 2.0})
    assert out == {"train/CE loss": 1.0, "optim/step skipped": 0, "throughput/total tokens": 8,
                   "eval/heldout loss": 2.0}
    with pytest.raises(KeyError, match="unknown metric key 'loss'"):
        named({"loss": 1.0})


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_tags_and_values_read_by_tensorboard(tmp_path):
    log = MetricsLogger([TensorBoardSink(tmp_path / "tb")])
    values = {name: float(i) + 0.5 for i, name in enumerate(METRIC_NAMES.values())}
    for step in (1, 2, 3):
        log.log(step, {k: v * step for k, v in values.items()})
    log.close()
    got = scalars(tmp_path / "tb")
    assert set(got) == set(METRIC_NAMES.values())  # "train/CE loss", "optim/LR (group 0)" unchanged
    for name, v in values.items():
        assert got[name] == [(s, float(np.float32(v * s))) for s in (1, 2, 3)]


def test_tensorboard_resume_hides_steps_of_the_crashed_run(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    for s in range(1, 6):
        sink.write(s, {"train/CE loss": 100.0 + s})
    sink.close()
    logger = MetricsLogger([TensorBoardSink(tmp_path / "tb")])
    logger.truncate_after(3)  # resumed from checkpoint 3 (right away: same-second file names too)
    for s in range(4, 7):
        logger.log(s, {"train/CE loss": float(s)})
    logger.close()
    assert scalars(tmp_path / "tb")["train/CE loss"] == [(1, 101.0), (2, 102.0), (3, 103.0), (4, 4.0),
                                                        (5, 5.0), (6, 6.0)]


def test_progress_prints_plain_lines_when_not_a_tty():
    out = io.StringIO()
    bar = ProgressBar(20, 10, every=5, file=out)
    for s in range(11, 21):
        bar.update(s, loss=3.25, tokens_per_sec=12345.0)
    bar.write("step 20: eval/heldout loss 3.0")
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("step 15/20 (75.0%) loss 3.2500 12.3k tok/s elapsed ")
    assert "eta" in lines[0] and lines[1].startswith("step 20/20 (100.0%)")
    assert lines[2] == "step 20: eval/heldout loss 3.0"


def test_progress_bar_forced_uses_tqdm():
    out = io.StringIO()
    bar = ProgressBar(4, 0, file=out, force=True)
    for s in range(1, 5):
        bar.update(s, loss=1.0, tokens_per_sec=10.0)
    bar.close()
    text = out.getvalue()
    assert "4/4" in text and "loss 1.0000" in text and "step 4/4 (" not in text
