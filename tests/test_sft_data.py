"""SFT data: packed instances and label masks equal OLMo-core 3.0.0's ``NumpyPackedFSLDataset``
(which runs in the test), the global order and process split equal its data loader's for 1 to 4
processes, label masks reach the loss, and bad label-mask files are errors naming them."""

from __future__ import annotations

import numpy as np
import pytest

from olmax.config import ConfigError
from olmax.data import DataError
from olmax.data.packed import PackedDataset, best_fit_decreasing, document_spans

V, EOS, PAD, L = 512, 0, 1, 128


def write_sft_files(folder, n_files=2, docs=1600, seed=0, tail=True):
    """Token files of EOS-ended documents (lengths 1..300, so some exceed L=128 and are cut),
    optionally a tail without EOS (not a document), and label-mask files (one bool byte a token)."""
    rng = np.random.default_rng(seed)
    toks, masks = [], []
    for i in range(n_files):
        parts, mparts = [], []
        for _ in range(docs):
            n = int(rng.choice([rng.integers(1, 40), rng.integers(40, 128), rng.integers(128, 300)], p=[.5, .4, .1]))
            doc = rng.integers(2, V, size=n).astype(np.uint16)
            doc[-1] = EOS
            parts.append(doc)
            m = np.zeros(n, dtype=bool)
            m[int(rng.integers(0, n)):] = True  # a prompt, then the trained response
            mparts.append(m)
        if tail:
            parts.append(rng.integers(2, V, size=7).astype(np.uint16))
            mparts.append(np.ones(7, dtype=bool))
        t, m = folder / f"token_ids_part_{i:04d}.npy", folder / f"labels_mask_{i:04d}.npy"
        np.concatenate(parts).tofile(t)
        np.concatenate(mparts).tofile(m)
        toks.append(str(t))
        masks.append(str(m))
    return toks, masks


def olmo_core_packed(paths, masks, work, strategy="truncate", seq=L):
    from olmo_core.data import NumpyPackedFSLDatasetConfig, TokenizerConfig
    from olmo_core.data.types import LongDocStrategy, NumpyDatasetDType
    tok = TokenizerConfig(vocab_size=V, eos_token_id=EOS, pad_token_id=PAD)
    ds = NumpyPackedFSLDatasetConfig(paths=list(paths), sequence_length=seq, tokenizer=tok,
                                     dtype=NumpyDatasetDType.uint16, work_dir=str(work), label_mask_paths=list(masks),
                                     generate_doc_lengths=True,
                                     long_doc_strategy=LongDocStrategy(strategy)).build()
    ds.prepare()
    return ds


@pytest.mark.parametrize("strategy", ["truncate", "fragment"])
def test_packed_instances_equal_olmo_core(tmp_path, strategy):
    paths, masks = write_sft_files(tmp_path)
    ref = olmo_core_packed(paths, masks, tmp_path / "work", strategy)
    mine = PackedDataset(paths, sequence_length=L, vocab_size=V, eos_token_id=EOS, pad_token_id=PAD, dtype="uint16",
                         label_mask_paths=masks, long_doc_strategy=strategy)
    assert len(mine) == len(ref) > 100
    assert mine.fingerprint == ref.fingerprint
    ids = np.arange(len(mine))
    toks, lm, dl = mine.read(ids), mine.read_label_mask(ids), mine.doc_lens(ids)
    truncated = 0
    for i in ids:
        r = ref[int(i)]
        np.testing.assert_array_equal(toks[i], r["input_ids"].numpy(), err_msg=f"instance {i}")
        np.testing.assert_array_equal(lm[i], r["label_mask"].numpy(), err_msg=f"instance {i}")
        assert dl[i] == r["doc_lens"].tolist(), f"instance {i}"
        truncated += toks[i][-1] != EOS and toks[i][-1] != PAD
    assert truncated > 0  # documents longer than L were cut (truncate) or split (fragment)


def test_best_fit_decreasing_rule():
    # Longest first; each into the fullest instance that still holds it, the oldest among equals.
    spans = np.array([[0, 5], [5, 12], [12, 15], [15, 17], [17, 18]])  # lengths 5, 7, 3, 2, 1
    sorted_spans, bins = best_fit_decreasing(spans, 8)
    assert (sorted_spans[:, 1] - sorted_spans[:, 0]).tolist() == [7, 5, 3, 2, 1]
    assert bins == [[0, 4], [1, 2], [3]]
    with pytest.raises(DataError):
        best_fit_decreasing(np.array([[0, 9]]), 8)


def test_document_spans_truncate_and_fragment():
    t = np.array([5, 6, 0, 7, 7, 7, 7, 7, 0, 9], dtype=np.uint16)  # docs of 3 and 6 tokens, a 1-token tail
    assert document_spans(t, 0, 4).tolist() == [[0, 3], [3, 7]]
    assert document_spans(t, 0, 4, "fragment").tolist() == [[0, 3], [3, 7], [7, 9]]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_packed_batches_equal_olmo_core_loader(tmp_path, world):
    """Every process's share of every step (instance ids, tokens, label masks) is OLMo-core's
    data loader's for that rank, across an epoch boundary."""
    from olmo_core.data import DataCollator, NumpyDataLoaderBase

    from olmax.data.loader import DataLoader
    from olmax.recipes import get_recipe
    paths, masks = write_sft_files(tmp_path, docs=400)
    ref_ds = olmo_core_packed(paths, masks, tmp_path / "work")
    B = 12
    cfg = get_recipe("tiny", [f"model.vocab_size={V}", "data.dtype=uint16", f"data.eos_token_id={EOS}",
                              f"data.pad_token_id={PAD}", f"data.sequence_length={L}", "data.packing=obfd",
                              "data.paths=" + ",".join(paths), "data.label_mask_paths=" + ",".join(masks),
                              f"train.global_batch_size={B}", "data.workers=0", "data.seed=7"])
    steps = len(ref_ds) // B + 2  # into the second epoch
    for r in range(world):
        ref = NumpyDataLoaderBase.wrap_numpy_dataset(
            ref_ds, global_batch_size=B * L, collator=DataCollator(pad_token_id=PAD), work_dir=tmp_path / "work",
            seed=7, dp_world_size=world, dp_rank=r, num_threads=0, num_workers=0)
        got = []
        for epoch in (1, 2):
            ref.reshuffle(epoch=epoch)
            got += list(ref)
            ref.reset()
        mine = DataLoader(cfg, process_index=r, process_count=world, stop_step=steps, cache_dir=tmp_path / "order")
        for k in range(steps):
            b, rb = mine.batch(k), got[k]
            assert b["instance_ids"].tolist() == rb["index"].tolist(), (r, k)
            np.testing.assert_array_equal(b["input_ids"], rb["input_ids"].numpy())
            np.testing.assert_array_equal(b["label_mask"], rb["label_mask"].numpy())


def test_label_mask_file_errors(tmp_path):
    paths, masks = write_sft_files(tmp_path, docs=50)
    kw = dict(sequence_length=L, vocab_size=V, eos_token_id=EOS, pad_token_id=PAD, dtype="uint16")
    with pytest.raises(DataError, match="2 token files"):
        PackedDataset(paths, label_mask_paths=masks[:1], **kw)
    with pytest.raises(DataError, match="not found: .*missing.npy"):
        PackedDataset(paths, label_mask_paths=[masks[0], str(tmp_path / "missing.npy")], **kw)
    short = tmp_path / "short.npy"
    short.write_bytes(open(masks[1], "rb").read()[:-3])
    with pytest.raises(DataError, match="short.npy.*label-mask bytes"):
        PackedDataset(paths, label_mask_paths=[masks[0], str(short)], **kw)
    with pytest.raises(DataError, match="matches no file"):
        PackedDataset(paths, label_mask_paths=[str(tmp_path / "nothing_*.npy")], **kw)
    # Globs pair in sorted order.
    ds = PackedDataset([str(tmp_path / "token_ids_part_*.npy")], label_mask_paths=[str(tmp_path / "labels_mask_*.npy")],
                       **kw)
    assert [f.mask_path for f in ds.files] == masks
    from olmax.recipes import get_recipe
    with pytest.raises(ConfigError, match="loss_ranks"):
        get_recipe("tiny", ["train.global_batch_size=6", "train.loss_ranks=4"])


def test_dump_instances_equal_olmo_core(tmp_path, capsys):
    from olmax.cli import main
    paths, masks = write_sft_files(tmp_path, docs=300)
    ref = olmo_core_packed(paths, masks, tmp_path / "work")
    sets = [f"model.vocab_size={V}", "data.dtype=uint16", f"data.eos_token_id={EOS}", f"data.pad_token_id={PAD}",
            f"data.sequence_length={L}", "data.packing=obfd", "data.paths=" + ",".join(paths),
            "data.label_mask_paths=" + ",".join(masks), "train.global_batch_size=8", "data.workers=0"]
    args = ["data", "batches", "tiny", "--steps", "0:3", "--out", str(tmp_path / "ids.npy"),
            "--dump-instances", str(tmp_path / "inst.npz")]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    d = np.load(tmp_path / "inst.npz")
    assert d["input_ids"].shape == (24, L)
    assert d["instance_ids"].tolist() == np.load(tmp_path / "ids.npy").reshape(-1).tolist()
    for row, i in enumerate(d["instance_ids"]):
        r = ref[int(i)]
        np.testing.assert_array_equal(d["input_ids"][row], r["input_ids"].numpy())
        np.testing.assert_array_equal(d["label_mask"][row], r["label_mask"].numpy())
        lens = d["doc_lens"][row]
        assert lens[lens > 0].tolist() == r["doc_lens"].tolist()


def test_per_rank_loss_weights_are_olmo_core_rule():
    """train.loss_ranks=R: the weighted label sum equals the mean over ranks of each rank's token
    mean, rank r holding columns r::R of the global batch (rows grouped by process)."""
    import jax.numpy as jnp

    from olmax.model.loss import per_rank_weights, rank_of_rows
    rng = np.random.default_rng(0)
    B, T, R = 8, 16, 4
    mask = rng.random((B, T)) < 0.4
    mask[5] = False  # a row without labels
    ce = rng.random((B, T - 1))
    for P in (1, 2):
        w = np.asarray(per_rank_weights(jnp.asarray(mask), R, P))
        got = float((w[:, 1:] * ce).sum())
        ranks = rank_of_rows(B, P, R)
        # The step's rows are process 0's share, then process 1's, ... as process_share cuts them.
        from olmax.data.order import GlobalOrder, process_share
        order = GlobalOrder(B, B, seed=0)
        columns = {int(c): k for k, c in enumerate(order.batches([0])[0])}
        rows = np.concatenate([process_share(order, np.array([0]), p, P)[0] for p in range(P)])
        assert ranks.tolist() == [columns[int(i)] % R for i in rows]
        want = np.mean([(ce * mask[:, 1:])[ranks == r].sum() / mask[ranks == r, 1:].sum() for r in range(R)])
        assert got == pytest.approx(want, rel=1e-6)
        assert sorted(np.bincount(ranks).tolist()) == [B // R] * R


@pytest.mark.integration
def test_epochs_resolve_to_steps_and_sft_run_trains(tmp_path):
    """tiny_sft on packed label-masked data: train.epochs becomes whole batches of an epoch times
    the epochs, the warmup is round(0.03 * steps), and the held-out loss counts masked labels only."""
    from olmax.optim import make_schedule
    from olmax.recipes import get_recipe
    from olmax.train.loop import resolve_epochs, train
    paths, masks = write_sft_files(tmp_path, docs=200)
    (tmp_path / "held").mkdir()
    hp, hm = write_sft_files(tmp_path / "held", n_files=1, docs=60, seed=1)
    sets = [f"model.vocab_size={V}", "model.padded_vocab_size=512", "data.dtype=uint16", f"data.eos_token_id={EOS}",
            f"data.pad_token_id={PAD}", f"data.sequence_length={L}", "data.paths=" + ",".join(paths),
            "data.label_mask_paths=" + ",".join(masks), "train.global_batch_size=32", "train.epochs=2",
            "eval.heldout_paths=" + hp[0], "eval.heldout_label_mask_paths=" + hm[0], "eval.batch_size=4",
            "eval.batches=2", "eval.interval=1000", "checkpoint.interval=1000", "train.log_interval=1"]
    cfg = get_recipe("tiny_sft", sets)
    n = len(PackedDataset(paths, sequence_length=L, vocab_size=V, eos_token_id=EOS, pad_token_id=PAD, dtype="uint16"))
    resolved, built = resolve_epochs(cfg)
    assert len(built) == n  # handed to the loader, not built again
    assert resolved.train.steps == 2 * (n // 32)
    sched = make_schedule(resolved.optim, resolved.train.steps)
    S = resolved.train.steps  # round(0.03 * S) = 0 warmup steps: linear decay from the first update
    assert round(0.03 * S) == 0 and float(sched(1)) == pytest.approx(1e-3 * (1 - 1 / S), rel=1e-6)
    long = make_schedule(resolved.optim, 200)  # round(0.03 * 200) = 6: lr/6 at step 1, full at step 6
    assert float(long(1)) == pytest.approx(1e-3 / 6) and float(long(6)) == pytest.approx(1e-3)
    res = train(cfg, tmp_path / "run", progress=False)
    losses = [res.losses[k] for k in sorted(res.losses)]
    assert len(losses) == resolved.train.steps and losses[-1] < losses[0]
    from olmax.eval.heldout import HeldoutEvaluator
    ev = HeldoutEvaluator(resolved)
    m = ev.masks[""]
    assert m.shape == ev.batches[""].shape and 0 < m.mean() < 1  # prompts and padding not scored


@pytest.mark.integration
def test_packed_sft_run_resumes_bitwise(tmp_path):
    """A packed, label-masked, document-masked run stopped after step 3 and resumed from its
    checkpoint gives the uninterrupted run's losses bit for bit (train.epochs=null: train.steps
    counts; the process-restart version of this check is `olmax verify resume`)."""
    from olmax.recipes import get_recipe
    from olmax.train.loop import train
    paths, masks = write_sft_files(tmp_path, docs=120)
    ov = [f"model.vocab_size={V}", "model.padded_vocab_size=512", "data.dtype=uint16", f"data.eos_token_id={EOS}",
          f"data.pad_token_id={PAD}", f"data.sequence_length={L}", "data.paths=" + ",".join(paths),
          "data.label_mask_paths=" + ",".join(masks), "train.global_batch_size=8", "train.epochs=null",
          "train.steps=6", "checkpoint.interval=3", "checkpoint.async_save=false", "eval.heldout_paths=",
          "train.loss_ranks=2", "train.log_interval=1"]
    cfg = get_recipe("tiny_sft", ov)
    whole = train(cfg, tmp_path / "a", progress=False).losses
    first = train(cfg, tmp_path / "b", max_steps_this_run=3, progress=False).losses
    rest = train(cfg, tmp_path / "b", progress=False).losses
    assert len(whole) == 6 and set(first) | set(rest) == set(whole)
    assert all({**first, **rest}[k] == whole[k] for k in whole), (whole, first, rest)


def test_mesh_fsdp_max_moves_the_rest_to_tensor_parallelism():
    """The 7B SFT recipe's 32 instances a step on any slice: at most 32 FSDP shards."""
    from olmax.config import MeshConfig
    from olmax.recipes import get_recipe
    from olmax.sharding import mesh_shape
    m = get_recipe("olmo3_7b_think_sft").mesh
    assert [mesh_shape(m, n)["fsdp"] for n in (1, 8, 64, 256)] == [1, 8, 32, 32]
    assert [mesh_shape(m, n)["tensor"] for n in (1, 8, 64, 256)] == [1, 1, 2, 8]
    with pytest.raises(ConfigError, match="fsdp_max=24 must divide"):
        mesh_shape(MeshConfig(fsdp_max=24), 64)
    with pytest.raises(ConfigError, match="mesh.tensor must be 1"):
        mesh_shape(MeshConfig(fsdp_max=8, tensor=2), 64)


def test_per_rank_loss_and_the_repetition_filter_do_not_mix():
    from olmax.recipes import get_recipe
    with pytest.raises(ConfigError, match="loss_ranks > 1"):
        get_recipe("tiny", ["train.loss_ranks=2", "data.repetition_filter=true"])
