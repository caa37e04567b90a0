"""A native lm-eval-harness model (``--model olmax``) that runs an olmax checkpoint in JAX.

Importing this module registers the model with lm-eval (lm-eval's own CLI with it registered:
``python -m olmax.eval.lm_eval_adapter ...``). Model args (``model_args`` string or dict):
``checkpoint`` (anything ``load_params`` accepts: weights dir, run or checkpoint dir, ``hf:DIR``),
``tokenizer`` (a ``tokenizer.json`` file or an HF tokenizer directory; default: the ``hf:`` dir or
the checkpoint dir when it holds a tokenizer), ``batch_size``, ``max_length`` (default: the model's
``max_position_embeddings``, as lm-eval's HF model resolves it), ``dtype`` (float32 | bfloat16, for
parameters and compute), ``max_gen_toks``, ``add_bos_token``, ``prefix_token_id`` and ``seed`` (of
sampled generations whose gen_kwargs give none; default 0).

Scores are comparable with ``lm_eval --model hf`` on the same weights and tokenizer: tokenisation,
left truncation, rolling windows, request ordering and stop-sequence handling mirror
``lm_eval/models/huggingface.py`` (0.4.x) line for line. OLMo 3's dolma2 tokenizer adds no BOS, so
none is added here either unless the tokenizer itself (or ``add_bos_token=True``) asks for it.

Cost: every shape is bucketed (batch and length rounded up to powers of two, capped at
``batch_size`` and ``max_length``), so jit compiles at most log2(batch) * log2(max_length) programs
per function. ``generate_until`` decodes through the KV cache (``olmax.engine``: one
prefill, then one token per step), all requests with the same gen_kwargs in one call (its
batches share one prompt bucket), one compiled decoder for every sampling setting.

Chat (``--apply_chat_template``): prompts are rendered with the tokenizer folder's own chat template
(``chat_template.jinja`` or ``tokenizer_config.json``), else the built-in OLMo 3 Instruct template,
through ``olmax.chat.template``: the text ``olmax tokenize --chat`` trains on and ``olmax generate``
prompts with. A jinja template renders as ``lm_eval --model hf`` renders it.

Generation kwargs: ``until``, ``max_gen_toks`` (and lm-eval's aliases), ``do_sample``,
``temperature``, ``top_p``, ``top_k`` and ``seed``. After lm-eval's ``normalize_gen_kwargs``,
decoding samples when ``do_sample`` is true or, without it, when ``temperature`` > 0 (as its vLLM
model); ``do_sample`` without a temperature samples at 1.0 (transformers' default), and top-k
and top-p are off unless given (transformers' ``generate`` would apply top_k=50 by default).
Each request draws from its own stream (the seed folded with its place in the sorted group), so
sampled answers are reproducible run to run and do not depend on ``batch_size``. Other
generation kwargs are ignored, as before.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from tqdm import tqdm

from olmax.chat.template import tokenizer_template
from olmax.checkpoint.load import load_params
from olmax.config import Config, ConfigError
from olmax.engine import Engine, Generator, Sampling, decoder, generate
from olmax.model.olmo3 import forward

DTYPES = ("float32", "bfloat16")
# Smallest sequence bucket: below this, padding is cheaper than another compile.
MIN_LEN_BUCKET = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _pow2_bucket(n: int, lo: int, hi: int) -> int:
    """n rounded up to a power of two, at least ``lo`` and at most ``hi``."""
    return min(hi, max(lo, 1 << max(0, n - 1).bit_length()))


def default_tokenizer_path(checkpoint: str) -> str | None:
    """The tokenizer that ships with a checkpoint: the ``hf:`` directory, or a weights/run dir
    that holds tokenizer files."""
    d = Path(checkpoint[3:] if checkpoint.startswith("hf:") else checkpoint)
    return str(d) if any((d / f).is_file() for f in TOKENIZER_FILES) else None


def load_tokenizer(path: str | Path, cfg: Config, add_bos_token: bool | None = None) -> Any:
    """An HF fast tokenizer, loaded the way lm-eval's HF model loads it.

    A bare ``tokenizer.json`` carries no special-token roles; they come from the checkpoint's
    config (``data.eos_token_id``, ``pad_token_id``, ``bos_token_id``)."""
    import transformers
    p = Path(path)
    kw = {} if add_bos_token is None else {"add_bos_token": add_bos_token}
    if p.is_dir():
        return transformers.AutoTokenizer.from_pretrained(str(p), use_fast=True, **kw)
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer {p} does not exist (expected a tokenizer.json file or an HF "
                                "tokenizer directory)")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(p), **kw)
    roles = {"eos_token": cfg.data.eos_token_id, "pad_token": cfg.data.pad_token_id, "bos_token": cfg.data.bos_token_id}
    for role, tid in roles.items():
        if tid is not None and tid < tok.backend_tokenizer.get_vocab_size(with_added_tokens=True):
            tok.add_special_tokens({role: tok.convert_ids_to_tokens(tid)})
    return tok


@register_model("olmax")
class OlmaxLM(TemplateLM):
    """lm-eval model over ``olmax.model.olmo3.forward`` (scoring) and the KV-cache decoder
    ``olmax.engine`` (generation: greedy or sampled)."""

    def __init__(self, checkpoint: str, tokenizer: str | None = None, batch_size: int | str = 8,
                 max_length: int | None = None, dtype: str = "float32", max_gen_toks: int = 256,
                 add_bos_token: bool | None = None, prefix_token_id: int | None = None,
                 seed: int = 0, device: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        if kwargs:
            raise ValueError(f"olmax model: unknown model args {sorted(kwargs)}; known: checkpoint, tokenizer, "
                             "batch_size, max_length, dtype, max_gen_toks, add_bos_token, prefix_token_id, seed")
        if dtype not in DTYPES:
            raise ValueError(f"olmax model: dtype={dtype!r}; choose one of {', '.join(DTYPES)}")
        # lm-eval's "auto" batch sizing probes for OOM by trial; with bucketed jit that would compile
        # many programs, so an explicit size is required.
        if str(batch_size).startswith("auto") or int(batch_size) < 1:
            raise ValueError(f"olmax model: batch_size={batch_size!r}; give a positive integer")
        checkpoint = str(checkpoint)
        tokenizer = tokenizer or default_tokenizer_path(checkpoint)
        if tokenizer is None:
            raise ValueError(f"olmax model: checkpoint {checkpoint} ships no tokenizer; pass tokenizer=PATH "
                             "(a tokenizer.json file or an HF tokenizer directory)")
        params, cfg = load_params(checkpoint, dtype=dtype)
        # Evaluation: no gradients, so no rematerialisation; compute in the requested dtype.
        cfg = replace(cfg, model=replace(cfg.model, compute_dtype=dtype, param_dtype=dtype, remat="none"))
        self.cfg = cfg
        self.tokenizer = load_tokenizer(tokenizer, cfg, add_bos_token)
        if len(self.tokenizer) > cfg.model.vocab_size:
            raise ConfigError(f"tokenizer {tokenizer} has {len(self.tokenizer)} tokens but checkpoint {checkpoint} "
                              f"has vocab_size {cfg.model.vocab_size}: they do not belong together")
        if self.tokenizer.eos_token_id is None:
            raise ConfigError(f"tokenizer {tokenizer} defines no eos token")
        self.chat = tokenizer_template(tokenizer, self.tokenizer.eos_token)
        self.checkpoint = checkpoint
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self._batch_size = int(batch_size)
        self._max_length = int(max_length or cfg.model.max_position_embeddings)
        self._max_gen_toks = int(max_gen_toks)
        self.params = jax.device_put(params)
        m, V = cfg.model, cfg.model.vocab_size

        def score(p: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
            # Padded vocabulary rows are not tokens: normalise over the real vocabulary only.
            logits = forward(p, x, m)[..., :V]
            logp = jax.nn.log_softmax(logits, axis=-1)
            return jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0], jnp.argmax(logp, axis=-1) == y

        self._score = jax.jit(score)
        self._seed = int(seed)
        self._decoder: Engine | Generator | None = None  # one KV-cache decoder; sampling is a runtime value

    # ------------------------------------------------------------------ lm-eval properties

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # As lm-eval's HF model: the token an empty context is replaced by (BOS, else EOS).
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    # ------------------------------------------------------------------ chat (lm-eval's --apply_chat_template)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template lm-eval records with the results (and keys its cache by): the jinja source,
        or the built-in template's name."""
        return self.chat.source or self.chat.name

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Few-shot turns as one prompt, rendered as olmax renders chat for training and generation.
        Without a generation prompt the final message is a prefilled reply left open, as HFLM
        renders it (transformers' ``continue_final_message``)."""
        if add_generation_prompt:
            return self.chat.render(chat_history, True)
        return self.chat.continue_final(chat_history)

    def get_model_info(self) -> dict:
        n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(self.params))
        return {"model_num_parameters": n, "model_dtype": self.cfg.model.compute_dtype,
                "model_revision": self.checkpoint}

    # ------------------------------------------------------------------ tokenisation (as HFLM)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        if add_special_tokens is not None:
            kw = {"add_special_tokens": add_special_tokens}
        elif self.add_bos_token is not None:
            kw = {"add_special_tokens": self.add_bos_token}
        else:
            kw = {}
        # A string that already starts with the prefix token must not get a second one.
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            kw["add_special_tokens"] = False
        enc = self.tokenizer.encode(string, **kw)
        return enc[-left_truncate_len:] if left_truncate_len else enc

    def _encode_context(self, string: str) -> list[int]:
        """A generation context, encoded as HFLM.tok_batch_encode does (it checks ``bos_token``,
        not the prefix token)."""
        if has_bos_prefix(string, getattr(self.tokenizer, "bos_token", None)):
            kw = {"add_special_tokens": False}
        elif self.add_bos_token is not None:
            kw = {"add_special_tokens": self.add_bos_token}
        else:
            kw = {}
        return self.tokenizer(string, **kw)["input_ids"]

    def tok_decode(self, tokens: list[int] | int, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ scoring

    def _batch_bucket(self, n: int) -> int:
        return _pow2_bucket(n, 1, self.batch_size)

    def _len_bucket(self, n: int) -> int:
        return _pow2_bucket(n, MIN_LEN_BUCKET, self.max_length)

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of continuation log-probs, continuation is the greedy decode) per request."""
        # Longest first, as HFLM: the first batch is the largest, so an OOM shows at once.
        coll = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        res: list[tuple[float, bool]] = []
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="Running loglikelihood requests")
        for chunk in coll.get_batched(n=self.batch_size):
            rows = []
            for _, ctx, cont in chunk:
                if not ctx or not cont or len(cont) > self.max_length:
                    raise ValueError(f"loglikelihood request with {len(ctx)} context and {len(cont)} continuation "
                                     f"tokens (need both > 0, continuation <= max_length {self.max_length})")
                # Too long: drop tokens from the left, keeping max_length inputs (HFLM's truncation).
                toks = (ctx + cont)[-(self.max_length + 1):]
                rows.append((toks[:-1], toks[1:], len(cont)))
            B, T = self._batch_bucket(len(rows)), self._len_bucket(max(len(r[0]) for r in rows))
            x = np.zeros((B, T), np.int32)
            y = np.zeros((B, T), np.int32)
            for i, (inp, tgt, _) in enumerate(rows):
                x[i, :len(inp)] = inp
                y[i, :len(tgt)] = tgt
            # Right padding never reaches real positions: attention is causal.
            logp, greedy = jax.device_get(self._score(self.params, x, y))
            for i, ((key, _, _), (inp, _, n)) in enumerate(zip(chunk, rows)):
                sl = slice(len(inp) - n, len(inp))
                ans = (float(logp[i, sl].astype(np.float64).sum()), bool(greedy[i, sl].all()))
                res.append(ans)
                # Rolling windows pass key None; their sum is cached per document instead.
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, ans)
                pbar.update(1)
        pbar.close()
        return coll.get_original(res)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents, in disjoint windows of ``max_length`` tokens each
        conditioned on the tokens before it (``lm_eval.utils.get_rolling_token_windows``)."""
        from lm_eval import utils
        windows, counts = [], []
        for (string,) in tqdm([r.args for r in requests], disable=disable_tqdm):
            w = [(None, *utils.make_disjoint_window(p)) for p in utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            windows.extend(w)
            counts.append(len(w))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=True)
        out, i = [], 0
        for req, n in zip(requests, counts):
            total = sum(s for s, _ in scores[i:i + n])
            i += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return out

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Generation until a stop sequence, EOS or ``max_gen_toks`` tokens; greedy unless the
        gen_kwargs ask for sampling (module docstring)."""
        coll = Collator([r.args for r in requests], sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]),
                        group_by="gen_kwargs", group_fn=lambda a: a[1])
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        stop_ids = {self.eot_token_id, self.cfg.data.eos_token_id}
        res: list[str] = []
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="Running generate_until requests")
        # n=0: each group of requests with the same gen_kwargs is one chunk, decoded in one call
        # (batches of batch_size inside it), so every request has its own sampling stream.
        for chunk in coll.get_batched(n=0):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = kwargs.pop("max_gen_toks")
            sampling = self._sampling(kwargs, all_kwargs[0])
            max_ctx = self.max_length - max_gen
            if max_ctx <= 0:
                raise ValueError(f"max_gen_toks {max_gen} must be below max_length {self.max_length}")
            ctx_enc = [self._encode_context(c)[-max_ctx:] for c in contexts]
            gens = self._generate(ctx_enc, max_gen, until, stop_ids, sampling)
            for ctx, gen_kwargs, toks in zip(contexts, all_kwargs, gens):
                s = postprocess_generated_text(self.tok_decode(toks), until, None)
                res.append(s)
                self.cache_hook.add_partial("generate_until", (ctx, gen_kwargs), s)
                pbar.update(1)
        pbar.close()
        return coll.get_original(res)

    def _sampling(self, kwargs: dict, raw: dict) -> Sampling:
        """The decoding a request's (normalised) gen_kwargs ask for."""
        seed = self._seed if kwargs.get("seed") is None else int(kwargs["seed"])
        if not kwargs.get("do_sample"):
            return Sampling(seed=seed)
        temperature = float(raw["temperature"]) if raw.get("temperature") is not None else 1.0
        top_k = kwargs.get("top_k")
        top_p = kwargs.get("top_p")
        s = Sampling(temperature=temperature or None, top_p=None if top_p is None else float(top_p),
                     top_k=int(top_k) if top_k else None, seed=seed)
        try:
            s.check()
        except ValueError as e:
            raise ValueError(f"olmax model: generation kwargs {raw}: {e}") from None
        return s

    def _generate(self, contexts: list[list[int]], max_gen: int, until: list[str], stop_ids: set[int],
                  sampling: Sampling = Sampling()) -> list[list[int]]:
        """Continuations of the contexts through the KV cache, stopping at ``stop_ids`` or once
        the decoded text contains a string of ``until``."""
        if self._decoder is None:
            self._decoder = decoder(self.params, self.cfg.model, rows=self.batch_size)
        stops = [s for s in until if s]

        def stop(i: int, ids: list[int]) -> bool:
            text = self.tok_decode(ids)
            return any(s in text for s in stops)

        out = generate(self.params, self.cfg.model, contexts, max_new_tokens=max_gen, sampling=sampling,
                       eos_ids=stop_ids, batch_size=self.batch_size, stop=stop if stops else None,
                       generator=self._decoder)
        return [c.token_ids for c in out]

    def _greedy(self, contexts: list[list[int]], max_gen: int, until: list[str], stop_ids: set[int]) -> list[list[int]]:
        """Greedy continuations (``_generate`` without sampling)."""
        return self._generate(contexts, max_gen, until, stop_ids)


if __name__ == "__main__":
    # lm-eval's own CLI with this model registered:
    #   python -m olmax.eval.lm_eval_adapter run --model olmax --model_args checkpoint=...,tokenizer=... --tasks ...
    from lm_eval.__main__ import cli_evaluate
    cli_evaluate()
