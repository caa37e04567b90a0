"""The RL loop's data: prompts, rollouts sampled from the policy's own weights, rewards, groups.

What a step does (``RlData.rollouts(step, params)``):

1. Draws ``rl.prompts_per_step`` prompts from the prompt stream: prompt k of the stream is
   ``permutation(epoch)[k % n]`` with ``epoch = k // n`` and the permutation seeded by
   ``(data.seed, epoch)``; prompts retired by ``rl.retire_pass_rate`` are passed over. The stream
   position (and the retired prompts) are the data state saved in every checkpoint.
2. Samples ``rl.group_size`` completions of each with olmax's KV-cache generator
   (``olmax.engine``) loaded with the trainer's current weights: the same parameters, on
   the same mesh; there is no second copy to keep in sync. Row j of sampling round r of step s
   draws from ``fold_in(key(seed(train.seed, s, r)), j)``: rollouts are a pure function of the
   weights, the step and the data state, so a resumed run samples what an uninterrupted one does.
3. Scores each completion (``olmax.rl.rewards``; the completion text is cut at the first stop
   string or literal ``<|im_end|>``, special tokens dropped) and finds the groups whose rewards
   are all equal. With ``rl.active_sampling`` it samples further rounds of fresh prompts until
   ``prompts_per_step`` informative groups (at most ``rl.max_sampling_rounds`` rounds).
4. Builds a fixed-shape batch of ``prompts_per_step x group_size`` rows: prompt + completion
   right-padded to ``data.sequence_length``, ``completion_mask`` on the completion tokens (EOS
   included), group advantages, and the generation log-probs. Groups dropped by
   ``rl.filter_zero_std`` stay in the batch as rows with no trained token (``row_valid`` False)
   so that the step compiles once; they add nothing to the loss or to any count. With
   ``rl.pack_length`` the update packs these rows into rows of that length
   (``olmax.rl.packing``).

Several processes (a multi-host slice): every process runs the same loop on the whole batch. The
generator's sampled tokens are gathered onto every device each step, so every process sees the same
completions and stops; process 0 alone scores them (a verifier with a timeout could answer
differently on another host) and sends its rewards to the others; the training batch is the same
host array everywhere, and each process puts its own rows on its devices.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from olmax.config import Config, ConfigError
from olmax.rl import grpo
from olmax.rl.rewards import RewardFn

IM_END_TEXT = "<|im_end|>"


class PromptDataError(ConfigError):
    """A prompts file that cannot be used (names the file and line)."""


@dataclasses.dataclass
class Prompt:
    ids: list[int]
    gold: str
    line: int


def _stream_seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def load_codec(cfg: Config) -> Any:
    """The tokenizer of prompts and completions: ``rl.tokenizer``, else the one that belongs to
    ``train.init_from`` (or to the run's training data)."""
    from olmax.chat.codec import TextCodec, find_tokenizer
    path = cfg.rl.tokenizer
    if path is not None and not Path(path).exists():
        raise ConfigError(f"rl.tokenizer={path}: does not exist (give a tokenizer.json or a folder holding one)")
    if path is None and cfg.train.init_from:
        src = cfg.train.init_from.split(":", 1)[1] if cfg.train.init_from.split(":", 1)[0] in ("state", "olmax") \
            else cfg.train.init_from
        found = find_tokenizer(src, cfg)
        if found is None:  # a run directory: the tokenizer beside that run's own training data
            from olmax.config import load_yaml
            for d in (Path(src), Path(src).parent.parent):
                if (d / "config.yaml").is_file():
                    found = find_tokenizer(src, load_yaml(str(d / "config.yaml")))
                    break
        path = str(found) if found is not None else None
    if path is None:
        raise ConfigError("train.objective=grpo needs a tokenizer for prompts and completions: set rl.tokenizer "
                          "(a tokenizer.json or a folder holding one)")
    return TextCodec.load(path, cfg)


def prompts_file(path: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise PromptDataError(f"rl.prompts_path {p}: no such file (JSONL of prompts with ground_truth)")
    return p


def _prompt_text(p: Path) -> str:
    """The text of ``rl.prompts_path``, read whole; a file that is not UTF-8 is named."""
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PromptDataError(f"rl.prompts_path {p}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_prompts(path: str, codec: Any, max_prompt_length: int) -> tuple[list[Prompt], int]:
    """Prompts of ``rl.prompts_path`` and how many were left out as longer than
    ``max_prompt_length`` tokens."""
    from olmax.chat.codec import prompt_record
    p = prompts_file(path)
    out, too_long = [], 0
    with io.StringIO(_prompt_text(p)) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptDataError(f"{p}:{n}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise PromptDataError(f"{p}:{n}: expected a JSON object with messages or prompt, and ground_truth")
            if "ground_truth" not in rec:
                raise PromptDataError(f"{p}:{n}: no ground_truth")
            gold = rec["ground_truth"]
            if isinstance(gold, list) and len(gold) == 1:
                gold = gold[0]
            if not isinstance(gold, (str, int, float)):
                raise PromptDataError(f"{p}:{n}: ground_truth must be a string, got {type(gold).__name__}")
            try:
                prompt = prompt_record(rec, f"{p}:{n}")
                text = codec.render_chat(prompt) if isinstance(prompt, list) else prompt
            except ValueError as e:
                raise PromptDataError(str(e)) from None
            if text is None:
                raise PromptDataError(f"{p}:{n}: needs messages (a chat) or prompt (a string)")
            ids = codec.encode(text)
            if not ids:
                raise PromptDataError(f"{p}:{n}: the prompt is empty")
            if len(ids) > max_prompt_length:
                too_long += 1
                continue
            out.append(Prompt(ids, str(gold), n))
    if not out and not too_long:
        raise PromptDataError(f"rl.prompts_path {p}: the file holds no prompt (it is empty or blank lines only)")
    if not out:
        raise PromptDataError(f"rl.prompts_path {p}: no usable prompt: all {too_long} are longer than "
                              f"rl.max_prompt_length={max_prompt_length} tokens")
    return out, too_long


@dataclasses.dataclass
class RlState:
    """Where the prompt stream stands; saved in every checkpoint as the data state."""

    seed: int
    batches_processed: int
    fingerprint: str
    prompts_drawn: int
    retired: list[int] = dataclasses.field(default_factory=list)
    kind: str = "rl-prompts"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def completion_text(codec: Any, ids: list[int], stops: tuple[str, ...]) -> str:
    """The text a verifier scores: special tokens dropped, cut at the first stop string (and at a
    literal ``<|im_end|>``, the end of a turn for a tokenizer without that special token)."""
    text = codec.decode(ids)
    cut = [i for i in (text.find(s) for s in (*stops, IM_END_TEXT)) if i >= 0]
    return text[:min(cut)] if cut else text


class RlData:
    """The loop's data for ``train.objective=grpo`` (see the module docstring)."""

    def __init__(self, cfg: Config, start_step: int, data_state: dict | None, allow_fingerprint_mismatch: bool,
                 mesh: Any, run_dir: Path):
        r = cfg.rl
        if not r.prompts_path:
            raise ConfigError("train.objective=grpo needs rl.prompts_path (a JSONL of prompts with ground_truth, "
                              "e.g. --set rl.prompts_path=FILE)")
        prompts_file(r.prompts_path)  # a missing file first, before the tokenizer is looked for
        self.cfg, self.mesh = cfg, mesh
        self.codec = load_codec(cfg)
        self.prompts, too_long = read_prompts(r.prompts_path, self.codec, r.max_prompt_length)
        digest = hashlib.sha256()
        for p in self.prompts:
            digest.update(json.dumps([p.ids, p.gold]).encode())
        self.fingerprint = digest.hexdigest()[:16]
        if too_long and jax.process_index() == 0:
            print(f"olmax: note: {too_long} prompts of {r.prompts_path} are longer than rl.max_prompt_length="
                  f"{r.max_prompt_length} tokens and are left out", file=sys.stderr)
        self.drawn, self.retired = 0, set()
        if data_state is not None:
            if data_state.get("kind") != "rl-prompts":
                raise ConfigError(f"the checkpoint's data state is {data_state.get('kind', 'token instances')!r}, "
                                  "not an RL prompt stream: resume it with its own objective")
            old = data_state.get("fingerprint")
            if old != self.fingerprint and not allow_fingerprint_mismatch:
                raise ConfigError(f"the checkpoint was trained on other prompts (fingerprint {old!r}, "
                                  f"{r.prompts_path} has {self.fingerprint!r}); restore them or pass "
                                  "--allow-fingerprint-mismatch")
            self.drawn = int(data_state["prompts_drawn"])
            self.retired = set(int(i) for i in data_state.get("retired", ()))
        self.reward = RewardFn(r.reward, r.reward_multiplier, r.reward_timeout_s)
        eos = cfg.data.eos_token_id
        self.eos_ids = {int(eos)} if eos is not None else set()
        self.L = cfg.data.sequence_length
        self.generator = None
        self._kv_counted = (0, 0)  # the engine's shared prompt positions and preemptions reported so far
        self._perm: tuple[int, np.ndarray] | None = None
        self.trace = None
        if cfg.train.trace_instance_ids:
            self.trace = open(Path(run_dir) / f"instance_ids.p{jax.process_index()}.jsonl", "a")

    # -- the prompt stream ----------------------------------------------------------------------

    def _at(self, k: int) -> int:
        n = len(self.prompts)
        epoch = k // n
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.default_rng(_stream_seed(self.cfg.data.seed, epoch))
            self._perm = (epoch, rng.permutation(n))
        return int(self._perm[1][k % n])

    def draw(self, count: int) -> list[int]:
        """The next ``count`` prompt indices of the stream (retired prompts passed over)."""
        if len(self.retired) >= len(self.prompts):
            raise ConfigError(f"every prompt of {self.cfg.rl.prompts_path} is retired (rl.retire_pass_rate="
                              f"{self.cfg.rl.retire_pass_rate}): nothing is left to train on")
        out = []
        while len(out) < count:
            i = self._at(self.drawn)
            self.drawn += 1
            if i not in self.retired:
                out.append(i)
        return out

    # -- rollouts -------------------------------------------------------------------------------

    def _generate(self, params: Any, rows: list[list[int]], seed: int) -> list[Any]:
        from olmax.engine import Sampling, call_rows, decoder, generate, parse_budget
        from olmax.engine.paged import budget_bytes
        r = self.cfg.rl
        sampling = Sampling(temperature=r.temperature, top_p=None if r.top_p >= 1 else r.top_p, seed=seed)
        batch = r.generation_batch or len(rows)
        if self.generator is None:
            # In the layout of the batches it runs from the start: the weights reloaded every step
            # then go through one program compiled in the first step (not a new one in the second).
            budget = parse_budget(r.kv_budget)
            self.generator = decoder(params, self.cfg.model, r.batching, rows=call_rows(len(rows), batch, self.mesh),
                                     mesh=self.mesh, sampling=sampling, kv_cache=r.kv_cache, page_size=r.page_size,
                                     kv_budget=None if budget is None else budget_bytes(budget))
        else:
            self.generator.load(params)
        stops = r.stop_strings
        stop = None
        if stops:
            tail = max(len(s) for s in stops) + 16

            def stop(_i: int, ids: list[int]) -> bool:
                text = self.codec.tokenizer.decode(ids[-tail:], skip_special_tokens=False)
                return any(s in text for s in stops)
        return generate(None, self.cfg.model, rows, max_new_tokens=r.max_response_length, sampling=sampling,
                        eos_ids=self.eos_ids, batch_size=batch, stop=stop,
                        generator=self.generator)

    def _kv_metrics(self) -> dict[str, float]:
        """The continuous engine's KV cache (``Engine.kv_report``): peak bytes used and reserved in
        the step's last sampling round, and the step's prompt positions served from shared pages
        and preemptions: the engine counts them over its life, so each step reports what it added
        (the same figures whether or not the run resumed in between)."""
        report = getattr(self.generator, "kv_report", None)
        if report is None:
            return {}
        kv = report()
        seen = self._kv_counted
        self._kv_counted = (kv["kv_shared_prompt_tokens"], kv["preemptions"])
        return {"rl/kv_bytes_peak": float(kv["kv_bytes_peak"]), "rl/kv_bytes_reserved": float(kv["kv_bytes_reserved"]),
                "rl/kv_shared_prompt_tokens": float(kv["kv_shared_prompt_tokens"] - seen[0]),
                "rl/preemptions": float(kv["preemptions"] - seen[1])}

    def _score(self, texts: list[str], golds: list[str]) -> np.ndarray:
        """Rewards of the completions; with several processes, process 0's, sent to the rest (so
        that a verifier timing out on one host cannot make the hosts train different batches)."""
        if jax.process_count() == 1:
            return np.asarray(self.reward.batch(texts, golds), np.float32)
        from jax.experimental import multihost_utils
        mine = np.asarray(self.reward.batch(texts, golds) if jax.process_index() == 0 else np.zeros(len(texts)),
                          np.float32)
        return np.asarray(multihost_utils.broadcast_one_to_all(mine), np.float32)

    def rollouts(self, step: int, params: Any) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Step ``step``'s training batch (host arrays) and its rollout metrics."""
        from olmax.engine import NonFiniteLogits
        r = self.cfg.rl
        P, G = r.prompts_per_step, r.group_size
        t0 = time.perf_counter()
        kept: list[tuple[int, list[Any], np.ndarray]] = []      # informative groups
        spare: list[tuple[int, list[Any], np.ndarray]] = []     # zero-std groups (masked out when filtered)
        all_rewards, lengths, truncated, generated, zero_std, rounds = [], [], 0, 0, 0, 0
        slot_steps = decoded = 0
        while True:
            ids = self.draw(P)
            rows = [self.prompts[i].ids for i in ids for _ in range(G)]
            before = (self.generator.stats.slot_steps, self.generator.stats.decoded) if self.generator else (0, 0)
            try:
                comps = self._generate(params, rows, _stream_seed(self.cfg.train.seed, step, rounds))
            except NonFiniteLogits as e:  # never train on rollouts of a broken policy
                # ``step`` counts from 0; the run names its steps from 1 (``step 2, the last of this run``)
                raise ValueError(f"RL step {step + 1}: the policy's rollout of prompt {ids[e.prompt // G]}: "
                                 f"{e.error}; its weights, or their forward, are broken (the updates before it "
                                 f"diverged: a learning rate too high, optim.lr={self.cfg.optim.lr}, is the usual "
                                 "cause)") from None
            slot_steps += self.generator.stats.slot_steps - before[0]
            decoded += self.generator.stats.decoded - before[1]
            rounds += 1
            texts = [completion_text(self.codec, c.token_ids, r.stop_strings) for c in comps]
            golds = [self.prompts[i].gold for i in ids for _ in range(G)]
            rewards = self._score(texts, golds)
            flat = grpo.zero_std_groups(rewards, G)
            for g, i in enumerate(ids):
                group = (i, comps[g * G:(g + 1) * G], rewards[g * G:(g + 1) * G])
                (spare if (flat[g] and r.filter_zero_std) else kept).append(group)
                if r.retire_pass_rate is not None and np.mean(group[2] > 0) >= r.retire_pass_rate:
                    self.retired.add(i)
            all_rewards.append(rewards)
            zero_std += int(flat.sum())
            for c in comps:
                lengths.append(len(c.token_ids))
                truncated += c.finish_reason == "length"
                generated += len(c.token_ids)
            if not (r.active_sampling and len(kept) < P and rounds < r.max_sampling_rounds):
                break
        t_gen = time.perf_counter() - t0
        groups = kept[:P]
        n_valid = len(groups)
        groups += spare[:P - len(groups)]
        batch = self._batch(groups, n_valid)
        rewards = np.concatenate(all_rewards)
        metrics = {
            "rl/reward_mean": float(rewards.mean()), "rl/reward_std": float(rewards.std()),
            "rl/zero_std_share": zero_std / (len(rewards) // G),
            "rl/groups_trained": float(n_valid), "rl/sampling_rounds": float(rounds),
            "rl/response_length_mean": float(np.mean(lengths)), "rl/response_length_max": float(np.max(lengths)),
            "rl/truncation_rate": truncated / len(lengths),
            "rl/tokens_generated": float(generated),
            "rl/generation_tokens_per_sec": generated / t_gen if t_gen > 0 else 0.0,
            # Tokens made per decode step and slot: the share of the engine's slots that did useful work.
            "rl/slot_utilisation": decoded / slot_steps if slot_steps else 1.0,
            **self._kv_metrics(),
            "rl/time_generation_s": t_gen, "rl/prompts_retired": float(len(self.retired)),
            "rl/reward_failures": float(self.reward.failures + self.reward.timeouts),
        }
        if self.trace is not None:
            self.trace.write(json.dumps({"step": step, "prompts": [g[0] for g in groups]}) + "\n")
            self.trace.flush()
        return batch, metrics

    def _batch(self, groups: list[tuple[int, list[Any], np.ndarray]], n_valid: int) -> dict[str, np.ndarray]:
        r = self.cfg.rl
        G, L = r.group_size, self.L
        n = len(groups) * G
        toks = np.full((n, L), self.cfg.data.pad_token_id or 0, np.int32)
        cmask = np.zeros((n, L), bool)     # trained completion tokens
        gmask = np.zeros((n, L), bool)     # every generated token (the log-prob gap is over these)
        gen_logps = np.zeros((n, L), np.float32)
        valid = np.zeros(n, bool)
        lengths = np.zeros(n, np.int32)   # prompt + completion tokens (the rest of the row is padding)
        rewards = np.zeros(n, np.float32)
        for g, (i, comps, rew) in enumerate(groups):
            prompt = self.prompts[i].ids
            for j, c in enumerate(comps):
                row = g * G + j
                p, t = len(prompt), len(c.token_ids)
                toks[row, :p], toks[row, p:p + t] = prompt, c.token_ids
                gmask[row, p:p + t] = True
                lengths[row] = p + t
                # token_logps layout: position i holds log p(token i + 1)
                gen_logps[row, p - 1:p - 1 + t] = c.logprobs
                valid[row] = g < n_valid
                if valid[row] and not (r.mask_truncated and c.finish_reason == "length"):
                    cmask[row, p:p + t] = True
            rewards[g * G:(g + 1) * G] = rew
        adv = grpo.group_advantages(rewards, G, r.advantage)
        adv[~valid] = 0.0
        return {"input_ids": toks, "completion_mask": cmask, "generated_mask": gmask, "gen_logps": gen_logps,
                "advantages": adv, "row_valid": valid, "lengths": lengths}

    # -- the loop's interface -------------------------------------------------------------------

    def state(self, done: int) -> RlState:
        return RlState(seed=self.cfg.data.seed, batches_processed=done, fingerprint=self.fingerprint,
                       prompts_drawn=self.drawn, retired=sorted(self.retired))

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
            self.trace = None


def max_gap(old_logps: np.ndarray, gen_logps: np.ndarray, generated_mask: np.ndarray) -> float:
    """The largest |training log-prob - generation log-prob| over the generated tokens."""
    m = np.concatenate([generated_mask[:, 1:], np.zeros_like(generated_mask[:, :1])], axis=1)
    if not m.any():
        return 0.0
    d = np.abs(np.asarray(old_logps, np.float64) - np.asarray(gen_logps, np.float64))[m]
    return float(np.nanmax(d)) if not np.isnan(d).all() else math.nan


