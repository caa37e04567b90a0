"""Loader: same batches for any worker count, exact resume (across an epoch boundary too),
fingerprint checks on resume, label masks, and the global jax.Array."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from data_testlib import make_cfg, random_files, write_tokens

from olmax.data import DataError
from olmax.data.dataset import dirty_instances
from olmax.data.loader import DataLoader, DataState
from olmax.data.order import process_share


def ids_of(batches: list[dict]) -> np.ndarray:
    return np.stack([b["instance_ids"] for b in batches])


def test_workers_same_batches_and_resume(cfg) -> None:
    """W=0, W=2 and W=1 give the same stream; W=2 stopped at step 19 and resumed with W=1 across
    the epoch boundary (21 steps per epoch) equals the uninterrupted W=0 run."""
    def loader(w: int, **kw) -> DataLoader:
        return DataLoader(cfg.override([f"data.workers={w}"]), process_index=1, process_count=3, stop_step=30, **kw)
    base = list(loader(0))
    head, dl = [], loader(2)
    for b in dl:
        head.append(b)
        if len(head) == 19:
            break
    dl.close()
    rest = list(loader(1, resume=dl.state()))
    assert [int(b["step"]) for b in head + rest] == list(range(30))
    for a, b in zip(base, head + rest):
        for k in ("input_ids", "instance_ids", "label_mask"):
            assert np.array_equal(a[k], b[k])
    assert np.array_equal(ids_of(base), process_share(dl.order, np.arange(30), 1, 3))
    b = base[0]
    assert b["input_ids"].dtype == np.int32 and b["input_ids"].shape == (4, 32)
    assert b["instance_ids"].dtype == np.int64 and b["label_mask"].dtype == bool and b["label_mask"].all()
    assert np.array_equal(b["input_ids"], dl.dataset.read(b["instance_ids"]))


def test_resume_equals_uninterrupted_across_epoch_boundary(cfg) -> None:
    full = list(DataLoader(cfg, stop_step=45))               # 21 batches per epoch: epochs 1, 2, 3
    for k in (0, 7, 20, 21, 38):
        first = DataLoader(cfg, stop_step=45)
        it = iter(first)
        head = [next(it) for _ in range(k)]
        first.close()
        state = DataState.from_dict(json.loads(json.dumps(first.state().to_dict())))  # as a checkpoint stores it
        assert state.batches_processed == k and state.epoch == 1 + k // 21
        assert state.tokens_processed == k * 12 * 32 and state.fingerprint == first.dataset.fingerprint
        rest = list(DataLoader(cfg.override(["data.prefetch=0"]), stop_step=45, resume=state))  # synchronous reads
        assert np.array_equal(ids_of(head + rest), ids_of(full)), k
        assert all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(head + rest, full))
    # epoch 2 is a reshuffle (seed + 2), not a repeat of epoch 1
    assert not np.array_equal(ids_of(full[:21]), ids_of(full[21:42]))
    assert len(set(ids_of(full[:21]).ravel())) == len(set(ids_of(full[21:42]).ravel())) == 21 * 12


def test_fingerprint_mismatch_names_the_change(tmp_path: Path, files: list[str], cfg) -> None:
    state = DataLoader(cfg, start_step=5).state()

    def resume(c, **kw) -> DataLoader:
        return DataLoader(c, resume=state, **kw)

    assert resume(cfg).start_step == 5
    extra = random_files(tmp_path / "more", sizes=(640,), seed=9)
    with pytest.raises(DataError, match=r"files added: part-00000.npy"):
        resume(make_cfg(files + extra, tmp_path / "cache"))
    with pytest.raises(DataError) as err:   # a repeated basename inserted mid-list: only that one is new
        resume(make_cfg(files[:2] + extra + files[2:], tmp_path / "cache"))
    assert ("data state: files added: part-00000.npy. Restore the original files, start a new --run-dir, "
            "or pass --allow-fingerprint-mismatch" in str(err.value))
    with pytest.raises(DataError, match=r"files removed: part-00004.npy"):
        resume(make_cfg(files[:4], tmp_path / "cache"))
    with pytest.raises(DataError, match=r"sequence_length changed: 32 -> 16"):
        resume(cfg.override(["data.sequence_length=16"]))
    with pytest.raises(DataError, match=r"eos_token_id changed: 0 -> 2"):
        resume(cfg.override(["data.eos_token_id=2"]))
    with pytest.raises(DataError, match=r"data.seed=1 but the saved data state used seed 34521"):
        resume(cfg.override(["data.seed=1"]))
    with pytest.raises(DataError, match=r"train.global_batch_size=24"):
        resume(cfg.override(["train.global_batch_size=24"]))
    with pytest.raises(DataError, match=r"start_step=3 disagrees"):
        DataLoader(cfg, start_step=3, resume=state)
    grown = np.concatenate([np.fromfile(files[1], "<u2"), np.ones(64, np.uint16)])
    write_tokens(Path(files[1]), grown)
    with pytest.raises(DataError,
                       match=r"files resized: part-00001.npy \(5000 -> 5128 bytes\).*allow-fingerprint-mismatch"):
        resume(cfg)
    dl = resume(cfg, allow_fingerprint_mismatch=True)          # the explicit override
    assert dl.start_step == 5 and dl.state().fingerprint != state.fingerprint
    with pytest.raises(DataError, match=r"unknown keys \['bogus'\]"):
        DataState.from_dict({**state.to_dict(), "bogus": 1})
    with pytest.raises(DataError, match=r"missing keys \['seed'\]"):
        DataState.from_dict({k: v for k, v in state.to_dict().items() if k != "seed"})


def test_label_mask_follows_repetition_filter(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, 1000, 32 * 60)
    for i in range(0, 60, 4):                      # every 4th instance: 32 repeats of period 1
        tokens[i * 32:(i + 1) * 32] = 7
    paths = [write_tokens(tmp_path / "t.npy", tokens)]
    on = make_cfg(paths, tmp_path / "c", "data.repetition_filter=true", "data.repetition_max_period=5")
    for c, filt in ((on, True), (on.override(["data.repetition_filter=false"]), False)):
        for b in DataLoader(c, stop_step=5):
            dirty = dirty_instances(b["input_ids"], max_period=5) if filt else np.zeros(12, bool)
            assert np.array_equal(b["label_mask"], np.repeat(~dirty[:, None], 32, axis=1))
            assert np.array_equal(dirty, b["instance_ids"] % 4 == 0 if filt else dirty)


def test_bad_topology(cfg) -> None:
    with pytest.raises(DataError, match="global_batch_size=12 is not divisible by the 5 data processes"):
        DataLoader(cfg, process_count=5)
    with pytest.raises(DataError, match="process index 3 is outside 0..2"):
        DataLoader(cfg, process_index=3, process_count=3)


def test_global_batch_to_device(tmp_path: Path, cfg) -> None:
    """4 fake CPU devices, mesh (data=2, fsdp=2, tensor=1): the batch is sharded 4 ways."""
    (tmp_path / "cfg.yaml").write_text(cfg.to_yaml())
    script = textwrap.dedent(f"""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax, numpy as np
        from jax.sharding import Mesh
        from olmax.recipes import get_recipe
        from olmax.data.loader import DataLoader, global_batch_to_device
        cfg = get_recipe({str(tmp_path / "cfg.yaml")!r})
        local = DataLoader(cfg).batch(3)
        mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 1), ("data", "fsdp", "tensor"))
        g = global_batch_to_device(local, mesh)
        x = g["input_ids"]
        assert x.shape == (12, 32) and x.dtype == np.int32, x.shape
        assert tuple(x.sharding.spec) == (("data", "fsdp"), None), x.sharding.spec
        assert [s.data.shape for s in x.addressable_shards] == [(3, 32)] * 4
        assert np.array_equal(np.asarray(x), local["input_ids"])
        assert np.array_equal(np.asarray(g["label_mask"]), local["label_mask"])
        assert int(g["step"]) == 3
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
