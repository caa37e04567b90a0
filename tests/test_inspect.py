"""Parameter counts, FLOPs per token and the memory estimate, computed without weights."""

import json
import subprocess
import sys

import pytest

from olmax.commands import inspect_config
from olmax.config import ConfigError
from olmax.metrics.flops import causal_pairs, flops_per_token
from olmax.model.params import count_params
from olmax.recipes import get_recipe


def test_7b_parameter_counts_are_exact():
    m = get_recipe("olmo3_7b_stage1").model
    assert count_params(m, padded=False)["total"] == 7_298_011_136
    assert count_params(m, padded=True)["total"] == 7_298_617_344


def test_head_reshape_keeps_parameter_count():
    a = get_recipe("olmo3_7b_stage1").model
    b = get_recipe("olmo3_7b_stage1", ["model.n_heads=16", "model.n_kv_heads=16", "model.head_dim=256"]).model
    assert count_params(a) == count_params(b)


def test_causal_pairs_brute_force():
    import numpy as np
    for L, W in [(10, None), (10, 4), (10, 10), (10, 20), (37, 5)]:
        q = np.arange(L)[:, None]
        k = np.arange(L)[None, :]
        allowed = (k <= q) & ((k > q - W) if W else True)
        assert causal_pairs(L, W) == int(allowed.sum())


def test_flops_formula_components():
    m = get_recipe("olmo3_7b_stage1").model
    f = flops_per_token(m, 8192)
    non_emb = count_params(m)["non_embedding"]
    assert f["dense"] == 6 * non_emb
    full = 12 * 32 * 128 * (8192 * 8193 // 2) / 8192
    sliding = 12 * 32 * 128 * (4096 * 4097 // 2 + 4096 * 4096) / 8192
    assert f["attention"] == pytest.approx(8 * full + 24 * sliding, rel=1e-12)
    # Counting every layer as full attention (the MaxText count) overstates by about 2.6%.
    maxtext = f["dense"] + 32 * full
    assert 0.02 < maxtext / f["total"] - 1 < 0.03


def test_memory_estimate_scales_with_fsdp():
    cfg = get_recipe("olmo3_7b_stage1")
    one = inspect_config(cfg, 8)["memory_per_device"]
    many = inspect_config(cfg, 64)["memory_per_device"]
    assert many["adam_moments_gib"] < one["adam_moments_gib"] / 7


def test_indivisible_batch_is_an_error_naming_numbers():
    cfg = get_recipe("olmo3_7b_stage1", ["train.global_batch_size=500"])
    with pytest.raises(ConfigError, match="global_batch_size=500 is not divisible by the 64"):
        inspect_config(cfg, 64)


def test_cli_inspect_json_and_print_config():
    out = subprocess.run([sys.executable, "-m", "olmax.cli", "inspect", "olmo3_7b_stage1", "--devices", "512",
                          "--json"], capture_output=True, text=True, check=True).stdout
    info = json.loads(out)
    assert info["params"]["total"] == 7_298_011_136 and info["params"]["total_padded"] == 7_298_617_344
    assert info["layers"]["full_attention"] == list(range(3, 32, 4))
    r = subprocess.run([sys.executable, "-m", "olmax.cli", "print-config", "tiny", "--set", "model.d_moel=3"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "did you mean 'model.d_model'" in r.stderr
