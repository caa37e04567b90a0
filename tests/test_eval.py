"""Evaluation on a tiny OLMo 3: domain metrics against a hand computation, KL against numpy,
a trained model beating an untrained one on every domain, the memorisation alarm on a real
repeated-data run, the ``olmax eval`` commands, and clear errors on bad inputs."""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
from dataclasses import replace
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.config import ConfigError
from olmax.eval.alarm import check_memorisation
from olmax.eval.domains import Domain, DomainEvaluator, domain_metrics, load_domains
from olmax.eval.heldout import HeldoutEvaluator, heldout_windows
from olmax.eval.kl import kl, logit_metrics, summarize
from olmax.model.olmo3 import forward
from olmax.model.params import init_params
from olmax.objectives.lm import make_lm_step
from olmax.optim import apply_update, init_opt_state
from olmax.recipes import get_recipe
from olmax.sharding import make_mesh
from trainlib import normal

V, L, B, STEPS = 64, 32, 8, 40
# A tiny OLMo 3 (one sliding and one full layer) whose LM head is padded to 128 rows, so every
# real-vocabulary quantity is tested against the padding.
OVERRIDES = [f"model.vocab_size={V}", "model.padded_vocab_size=128", "model.d_model=32", "model.n_layers=2",
             "model.n_heads=2", "model.n_kv_heads=2", "model.head_dim=16", "model.mlp_hidden=64",
             "model.sliding_window=16", "model.full_attention_every=2", f"data.sequence_length={L}",
             "data.dtype=uint16", f"train.global_batch_size={B}", f"train.steps={STEPS}", "optim.lr=1e-2",
             "optim.schedule.warmup=5", "eval.batches=2", "eval.batch_size=4"]


@pytest.fixture(scope="module")
def cfg():
    return get_recipe("tiny", OVERRIDES)


def markov(n: int, seed: int) -> np.ndarray:
    """A chain over ids 2..63: the next id is (5t+3) with prob 0.8, else (11t+7), mod 62, + 2."""
    rng = np.random.default_rng(seed)
    out = np.empty(n, np.int64)
    t = int(rng.integers(0, 62))
    u = rng.random(n)
    for i in range(n):
        t = (5 * t + 3) % 62 if u[i] < 0.8 else (11 * t + 7) % 62
        out[i] = t + 2
    return out


def cycles(n: int, seed: int) -> np.ndarray:
    """Short random patterns (period 3..6) over ids 32..47, each repeated 4-8 times."""
    rng = np.random.default_rng(seed)
    parts, have = [], 0
    while have < n:
        pat = rng.integers(32, 48, int(rng.integers(3, 7)))
        p = np.tile(pat, int(rng.integers(4, 9)))
        parts.append(p)
        have += len(p)
    return np.concatenate(parts)[:n]


fwd = jax.jit(forward, static_argnums=2)   # one compile per input shape, shared by the tests


def write_tokens(path: Path, tokens: np.ndarray) -> str:
    tokens.astype("<u2").tofile(path)
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    train = {"chain": markov(20000, 0), "cycles": cycles(20000, 1)}
    held = {"chain": write_tokens(d / "chain.npy", markov(1000, 2)),
            "cycles": write_tokens(d / "cycles.npy", cycles(1000, 3))}
    return train, held, d


def trainer(cfg):
    update = partial(apply_update, optim_cfg=cfg.optim, total_steps=cfg.train.steps)
    return jax.jit(make_lm_step(cfg, 1, update))


def batch_from(train: dict[str, np.ndarray], rng: np.random.Generator) -> dict:
    rows = []
    for i in range(B):   # half the rows from each process
        src = train["chain" if i % 2 == 0 else "cycles"]
        s = int(rng.integers(0, len(src) - L))
        rows.append(src[s:s + L])
    return {"input_ids": jnp.asarray(np.stack(rows), jnp.int32), "label_mask": jnp.ones((B, L), bool)}


@pytest.fixture(scope="module")
def runs(cfg, data):
    """An untrained model, an honest run (a fresh batch every step) and a repeated-data run (the
    same two batches over and over: the extreme of sampling with replacement), from the same init.
    Held-out loss is evaluated every 10 steps on identical batches."""
    train, held, _ = data
    step = trainer(cfg)
    p0 = init_params(cfg.model, jax.random.key(0))
    ev = HeldoutEvaluator(cfg, make_mesh(cfg.mesh), paths=(held["chain"], held["cycles"]), per_batch=True)
    rng = np.random.default_rng(7)
    fixed = [batch_from(train, rng) for _ in range(2)]
    out = {"init": p0}
    for name, get in (("honest", lambda i: batch_from(train, rng)), ("repeated", lambda i: fixed[i % 2])):
        params, opt = p0, init_opt_state(p0, cfg.optim)
        curve, heldout = {}, {}
        for i in range(STEPS):
            params, opt, m = step(params, opt, get(i))
            curve[i + 1] = float(m["ce_loss"])
            if (i + 1) % 10 == 0:
                heldout[i + 1] = ev.evaluate(params)["eval/heldout/CE loss"]
        out[name] = params
        out[name + "_curves"] = (curve, heldout)
    return out


# --------------------------------------------------------------------------- domains


def test_bits_per_byte_formula():
    m = domain_metrics(nats=100.0, tokens_scored=50, tokens_total=200, nbytes=800)
    assert m["loss"] == 2.0 and m["perplexity"] == pytest.approx(math.e ** 2)
    assert m["bytes_scored"] == 200.0                                  # 50 of 200 tokens: a quarter of the bytes
    assert m["bits_per_byte"] == pytest.approx(100.0 / math.log(2) / 200.0)


def test_domain_metrics_match_hand_computation(cfg, data, tmp_path):
    _, held, _ = data
    p = init_params(cfg.model, jax.random.key(1))
    ev = DomainEvaluator(cfg, [Domain("chain", (held["chain"],), 3000), Domain("cycles", (held["cycles"],), 2500)],
                         batch_size=2, batches=2)
    r = ev.evaluate_detailed(p)
    for name, nbytes in (("chain", 3000), ("cycles", 2500)):
        windows = np.fromfile(held[name], "<u2")[: 4 * L].reshape(4, L).astype(np.int32)   # 2 batches of 2
        lg = np.asarray(fwd(p, jnp.asarray(windows), cfg.model), np.float64)[:, :-1]   # the padded rows too
        lp = lg - lg.max(-1, keepdims=True)
        lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
        nats = -np.take_along_axis(lp, windows[:, 1:, None], -1).sum()
        scored = 4 * (L - 1)
        d = r["domains"][name]
        assert d["tokens_scored"] == scored and d["tokens_total"] == 1000 and d["windows"] == 4
        assert d["loss"] == pytest.approx(nats / scored, rel=1e-5)
        assert d["perplexity"] == pytest.approx(math.exp(nats / scored), rel=1e-5)
        assert d["bits_per_byte"] == pytest.approx(nats / math.log(2) / (nbytes * scored / 1000), rel=1e-5)
    dm = r["domains"]
    assert r["macro"]["loss"] == pytest.approx((dm["chain"]["loss"] + dm["cycles"]["loss"]) / 2)
    # Micro pools tokens and bytes; the domains' byte counts differ (3000 vs 2500), so micro bits
    # per byte differ from the macro mean.
    pooled_nats = sum(dm[n]["loss"] * dm[n]["tokens_scored"] for n in dm)
    pooled_bytes = sum(dm[n]["bytes_scored"] for n in dm)
    assert r["micro"]["bits_per_byte"] == pytest.approx(pooled_nats / math.log(2) / pooled_bytes, rel=1e-9)
    assert r["micro"]["bits_per_byte"] != pytest.approx(r["macro"]["bits_per_byte"], rel=1e-6)
    # One vocabulary rule: ``eval loss`` on a domain's files gives the domain's loss.
    assert HeldoutEvaluator(cfg, paths=(held["chain"],), batch_size=2, batches=2).evaluate(p)[
        "eval/heldout/CE loss"] == dm["chain"]["loss"]
    flat = ev.evaluate(p)
    assert flat["eval/domains/chain/bits per byte"] == pytest.approx(dm["chain"]["bits_per_byte"])
    assert set(flat) >= {"eval/domains/macro/CE loss", "eval/domains/cycles/PPL"}


def test_domain_specs(tmp_path):
    (tmp_path / "a.npy").write_bytes(b"\0\0" * 10)
    a = str(tmp_path / "a.npy")
    assert load_domains([f"web={a},{a}:1_000"]) == [Domain("web", (a, a), 1000)]
    (tmp_path / "d.yaml").write_text("news: {paths: [a.npy], bytes: 42}\nwiki: {paths: a.npy, bytes: 7}\n")
    ds = load_domains([str(tmp_path / "d.yaml")])
    assert [(d.name, d.paths, d.bytes) for d in ds] == [("news", (a,), 42), ("wiki", (a,), 7)]
    with pytest.raises(ConfigError, match="raw UTF-8 byte count"):
        load_domains([f"web={a}"])
    with pytest.raises(ConfigError, match="must be non-empty"):
        load_domains([f"macro={a}:5"])
    with pytest.raises(ConfigError, match="unique"):
        load_domains([f"web={a}:5", f"web={a}:6"])
    # A tokenize folder is expanded to its files; a manifest recording text_bytes needs no :BYTES.
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "part-00000.npy").write_bytes(b"\0\0" * 10)
    manifest = {"dtype": "uint16", "eos_token_id": 0, "files": [{"path": "part-00000.npy", "tokens": 10}]}
    (tmp_path / "tok" / "manifest.json").write_text(json.dumps({**manifest, "text_bytes": 37}))
    assert load_domains([f"tok={tmp_path / 'tok'}"])[0].bytes == 37
    (tmp_path / "bad.yaml").write_text("news: {paths: [a.npy], bytes: 42, weight: 2}\n")
    with pytest.raises(ConfigError, match="unknown keys"):
        load_domains([str(tmp_path / "bad.yaml")])


# --------------------------------------------------------------------------- KL


def test_domain_file_not_utf8_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xffnews: {paths: [a.npy], bytes: 42}\n")
    with pytest.raises(ConfigError, match=rf"--domain {re.escape(str(bad))}: not UTF-8"):
        load_domains([str(bad)])


def test_kl_self_is_zero(cfg):
    p = init_params(cfg.model, jax.random.key(2))
    toks = np.random.default_rng(0).integers(0, V, (4, L))
    r = kl(p, cfg, p, cfg, toks)
    assert r == {"kl_mean": 0.0, "kl_max": 0.0, "top1_agreement": 1.0, "top10_overlap": 1.0,
                 "max_abs_logit_diff": 0.0, "tokens": 4 * L}
    # Changing only the padded LM-head rows changes no real-vocabulary quantity.
    q = dict(p, lm_head=p["lm_head"].at[:, V:].add(5.0))
    assert kl(p, cfg, q, cfg, toks)["kl_max"] == 0.0


def test_kl_perturbed_matches_numpy(cfg):
    p = init_params(cfg.model, jax.random.key(3))
    # Scale the head so the distributions are peaked (a near-uniform model makes every KL tiny).
    p = dict(p, lm_head=p["lm_head"] * 40.0)
    noise = normal(jax.random.key(4), p["lm_head"].shape) * 0.3
    q = dict(p, lm_head=p["lm_head"] + noise)
    toks = np.random.default_rng(1).integers(0, V, (4, L))
    r = kl(p, cfg, q, cfg, toks)
    la = np.asarray(fwd(p, jnp.asarray(toks), cfg.model), np.float64)[..., :V]
    lb = np.asarray(fwd(q, jnp.asarray(toks), cfg.model), np.float64)[..., :V]
    lsm = lambda x: x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
    pa, pb = lsm(la), lsm(lb)
    kl_tok = (np.exp(pa) * (pa - pb)).sum(-1)
    assert r["kl_mean"] > 1e-3
    assert r["kl_mean"] == pytest.approx(kl_tok.mean(), rel=1e-3)
    assert r["kl_max"] == pytest.approx(kl_tok.max(), rel=1e-3)
    assert r["top1_agreement"] == pytest.approx((la.argmax(-1) == lb.argmax(-1)).mean())
    ta, tb = np.argsort(-la, -1)[..., :10], np.argsort(-lb, -1)[..., :10]
    overlap = np.mean([len(set(x) & set(y)) / 10 for x, y in zip(ta.reshape(-1, 10), tb.reshape(-1, 10))])
    assert r["top10_overlap"] == pytest.approx(overlap)
    assert r["max_abs_logit_diff"] == pytest.approx(np.abs(la - lb).max(), rel=1e-5)
    assert r["tokens"] == 4 * L


def test_logit_metrics_agree_in_fp32_jax_and_float64_numpy():
    # One implementation for ``eval kl`` (fp32, jitted) and ``parity`` (float64 numpy, row by row).
    la = np.random.default_rng(5).normal(0, 3, (3, 7, 37))
    lb = la + np.random.default_rng(6).normal(0, 0.5, la.shape)
    f64 = summarize([logit_metrics(a, b, xp=np) for a, b in zip(la, lb)], 21)
    f32 = summarize([jax.jit(logit_metrics)(jnp.asarray(la, jnp.float32), jnp.asarray(lb, jnp.float32))], 21)
    assert f64.keys() == f32.keys() and f64["kl_mean"] > 1e-2 and f64["top10_overlap"] < 1
    for key, v in f64.items():
        assert f32[key] == pytest.approx(v, rel=1e-5), key


# --------------------------------------------------------------------------- trained vs untrained


def test_trained_model_beats_untrained_on_every_domain(cfg, data, runs):
    _, held, _ = data
    ev = DomainEvaluator(cfg, [Domain("chain", (held["chain"],), 2900), Domain("cycles", (held["cycles"],), 3100)],
                         batches=0)
    before, after = ev.evaluate_detailed(runs["init"]), ev.evaluate_detailed(runs["honest"])
    assert before["domains"]["chain"]["windows"] == 28                # every whole batch of 4 of the 31 windows
    for name in ("chain", "cycles"):
        b, a = before["domains"][name], after["domains"][name]
        assert b["loss"] == pytest.approx(math.log(cfg.model.embedding_rows), abs=0.1)   # untrained: about uniform
        assert a["loss"] < b["loss"] - 0.5, (name, a["loss"], b["loss"])
        assert a["bits_per_byte"] < b["bits_per_byte"] and a["perplexity"] < b["perplexity"]
    assert after["macro"]["bits_per_byte"] < before["macro"]["bits_per_byte"]


def test_alarm_fires_on_a_real_repeated_data_run(runs):
    """The repeated-data run's training loss beats the honest run's (it memorises its batches)
    while its held-out loss does not: the alarm fires; the honest run against itself stays quiet."""
    honest_t, honest_h = runs["honest_curves"]
    rep_t, rep_h = runs["repeated_curves"]
    res = check_memorisation(rep_t, honest_t, rep_h, honest_h, label="repeated", reference="honest", window=10)
    assert res.fired, res.message
    last = res.checks[-1]
    assert last.train_gap < -0.02 and last.heldout_gap > 0.25 * last.train_gap
    quiet = check_memorisation(honest_t, honest_t, honest_h, honest_h, window=10)
    assert not quiet.fired and quiet.status == "ok"


def test_heldout_per_batch_values(cfg, data, runs):
    _, held, _ = data
    ev = HeldoutEvaluator(cfg, make_mesh(cfg.mesh), paths=(held["chain"],), per_batch=True)
    r = ev.evaluate(runs["honest"])
    per = [r[f"eval/heldout/CE loss [batch {i}]"] for i in range(2)]
    assert r["eval/heldout/CE loss"] == pytest.approx(np.mean(per), rel=1e-6)   # equal label counts per batch
    assert r["eval/heldout/PPL"] == pytest.approx(math.exp(r["eval/heldout/CE loss"]))


# --------------------------------------------------------------------------- commands and errors


def test_eval_commands(cfg, data, runs, tmp_path, capsys):
    from olmax.eval.commands import register
    from olmax.model.weights_io import flatten_tree, save_weights
    _, held, _ = data
    for name in ("init", "honest"):
        save_weights(tmp_path / name, [(k, np.asarray(v)) for k, v in flatten_tree(runs[name])], cfg)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())

    def run(*argv: str) -> dict:
        args = parser.parse_args(list(argv))
        assert args.func(args) == 0
        return json.loads(capsys.readouterr().out)

    r = run("eval", "loss", "--checkpoint", str(tmp_path / "honest"), "--data", held["chain"], "--seq-len", str(L),
            "--batches", "3", "--batch-size", "2", "--json")
    assert set(r) == {"checkpoint", "files", "seq_len", "batch_size", "batches", "tokens", "loss", "perplexity",
                      "loss_se", "per_batch_loss"}
    assert r["batches"] == 3 and r["tokens"] == 3 * 2 * (L - 1) and len(r["per_batch_loss"]) == 3
    assert r["loss"] == pytest.approx(np.mean(r["per_batch_loss"]), rel=1e-6) and r["loss_se"] > 0
    r = run("eval", "domains", "--checkpoint", str(tmp_path / "honest"), "--domain", f"chain={held['chain']}:2900",
            "--domain", f"cycles={held['cycles']}:3100", "--batches", "0", "--json")
    assert set(r["domains"]) == {"chain", "cycles"} and set(r["macro"]) == {"loss", "perplexity", "bits_per_byte"}
    r = run("eval", "kl", str(tmp_path / "honest"), str(tmp_path / "honest"), "--seq-len", "16", "--batch-size", "2",
            "--json")
    assert r["kl_mean"] == 0.0 and r["top1_agreement"] == 1.0 and r["tokens"] == 32
    r = run("eval", "kl", str(tmp_path / "init"), str(tmp_path / "honest"), "--data", held["chain"], "--json")
    assert r["kl_mean"] > 0.1 and r["inputs"] == held["chain"] and (r["batch"], r["seq_len"]) == (2, 128)


def test_old_batch_spelling_still_parses():
    """``--batch`` (eval kl and parity before ``--batch-size``) stays a hidden alias for a release."""
    from olmax.cli import build_parser
    parser = build_parser()
    for argv in (["eval", "kl", "a", "b"], ["parity", "--hf", "d"]):
        assert parser.parse_args(argv).batch_size == 2
        assert parser.parse_args(argv + ["--batch", "3"]).batch_size == 3
        assert parser.parse_args(argv + ["--batch-size", "4"]).batch_size == 4


def test_old_param_dtype_spelling_still_parses(capsys):
    """``--param-dtype`` (eval loss, domains and kl before ``--dtype``) stays a hidden alias for a release."""
    from olmax.cli import build_parser
    parser = build_parser()
    for argv in (["eval", "loss", "--checkpoint", "c", "--data", "f"], ["eval", "domains", "--checkpoint", "c",
                 "--domain", "x=f:1"], ["eval", "kl", "a", "b"]):
        assert parser.parse_args(argv).dtype is None
        assert parser.parse_args(argv + ["--param-dtype", "bfloat16"]).dtype == "bfloat16"
        assert parser.parse_args(argv + ["--dtype", "bfloat16"]).dtype == "bfloat16"
        with pytest.raises(SystemExit):
            parser.parse_args(argv + ["--help"])
        shown = capsys.readouterr().out
        assert "--dtype" in shown and "--param-dtype" not in shown


def test_the_runs_heldout_mix_file_resolves_as_its_training_data_does(cfg, data, tmp_path):
    """eval.heldout_paths is read like data.paths: {root} and {TOKENIZER} in a mix file take the
    run's data.mix_root and data.mix_tokenizer."""
    _, held, d = data
    mix = tmp_path / "heldout.txt"
    mix.write_text("chain,{root}/chain.npy\ncycles,{root}/{TOKENIZER}/cycles.npy\n")
    (d / "tok").mkdir(exist_ok=True)
    shutil.copy(held["cycles"], d / "tok" / "cycles.npy")
    run = replace(cfg, data=replace(cfg.data, mix_root=str(d), mix_tokenizer="tok"),
                  eval=replace(cfg.eval, heldout_paths=(str(mix),)))
    ev = HeldoutEvaluator(run, make_mesh(run.mesh))
    assert ev.files[""] == [str(d / "chain.npy"), str(d / "tok" / "cycles.npy")]
    with pytest.raises(ValueError, match=r"heldout.txt:1: .*data.mix_root is not set"):
        HeldoutEvaluator(replace(run, data=cfg.data), make_mesh(run.mesh))


def test_bad_inputs_fail_clearly(cfg, data, tmp_path, monkeypatch, capsys):
    _, held, _ = data
    mesh = make_mesh(cfg.mesh)
    # Held-out windows and domains resolve paths with the data pipeline: one error for both.
    with pytest.raises(ValueError, match="token file not found: .*missing.npy"):
        heldout_windows([str(tmp_path / "missing.npy")], "uint16", L, None)
    with pytest.raises(ValueError, match="token file not found"):
        DomainEvaluator(cfg, [Domain("x", (str(tmp_path / "missing.npy"),), 10)])
    odd = tmp_path / "odd.npy"
    odd.write_bytes(b"\1\0" * 100 + b"\1")
    with pytest.raises(ConfigError, match="not a multiple of uint16"):
        HeldoutEvaluator(cfg, mesh, paths=(str(odd),))
    short = write_tokens(tmp_path / "short.npy", np.arange(3 * L) % V)   # 3 windows, batch of 4
    with pytest.raises(ConfigError, match="fewer than one batch of 4"):
        HeldoutEvaluator(cfg, mesh, paths=(short,))
    with pytest.raises(ConfigError, match="fewer than one batch of 4"):
        DomainEvaluator(cfg, [Domain("short", (short,), 100)])
    big = write_tokens(tmp_path / "big.npy", np.full(4 * L, V + 3))
    with pytest.raises(ConfigError, match="token id 67 >= model.vocab_size=64"):
        HeldoutEvaluator(cfg, mesh, paths=(big,))
    p = init_params(cfg.model, jax.random.key(0))
    other = get_recipe("tiny", OVERRIDES[1:] + ["model.vocab_size=96"])
    with pytest.raises(ConfigError, match="different vocabularies"):
        kl(p, cfg, init_params(other.model, jax.random.key(0)), other, np.zeros((1, 4), int))
    with pytest.raises(ConfigError, match=r"token ids must lie in \[0, 64\)"):
        kl(p, cfg, p, cfg, np.full((1, 4), V))
    # Through the CLI: "error: ..." and exit status 2.
    import olmax.cli
    monkeypatch.setattr(olmax.cli, "COMMAND_MODULES", [olmax.eval.commands])
    rc = olmax.cli.main(["eval", "loss", "--checkpoint", str(tmp_path / "nowhere"), "--data", held["chain"]])
    assert rc == 2 and "error: checkpoint" in capsys.readouterr().err
