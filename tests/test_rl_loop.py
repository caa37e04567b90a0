"""The RL loop (``train.objective=grpo``): rollouts sampled from the trainer's own weights, the
log-prob gap between generation and training, resume, the prompt stream, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from olmax.config import ConfigError
from olmax.model.dispatch import can_reproduce_decode_bits
from olmax.recipes import get_recipe
from olmax.rl.rollout import PromptDataError, RlData, completion_text
from olmax.train.loop import train
from trainlib import rl_cfg, write_rl_data

# End-to-end runs in child processes: the integration tier (`make test-integration`).
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small BPE and 12 prompts whose gold answer is the letter "a" (``trainlib.write_rl_data``)."""
    return write_rl_data(tmp_path_factory.mktemp("rl_data"))


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(rl_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("rl_straight") / "run"
    train(rl_cfg(rl_data, "train.steps=4", "rl.num_mini_batches=2", "rl.num_epochs=2"), run, progress=False)
    return run


@pytest.fixture(scope="module")
def padded(rl_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``straight`` with one completion a training row (``trainlib.rl_overrides`` packs them)."""
    run = tmp_path_factory.mktemp("rl_padded") / "run"
    train(rl_cfg(rl_data, "train.steps=4", "rl.num_mini_batches=2", "rl.num_epochs=2", "rl.pack_length=null"), run,
          progress=False)
    return run


def test_rl_run_reports_its_metrics_and_samples_from_its_own_weights(straight: Path):
    got = rows(straight)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    # On one CPU device the rollouts decode with olmax's kernels and the training forward repeats
    # their arithmetic: the gap is zero. Elsewhere it is fp32 rounding (vLLM-based trainers see 1e-2).
    exact = can_reproduce_decode_bits(get_recipe("tiny_rl", ["model.compute_dtype=float32"]).model)
    for r in got:
        assert ((r["rl/max_logprob_gap"] == 0.0) if exact else (0 <= r["rl/max_logprob_gap"] <= 1e-5)), \
            r["rl/max_logprob_gap"]
        assert r["rl/updates"] == 4.0                       # 2 mini-batches x 2 epochs
        assert 0 <= r["rl/zero_std_share"] <= 1 and 0 <= r["rl/truncation_rate"] <= 1
        assert r["rl/tokens_generated"] > 0 and r["rl/generation_tokens_per_sec"] > 0
        assert 0 < r["rl/generation_share"] < 1
        assert np.isfinite(r["optim/total grad norm"])
    # the rewards vary (a test whose groups were all flat would train nothing)
    assert any(r["rl/groups_trained"] > 0 for r in got)
    # Several updates per batch: after the first, the policy has moved, so every step clips some
    # tokens and its mean ratio is away from 1 by far more than the generator's rounding (1e-5);
    # tokens' ratios move both ways, so the mean can come close to 1. (Measured with the
    # inverse-CDF sampler: clip fractions 0.07 to 0.32, mean ratios 0.51 to 1.038, the closest
    # to 1 at 1.0008; with Gumbel-max draws before it, 0.09 to 0.33 and 1.0095 to 1.040.)
    assert all(r["rl/clip_fraction"] > 0 and abs(r["rl/ratio_mean"] - 1) > 1e-4 for r in got), \
        [(r["rl/clip_fraction"], r["rl/ratio_mean"]) for r in got]


def test_packed_rows_train_what_padded_rows_train(straight: Path, padded: Path):
    """Packed training rows against one completion a row: the first step (the same
    weights, so the same rollouts) trains the same tokens with the same loss, on fewer rows with
    less padding; the log-prob gap is 0 either way on the CPU kernels."""
    exact = can_reproduce_decode_bits(get_recipe("tiny_rl", ["model.compute_dtype=float32"]).model)
    p, q = rows(straight), rows(padded)
    for k in ("rl/reward_mean", "rl/trained_tokens", "rl/tokens_generated"):
        assert p[0][k] == q[0][k], k
    # four updates (2 mini-batches x 2 epochs): the later ones start from weights that differ by
    # the rounding of the first (a one-update comparison at 1e-6 is tests/test_rl_packing.py's)
    assert p[0]["rl/loss"] == pytest.approx(q[0]["rl/loss"], rel=1e-5, abs=1e-7)
    assert any(a["rl/groups_trained"] > 0 for a in p)
    for a, b in zip(p, q):
        assert a["rl/training_rows"] < b["rl/training_rows"] == 8
        assert 0 < b["rl/padding_share"] < 1
        if a["rl/groups_trained"] > 0:  # (a step whose groups were all dropped packs empty rows)
            assert 0 <= a["rl/padding_share"] < b["rl/padding_share"]
        if exact:
            assert a["rl/max_logprob_gap"] == 0.0 and b["rl/max_logprob_gap"] == 0.0


@pytest.mark.parametrize("pack", ["packed", "padded"])
def test_rl_resume_is_bitwise(rl_data: Path, straight: Path, padded: Path, tmp_path: Path, pack: str):
    from olmax.checkpoint.load import load_params
    run = tmp_path / "run"
    cfg = rl_cfg(rl_data, "train.steps=4", "rl.num_mini_batches=2", "rl.num_epochs=2",
                 *(["rl.pack_length=null"] if pack == "padded" else []))
    first = train(cfg, run, max_steps_this_run=2, progress=False)
    assert first.stopped_early and first.end_step == 2
    train(cfg, run, progress=False)
    straight = straight if pack == "packed" else padded
    a, b = rows(straight), rows(run)
    keys = [k for k in a[0] if k.startswith(("rl/reward", "rl/max_logprob", "optim/total", "rl/clip", "rl/response",
                                             "rl/padding", "rl/training_rows", "rl/loss"))]
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    pa, pb = load_params(str(straight))[0], load_params(str(run))[0]
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)))


def test_continuous_and_static_rollouts_train_the_same(rl_data: Path, straight: Path, tmp_path: Path):
    """The same run with static rollouts (``rl.batching=static``) and in generation batches smaller
    than a step's rows (so the continuous engine refills slots): every per-step figure but the
    timings and the slot utilisation, and the final weights, equal the continuous run's."""
    from olmax.checkpoint.load import load_params
    runs = {}
    for batching in ("continuous", "static"):
        runs[batching] = tmp_path / batching
        train(rl_cfg(rl_data, "train.steps=4", "rl.num_mini_batches=2", "rl.num_epochs=2", "rl.generation_batch=4",
                     f"rl.batching={batching}"), runs[batching], progress=False)
    a, b = rows(runs["continuous"]), rows(runs["static"])
    # the engines' own figures: timings, slot use and the continuous engine's KV cache (static has none)
    timing = ("time", "tokens_per_sec", "generation_share", "slot_utilisation", "throughput", "MFU", "elapsed",
              "rl/kv_", "rl/preemptions")
    keys = [k for k in a[0] if k.startswith(("rl/", "optim/")) and not any(t in k for t in timing)]
    assert "rl/kv_bytes_peak" in a[0] and "rl/kv_bytes_peak" not in b[0]
    assert len(keys) > 15 and [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    # and the same as all of a step's rows in one batch (the default)
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in rows(straight)]
    assert all(a_["rl/slot_utilisation"] >= b_["rl/slot_utilisation"] for a_, b_ in zip(a, b))
    pa, pb = load_params(str(runs["continuous"]))[0], load_params(str(runs["static"]))[0]
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)))


def _paged(rl_data: Path, *extra: str):
    """``straight`` with rollouts on the paged KV cache in generation batches of 4, pages of 4 (these
    prompts of 4 words hold a whole page or two, which a group's rows share) and the smallest budget
    (the 4 rows' sliding windows and positions, one row at the cache's full 64 positions and 2 pages
    more). Preemption is left to tests/test_engine_paged.py: a budget holds one row of the whole
    cache, which these 16-position rows never come near."""
    from olmax.model.decode import page_bytes, row_bytes
    m = rl_cfg(rl_data).model
    budget = 4 * row_bytes(m, 64, "float32") + (1 + 64 // 4 + 2) * page_bytes(m, 4, "float32")
    return rl_cfg(rl_data, "train.steps=4", "rl.num_mini_batches=2", "rl.num_epochs=2", "rl.generation_batch=4",
                  "rl.kv_cache=paged", "rl.page_size=4", f"rl.kv_budget={budget / 1024!r}KiB", *extra)


@pytest.fixture(scope="module")
def paged(rl_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("rl_paged") / "run"
    train(_paged(rl_data), run, progress=False)
    return run


KV = ("rl/kv_", "rl/preemptions")


def test_paged_rollouts_train_the_same(straight: Path, paged: Path):
    """Rollouts on the paged KV cache (a group's prompt pages shared, under a budget): every
    per-step figure but the timings, the slot utilisation and the KV cache's own, and the final
    weights, equal the contiguous cache's (``straight``; in batches of 4 it trains the same:
    ``test_continuous_and_static_rollouts_train_the_same``)."""
    from olmax.checkpoint.load import load_params
    a, b = rows(straight), rows(paged)
    timing = ("time", "tokens_per_sec", "generation_share", "slot_utilisation", "throughput", "MFU", "elapsed")
    keys = [k for k in a[0] if k.startswith(("rl/", "optim/")) and not any(t in k for t in timing)
            and not k.startswith(KV)]
    assert len(keys) > 15 and [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    assert sum(r["rl/kv_shared_prompt_tokens"] for r in b) > 0
    assert all(r["rl/kv_bytes_reserved"] < a_["rl/kv_bytes_reserved"] for r, a_ in zip(b, a))
    assert all(r["rl/kv_bytes_peak"] <= r["rl/kv_bytes_reserved"] for r in b)
    pa, pb = load_params(str(straight))[0], load_params(str(paged))[0]
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)))


def test_rl_resume_is_bitwise_with_the_paged_cache(rl_data: Path, paged: Path, tmp_path: Path):
    from olmax.checkpoint.load import load_params
    run = tmp_path / "run"
    first = train(_paged(rl_data), run, max_steps_this_run=2, progress=False)
    assert first.stopped_early and first.end_step == 2
    train(_paged(rl_data), run, progress=False)
    a, b = rows(paged), rows(run)
    keys = [k for k in a[0] if k.startswith(("rl/reward", "rl/max_logprob", "optim/total", "rl/clip", "rl/response",
                                             "rl/padding", "rl/training_rows", "rl/loss"))]
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    pa, pb = load_params(str(paged))[0], load_params(str(run))[0]
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)))


def test_rl_options_kl_active_sampling_and_retirement(rl_data: Path, tmp_path: Path):
    run = tmp_path / "run"
    train(rl_cfg(rl_data, "train.steps=2", "rl.kl_beta=0.5", "rl.num_epochs=2", "rl.active_sampling=true",
                 "rl.max_sampling_rounds=3", "rl.retire_pass_rate=1.0", "rl.aggregation=sequence_mean"),
          run, progress=False)
    for r in rows(run):
        assert 1 <= r["rl/sampling_rounds"] <= 3 and r["rl/groups_trained"] <= 2
        # active sampling stops at the first round that fills the batch with informative groups
        assert r["rl/groups_trained"] == 2 or r["rl/sampling_rounds"] == 3
        assert r["rl/kl"] > 0                # the second update moved away from the frozen initial weights


def test_rl_batch_rows_masks_and_advantages(rl_data: Path, tmp_path: Path):
    """Prompt + completion rows: trained tokens, the generation log-probs in token_logps' layout,
    dropped groups (no trained token, advantage 0, row_valid False), and rl.mask_truncated."""
    from olmax.engine import Completion
    d = RlData(rl_cfg(rl_data, "rl.mask_truncated=true"), 0, None, False, None, tmp_path)
    p0 = d.prompts[0].ids
    comps = [Completion([5, 6, 0], [-0.5, -0.25, -0.125], "stop"), Completion([7] * 8, [-1.0] * 8, "length"),
             Completion([8, 0], [-2.0, -3.0], "stop"), Completion([9, 0], [-4.0, -5.0], "stop")]
    flat = [Completion([5, 0], [-1.0, -1.0], "stop") for _ in range(4)]
    b = d._batch([(0, comps, np.array([1, 0, 1, 0], np.float32)), (1, flat, np.zeros(4, np.float32))], n_valid=1)
    n = len(p0)
    assert b["input_ids"].shape == (8, 56)
    assert b["input_ids"][0, :n].tolist() == p0 and b["input_ids"][0, n:n + 3].tolist() == [5, 6, 0]
    assert b["completion_mask"][0].sum() == 3 and b["completion_mask"][0, n:n + 3].all()
    assert b["completion_mask"][1].sum() == 0 and b["generated_mask"][1].sum() == 8     # truncated: masked
    assert b["gen_logps"][0, n - 1:n + 2].tolist() == [-0.5, -0.25, -0.125] and b["gen_logps"][0, n + 2] == 0
    assert b["advantages"][:4].tolist() == [0.5, -0.5, 0.5, -0.5]
    assert not b["row_valid"][4:].any() and b["row_valid"][:4].all()
    assert b["lengths"][:4].tolist() == [n + 3, n + 8, n + 2, n + 2]
    assert b["completion_mask"][4:].sum() == 0 and (b["advantages"][4:] == 0).all()


def test_prompt_stream_state_and_retirement(rl_data: Path, tmp_path: Path):
    cfg = rl_cfg(rl_data)
    d = RlData(cfg, 0, None, False, None, tmp_path)
    first = d.draw(12)
    assert sorted(first) == list(range(12))               # one epoch: every prompt once
    second = d.draw(12)
    assert sorted(second) == list(range(12)) and second != first   # the next epoch, reshuffled
    state = d.state(3).to_dict()
    d.retired = {0, 1}
    again = RlData(cfg, 3, state, False, None, tmp_path)
    assert again.drawn == 24
    again.retired = {0, 1}
    assert not {0, 1} & set(again.draw(20))
    assert completion_text(d.codec, d.codec.encode("yes</answer> more"), ("</answer>",)) == "yes"
    assert completion_text(d.codec, d.codec.encode("ok<|im_end|>\n"), ()) == "ok"


def test_rl_bad_input_names_the_culprit(rl_data: Path, tmp_path: Path):
    with pytest.raises(ConfigError, match=r"global_batch_size \(16\) must be rl.prompts_per_step x rl.group_size"):
        get_recipe("tiny_rl", ["rl.prompts_per_step=3"])
    with pytest.raises(ConfigError, match="data.sequence_length"):
        get_recipe("tiny_rl", ["rl.max_response_length=100"])
    with pytest.raises(ConfigError, match="whole groups"):
        get_recipe("tiny_rl", ["rl.num_mini_batches=8"])
    with pytest.raises(ConfigError, match="rl.temperature"):
        get_recipe("tiny_rl", ["rl.temperature=0"])
    with pytest.raises(ConfigError, match="needs rl.prompts_path"):
        RlData(get_recipe("tiny_rl"), 0, None, False, None, tmp_path)
    # A missing prompt file is named first, not the tokenizer a recipe without one also lacks.
    with pytest.raises(PromptDataError, match=r"rl.prompts_path .*missing.jsonl: no such file"):
        RlData(get_recipe("tiny_rl", [f"rl.prompts_path={tmp_path / 'missing.jsonl'}"]), 0, None, False, None,
               tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a cat", "ground_truth": "e"}\n{"prompt": "no gold"}\n')
    with pytest.raises(PromptDataError, match=r"bad.jsonl:2: no ground_truth"):
        RlData(rl_cfg(rl_data, f"rl.prompts_path={bad}"), 0, None, False, None, tmp_path)
    bad.write_text('{"prompt": "a cat", "ground_truth": "e"}\nnot json\n')
    with pytest.raises(PromptDataError, match=r"bad.jsonl:2: not JSON"):
        RlData(rl_cfg(rl_data, f"rl.prompts_path={bad}"), 0, None, False, None, tmp_path)
    bad.write_text('{"prompt": "a cat", "ground_truth": "e"}\n{"text": "a dog", "ground_truth": "e"}\n')
    with pytest.raises(PromptDataError, match=r"bad.jsonl:2: needs messages \(a chat\) or prompt"):
        RlData(rl_cfg(rl_data, f"rl.prompts_path={bad}"), 0, None, False, None, tmp_path)
    bad.write_text('{"prompt": "a cat", "ground_truth": "e"}\n'
                   '{"messages": [{"role": "robot", "content": "hi"}], "ground_truth": "e"}\n')
    with pytest.raises(PromptDataError, match=r"bad.jsonl:2: message 0 has role 'robot'"):
        RlData(rl_cfg(rl_data, f"rl.prompts_path={bad}"), 0, None, False, None, tmp_path)
    with pytest.raises(PromptDataError, match="no usable prompt"):
        RlData(rl_cfg(rl_data, "rl.max_prompt_length=1", "data.sequence_length=56"), 0, None, False, None, tmp_path)
    state = RlData(rl_cfg(rl_data), 0, None, False, None, tmp_path).state(2).to_dict()
    state["fingerprint"] = "0" * 16
    with pytest.raises(ConfigError, match="trained on other prompts"):
        RlData(rl_cfg(rl_data), 2, state, False, None, tmp_path)
    with pytest.raises(ConfigError, match="not an RL prompt stream"):
        RlData(rl_cfg(rl_data), 2, {"kind": "dpo-pairs"}, False, None, tmp_path)
