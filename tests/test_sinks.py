"""Metric sinks: JSONL rows and resume truncation, TensorBoard tags read back by TensorBoard, W&B runs
read back from their offline files, progress."""

from __future__ import annotations

import io
import json
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from olmax.metrics.sinks import METRIC_NAMES, JsonlSink, MetricsLogger, ProgressBar, TensorBoardSink, named


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


# --------------------------------------------------------------------------- Weights & Biases


def _wandb_offline(monkeypatch, tmp_path):
    """W&B offline, every file of it under tmp_path, no API key, no network."""
    for k in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for k, sub in (("WANDB_DIR", "wandb_dir"), ("WANDB_CONFIG_DIR", "wandb_config"), ("WANDB_CACHE_DIR", "wandb_cache"),
                   ("WANDB_DATA_DIR", "wandb_data"), ("WANDB_ARTIFACT_DIR", "wandb_artifacts")):
        (tmp_path / sub).mkdir(exist_ok=True)
        monkeypatch.setenv(k, str(tmp_path / sub))
    return tmp_path / "wandb_dir"


def wandb_records(path):
    """The records of a W&B ``.wandb`` file (a W&B header, then a LevelDB log of Record protos)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def wandb_history(path) -> list[dict]:
    rows = []
    for r in wandb_records(path):
        if r.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            rows.append({"step": row.pop("_step"), **{k: v for k, v in row.items() if not k.startswith("_")}})
    return rows


@pytest.mark.integration
def test_wandb_sink_logs_the_jsonl_rows_offline_and_a_restart_resumes_the_same_run(tmp_path, corpus, monkeypatch):
    from olmax.recipes import get_recipe
    from olmax.train.loop import train
    from trainlib import small_overrides
    wdir = _wandb_offline(monkeypatch, tmp_path)
    cfg = get_recipe("tiny", small_overrides(corpus, "train.steps=4", "wandb.project=olmax-test",
                                             "wandb.group=g", "wandb.tags=a,b"))
    run = tmp_path / "myrun"
    train(cfg, run, progress=False, max_steps_this_run=2)  # checkpoint 2, then a new process resumes
    rid = (run / "wandb_run_id").read_text().strip()
    train(cfg, run, progress=False)
    assert (run / "wandb_run_id").read_text().strip() == rid  # the restart kept the id
    runs = sorted((wdir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(d.name.endswith("-" + rid) for d in runs), runs
    files = [d / f"run-{rid}.wandb" for d in runs]
    first, second = (wandb_history(f) for f in files)
    jsonl = rows(run / "metrics.jsonl")
    assert [r["step"] for r in first] == [1, 2] and [r["step"] for r in second] == [3, 4]
    # The same rows as metrics.jsonl: names, steps and values.
    assert first + second == jsonl
    assert {"train/CE loss", "optim/LR (group 0)", "throughput/total tokens"} <= set(jsonl[0])
    info = [r.run for f in files for r in wandb_records(f) if r.WhichOneof("record_type") == "run"]
    assert [(i.run_id, i.project, i.run_group, i.display_name, list(i.tags)) for i in info] == \
        [(rid, "olmax-test", "g", "myrun", ["a", "b"])] * 2
    config = {u.key: json.loads(u.value_json) for u in info[0].config.update}
    assert config["wandb"]["project"] == "olmax-test" and config["model"]["d_model"] == 32


@pytest.mark.integration
def test_a_failing_wandb_warns_once_and_training_goes_on(tmp_path, corpus, monkeypatch, capfd):
    import wandb

    from olmax.recipes import get_recipe
    from olmax.train.loop import train
    from trainlib import small_overrides
    _wandb_offline(monkeypatch, tmp_path)

    def no_network(**kw):
        raise wandb.errors.CommError("network is unreachable")

    monkeypatch.setattr(wandb, "init", no_network)
    cfg = get_recipe("tiny", small_overrides(corpus, "train.steps=3", "wandb.project=olmax-test"))
    assert train(cfg, tmp_path / "run", progress=False).end_step == 3
    err = capfd.readouterr().err
    assert err.count("W&B logging stopped") == 1 and "CommError: network is unreachable" in err
    assert [r["step"] for r in rows(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]


class _FakeRun:
    def __init__(self, fail_at: int):
        self.id, self.dir, self.step, self.fail_at = "fake", "/nowhere/wandb/run/files", 0, fail_at
        self.logged, self.finished = [], []

    def log(self, values, step):
        if step == self.fail_at:
            raise OSError("wandb-core went away")
        self.logged.append(step)

    def finish(self, exit_code=0):
        self.finished.append(exit_code)


def test_wandb_sink_failing_mid_run_or_on_a_bad_id_file_warns_once(tmp_path, monkeypatch):
    """A log call that raises ends W&B logging for the run with one warning (the run is finished
    as failed); a resumed W&B run skips the steps W&B already holds; a run directory whose id
    file is not an id warns the same way."""
    import types

    from olmax.config import WandbConfig
    from olmax.metrics.sinks import WandbSink
    made = []

    def init(**kw):
        made.append(kw)
        return run

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Settings=lambda **kw: kw))
    run, err = _FakeRun(fail_at=5), io.StringIO()
    run.step = 3  # W&B holds steps 1 and 2 from a crashed run
    sink = WandbSink(WandbConfig(project="p", mode="offline"), tmp_path, err=err)
    for s in range(1, 8):
        sink.write(s, {"train/CE loss": 1.0})
    sink.close()
    assert run.logged == [3, 4] and run.finished == [1]
    assert err.getvalue().count("W&B logging stopped") == 1 and "OSError: wandb-core went away" in err.getvalue()
    assert made[0]["id"] == (tmp_path / "wandb_run_id").read_text().strip() and made[0]["resume"] == "allow"
    assert made[0]["mode"] == "offline" and made[0]["name"] == tmp_path.name and made[0]["dir"] == str(tmp_path)
    (tmp_path / "wandb_run_id").write_text("not an id!\n")
    run, err = _FakeRun(fail_at=-1), io.StringIO()
    sink = WandbSink(WandbConfig(project="p"), tmp_path, err=err)
    sink.write(1, {"train/CE loss": 1.0})
    sink.write(2, {"train/CE loss": 1.0})
    sink.close()
    assert len(made) == 1 and err.getvalue().count("W&B logging stopped") == 1 and "wandb_run_id" in err.getvalue()


def test_wandb_auto_mode_is_offline_without_an_api_key(tmp_path, monkeypatch):
    from olmax.metrics.sinks import _wandb_mode
    for k in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert _wandb_mode("auto") == "offline" and _wandb_mode("online") == "online"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    (tmp_path / "netrc").chmod(0o600)
    assert _wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    assert _wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert _wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert _wandb_mode("auto") is None and _wandb_mode("offline") == "offline"  # None: W&B reads WANDB_MODE


@pytest.mark.parametrize("override,said", [
    ("wandb.project=a/b", "wandb.project='a/b': W&B names are at most 128 characters"),
    ("wandb.project=" + "p" * 129, "too long"),
    ("wandb.entity=me", "wandb.entity set but wandb.project is empty"),
    ("wandb.mode=offline", "wandb.mode set but wandb.project is empty"),
    ("wandb.tags=ok," + "t" * 65, "wandb.tags: each tag must be 1 to 64 characters"),
    ("wandb.mode=banana", "wandb.mode: expected one of 'auto', 'online', 'offline'"),
    ("wandb.projekt=p", "did you mean 'wandb.project'"),
])
def test_wandb_config_errors_name_the_field(override, said):
    from olmax.config import ConfigError
    from olmax.recipes import get_recipe
    extra = ["wandb.project=p"] if "tags" in override else []
    with pytest.raises(ConfigError) as e:
        get_recipe("tiny", [*extra, override])
    assert said in str(e.value)
    assert get_recipe("tiny", ["wandb.project=my project", "wandb.tags=a,b"]).wandb.tags == ("a", "b")
