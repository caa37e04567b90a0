"""Direct preference optimisation: the loss, the pair data, the cached reference log-probs, the
step and the objective (``train.objective=dpo``).

What is reproduced: open-instruct's ``dpo_tune_cache.py`` (OLMo 3 Think and Instruct DPO), loss
``dpo_norm``; TRL 1.16's ``DPOTrainer(loss_type="sigmoid_norm")`` computes the same loss and is
the reference of ``olmax verify trl --dpo``.

Per sequence, the log-probability of the response is taken over its trained tokens (the label
mask; position i's token counts where ``label_mask[i]`` is True, i >= 1, predicted from the
tokens before it, as in the LM loss of ``olmax.model.loss``): ``dpo_norm`` uses the mean over
those tokens, ``dpo`` their sum. With ``x = (pi_c - pi_r) - (ref_c - ref_r)`` the per-pair loss
is ``-(1 - e) log sigmoid(beta x) - e log sigmoid(-beta x)`` (e = ``dpo.label_smoothing``,
conservative DPO), averaged over the pairs of the global batch. Chosen and rejected sequences of
a micro-batch run in one forward pass (one row each, right-padded to ``data.sequence_length``,
no packing); pairs are never split between micro-batches.

Metrics (``dpo/...``): ``loss``; ``rewards/chosen`` and ``rewards/rejected`` = beta * (pi - ref)
of the log-probs the loss uses (open-instruct's definition; mean over pairs); ``rewards/accuracies``
(chosen reward > rejected reward); ``rewards/margins``; ``logps/chosen`` and ``logps/rejected``
(the per-sequence log-probs of the loss); ``token_logps/chosen`` and ``token_logps/rejected``
(per-token log-prob over all trained tokens of the batch); ``summed_rewards/chosen`` and
``summed_rewards/rejected`` = beta * (sum pi - sum ref), which is what TRL logs as
``rewards/*`` even for ``sigmoid_norm``.

Reference log-probs: computed once, before the first update, into ``RUN_DIR/reference_logps/``
(``logps.npy`` float32 [pairs, 2] of summed log-probs, ``counts.npy`` int32 [pairs, 2] of trained
tokens, ``meta.json`` with a fingerprint of the data and of the reference model). The pass resumes
where it stopped; a cache made for other data or another reference is an error naming the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from olmax.config import RUNTIME_MODEL_FIELDS, Config, ConfigError, model_differences
from olmax.data import chat
from olmax.model.loss import token_logps
from olmax.objectives.accumulate import accumulate, jit_update, micro_sharding, optimizer_update
from olmax.objectives.base import TRAINED_TOKENS, Objective
from olmax.sharding import BatchPlan, activation_mesh, batch_sharding

CACHE_FORMAT = "olmax-reference-logps/1"
CACHE_DIR = "reference_logps"


class PreferenceDataError(ConfigError):
    """A preference-pair folder that cannot be read (names the file)."""


# --------------------------------------------------------------------------- pair files


def read_pairs(folder: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``olmax.data.chat.read_pairs`` (the pair files' one reader), its errors naming the config key."""
    try:
        return chat.read_pairs(folder)
    except (FileNotFoundError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise PreferenceDataError(f"data.preference_path {folder}: {e}") from None


class PairSet:
    """Preference pairs as fixed-length rows: pair i -> ([2, L] tokens, [2, L] label mask)."""

    def __init__(self, folder: str | os.PathLike, seq_len: int, pad_id: int, vocab_size: int | None = None):
        self.folder = Path(folder)
        self.tokens, self.mask, self.index = read_pairs(folder)
        self.L, self.pad = seq_len, pad_id
        idx = self.index
        if idx.ndim != 2 or idx.shape[1] != 4 or idx.shape[0] == 0:
            raise PreferenceDataError(f"{self.folder / 'pairs_index.npy'}: expected a non-empty [n, 4] array, "
                                      f"got shape {idx.shape}")
        if self.tokens.shape != self.mask.shape:
            raise PreferenceDataError(f"{self.folder / 'pairs_labels_mask.npy'}: {self.mask.shape[0]} entries, "
                                      f"pairs_token_ids.npy has {self.tokens.shape[0]}")
        ends = np.maximum(idx[:, 0] + idx[:, 1], idx[:, 2] + idx[:, 3])
        if (idx < 0).any() or int(ends.max()) > self.tokens.shape[0]:
            raise PreferenceDataError(f"{self.folder / 'pairs_index.npy'}: offsets point past the "
                                      f"{self.tokens.shape[0]} tokens of pairs_token_ids.npy")
        if vocab_size is not None and self.tokens.size and int(self.tokens.max()) >= vocab_size:
            # An id past the embedding reads as NaN: every step would be skipped as non-finite.
            at = int(np.argmax(np.asarray(self.tokens) >= vocab_size))
            pair = int(np.searchsorted(idx[:, 0], at, side="right")) - 1  # pairs lie back to back (read_pairs)
            raise PreferenceDataError(f"{self.folder / 'pairs_token_ids.npy'}: token id {int(self.tokens[at])} "
                                      f"(pair {pair}) is outside the model's vocabulary of {vocab_size} "
                                      "(model.vocab_size); "
                                      "pairs from another tokenizer?")
        self.n = int(idx.shape[0])
        self.truncated = int((idx[:, 1] > seq_len).sum() + (idx[:, 3] > seq_len).sum())
        self._check_pairs()
        self.fingerprint = self._fingerprint()

    def _check_pairs(self) -> None:
        """Pairs that teach nothing are refused before any compute: identical chosen and rejected
        sequences, or (all pairs) both sides cut to their prompt by ``data.sequence_length``. Pairs
        with one side cut are counted (``cut``) and named in a note."""
        idx, L = self.index, self.L
        same = np.flatnonzero((idx[:, 1] == idx[:, 3]) & (idx[:, 0] != idx[:, 2]))
        for i in same.tolist():
            c, r, n = int(idx[i, 0]), int(idx[i, 2]), int(idx[i, 1])
            if np.array_equal(self.tokens[c:c + n], self.tokens[r:r + n]) and \
                    np.array_equal(self.mask[c:c + n], self.mask[r:r + n]):
                raise PreferenceDataError(f"{self.folder}: pair {i} has identical chosen and rejected sequences: it "
                                          "teaches nothing (its DPO loss is log 2 whatever the weights); drop such "
                                          "pairs (olmax tokenize --preference refuses them, --skip-bad skips them)")
        starts = np.concatenate([idx[:, 0], idx[:, 2]])
        ends = starts + np.minimum(np.concatenate([idx[:, 1], idx[:, 3]]), L)
        # the trained labels of each sequence within its first L tokens (position 0 predicts nothing)
        trained = (_prefix_trues(self.mask, ends) - _prefix_trues(self.mask, starts + 1)).reshape(2, -1)
        empty = trained <= 0
        self.cut = int(np.sum(empty.any(axis=0)))
        if empty.all():
            raise ConfigError(f"data.sequence_length={L}: every pair of {self.folder} keeps no trained (answer) "
                              f"token in its first {L} tokens, on either side (their prompts are longer): DPO would "
                              "train on nothing; raise data.sequence_length")

    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(self.index).tobytes())
        for arr in (self.tokens, self.mask):
            flat = np.asarray(arr).reshape(-1)
            h.update(str((flat.dtype.str, flat.shape)).encode())
            # Sampled content: 64 spans of 4096 entries spread over the array (whole arrays when small).
            span, n = 4096, flat.shape[0]
            starts = [0] if n <= 64 * span else np.linspace(0, n - span, 64).astype(np.int64).tolist()
            for s in starts:
                h.update(np.ascontiguousarray(flat[s:s + (n if n <= 64 * span else span)]).tobytes())
        h.update(f"L={self.L};pad={self.pad}".encode())
        return h.hexdigest()[:16]

    def rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids int32 [k, 2, L], label_mask bool [k, 2, L])`` of pairs ``ids``; sequences
        longer than L keep their first L tokens."""
        k = len(ids)
        toks = np.full((k, 2, self.L), self.pad, np.int32)
        mask = np.zeros((k, 2, self.L), bool)
        for j, i in enumerate(np.asarray(ids, np.int64)):
            row = self.index[int(i)]
            for s in (0, 1):
                off, n = int(row[2 * s]), min(int(row[2 * s + 1]), self.L)
                toks[j, s, :n] = self.tokens[off:off + n]
                mask[j, s, :n] = self.mask[off:off + n]
        return toks, mask


def _prefix_trues(mask: np.ndarray, points: np.ndarray, chunk: int = 1 << 24) -> np.ndarray:
    """``count_nonzero(mask[:p])`` for each of ``points``, in one pass over ``mask`` in chunks
    (a memory-mapped mask of any size)."""
    pts = np.asarray(points, np.int64)
    order = np.argsort(pts, kind="stable")
    sp = pts[order]
    out = np.empty(len(sp), np.int64)
    n, base, i, a = len(mask), 0, 0, 0
    while True:
        b = min(a + chunk, n)
        j = int(np.searchsorted(sp, b, side="right"))
        cs = np.concatenate([[0], np.cumsum(np.asarray(mask[a:b]) != 0, dtype=np.int64)])
        out[i:j] = base + cs[sp[i:j] - a]
        base, i, a = base + int(cs[-1]), j, b
        if a >= n or i >= len(sp):
            break
    res = np.empty_like(out)
    res[order] = out
    return res


def pair_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The pairs of one epoch in training order: a permutation seeded by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n).astype(np.int64)


def step_pairs(n: int, seed: int, global_batch: int, step: int) -> np.ndarray:
    """Pair ids of global batch ``step`` (0-based): epochs of ``n // global_batch`` batches, the
    remainder of each epoch dropped."""
    per_epoch = n // global_batch
    if per_epoch == 0:
        raise ConfigError(f"train.global_batch_size={global_batch} pairs is more than the {n} pairs of the data")
    epoch, k = divmod(step, per_epoch)
    return pair_order(n, seed, epoch)[k * global_batch:(k + 1) * global_batch]


# --------------------------------------------------------------------------- the model side


def sequence_logps(params: Any, input_ids: jax.Array, label_mask: jax.Array, cfg: Config
                   ) -> tuple[jax.Array, jax.Array]:
    """``(summed log-prob, counted tokens)`` per sequence of ``input_ids`` [..., L] (leading axes kept)."""
    lead, L = input_ids.shape[:-1], input_ids.shape[-1]
    toks, mask = input_ids.reshape(-1, L), label_mask.reshape(-1, L)
    lp = token_logps(params, toks, mask, cfg)
    counts = jnp.sum(mask[:, 1:].astype(jnp.float32), axis=1)
    return jnp.sum(lp, axis=1).reshape(lead), counts.reshape(lead)


def dpo_terms(pi_sum: jax.Array, ref_sum: jax.Array, counts: jax.Array, *, loss: str, beta: float,
              label_smoothing: float) -> dict[str, jax.Array]:
    """Per-pair terms from [k, 2] (chosen, rejected) summed log-probs and token counts."""
    if loss == "dpo_norm":
        denom = jnp.maximum(counts, 1.0)
        pi, ref = pi_sum / denom, ref_sum / denom
    elif loss == "dpo":
        pi, ref = pi_sum, ref_sum
    else:
        raise ConfigError(f"dpo.loss: unknown loss {loss!r} (dpo_norm, dpo)")
    x = (pi[:, 0] - pi[:, 1]) - (ref[:, 0] - ref[:, 1])
    e = label_smoothing
    losses = -(1.0 - e) * jax.nn.log_sigmoid(beta * x)
    if e:
        losses = losses - e * jax.nn.log_sigmoid(-beta * x)
    rewards = beta * jax.lax.stop_gradient(pi - ref)
    summed = beta * jax.lax.stop_gradient(pi_sum - ref_sum)
    return {"losses": losses, "rewards": rewards, "summed_rewards": summed, "logps": jax.lax.stop_gradient(pi),
            "token_logp_sum": jax.lax.stop_gradient(pi_sum), "counts": counts}


def _sums(terms: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The batch sums every metric is made of (micro-batches add them up)."""
    r, s = terms["rewards"], terms["summed_rewards"]
    return {"loss": jnp.sum(terms["losses"]),
            "rewards/chosen": jnp.sum(r[:, 0]), "rewards/rejected": jnp.sum(r[:, 1]),
            "rewards/accuracies": jnp.sum((r[:, 0] > r[:, 1]).astype(jnp.float32)),
            "rewards/margins": jnp.sum(r[:, 0] - r[:, 1]),
            "summed_rewards/chosen": jnp.sum(s[:, 0]), "summed_rewards/rejected": jnp.sum(s[:, 1]),
            "logps/chosen": jnp.sum(terms["logps"][:, 0]), "logps/rejected": jnp.sum(terms["logps"][:, 1]),
            "tok_sum_c": jnp.sum(terms["token_logp_sum"][:, 0]), "tok_sum_r": jnp.sum(terms["token_logp_sum"][:, 1]),
            "tok_n_c": jnp.sum(terms["counts"][:, 0]), "tok_n_r": jnp.sum(terms["counts"][:, 1])}


def _finish(sums: dict[str, jax.Array], pairs: int) -> dict[str, jax.Array]:
    out = {f"dpo/{k}": v / pairs for k, v in sums.items() if not k.startswith("tok_")}
    out["dpo/token_logps/chosen"] = sums["tok_sum_c"] / jnp.maximum(sums["tok_n_c"], 1.0)
    out["dpo/token_logps/rejected"] = sums["tok_sum_r"] / jnp.maximum(sums["tok_n_r"], 1.0)
    out[TRAINED_TOKENS] = sums["tok_n_c"] + sums["tok_n_r"]  # not logged: the loop counts batches without any
    return out


def dpo_batch_loss(params: Any, batch: dict[str, jax.Array], cfg: Config) -> tuple[jax.Array, dict]:
    """``(sum of per-pair losses, metric sums)`` of a (micro-)batch: ``input_ids`` and
    ``label_mask`` [k, 2, L] (chosen, rejected), ``ref_logps`` [k, 2] summed reference log-probs.
    All 2k sequences run in one forward pass."""
    pi_sum, counts = sequence_logps(params, batch["input_ids"], batch["label_mask"], cfg)
    d = cfg.dpo
    terms = dpo_terms(pi_sum, batch["ref_logps"], counts, loss=d.loss, beta=d.beta, label_smoothing=d.label_smoothing)
    return jnp.sum(terms["losses"]), jax.lax.stop_gradient(_sums(terms))


def make_dpo_step(cfg: Config, accum_steps: int, apply_update: Callable,
                  micro_constraint: Callable[[jax.Array], jax.Array] | None = None,
                  mesh: Mesh | None = None) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, metrics)`` (not jitted): the mean
    DPO loss over the global batch's pairs, gradients accumulated over micro-batches of pairs."""

    def step(params, opt_state, batch):
        with activation_mesh(mesh):
            pairs = batch["input_ids"].shape[0]
            grads, sums = accumulate(partial(dpo_batch_loss, cfg=cfg), params, batch, accum_steps, micro_constraint)
            grads = jax.tree.map(lambda g: g / pairs, grads)
            metrics = _finish(sums, pairs)
            loss = metrics["dpo/loss"]
            new_params, new_opt, om = apply_update(params, grads, opt_state, loss)
            return new_params, new_opt, {"loss": loss, **metrics, **om}

    return step


def jit_dpo_step(cfg: Config, mesh: Mesh, plan: BatchPlan, pshard: Any, oshard: Any) -> Callable:
    """The DPO train step as the loop runs it: jitted with the state's shardings, the pairs split
    over the data-parallel axes, the old state donated."""
    step = make_dpo_step(cfg, plan.accum_steps, optimizer_update(cfg), micro_constraint=micro_sharding(mesh),
                         mesh=mesh)
    return jit_update(step, pshard, oshard, _pair_shardings(mesh))


def _pair_shardings(mesh: Mesh) -> dict[str, Any]:
    """A batch of pairs split over the data-parallel axes (pair by pair)."""
    s3 = batch_sharding(mesh, 3)
    return {"input_ids": s3, "label_mask": s3, "ref_logps": batch_sharding(mesh, 2)}


# --------------------------------------------------------------------------- reference log-probs


def _model_identity(cfg: Config) -> dict[str, Any]:
    m = dataclasses.asdict(cfg.model)
    keep = {k: v for k, v in m.items() if k not in RUNTIME_MODEL_FIELDS or k == "compute_dtype"}
    return keep


def reference_identity(cfg: Config) -> dict[str, Any]:
    """What the reference log-probs depend on besides the data: the reference weights (named by
    their source and the sizes of its files), the architecture and the compute dtype."""
    ref = cfg.dpo.reference
    if ref == "init":
        src = cfg.train.init_from or f"random-init:seed={cfg.train.seed}"
    else:
        src = ref
    kind, _, path = src.partition(":")
    local = path if kind in ("hf", "olmax", "state") else src
    files: dict[str, int] = {}
    p = Path(local)
    if not src.startswith("random-init") and p.exists():
        for q in _weight_files(p, hf=kind == "hf")[:2000]:
            files[str(q.relative_to(p)) if q != p else q.name] = q.stat().st_size
    return {"reference": ref, "source": src, "files": files, "model": _model_identity(cfg)}


def _weight_files(p: Path, hf: bool) -> list[Path]:
    """The files that hold the reference's weights: a file, every file of an HF or olmax weights
    directory, and of a run directory only its newest committed checkpoint (of a checkpoint
    directory, that one). A run directory's other files (its lock, metrics, TensorBoard events,
    order cache) change whenever the run is opened again, not its weights: counting them made a
    DPO run refuse its own cache after the reference run was resumed or the demo rerun."""
    if p.is_file():
        return [p]
    from olmax.checkpoint.load import resolve_checkpoint
    from olmax.checkpoint.store import CHECKPOINT_DIR
    from olmax.model.weights_io import is_weights_dir
    root = p
    if not hf and not is_weights_dir(p):
        try:
            run, step = resolve_checkpoint(p)
        except ConfigError:
            pass  # not a run: every file counts
        else:
            root = Path(run) / CHECKPOINT_DIR / str(step)
    return sorted(q for q in root.rglob("*") if q.is_file())


def _reference_path(cfg: Config) -> str:
    """``dpo.reference``'s weights (not "init"), checked to exist."""
    ref = cfg.dpo.reference
    path = ref[len("olmax:"):] if ref.startswith("olmax:") else ref
    if not ref.startswith("hf:") and not Path(path).exists():
        raise ConfigError(f"dpo.reference {ref}: {Path(path)} does not exist")
    if ref.startswith("hf:") and not Path(ref[3:]).is_dir():
        raise ConfigError(f"dpo.reference {ref}: {Path(ref[3:])} is not a directory")
    return path


def reference_params(cfg: Config, mesh: Mesh, pshard: Any) -> Any:
    """The reference weights of ``dpo.reference`` (not "init"), checked to be the same model."""
    from olmax.checkpoint.load import load_params
    ref = cfg.dpo.reference
    params, src_cfg = load_params(_reference_path(cfg))
    diffs = model_differences(src_cfg.model, cfg.model, ignore=frozenset({"param_dtype"}))
    if diffs:
        raise ConfigError(f"dpo.reference {ref} is a different model: " + "; ".join(
            f"model.{f}: the reference has {a!r}, the config has {b!r}" for f, a, b in diffs))
    params = jax.tree.map(lambda a: jnp.asarray(a, cfg.model.param_dtype), params)
    return jax.device_put(params, pshard)


class ReferenceCache:
    """``RUN_DIR/reference_logps``: summed reference log-probs and token counts per pair."""

    def __init__(self, run_dir: str | os.PathLike, pairs: PairSet, cfg: Config):
        self.dir = Path(run_dir) / CACHE_DIR
        self.pairs = pairs
        ident = {"data": pairs.fingerprint, "pairs": pairs.n, "sequence_length": pairs.L,
                 **reference_identity(cfg)}
        self.inputs = ident
        self.fingerprint = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
        self.meta_path = self.dir / "meta.json"
        self.done = 0
        self.logps: np.ndarray | None = None
        if self.meta_path.exists():
            try:
                meta = json.loads(self.meta_path.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{self.meta_path}: unreadable ({e}); delete {self.dir} to recompute") from None
            if meta.get("format") != CACHE_FORMAT or meta.get("fingerprint") != self.fingerprint:
                what = _what_changed(meta.get("inputs", {}), ident)
                raise ConfigError(
                    f"{self.meta_path}: the reference log-probs were computed for other inputs ({what}; "
                    f"fingerprint {meta.get('fingerprint')!r}, now {self.fingerprint!r}). Restore the original "
                    f"data.preference_path / dpo.reference, delete {self.dir} to recompute, or use another --run-dir")
            self.done = int(meta.get("done", 0))
            if self.done:
                self.logps = np.load(self.dir / "logps.npy")
                self.counts = np.load(self.dir / "counts.npy")
                if self.logps.shape != (pairs.n, 2):
                    raise ConfigError(f"{self.dir / 'logps.npy'}: shape {self.logps.shape}, expected {(pairs.n, 2)}")

    @property
    def complete(self) -> bool:
        return self.done >= self.pairs.n

    def compute(self, params: Any, cfg: Config, mesh: Mesh, chunk: int, say: Callable[[str], None] = print,
                stop_after: int | None = None) -> None:
        """Fill the cache from pair ``done`` on, ``chunk`` pairs per forward, saving after each
        chunk (``stop_after`` chunks: tests of the resume)."""
        if self.complete:
            return
        n = self.pairs.n
        is_main = jax.process_index() == 0
        R, r = jax.process_count(), jax.process_index()
        dp = int(np.prod([mesh.shape[a] for a in mesh.axis_names if a != "tensor"]))
        chunk = max(dp, -(-chunk // dp) * dp)
        if R > 1 and chunk % R:
            chunk = -(-chunk // (dp * R)) * dp * R
        if self.logps is None:
            self.logps = np.zeros((n, 2), np.float32)
            self.counts = np.zeros((n, 2), np.int32)
        shard3, shard1 = batch_sharding(mesh, 3), batch_sharding(mesh, 2)

        @partial(jax.jit, out_shardings=(shard1, shard1))
        def fwd(p, toks, mask):
            with activation_mesh(mesh):
                return sequence_logps(p, toks, mask, cfg)

        say(f"olmax: reference log-probs of {n} pairs ({self.done} cached) into {self.dir}")
        self.dir.mkdir(parents=True, exist_ok=True)
        chunks = 0
        while self.done < n:
            ids = np.arange(self.done, min(self.done + chunk, n))
            padded = np.concatenate([ids, np.full(chunk - len(ids), ids[0])])
            local = padded[r::R] if R > 1 else padded
            toks, mask = self.pairs.rows(local)
            put = lambda x, s: jax.make_array_from_process_local_data(s, x, (chunk, *x.shape[1:]))  # noqa: E731
            lp, cnt = fwd(params, put(toks, shard3), put(mask, shard3))
            if R > 1:
                from jax.experimental import multihost_utils
                lp = np.asarray(multihost_utils.process_allgather(lp, tiled=True))
                cnt = np.asarray(multihost_utils.process_allgather(cnt, tiled=True))
                order = np.concatenate([np.arange(chunk)[q::R] for q in range(R)])
                lp_full, cnt_full = np.empty_like(lp), np.empty_like(cnt)
                lp_full[order], cnt_full[order] = lp, cnt
                lp, cnt = lp_full, cnt_full
            lp, cnt = np.asarray(lp, np.float32), np.asarray(cnt)
            k = len(ids)
            self.logps[ids] = lp[:k]
            self.counts[ids] = cnt[:k].astype(np.int32)
            self.done += k
            if is_main:
                self._save()
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                return
        say(f"olmax: reference log-probs done ({n} pairs)")

    def _save(self) -> None:
        for name, arr in (("logps.npy", self.logps), ("counts.npy", self.counts)):
            tmp = self.dir / (name + ".tmp.npy")
            np.save(tmp, arr)
            os.replace(tmp, self.dir / name)
        tmp = self.dir / "meta.json.tmp"
        tmp.write_text(json.dumps({"format": CACHE_FORMAT, "fingerprint": self.fingerprint, "done": self.done,
                                   "pairs": self.pairs.n, "inputs": self.inputs}, indent=1))
        os.replace(tmp, self.meta_path)


def _what_changed(old: dict, new: dict) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    names = {"data": "the preference data", "files": "the reference weights' files", "source": "the reference",
             "reference": "dpo.reference", "model": "the model config", "sequence_length": "data.sequence_length",
             "pairs": "the number of pairs"}
    return ", ".join(names.get(k, k) for k in keys) + " changed" if keys else "unknown format"


# --------------------------------------------------------------------------- the loop's data


@dataclasses.dataclass
class PairState:
    """Where the pair stream stands; saved in every checkpoint as the data state."""

    seed: int
    batches_processed: int
    fingerprint: str
    global_batch_size: int
    kind: str = "dpo-pairs"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class DpoData:
    """The loop's data for ``train.objective=dpo``: global batch k = ``step_pairs(k)``, with the
    cached reference log-probs (``prepare`` fills the cache before the first step)."""

    def __init__(self, cfg: Config, start_step: int, data_state: dict | None, allow_fingerprint_mismatch: bool,
                 mesh: Mesh, run_dir: Path):
        self.cfg, self.mesh = cfg, mesh
        if not cfg.data.preference_path:
            raise ConfigError("train.objective=dpo needs data.preference_path (a folder of preference pairs, "
                              "e.g. --set data.preference_path=DIR)")
        self.pairs = PairSet(cfg.data.preference_path, cfg.data.sequence_length, cfg.data.pad_token_id,
                             cfg.model.vocab_size)
        self.fingerprint = self.pairs.fingerprint
        self.B = cfg.train.global_batch_size
        step_pairs(self.pairs.n, cfg.data.seed, self.B, 0)  # enough pairs for one batch
        if data_state is not None:
            old = data_state.get("fingerprint")
            if old != self.fingerprint and not allow_fingerprint_mismatch:
                raise ConfigError(f"the checkpoint was trained on other preference pairs (fingerprint {old!r}, "
                                  f"{cfg.data.preference_path} has {self.fingerprint!r}); restore the data or pass "
                                  "--allow-fingerprint-mismatch")
        self.cache = ReferenceCache(run_dir, self.pairs, cfg)
        if not self.cache.complete and cfg.dpo.reference != "init":
            _reference_path(cfg)  # a missing reference fails here, before the model is initialised and compiled
        self.trace = None
        if cfg.train.trace_instance_ids:
            self.trace = open(Path(run_dir) / f"instance_ids.p{jax.process_index()}.jsonl", "a")
        if self.pairs.truncated and jax.process_index() == 0:
            print(f"olmax: note: {self.pairs.truncated} sequences of {cfg.data.preference_path} are longer than "
                  f"data.sequence_length={self.pairs.L} and keep their first {self.pairs.L} tokens", file=sys.stderr)
        if self.pairs.cut and jax.process_index() == 0:
            print(f"olmax: WARNING {self.pairs.cut} of the {self.pairs.n} pairs of {cfg.data.preference_path} keep no "
                  f"trained token on a side within data.sequence_length={self.pairs.L} (cut to the prompt): that "
                  "side adds nothing to the loss", file=sys.stderr)

    def prepare(self, initial_params: Callable[[], Any], pshard: Any, plan: BatchPlan,
                say: Callable[[str], None]) -> None:
        """Compute whatever is missing of the reference log-probs (``initial_params()`` gives the
        policy's initial weights, used when ``dpo.reference`` is "init")."""
        if self.cache.complete:
            return
        ref = self.cfg.dpo.reference
        params = initial_params() if ref == "init" else reference_params(self.cfg, self.mesh, pshard)
        chunk = self.cfg.dpo.reference_batch_size or plan.micro_batch * plan.data_parallel
        self.cache.compute(params, self.cfg, self.mesh, chunk, say=say)
        del params

    def global_batch(self, step: int) -> dict[str, jax.Array]:
        if not self.cache.complete:
            raise RuntimeError("reference log-probs are incomplete; DpoData.prepare must run first")
        ids = step_pairs(self.pairs.n, self.cfg.data.seed, self.B, step)
        R, r = jax.process_count(), jax.process_index()
        local = ids[r::R] if R > 1 else ids
        toks, mask = self.pairs.rows(local)
        if self.trace is not None:
            # what this process read (its share of the step's pairs), as pre-training's trace does
            self.trace.write(json.dumps({"step": step, "instance_ids": local.tolist()}) + "\n")
            self.trace.flush()
        from olmax.data.loader import global_batch_to_device
        return global_batch_to_device({"input_ids": toks, "label_mask": mask,
                                       "ref_logps": self.cache.logps[local]}, self.mesh)

    def state(self, done: int) -> PairState:
        return PairState(seed=self.cfg.data.seed, batches_processed=done, fingerprint=self.fingerprint,
                         global_batch_size=self.B)

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()


# --------------------------------------------------------------------------- the objective


class Dpo(Objective):
    """``train.objective=dpo``: ``global_batch_size`` pairs a step, a chosen and a rejected row each."""

    name = "dpo"
    loss_name = "DPO loss"
    empty_batch = ("every pair cut to its prompt on both sides by data.sequence_length; its loss is log 2 whatever "
                   "the weights")
    rows_per_example = 2

    def data(self, start: int, data_state: dict | None, allow_fingerprint_mismatch: bool, mesh: Mesh, run: Path,
             dataset: Any = None) -> DpoData:
        return DpoData(self.cfg, start, data_state, allow_fingerprint_mismatch, mesh, run)

    def prepare(self, data: DpoData, initial_params: Callable[[], Any], pshard: Any, plan: BatchPlan,
                say: Callable[[str], None]) -> None:
        data.prepare(initial_params, pshard, plan, say)  # the reference log-probs, before the first update

    def jit_update(self, mesh: Mesh, plan: BatchPlan, pshard: Any, oshard: Any) -> Callable:
        return jit_dpo_step(self.cfg, mesh, plan, pshard, oshard)

    def abstract_batch(self, mesh: Mesh, plan: BatchPlan) -> dict[str, jax.ShapeDtypeStruct]:
        # a chosen and a rejected row of L tokens per pair, and their reference log-probs
        B, L, shard = self.update_batch_size(), self.cfg.data.sequence_length, _pair_shardings(mesh)
        shapes = {"input_ids": ((B, 2, L), jnp.int32), "label_mask": ((B, 2, L), jnp.bool_),
                  "ref_logps": ((B, 2), jnp.float32)}
        return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=shard[k]) for k, (shape, dtype) in shapes.items()}
