"""HF transformers <-> olmax conversion for OLMo 3 (``Olmo3ForCausalLM``), config and weights.

Conventions (spec section 2):
- HF linear weights are ``[out, in]``; olmax stores ``[in, out]``: every projection and the LM
  head are transposed (exact, so HF -> olmax -> HF is bitwise identical).
- The embedding and LM head are padded from ``vocab_size`` to ``padded_vocab_size`` rows (OLMo-core
  pads to a multiple of 128). Padded rows follow OLMo-core's HF import, which calls
  ``resize_token_embeddings`` with transformers' default ``mean_resizing``: new rows are drawn
  from N(mean of the real rows, 1e-9 * their covariance), i.e. the mean up to ~1e-6 noise. We
  write the mean itself (computed in fp32, then cast), so conversion is deterministic. Export
  slices the padded rows off again.
- Tensors keep their stored dtype (fp32 or bf16; fp16 is widened to fp32, losslessly) unless a
  dtype is requested. Everything is read and written tensor by tensor.
- Config: both the legacy form (``rope_theta`` + ``rope_scaling``, the released files) and the
  nested ``rope_parameters`` per layer type (what ``save_pretrained`` writes in transformers 5)
  are read. Export writes every field explicitly, because ``Olmo3Config``'s class defaults are
  not the released values (vocab 50304, eps 1e-5, ...).

``random_hf_model`` saves a random ``Olmo3ForCausalLM`` made by transformers itself: the
reference model of the parity, conversion and lm-eval tests (no download).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from olmax import io
from olmax.config import Config, ConfigError, ModelConfig, RopeScaling, validate
from olmax.extras import require
from olmax.model.weights_io import (
    DEFAULT_SHARD_BYTES,
    DTYPES,
    INDEX_NAME,
    TensorReader,
    WeightsError,
    atomic_dir,
    check_reader,
    dtype_name,
    iter_weights,
    load_config,
    named_specs,
    np_dtype,
    save_weights,
    unflatten,
    write_shards,
)

ARCHITECTURE = "Olmo3ForCausalLM"
MODEL_TYPE = "olmo3"
PAD_MULTIPLE = 128  # OLMo-core pads the vocabulary to a multiple of 128 (100278 -> 100352)

# Olmo3Config class defaults (transformers 5.24) for keys a config.json may omit: a missing key
# means transformers runs this value, so parity needs the same.
HF_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5, "sliding_window": 4096, "max_position_embeddings": 2048, "rope_theta": 500000.0,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02,
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_YARN_KEYS = {"rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
              "attention_factor", "mscale", "mscale_all_dim", "truncate", "rope_theta"}


class ConversionError(ValueError):
    """A checkpoint or config that cannot be converted; the message names the field or tensor."""


# --------------------------------------------------------------------------- config


def _check_object(hf: Any) -> None:
    if not isinstance(hf, dict):
        raise ConversionError(f"config.json must be a JSON object {{field: value}}, got {type(hf).__name__}")


def _number(value: Any, kind: type[int] | type[float], field: str, minimum: int | None = None) -> Any:
    """``value`` of config.json ``field`` as ``kind`` (int or float). A string, bool, null, list or
    object, or for an int a fractional or non-finite number, is a ``ConversionError`` naming the
    field (``int("four")`` would say neither file nor field)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and kind is int and isinstance(value, float):
        ok = value.is_integer()  # False for nan and +-inf too
    if not ok:
        raise ConversionError(f"config.json {field} must be {'an integer' if kind is int else 'a number'}, "
                              f"got {value!r}")
    out = kind(value)
    if minimum is not None and out < minimum:
        raise ConversionError(f"config.json {field} must be >= {minimum}, got {value!r}")
    return out


def _check_architecture(hf: dict[str, Any]) -> None:
    archs = hf.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConversionError(f"config.json architectures must be a list of class names, got {archs!r}")
    mt = hf.get("model_type")
    if (archs and ARCHITECTURE not in archs) or (mt is not None and mt != MODEL_TYPE):
        got = ", ".join(archs) if archs else f"model_type {mt!r}"
        raise ConversionError(
            f"config.json describes {got}, not {ARCHITECTURE} (model_type {MODEL_TYPE!r}); olmax converts OLMo 3 only")
    if not archs and mt is None:
        raise ConversionError(f"config.json names no architecture or model_type; expected {ARCHITECTURE}")


def _full_attention_every(layer_types: list[str], n_layers: int) -> tuple[int, bool]:
    """(k, last forced) with ``full iff i % k == k-1`` (or i is the last layer, when forced, as
    OLMo-core's olmo3 builders do) that reproduces ``layer_types`` (olmax's pattern)."""
    full = [t == "full_attention" for t in layer_types]
    candidates = [4] + [i + 1 for i, f in enumerate(full) if f][:1] + [n_layers + 1]
    for force_last in (True, False):
        for k in candidates:
            if all(f == (i % k == k - 1 or (force_last and i == n_layers - 1)) for i, f in enumerate(full)):
                return k, force_last
    raise ConversionError(
        f"config.json layer_types {layer_types} is not OLMo 3's pattern (full attention iff i % k == k-1 for "
        "some k, optionally also on the last layer, sliding elsewhere) nor all full_attention; olmax cannot "
        "express it")


def _yarn_from(d: dict[str, Any], theta: float, max_pos: int, where: str) -> RopeScaling | None:
    if not isinstance(d, dict):
        raise ConversionError(f"config.json {where} must be an object, got {d!r}")
    rtype = d.get("rope_type", d.get("type", "default"))
    if rtype == "default":
        return None
    if rtype != "yarn":
        raise ConversionError(f"config.json {where}: rope_type {rtype!r} is not supported (olmax implements "
                              "default RoPE and YaRN on full-attention layers)")
    unknown = sorted(set(d) - _YARN_KEYS)
    if unknown:
        raise ConversionError(f"config.json {where}: unknown YaRN key {unknown[0]!r}")
    if d.get("truncate", True) is not True:
        raise ConversionError(f"config.json {where}: truncate={d['truncate']!r}; olmax implements truncate=true "
                              "(transformers' default)")
    orig = d.get("original_max_position_embeddings")
    orig = _number(orig, int, f"{where}.original_max_position_embeddings") if orig else max_pos
    factor = d.get("factor")  # transformers' fallback: max_pos / orig
    factor = _number(factor, float, f"{where}.factor") if factor is not None else max_pos / orig
    attn = d.get("attention_factor")
    if attn is None and d.get("mscale") and d.get("mscale_all_dim"):
        # transformers derives it from mscale / mscale_all_dim; olmax stores the result.
        def get_mscale(s: float, m: float) -> float:
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
        attn = get_mscale(factor, _number(d["mscale"], float, f"{where}.mscale")) / get_mscale(
            factor, _number(d["mscale_all_dim"], float, f"{where}.mscale_all_dim"))
    # transformers reads ``beta_fast or 32``: a 0/None means the default.
    return RopeScaling(rope_type="yarn", factor=factor, original_max_position_embeddings=orig,
                       beta_fast=_number(d.get("beta_fast") or 32, float, f"{where}.beta_fast"),
                       beta_slow=_number(d.get("beta_slow") or 1, float, f"{where}.beta_slow"),
                       attention_factor=None if attn is None else _number(attn, float, f"{where}.attention_factor"))


def _rope_from(hf: dict[str, Any], max_pos: int, has_sliding: bool) -> tuple[float, RopeScaling | None]:
    nested = hf.get("rope_parameters")
    if nested is not None:
        if not isinstance(nested, dict) or not set(nested) <= {"full_attention", "sliding_attention"} or not nested:
            raise ConversionError("config.json rope_parameters must be nested per layer type "
                                  "({'full_attention': {...}, 'sliding_attention': {...}}), got " + repr(nested))
        thetas = {}
        for t, p in nested.items():
            if p is not None and not isinstance(p, dict):
                raise ConversionError(f"config.json rope_parameters.{t} must be an object, got {p!r}")
            if p and "rope_theta" in p:
                thetas[t] = _number(p["rope_theta"], float, f"rope_parameters.{t}.rope_theta")
            else:
                thetas[t] = _number(hf.get("rope_theta", HF_DEFAULTS["rope_theta"]), float, "rope_theta")
        if len(set(thetas.values())) > 1:
            raise ConversionError(f"config.json rope_parameters gives different rope_theta per layer type {thetas}; "
                                  "olmax has one model.rope_theta")
        sliding = nested.get("sliding_attention") or {}
        if sliding.get("rope_type", sliding.get("type", "default")) != "default":
            raise ConversionError("config.json rope_parameters.sliding_attention must be default RoPE; olmax "
                                  "applies YaRN to full-attention layers only")
        theta = next(iter(thetas.values()))
        return theta, _yarn_from(nested.get("full_attention") or {}, theta, max_pos, "rope_parameters.full_attention")
    # Legacy form (the released files): one rope_theta for every layer; rope_scaling on full layers.
    theta = _number(hf.get("rope_theta", HF_DEFAULTS["rope_theta"]), float, "rope_theta")
    if theta != HF_DEFAULTS["rope_theta"] and has_sliding:
        # transformers 5.24's Olmo3Config moves a legacy rope_theta into full_attention only and gives
        # sliding layers 500000 (its default_theta); olmax keeps the file's meaning (all layers).
        warnings.warn(f"legacy rope_theta={theta}: transformers >= 5 applies it to full-attention layers only "
                      "(sliding layers get 500000); olmax applies it to every layer, as the file intends",
                      stacklevel=3)
    scaling = hf.get("rope_scaling")
    return theta, (_yarn_from(scaling, theta, max_pos, "rope_scaling") if scaling else None)


def _token_id(hf: dict[str, Any], key: str) -> int | None:
    v = hf.get(key)
    if isinstance(v, list):
        if not v:
            return None
        if len(v) > 1:
            warnings.warn(f"config.json {key}={v}: olmax keeps one id, the first ({v[0]})", stacklevel=3)
        v = v[0]
    return None if v is None else _number(v, int, key)


def hf_config_to_olmax(hf: dict[str, Any], padded_vocab_size: int | None = None
                       ) -> tuple[ModelConfig, dict[str, int | None]]:
    """HF ``config.json`` dict -> (``ModelConfig``, token ids ``{eos,pad,bos}_token_id`` for DataConfig).

    ``padded_vocab_size`` defaults to the next multiple of 128 (OLMo-core's padding)."""
    _check_object(hf)
    _check_architecture(hf)
    missing = [k for k in _REQUIRED if hf.get(k) is None]
    if missing:
        raise ConversionError(f"config.json has no {missing[0]!r}")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("tie_word_embeddings", False)):
        got = hf.get(key, HF_DEFAULTS[key])
        if got != want:
            raise ConversionError(f"config.json {key}={got!r}; OLMo 3 (and olmax) uses {want!r}")
    if hf.get("mlp_bias"):
        raise ConversionError("config.json mlp_bias=true; OLMo 3 (and olmax) has no biases")
    d = _number(hf["hidden_size"], int, "hidden_size")
    n_heads = _number(hf["num_attention_heads"], int, "num_attention_heads", minimum=1)
    n_layers = _number(hf["num_hidden_layers"], int, "num_hidden_layers")
    head_dim = hf.get("head_dim")
    if head_dim is None:
        if d % n_heads:
            raise ConversionError(f"config.json has no head_dim and hidden_size {d} is not a multiple of "
                                  f"num_attention_heads {n_heads}")
        head_dim = d // n_heads
    head_dim = _number(head_dim, int, "head_dim")
    max_pos = _number(hf.get("max_position_embeddings", HF_DEFAULTS["max_position_embeddings"]), int,
                      "max_position_embeddings", minimum=1)
    window = hf.get("sliding_window", HF_DEFAULTS["sliding_window"])
    window = None if window is None else _number(window, int, "sliding_window")
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n_layers)]  # HF default
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        raise ConversionError(f"config.json layer_types must be a list of 'full_attention' / 'sliding_attention' "
                              f"strings, got {layer_types!r}")
    if len(layer_types) != n_layers:
        raise ConversionError(f"config.json layer_types has {len(layer_types)} entries for {n_layers} layers")
    bad = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if bad:
        raise ConversionError(f"config.json layer_types contains {bad[0]!r}; OLMo 3 has full_attention and "
                              "sliding_attention")
    theta, scaling = _rope_from(hf, max_pos, has_sliding="sliding_attention" in layer_types)
    force_last = True
    if all(t == "full_attention" for t in layer_types):
        window, every = None, 4
    elif window is None:
        raise ConversionError("config.json has sliding_attention layers but sliding_window is null")
    else:
        every, force_last = _full_attention_every(layer_types, n_layers)

    vocab = _number(hf["vocab_size"], int, "vocab_size")
    padded = -(-vocab // PAD_MULTIPLE) * PAD_MULTIPLE if padded_vocab_size is None else int(padded_vocab_size)
    if padded < vocab:
        raise ConversionError(f"padded vocabulary {padded} is smaller than config.json vocab_size {vocab}")
    dtype = hf.get("dtype", hf.get("torch_dtype")) or "float32"
    if not isinstance(dtype, str) or dtype not in DTYPES:  # e.g. float16: olmax keeps fp32 master weights
        dtype = "float32"
    model = ModelConfig(
        vocab_size=vocab, padded_vocab_size=padded, d_model=d, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=_number(hf.get("num_key_value_heads") or n_heads, int, "num_key_value_heads"), head_dim=head_dim,
        mlp_hidden=_number(hf["intermediate_size"], int, "intermediate_size"),
        norm_eps=_number(hf.get("rms_norm_eps", HF_DEFAULTS["rms_norm_eps"]), float, "rms_norm_eps"),
        rope_theta=theta, rope_scaling=scaling, sliding_window=window,
        full_attention_every=every, full_attention_last_layer=force_last, max_position_embeddings=max_pos,
        init_std=_number(hf.get("initializer_range", HF_DEFAULTS["initializer_range"]), float, "initializer_range"),
        param_dtype=dtype,
    )
    ids = {k: _token_id(hf, k) for k in ("eos_token_id", "pad_token_id", "bos_token_id")}
    return model, ids


def config_from_hf(hf: dict[str, Any], padded_vocab_size: int | None = None, base: Config | None = None,
                   name: str = "hf") -> Config:
    """A full olmax ``Config`` whose model and token ids come from an HF config; the other sections,
    and the model's run-time choices (compute dtype, attention kernel, remat), come from ``base``
    (default ``Config()``). With a base of the same vocabulary, its padding is kept."""
    _check_object(hf)
    if padded_vocab_size is None and base is not None and base.model.vocab_size == hf.get("vocab_size"):
        padded_vocab_size = base.model.embedding_rows
    model, ids = hf_config_to_olmax(hf, padded_vocab_size)
    if base is not None:
        model = replace(model, compute_dtype=base.model.compute_dtype, attention_impl=base.model.attention_impl,
                        remat=base.model.remat)
    base = base or Config()
    if ids["eos_token_id"] is None:
        raise ConversionError("config.json has no eos_token_id; olmax's data pipeline needs one")
    data = replace(base.data, eos_token_id=ids["eos_token_id"],
                   # HF allows no pad id; olmax needs one and pads with EOS then (OLMo-core's fallback).
                   pad_token_id=ids["pad_token_id"] if ids["pad_token_id"] is not None else ids["eos_token_id"],
                   bos_token_id=ids["bos_token_id"])
    cfg = replace(base, name=name, model=model, data=data)
    try:
        return validate(cfg)
    except ConfigError as e:
        raise ConversionError(f"config.json gives an invalid olmax config: {e}") from None


def olmax_to_hf_config(cfg: Config, dtype: str | None = None) -> dict[str, Any]:
    """Every ``Olmo3Config`` field, explicitly (its class defaults are not OLMo 3's values)."""
    m, data = cfg.model, cfg.data
    layer_types = ["full_attention" if m.is_full_attention(i) else "sliding_attention" for i in range(m.n_layers)]
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling is not None:
        ys = m.rope_scaling
        full = {"rope_type": "yarn", "rope_theta": m.rope_theta, "factor": ys.factor,
                "original_max_position_embeddings": ys.original_max_position_embeddings,
                "beta_fast": ys.beta_fast, "beta_slow": ys.beta_slow}
        if ys.attention_factor is not None:
            full["attention_factor"] = ys.attention_factor
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": m.vocab_size,  # the real vocabulary: padded rows are sliced off on export
        "hidden_size": m.d_model,
        "intermediate_size": m.mlp_hidden,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_position_embeddings,
        "initializer_range": m.init_std,
        "use_cache": True,
        "pad_token_id": data.pad_token_id,
        "bos_token_id": data.bos_token_id,
        "eos_token_id": data.eos_token_id,
        "tie_word_embeddings": False,
        "rope_parameters": {"full_attention": full,
                            "sliding_attention": {"rope_type": "default", "rope_theta": m.rope_theta}},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": m.norm_eps,
        # All-full models still get a window value: transformers builds the sliding mask anyway.
        "sliding_window": m.sliding_window if m.sliding_window is not None else m.max_position_embeddings,
        "layer_types": layer_types,
        "dtype": dtype or m.param_dtype,
    }


# --------------------------------------------------------------------------- tensor names


def hf_name_map(m: ModelConfig) -> dict[str, tuple[str, bool]]:
    """olmax name -> (HF state-dict key, transposed?), in olmax tree order."""
    out: dict[str, tuple[str, bool]] = {}
    for name in named_specs(m):
        if name == "embed":
            out[name] = ("model.embed_tokens.weight", False)
        elif name == "lm_head":
            out[name] = ("lm_head.weight", True)
        elif name == "final_norm":
            out[name] = ("model.norm.weight", False)
        else:
            _, i, *rest = name.split(".")
            p = f"model.layers.{i}."
            key = ".".join(rest)
            out[name] = {
                "attn.q": (p + "self_attn.q_proj.weight", True), "attn.k": (p + "self_attn.k_proj.weight", True),
                "attn.v": (p + "self_attn.v_proj.weight", True), "attn.o": (p + "self_attn.o_proj.weight", True),
                "attn.q_norm": (p + "self_attn.q_norm.weight", False),
                "attn.k_norm": (p + "self_attn.k_norm.weight", False),
                "attn_norm": (p + "post_attention_layernorm.weight", False),
                "mlp.gate": (p + "mlp.gate_proj.weight", True), "mlp.up": (p + "mlp.up_proj.weight", True),
                "mlp.down": (p + "mlp.down_proj.weight", True),
                "mlp_norm": (p + "post_feedforward_layernorm.weight", False),
            }[key]
    return out


def _hf_shape(olmax_shape: tuple[int, ...], transposed: bool, name: str, m: ModelConfig) -> tuple[int, ...]:
    shape = tuple(reversed(olmax_shape)) if transposed else tuple(olmax_shape)
    if name in ("embed", "lm_head"):
        shape = (m.vocab_size, m.d_model)  # HF rows are the real vocabulary
    return shape


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    """Append ``rows - len(a)`` rows equal to the fp32 mean of the real rows (OLMo-core's mean resizing
    without its 1e-9-covariance noise), cast to ``a``'s dtype."""
    extra = rows - a.shape[0]
    if extra == 0:
        return a
    mean = a.astype(np.float32).mean(axis=0, keepdims=True).astype(a.dtype)
    return np.concatenate([a, np.repeat(mean, extra, axis=0)], axis=0)


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    path = hf_dir / "config.json"
    if not path.exists():
        raise ConversionError(f"{str(hf_dir)!r} has no config.json (not a HF model directory)")
    return io.read_json_object(path, "a HF config", ConversionError, " {field: value}")


def _open_hf(hf_dir: Path) -> TensorReader:
    try:
        return TensorReader(hf_dir, single_file="model.safetensors")
    except WeightsError as e:
        hint = " (pytorch_model.bin is not supported: re-save with safetensors)" if (
            hf_dir / "pytorch_model.bin").exists() else ""
        raise ConversionError(f"{e}{hint}") from None


def _stored_dtype(code: str, name: str) -> np.dtype:
    if code == "F32" or code == "F16":  # fp16 is widened to fp32 (lossless)
        return DTYPES["float32"]
    if code == "BF16":
        return DTYPES["bfloat16"]
    raise ConversionError(f"HF tensor {name!r} has dtype {code}; olmax converts float32/bfloat16/float16 weights")


def _iter_hf_to_olmax(hf_dir: Path, dtype: str | None, padded_vocab_size: int | None, base: Config | None
                      ) -> tuple[Config, list[str], Callable[[], Iterator[tuple[str, np.ndarray]]]]:
    """Validate the config and every HF tensor name and shape (from the headers, reading no data),
    then return the olmax config (``model.param_dtype`` names the dtype of the converted tensors),
    the olmax names and a generator of converted tensors, one at a time."""
    cfg = config_from_hf(read_hf_config(hf_dir), padded_vocab_size, base=base, name=f"hf:{hf_dir.name}")
    target = np_dtype(dtype)
    m = cfg.model
    specs = named_specs(m)
    names = hf_name_map(m)
    reader = _open_hf(hf_dir)
    try:
        found = set(reader.names())
        for oname, (hname, transposed) in names.items():
            if hname not in found:
                raise ConversionError(f"{hf_dir}: missing tensor {hname!r} (olmax {oname!r})")
            want = _hf_shape(specs[oname].shape, transposed, oname, m)
            got = reader.shape(hname)
            if got != want:
                raise ConversionError(f"{hf_dir}: tensor {hname!r} has shape {got}, config.json implies {want}")
            _stored_dtype(reader.dtype(hname), hname)
        extra = sorted(found - {h for h, _ in names.values()})
        if extra:
            raise ConversionError(f"{hf_dir}: unexpected tensor {extra[0]!r} (not part of {ARCHITECTURE} with "
                                  "this config.json)")
        embed = names["embed"][0]
        param_dtype = dtype or dtype_name(_stored_dtype(reader.dtype(embed), embed))
    except WeightsError as e:  # a damaged shard
        reader.close()
        raise ConversionError(str(e)) from None
    except BaseException:
        reader.close()
        raise

    def gen() -> Iterator[tuple[str, np.ndarray]]:
        with reader:
            for oname, (hname, transposed) in names.items():
                try:
                    a = reader.get(hname)
                except WeightsError as e:
                    raise ConversionError(str(e)) from None
                a = a.astype(target if target is not None else _stored_dtype(reader.dtype(hname), hname), copy=False)
                if oname in ("embed", "lm_head"):
                    a = _pad_rows(a, m.embedding_rows)
                yield oname, (np.ascontiguousarray(a.T) if transposed else a)

    # Without a base config the model computes in its weights' dtype, as HF runs it (a float32 HF
    # model is not evaluated in bf16); a base (a recipe training from HF weights) keeps its own.
    compute = param_dtype if base is None else m.compute_dtype
    return replace(cfg, model=replace(m, param_dtype=param_dtype, compute_dtype=compute)), list(names), gen


def _progress(total: int, label: str, stream: Any) -> Callable[[int, str], None] | None:
    """Print ``label: i/total tensors`` about ten times to ``stream`` (None: silent)."""
    if stream is None:
        return None
    step = max(10, total // 10)

    def report(i: int, name: str) -> None:
        if i % step == 0 or i == total:
            print(f"{label}: {i}/{total} tensors ({name})", file=stream, flush=True)
    return report


# --------------------------------------------------------------------------- public API


def load_hf_params(hf_dir: str | os.PathLike, dtype: str | None = None, padded_vocab_size: int | None = None,
                   base: Config | None = None) -> tuple[Any, Config]:
    """Read a HF OLMo 3 directory into ``(params, Config)`` in memory (numpy leaves, ``param_specs``
    layout). ``dtype`` None keeps the stored dtype, and ``model.param_dtype`` always names the dtype
    of the returned leaves (training from HF weights passes its master dtype, e.g. ``"float32"``).
    ``base`` supplies every non-architecture setting (see ``config_from_hf``)."""
    cfg, _, gen = _iter_hf_to_olmax(Path(hf_dir), dtype, padded_vocab_size, base)
    return unflatten(cfg.model, dict(gen())), cfg


# Tokenizer files that travel with converted weights, so ``olmax generate`` and ``olmax chat`` find
# the tokenizer and chat template of a converted checkpoint.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _copy_tokenizer(src: Path, dst: Path) -> None:
    import shutil
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def hf_to_olmax(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str | None = None,
                padded_vocab_size: int | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
                base: Config | None = None, progress: Any = None) -> Config:
    """Convert a HF OLMo 3 directory into an olmax weights directory (atomically: on any error
    nothing is left at ``out_dir``), with its tokenizer files (``TOKENIZER_FILES``) when it has
    them. Returns the written config. ``progress``: a stream for tensor-count progress lines (the
    CLI passes stderr)."""
    cfg, names, gen = _iter_hf_to_olmax(Path(hf_dir), dtype, padded_vocab_size, base)
    try:
        save_weights(out_dir, gen(), cfg, shard_bytes=shard_bytes,
                     progress=_progress(len(names), "hf-to-olmax", progress))
    except WeightsError as e:
        raise ConversionError(str(e)) from None
    _copy_tokenizer(Path(hf_dir), Path(out_dir))
    return cfg


def olmax_to_hf(weights_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str | None = None,
                shard_bytes: int = DEFAULT_SHARD_BYTES, progress: Any = None) -> Path:
    """Export an olmax weights directory as a HF ``Olmo3ForCausalLM`` directory (safetensors, one
    file or sharded with an index, config.json, generation_config.json), atomically, then the
    tokenizer files the weights directory holds (``TOKENIZER_FILES``).
    (``olmax convert olmax-to-hf`` also takes training checkpoints: ``olmax.compat.commands``.)"""
    weights_dir = Path(weights_dir)
    if not weights_dir.exists():
        raise ConversionError(f"checkpoint {str(weights_dir)!r} does not exist")
    try:
        cfg = load_config(weights_dir)
        with TensorReader(weights_dir) as reader:
            check_reader(reader, named_specs(cfg.model), str(weights_dir))
            stored = {"F32": "float32", "BF16": "bfloat16"}.get(reader.dtype("embed"), "float32")
    except WeightsError as e:
        raise ConversionError(str(e)) from None
    out = write_hf(iter_weights(weights_dir), cfg, out_dir, stored, dtype=dtype, shard_bytes=shard_bytes,
                   progress=progress)
    _copy_tokenizer(weights_dir, out)
    return out


def write_hf(named: Iterable[tuple[str, np.ndarray]], cfg: Config, out_dir: str | os.PathLike, stored: str,
             dtype: str | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES, progress: Any = None) -> Path:
    """Stream olmax ``(name, array)`` pairs of dtype ``stored`` into a HF directory (``olmax_to_hf``)."""
    m = cfg.model
    names = hf_name_map(m)
    target = np_dtype(dtype)

    def gen() -> Iterator[tuple[str, np.ndarray]]:
        for oname, a in named:
            hname, transposed = names[oname]
            if target is not None:
                a = a.astype(target, copy=False)
            if transposed:
                a = a.T
            if oname in ("embed", "lm_head"):
                a = a[: m.vocab_size]  # drop the padded rows
            yield hname, np.ascontiguousarray(a)

    hf_cfg = olmax_to_hf_config(cfg, dtype or stored)
    gen_cfg = {"bos_token_id": cfg.data.bos_token_id, "eos_token_id": cfg.data.eos_token_id,
               "pad_token_id": cfg.data.pad_token_id}
    with atomic_dir(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
        write_shards(tmp, gen(), shard_bytes=shard_bytes, metadata={"format": "pt"}, single_file="model.safetensors",
                     always_index=False, progress=_progress(len(names), "olmax-to-hf", progress))
    return Path(out_dir)


__all__ = ["ConversionError", "hf_config_to_olmax", "config_from_hf", "olmax_to_hf_config", "hf_name_map",
           "load_hf_params", "hf_to_olmax", "olmax_to_hf", "write_hf", "INDEX_NAME"]


def random_hf_model(out_dir: str | os.PathLike, seed: int = 0, dtype: str = "float32", **hf_config: Any) -> Path:
    """Save a random ``Olmo3ForCausalLM`` built by transformers itself (no download) to ``out_dir``.

    Weights are drawn so the check is sensitive: N(0, 1) embeddings, N(0, 1/fan_in) projections,
    an LM head giving logits of std about 4 (peaked distributions: near-uniform ones would make
    any KL tiny) and norm weights 1 + N(0, 0.3^2) (so a swapped norm shows up)."""
    require("hf", "torch", "transformers")
    import torch
    from transformers import Olmo3Config, Olmo3ForCausalLM

    cfg = Olmo3Config(**hf_config)
    g = torch.Generator().manual_seed(seed)
    model = Olmo3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=g)
            if p.ndim == 1:
                p.copy_(1 + 0.3 * z)
            elif name == "model.embed_tokens.weight":
                p.copy_(z)
            elif name == "lm_head.weight":
                p.copy_(4 * z / p.shape[1] ** 0.5)
            else:
                p.copy_(z / p.shape[1] ** 0.5)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out_dir))
    return Path(out_dir)
