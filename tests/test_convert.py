"""HF <-> olmax conversion: bitwise round trips, config forms, vocabulary padding, bad inputs.

The HF models are built by transformers itself (random weights, saved locally; nothing is downloaded)."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Olmo3Config
from transformers.models.olmo3.modeling_olmo3 import Olmo3RotaryEmbedding

from olmax import cli
from olmax.compat import commands
from olmax.compat.hf import (
    ConversionError,
    config_from_hf,
    hf_config_to_olmax,
    hf_to_olmax,
    load_hf_params,
    olmax_to_hf,
    olmax_to_hf_config,
    random_hf_model,
    read_hf_config,
)
from olmax.config import RUNTIME_MODEL_FIELDS, Config
from olmax.model.weights_io import (
    INDEX_NAME,
    WeightsError,
    flatten_tree,
    iter_weights,
    load_weights,
    named_specs,
    save_weights,
)
from olmax.recipes.olmo3 import olmo3_7b_model, olmo3_7b_stage1, olmo3_7b_stage3

# How a recipe computes its model (kernels, remat, scan, dtype): never in a converted file's config.
COMPUTE_FIELDS = RUNTIME_MODEL_FIELDS - {"init_std", "max_position_embeddings"}


BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, sliding_window=16, max_position_embeddings=128, rms_norm_eps=1e-6,
            eos_token_id=0, pad_token_id=1, bos_token_id=None,
            rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                                "original_max_position_embeddings": 32, "attention_factor": 1.25},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}})


def hf_tensors(d: Path) -> dict[str, np.ndarray]:
    """Every tensor of a HF directory (single file or sharded), read with safetensors (no torch)."""
    files = sorted(d.glob("*.safetensors"))
    out = {}
    for f in files:
        with safe_open(str(f), "np") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def no_leftovers(out: Path) -> None:
    """Nothing at ``out`` and no temporary directory beside it."""
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]


def assert_same_hf_config(a: Path, b: Path) -> None:
    """transformers loads both directories into the same Olmo3Config. The export spells out YaRN's
    beta_fast/beta_slow, which transformers otherwise defaults to 32/1: compare with those filled in,
    and compare the RoPE tables transformers derives."""
    skip = {"transformers_version", "_name_or_path"}
    ca, cb = Olmo3Config.from_pretrained(a), Olmo3Config.from_pretrained(b)
    da, db = ({k: v for k, v in c.to_dict().items() if k not in skip} for c in (ca, cb))
    for d in (da, db):
        for p in d["rope_parameters"].values():
            if p["rope_type"] == "yarn":
                p.setdefault("beta_fast", 32.0)
                p.setdefault("beta_slow", 1.0)
    assert da == db
    for layer_type in ("full_attention", "sliding_attention"):
        fa, fb = (Olmo3RotaryEmbedding(c) for c in (ca, cb))
        assert torch.equal(getattr(fa, f"{layer_type}_inv_freq"), getattr(fb, f"{layer_type}_inv_freq"))
        assert getattr(fa, f"{layer_type}_attention_scaling") == getattr(fb, f"{layer_type}_attention_scaling")


@pytest.fixture(scope="module")
def hf_fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_hf_model(tmp_path_factory.mktemp("hf") / "fp32", seed=0, **BASE)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype,sharded", [("float32", False), ("bfloat16", True)])
def test_round_trip_bitwise(tmp_path: Path, dtype: str, sharded: bool) -> None:
    src = tmp_path / "hf"
    random_hf_model(src, seed=1, dtype=dtype, **BASE)
    if sharded:  # re-save the HF input sharded too (index + several files)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype))
        src = tmp_path / "hf_sharded"
        model.save_pretrained(src, max_shard_size="20KB")
        assert (src / INDEX_NAME).exists()
    shard = 16 * 1024 if sharded else 2 * 1024**3
    cfg = hf_to_olmax(src, tmp_path / "olmax", shard_bytes=shard, progress=None)
    assert cfg.model.param_dtype == dtype
    ox = tmp_path / "olmax"
    index = json.loads((ox / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert (len(shards) > 1) == sharded
    assert all(s.startswith("model-") and s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    assert Config.from_dict(__import__("yaml").safe_load((ox / "config.yaml").read_text())) == cfg

    olmax_to_hf(ox, tmp_path / "back", shard_bytes=shard, progress=None)
    back = tmp_path / "back"
    assert (back / INDEX_NAME).exists() == sharded
    assert (back / "model.safetensors").exists() != sharded
    a, b = hf_tensors(src), hf_tensors(back)
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype == (np.float32 if dtype == "float32" else ml_dtypes.bfloat16), k
        assert a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), f"{k} differs after HF -> olmax -> HF"
    # Equivalent config: same olmax reading, and transformers loads both into the same Olmo3Config.
    orig_cfg = json.loads((src / "config.json").read_text())
    back_cfg = json.loads((back / "config.json").read_text())
    assert hf_config_to_olmax(orig_cfg) == hf_config_to_olmax(back_cfg)
    assert_same_hf_config(src, back)
    gen = json.loads((back / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 0 and gen["pad_token_id"] == 1


def test_export_loads_with_automodel_and_gives_same_logits(tmp_path: Path, hf_fp32: Path) -> None:
    hf_to_olmax(hf_fp32, tmp_path / "olmax", progress=None)
    olmax_to_hf(tmp_path / "olmax", tmp_path / "back", progress=None)
    toks = torch.as_tensor(np.random.default_rng(0).integers(0, 100, (2, 40)))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf_fp32, attn_implementation="eager").eval()(toks).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()(toks).logits
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "back")).__name__ == "Olmo3ForCausalLM"
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_cast_dtype_on_conversion(tmp_path: Path, hf_fp32: Path) -> None:
    hf_to_olmax(hf_fp32, tmp_path / "ox16", dtype="bfloat16", progress=None)
    params, cfg = load_weights(tmp_path / "ox16")
    assert cfg.model.param_dtype == "bfloat16"
    assert all(a.dtype == ml_dtypes.bfloat16 for _, a in flatten_tree(params))
    src = hf_tensors(hf_fp32)["model.layers.2.mlp.up_proj.weight"]
    np.testing.assert_array_equal(params["layers"][2]["mlp"]["up"], src.T.astype(ml_dtypes.bfloat16))
    olmax_to_hf(tmp_path / "ox16", tmp_path / "hf32", dtype="float32", progress=None)
    assert json.loads((tmp_path / "hf32" / "config.json").read_text())["dtype"] == "float32"
    assert hf_tensors(tmp_path / "hf32")["lm_head.weight"].dtype == np.float32


def test_load_hf_params_equals_converted_directory(tmp_path: Path, hf_fp32: Path) -> None:
    mem, cfg_mem = load_hf_params(hf_fp32)
    hf_to_olmax(hf_fp32, tmp_path / "ox", progress=None)
    disk, cfg_disk = load_weights(tmp_path / "ox")
    assert cfg_mem == cfg_disk
    assert [n for n, _ in flatten_tree(mem)] == list(named_specs(cfg_mem.model))
    for (n1, a), (n2, b) in zip(flatten_tree(mem), flatten_tree(disk)):
        assert n1 == n2 and a.tobytes() == b.tobytes(), n1
    assert [n for n, _ in iter_weights(tmp_path / "ox")] == list(named_specs(cfg_disk.model))


# --------------------------------------------------------------------------- vocabulary padding


def test_vocab_padding_and_slicing(tmp_path: Path, hf_fp32: Path) -> None:
    src = hf_tensors(hf_fp32)
    params, cfg = load_hf_params(hf_fp32)
    assert (cfg.model.vocab_size, cfg.model.padded_vocab_size) == (100, 128)  # next multiple of 128
    emb, head = params["embed"], params["lm_head"]
    assert emb.shape == (128, 64) and head.shape == (64, 128)
    np.testing.assert_array_equal(emb[:100], src["model.embed_tokens.weight"])
    np.testing.assert_array_equal(head[:, :100], src["lm_head.weight"].T)
    # OLMo-core's mean resizing (without its 1e-9 covariance noise): padded rows = mean real row.
    np.testing.assert_array_equal(emb[100:], np.repeat(src["model.embed_tokens.weight"].mean(0, keepdims=True), 28, 0))
    np.testing.assert_array_equal(head[:, 100:].T, np.repeat(src["lm_head.weight"].mean(0, keepdims=True), 28, 0))

    params, cfg = load_hf_params(hf_fp32, padded_vocab_size=256)
    assert params["embed"].shape == (256, 64) and cfg.model.embedding_rows == 256
    params, cfg = load_hf_params(hf_fp32, padded_vocab_size=100)
    assert params["embed"].shape == (100, 64)
    with pytest.raises(ConversionError, match="smaller than config.json vocab_size 100"):
        load_hf_params(hf_fp32, padded_vocab_size=64)

    hf_to_olmax(hf_fp32, tmp_path / "ox", padded_vocab_size=384, progress=None)
    olmax_to_hf(tmp_path / "ox", tmp_path / "back", progress=None)
    back = hf_tensors(tmp_path / "back")
    assert back["model.embed_tokens.weight"].shape == (100, 64) and back["lm_head.weight"].shape == (100, 64)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["vocab_size"] == 100


# --------------------------------------------------------------------------- config forms


def legacy(nested: dict) -> dict:
    """The released files' form: rope_theta + rope_scaling (YaRN on full layers) instead of rope_parameters."""
    d = {k: v for k, v in nested.items() if k != "rope_parameters"}
    full = dict(nested["rope_parameters"]["full_attention"])
    d["rope_theta"] = full.pop("rope_theta")
    d["rope_scaling"] = full if full["rope_type"] != "default" else None
    return d


def test_legacy_and_nested_config_forms_agree(hf_fp32: Path) -> None:
    nested = json.loads((hf_fp32 / "config.json").read_text())
    assert "rope_parameters" in nested  # transformers 5's save_pretrained writes the nested form
    m1, ids1 = hf_config_to_olmax(nested)
    m2, ids2 = hf_config_to_olmax(legacy(nested))
    assert m1 == m2 and ids1 == ids2
    assert m1.rope_scaling is not None and m1.rope_scaling.attention_factor == 1.25
    assert (m1.rope_scaling.factor, m1.rope_scaling.original_max_position_embeddings) == (4.0, 32)
    # transformers reads the legacy form into the same per-layer-type parameters.
    a = Olmo3Config.from_dict(nested).rope_parameters
    b = Olmo3Config.from_dict(legacy(nested)).rope_parameters
    assert a == b


RELEASED_7B_LEGACY = {  # the shape of AI2's released long-context config.json (legacy rope form)
    "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "attention_bias": False, "attention_dropout": 0.0,
    "eos_token_id": 100257, "pad_token_id": 100277, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 65536,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-06,
    "rope_scaling": {"attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1, "factor": 8.0,
                     "original_max_position_embeddings": 8192, "rope_type": "yarn"},
    "rope_theta": 500000, "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 100278,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(32)],
}


def test_7b_configs_both_ways() -> None:
    m, ids = hf_config_to_olmax(RELEASED_7B_LEGACY)
    want = replace(olmo3_7b_stage3().model, param_dtype="bfloat16")
    # The same model; how the recipe computes it (remat, kernels) is not part of a file's config.
    assert m == replace(want, **{f: getattr(m, f) for f in COMPUTE_FIELDS})
    assert ids == {"eos_token_id": 100257, "pad_token_id": 100277, "bos_token_id": None}
    for cfg in (olmo3_7b_stage1(), olmo3_7b_stage3()):
        d = olmax_to_hf_config(cfg)
        assert d["vocab_size"] == 100278 and d["layer_types"][3] == "full_attention" and d["rms_norm_eps"] == 1e-6
        back, _ = hf_config_to_olmax(d)
        assert back == replace(cfg.model, **{f: getattr(back, f) for f in COMPUTE_FIELDS})
        # transformers' own reading of the export matches the olmax config, field by field.
        hc = Olmo3Config(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
        assert (hc.vocab_size, hc.hidden_size, hc.num_hidden_layers, hc.head_dim, hc.rms_norm_eps,
                hc.sliding_window) == (100278, 4096, 32, 128, 1e-6, 4096)
        assert hc.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 500000.0}
        want_full = d["rope_parameters"]["full_attention"]
        assert {k: hc.rope_parameters["full_attention"][k] for k in want_full} == want_full
    assert olmo3_7b_model().padded_vocab_size == hf_config_to_olmax(RELEASED_7B_LEGACY)[0].padded_vocab_size == 100352


def test_olmo_core_forced_full_last_layer_round_trips(hf_fp32: Path) -> None:
    """OLMo-core's olmo3 builders force the last layer to full attention: with 5 layers the
    pattern is s, s, s, f, f, which olmax expresses as k=4 plus a full last layer."""
    types = ["sliding_attention"] * 3 + ["full_attention"] * 2
    d = {**json.loads((hf_fp32 / "config.json").read_text()), "layer_types": types}
    m = hf_config_to_olmax(d)[0]
    assert (m.full_attention_every, m.full_attention_last_layer) == (4, True)
    assert [m.is_full_attention(i) for i in range(5)] == [False, False, False, True, True]
    assert olmax_to_hf_config(Config(model=m), "float32")["layer_types"] == types
    # HF's default pattern for 5 layers (last layer sliding) maps to the flag off.
    d["layer_types"] = ["sliding_attention"] * 3 + ["full_attention", "sliding_attention"]
    m = hf_config_to_olmax(d)[0]
    assert (m.full_attention_every, m.full_attention_last_layer) == (4, False)


@pytest.mark.parametrize("change,match", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLM, not Olmo3ForCausalLM"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings=True"),
    ({"layer_types": ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]}, None),
    ({"layer_types": ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention",
                      "sliding_attention"]}, "not OLMo 3's pattern"),
    ({"layer_types": ["chunked_attention"] * 5}, "chunked_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}}, "different rope_theta"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                          "sliding_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 5e5,
                                                "original_max_position_embeddings": 64}}},
     "full-attention layers only"),
    ({"rope_parameters": {"full_attention": {"rope_type": "llama3", "rope_theta": 5e5}}}, "rope_type 'llama3'"),
    ({"num_attention_heads": None}, "num_attention_heads"),
])
def test_config_errors(hf_fp32: Path, change: dict, match: str | None) -> None:
    d = {**json.loads((hf_fp32 / "config.json").read_text()), **change}
    if match is None:  # full attention every 2nd layer is expressible (k = 2)
        assert hf_config_to_olmax(d)[0].full_attention_every == 2
        return
    with pytest.raises(ConversionError, match=match):
        hf_config_to_olmax(d)


def test_all_full_and_derived_head_dim() -> None:
    d = {**BASE, "architectures": ["Olmo3ForCausalLM"], "layer_types": ["full_attention"] * 5}
    del d["head_dim"]
    m, _ = hf_config_to_olmax(d)
    assert m.sliding_window is None and m.head_dim == 16 and all(m.is_full_attention(i) for i in range(5))
    hc = olmax_to_hf_config(replace(Config(), model=m, data=replace(Config().data, eos_token_id=0, pad_token_id=1)))
    assert hc["layer_types"] == ["full_attention"] * 5
    assert hf_config_to_olmax(hc)[0] == m


# --------------------------------------------------------------------------- bad inputs


def _llama(d: Path) -> Path:
    cfg = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=0, pad_token_id=1)
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy a single-file HF directory with its tensors edited by ``edit(dict)``."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = hf_tensors(src)
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("case,match", [
    ("llama", "LlamaForCausalLM, not Olmo3ForCausalLM"),
    ("llama_relabelled", "missing tensor 'model.layers.0.self_attn.q_norm.weight'"),
    ("missing", "missing tensor 'model.layers.3.mlp.down_proj.weight'"),
    ("unexpected", "unexpected tensor 'model.layers.5.self_attn.q_proj.weight'"),
    ("shape", r"tensor 'model.layers.1.self_attn.k_proj.weight' has shape \(32, 64\), config.json implies \(64, 64\)"),
    ("no_weights", "neither model.safetensors.index.json nor model.safetensors"),
])
def test_bad_hf_inputs_fail_clearly_and_write_nothing(tmp_path: Path, hf_fp32: Path, case: str, match: str) -> None:
    if case == "llama":
        src = _llama(tmp_path / "llama")
    elif case == "llama_relabelled":  # an honest Llama state dict behind an OLMo 3 config.json
        src = _llama(tmp_path / "llama")
        d = json.loads((src / "config.json").read_text())
        d.update(architectures=["Olmo3ForCausalLM"], model_type="olmo3", layer_types=["full_attention"] * 2,
                 head_dim=16, rope_theta=d.pop("rope_parameters")["rope_theta"])
        (src / "config.json").write_text(json.dumps(d))
    elif case == "missing":
        src = _rewrite(hf_fp32, tmp_path / "src", lambda t: t.pop("model.layers.3.mlp.down_proj.weight"))
    elif case == "unexpected":
        src = _rewrite(hf_fp32, tmp_path / "src", lambda t: t.update(
            {"model.layers.5.self_attn.q_proj.weight": t["model.layers.0.self_attn.q_proj.weight"]}))
    elif case == "shape":
        src = _rewrite(hf_fp32, tmp_path / "src", lambda t: t.update(
            {"model.layers.1.self_attn.k_proj.weight": np.zeros((32, 64), np.float32)}))
    else:
        src = tmp_path / "src"
        src.mkdir()
        (src / "config.json").write_text((hf_fp32 / "config.json").read_text())
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=match):
        hf_to_olmax(src, out, progress=None)
    no_leftovers(out)
    if case != "llama":
        with pytest.raises(ConversionError, match=match):
            load_hf_params(src)


def test_existing_output_is_never_overwritten(tmp_path: Path, hf_fp32: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="already exists and is not empty"):
        hf_to_olmax(hf_fp32, out, progress=None)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    hf_to_olmax(hf_fp32, empty, progress=None)  # an empty directory is fine
    assert (empty / "config.yaml").exists()


def test_bad_olmax_inputs(tmp_path: Path, hf_fp32: Path) -> None:
    params, cfg = load_hf_params(hf_fp32)
    named = flatten_tree(params)
    # save_weights checks every tensor against the config and leaves nothing behind on error.
    cases = [
        ([x for x in named if x[0] != "layers.2.mlp_norm"], "missing tensor 'layers.2.mlp_norm'"),
        (named + [("layers.9.attn.q", named[1][1])], "unexpected tensor 'layers.9.attn.q'"),
        ([(n, a.T if n == "layers.0.attn.q" else a) for n, a in named],
         r"tensor 'layers.0.attn.q' has shape \(128, 64\), the config expects \(64, 128\)"),
    ]
    for i, (tensors, match) in enumerate(cases):
        out = tmp_path / f"bad{i}"
        with pytest.raises(WeightsError, match=match):
            save_weights(out, tensors, cfg, shard_bytes=4096)
        no_leftovers(out)
    # A weights directory whose config disagrees with its tensors: load and export name the tensor.
    good = tmp_path / "good"
    save_weights(good, named, cfg)
    cfg_text = (good / "config.yaml").read_text().replace("mlp_hidden: 96", "mlp_hidden: 80")
    (good / "config.yaml").write_text(cfg_text)
    with pytest.raises(WeightsError, match=r"tensor 'layers.0.mlp.gate' has shape \(64, 96\), the config expects"):
        load_weights(good)
    with pytest.raises(ConversionError, match=r"tensor 'layers.0.mlp.gate' has shape \(64, 96\)"):
        olmax_to_hf(good, tmp_path / "hf_out", progress=None)
    no_leftovers(tmp_path / "hf_out")
    with pytest.raises(ConversionError, match="not an olmax weights directory"):
        olmax_to_hf(hf_fp32, tmp_path / "hf_out2", progress=None)


# --------------------------------------------------------------------------- command line


def test_convert_commands(tmp_path: Path, hf_fp32: Path, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser(prog="olmax")
    commands.register(parser.add_subparsers(dest="command", required=True))
    a = parser.parse_args(["convert", "hf-to-olmax", "--hf", str(hf_fp32), "--out", str(tmp_path / "ox"),
                           "--dtype", "bfloat16", "--pad-vocab-to", "256"])
    assert a.func(a) == 0
    _, cfg = load_weights(tmp_path / "ox")
    assert cfg.model.embedding_rows == 256 and cfg.model.param_dtype == "bfloat16"
    a = parser.parse_args(["convert", "olmax-to-hf", "--checkpoint", str(tmp_path / "ox"), "--out",
                           str(tmp_path / "hf")])
    assert a.func(a) == 0
    err = capsys.readouterr().err
    assert "hf-to-olmax:" in err and "tensors" in err  # progress
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").dtype == torch.bfloat16
    with pytest.raises(SystemExit):
        parser.parse_args(["convert", "hf-to-olmax", "--hf", "x", "--out", "y", "--dtype", "float16"])


# --------------------------------------------------------------------------- damaged files, malformed JSON
# The CLI's error contract: these are ValueErrors (WeightsError, ConversionError) naming the file and
# field, so `olmax` prints one `error:` line and exits 2; before, they were SafetensorError,
# TypeError or AttributeError tracebacks, or a bare "invalid literal for int()".


@pytest.fixture(scope="module")
def olmax_sharded(hf_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ox") / "w"
    hf_to_olmax(hf_fp32, out, shard_bytes=64 * 1024, progress=None)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    return out


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes({"truncated_header": data[:20], "truncated_data": data[:-100],
                      "garbage": b"not a safetensors file", "empty": b""}[how])


@pytest.mark.parametrize("how", ["truncated_header", "truncated_data", "garbage", "empty"])
def test_damaged_olmax_shard_is_named(tmp_path: Path, olmax_sharded: Path, how: str) -> None:
    w = shutil.copytree(olmax_sharded, tmp_path / "w")
    bad = sorted(w.glob("model-*.safetensors"))[1]
    _damage(bad, how)
    match = re.escape(f"{bad}: not a readable safetensors file (")
    with pytest.raises(WeightsError, match=match):
        load_weights(w)
    with pytest.raises(WeightsError, match=match):
        list(iter_weights(w))
    with pytest.raises(ConversionError, match=match):
        olmax_to_hf(w, tmp_path / "hf", progress=None)
    no_leftovers(tmp_path / "hf")


@pytest.mark.parametrize("sharded", [False, True])
def test_damaged_hf_safetensors_is_named(tmp_path: Path, hf_fp32: Path, olmax_sharded: Path, sharded: bool) -> None:
    src = tmp_path / "src"
    if sharded:
        olmax_to_hf(olmax_sharded, src, shard_bytes=64 * 1024, progress=None)
        bad = sorted(src.glob("model-*.safetensors"))[1]
    else:
        src.mkdir()
        (src / "config.json").write_text((hf_fp32 / "config.json").read_text())
        bad = src / "model.safetensors"
        bad.write_bytes((hf_fp32 / "model.safetensors").read_bytes())
    _damage(bad, "truncated_data")
    match = re.escape(f"{bad}: not a readable safetensors file (")
    with pytest.raises(ConversionError, match=match):
        load_hf_params(src)
    with pytest.raises(ConversionError, match=match):
        hf_to_olmax(src, tmp_path / "out", progress=None)
    no_leftovers(tmp_path / "out")


def test_index_naming_the_wrong_shard_is_named(tmp_path: Path, olmax_sharded: Path) -> None:
    w = shutil.copytree(olmax_sharded, tmp_path / "w")
    index = json.loads((w / INDEX_NAME).read_text())
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"]["embed"])
    index["weight_map"]["embed"] = other
    (w / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(WeightsError, match=re.escape(f"{w / other}: cannot read tensor 'embed'")):
        load_weights(w)


@pytest.mark.parametrize("index,match", [
    ("[]", 'not a safetensors index (expected a JSON object with a "weight_map" object, got list)'),
    ('"x"', "not a safetensors index (expected a JSON object"),
    ("{}", 'not a safetensors index (no "weight_map")'),
    ('{"weight_map": []}', "weight_map must be an object {tensor name: shard file}, got list"),
    ('{"weight_map": "model.safetensors"}', "weight_map must be an object {tensor name: shard file}, got str"),
    ('{"weight_map": {"embed": 5}}', "weight_map['embed'] must be a shard file name, got 5"),
])
def test_malformed_index_is_named(tmp_path: Path, olmax_sharded: Path, index: str, match: str) -> None:
    w = shutil.copytree(olmax_sharded, tmp_path / "w")
    (w / INDEX_NAME).write_text(index)
    match = re.escape(f"{w / INDEX_NAME}: {match}")
    with pytest.raises(WeightsError, match=match):
        load_weights(w)
    with pytest.raises(ConversionError, match=match):
        olmax_to_hf(w, tmp_path / "hf", progress=None)


@pytest.mark.parametrize("text", ["[1]", '"config"', "3", "null"])
def test_config_json_not_an_object_is_named(tmp_path: Path, hf_fp32: Path, text: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(text)
    (src / "model.safetensors").write_bytes((hf_fp32 / "model.safetensors").read_bytes())
    match = re.escape(f"{src / 'config.json'}: not a HF config (expected a JSON object")
    with pytest.raises(ConversionError, match=match):
        read_hf_config(src)
    with pytest.raises(ConversionError, match=match):
        load_hf_params(src)
    with pytest.raises(ConversionError, match=match):
        hf_to_olmax(src, tmp_path / "out", progress=None)
    no_leftovers(tmp_path / "out")
    for convert in (hf_config_to_olmax, config_from_hf):
        with pytest.raises(ConversionError, match="config.json must be a JSON object"):
            convert(json.loads(text))


@pytest.mark.parametrize("change,match", [
    ({"layer_types": 5}, "layer_types must be a list of 'full_attention' / 'sliding_attention' strings, got 5"),
    ({"layer_types": [["full_attention"]] * 5}, "layer_types must be a list of"),
    ({"num_hidden_layers": "four"}, "num_hidden_layers must be an integer, got 'four'"),
    ({"num_hidden_layers": 4.5}, "num_hidden_layers must be an integer, got 4.5"),
    ({"num_hidden_layers": float("inf")}, "num_hidden_layers must be an integer, got inf"),
    ({"num_hidden_layers": float("nan")}, "num_hidden_layers must be an integer, got nan"),
    ({"hidden_size": "64"}, "hidden_size must be an integer, got '64'"),
    ({"num_attention_heads": True}, "num_attention_heads must be an integer, got True"),
    ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads must be >= 1, got 0"),
    ({"head_dim": "x"}, "head_dim must be an integer, got 'x'"),
    ({"num_key_value_heads": "two"}, "num_key_value_heads must be an integer, got 'two'"),
    ({"intermediate_size": [96]}, r"intermediate_size must be an integer, got [96]"),
    ({"vocab_size": "100"}, "vocab_size must be an integer, got '100'"),
    ({"max_position_embeddings": None}, "max_position_embeddings must be an integer, got None"),
    ({"rms_norm_eps": "a"}, "rms_norm_eps must be a number, got 'a'"),
    ({"initializer_range": "x"}, "initializer_range must be a number, got 'x'"),
    ({"sliding_window": "x"}, "sliding_window must be an integer, got 'x'"),
    ({"eos_token_id": "x"}, "eos_token_id must be an integer, got 'x'"),
    ({"pad_token_id": ["x"]}, "pad_token_id must be an integer, got 'x'"),
    ({"architectures": 5}, "architectures must be a list of class names, got 5"),
    ({"rope_parameters": {"full_attention": 5}}, "rope_parameters.full_attention must be an object, got 5"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": "x"}}},
     "rope_parameters.full_attention.rope_theta must be a number, got 'x'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 5e5, "factor": "x"}}},
     "rope_parameters.full_attention.factor must be a number, got 'x'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                                             "original_max_position_embeddings": "32"}}},
     "rope_parameters.full_attention.original_max_position_embeddings must be an integer, got '32'"),
    ({"rope_parameters": None, "rope_theta": "x"}, "rope_theta must be a number, got 'x'"),
    ({"rope_parameters": None, "rope_scaling": 5}, "rope_scaling must be an object, got 5"),
    ({"rope_parameters": None, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": "x"}},
     "rope_scaling.beta_fast must be a number, got 'x'"),
])
def test_malformed_config_field_is_named(hf_fp32: Path, change: dict, match: str) -> None:
    d = {**json.loads((hf_fp32 / "config.json").read_text()), **change}
    with pytest.raises(ConversionError, match=re.escape(f"config.json {match}")):
        config_from_hf(d)


def test_cli_one_line_errors(tmp_path: Path, hf_fp32: Path, olmax_sharded: Path,
                             capsys: pytest.CaptureFixture) -> None:
    """Through `olmax`: exit 2 and one `error:` line naming the file (and field), no traceback."""
    w = shutil.copytree(olmax_sharded, tmp_path / "w")
    bad = sorted(w.glob("model-*.safetensors"))[0]
    _damage(bad, "garbage")
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({**json.loads((hf_fp32 / "config.json").read_text()),
                                                 "num_hidden_layers": "four"}))
    (src / "model.safetensors").write_bytes((hf_fp32 / "model.safetensors").read_bytes())
    for argv, want in [
        (["convert", "olmax-to-hf", "--checkpoint", str(w), "--out", str(tmp_path / "o1")],
         f"error: {bad}: not a readable safetensors file ("),
        (["convert", "hf-to-olmax", "--hf", str(src), "--out", str(tmp_path / "o2")],
         "error: config.json num_hidden_layers must be an integer, got 'four'"),
    ]:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(want) and "\n" not in err and "Traceback" not in err, err
