"""Global order: equal to OLMo-core's loader, cached on disk, split only by process_share."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from data_testlib import VOCAB, random_files
from olmo_core.data import DataCollator, NumpyFSLDataset
from olmo_core.data.data_loader import NumpyDataLoaderBase
from olmo_core.data.numpy_dataset import InstanceFilterConfig

from olmax.data import DataError
from olmax.data import order as order_mod
from olmax.data.dataset import TokenDataset
from olmax.data.loader import StepSource
from olmax.data.order import GlobalOrder, build_epoch_order, process_share, worker_steps

L, B, SEED = 32, 12, 34521


@pytest.mark.parametrize("ranks", [1, 3])
def test_order_and_filter_equal_olmo_core_loader(tmp_path: Path, ranks: int) -> None:
    """OLMo-core's own NumpyFSLDataLoader (per dp rank, epochs 1 and 2) reads exactly our ids,
    tokens and instance-filter decisions."""
    rng = np.random.default_rng(7)
    paths = random_files(tmp_path / "tok", sizes=(1000, 2500, 31, 4000, 777), vocab=4, seed=3)  # tiny vocab:
    data = [np.fromfile(p, "<u2") for p in paths]                                                  # natural runs
    for d in data[:2] + data[3:]:
        for s in rng.integers(0, len(d) - 40, 15):
            d[s:s + 36] = 9                                                                         # and planted ones
    for p, d in zip(paths, data):
        d.tofile(p)
    filt = InstanceFilterConfig(repetition_max_period=13, repetition_min_period=1, repetition_max_count=32)
    ref = NumpyFSLDataset(*paths, sequence_length=L, pad_token_id=1, eos_token_id=0, vocab_size=VOCAB,
                          dtype=np.uint16, instance_filter_config=filt)
    ours = TokenDataset(paths, sequence_length=L, vocab_size=VOCAB, eos_token_id=0, pad_token_id=1, dtype="uint16")
    order = GlobalOrder(len(ours), B, SEED)
    dirty_seen = 0
    for rank in range(ranks):
        source = StepSource(ours, order, rank, ranks, repetition_filter=(1, 13, 32))
        loader = NumpyDataLoaderBase.wrap_numpy_dataset(
            ref, global_batch_size=B * L, collator=DataCollator(pad_token_id=1), work_dir=tmp_path / "olmo",
            seed=SEED, dp_world_size=ranks, dp_rank=rank)
        for epoch in (1, 2):
            loader.reshuffle(epoch=epoch)
            n = 0
            for i, batch in enumerate(loader):
                mine = source((epoch - 1) * order.batches_per_epoch + i)
                assert np.array_equal(batch["index"].numpy(), mine["instance_ids"]), (rank, epoch, i)
                assert np.array_equal(batch["input_ids"].numpy(), mine["input_ids"])
                assert np.array_equal(batch["instance_mask"].numpy(), mine["label_mask"].all(axis=1))
                dirty_seen += int((~batch["instance_mask"]).sum())
                n += 1
            loader.reset()
            assert n == order.batches_per_epoch == 258 // B
    assert dirty_seen > 0


def test_cache_is_memory_mapped_reused_and_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    o = GlobalOrder(1000, 64, 5, cache_dir=tmp_path, key="abc")
    e1 = o.epoch(1)
    assert isinstance(e1.base, np.memmap) or isinstance(e1, np.memmap)
    assert np.array_equal(e1.reshape(-1), build_epoch_order(1000, 5, 1)[:15 * 64])
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == \
        ["order-abc-n1000-seed5-epoch1.npy"]                       # no temporary file left behind
    assert (tmp_path / "order-abc-n1000-seed5-epoch1.npy").stat().st_size == 4000

    def boom(*a: object) -> None:
        raise AssertionError("rebuilt although cached")
    monkeypatch.setattr(order_mod, "build_epoch_order", boom)
    again = GlobalOrder(1000, 64, 5, cache_dir=tmp_path, key="abc")
    assert np.array_equal(again.epoch(1), e1)                      # a restart recomputes nothing
    with pytest.raises(AssertionError, match="rebuilt"):
        GlobalOrder(1000, 64, 6, cache_dir=tmp_path, key="abc").epoch(1)   # another seed is another file


@pytest.mark.parametrize("damage", ["random", "duplicate"])
def test_damaged_cache_is_rebuilt_with_a_note(tmp_path: Path, capsys: pytest.CaptureFixture, damage: str) -> None:
    """A cache file of the right size but wrong content (random bytes: ids past N; one id written
    twice: not a permutation) is rebuilt from (seed, epoch), with a note naming it, not read."""
    GlobalOrder(1000, 64, 5, cache_dir=tmp_path, key="abc").epoch(1)
    path = tmp_path / "order-abc-n1000-seed5-epoch1.npy"
    if damage == "random":
        path.write_bytes(np.random.default_rng(0).bytes(4000))
    else:
        perm = np.fromfile(path, "<u4")
        perm[1] = perm[0]
        perm.tofile(path)
    again = GlobalOrder(1000, 64, 5, cache_dir=tmp_path, key="abc")
    assert np.array_equal(again.epoch(1).reshape(-1), build_epoch_order(1000, 5, 1)[:15 * 64])
    assert np.array_equal(np.fromfile(path, "<u4"), build_epoch_order(1000, 5, 1))
    err = capsys.readouterr().err
    assert f"note: order cache {path} " in err and "rebuilding it" in err and len(err.splitlines()) == 1
    assert not list(tmp_path.glob("*.tmp*"))


def test_steps_epochs_and_shares() -> None:
    o = GlobalOrder(100, 8, 1)
    assert o.batches_per_epoch == 12 and o.locate(11) == (1, 11) and o.locate(12) == (2, 0)
    e1, e2 = o.epoch(1), o.epoch(2)
    assert np.array_equal(o.batches([11, 12, 0]), np.stack([e1[11], e2[0], e1[0]]))
    # epoch e is PCG64(seed + e) over arange(N, uint32), truncated to whole batches
    perm = np.arange(100, dtype=np.uint32)
    np.random.Generator(np.random.PCG64(1 + 2)).shuffle(perm)
    assert np.array_equal(e2.reshape(-1), perm[:96]) and not np.array_equal(e1, e2)
    for R in (1, 2, 4, 8):
        shares = [process_share(o, np.arange(30), r, R) for r in range(R)]
        merged = np.empty((30, 8), np.uint32)
        for r, s in enumerate(shares):
            merged[:, r::R] = s
        assert np.array_equal(merged, o.batches(np.arange(30)))
    with pytest.raises(DataError, match="global_batch_size=8 is not divisible by the 3 data processes"):
        process_share(o, np.arange(2), 0, 3)
    assert list(worker_steps(5, 15, 1, 3)) == [6, 9, 12] and list(worker_steps(5, 8, 0, 0)) == [5, 6, 7]


def test_global_batch_larger_than_epoch(tmp_path: Path, cfg) -> None:
    with pytest.raises(DataError, match=r"train.global_batch_size=300 is larger than the epoch \(258 instances\)"):
        GlobalOrder(258, 300, 1)
    from olmax.data.loader import DataLoader
    with pytest.raises(DataError, match="train.global_batch_size=300 is larger than the epoch"):
        DataLoader(cfg.override(["train.global_batch_size=300"]))


@pytest.mark.slow
def test_real_size_order_builds_fast(tmp_path: Path) -> None:
    """724M instances (the OLMo 3 stage-1 mix at L=8192): one uint32 copy, about a minute."""
    import time
    t = time.perf_counter()
    o = GlobalOrder(724_000_000, 512, 34521, cache_dir=tmp_path)
    row = o.batches([0])
    assert row.shape == (1, 512) and time.perf_counter() - t < 120
