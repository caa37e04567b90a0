"""Config tree: strict overrides, types, validation, YAML round trip, recipe numbers."""

import math

import pytest
import yaml

from olmax.config import Config, ConfigError, load_yaml
from olmax.recipes import RECIPES, get_recipe


def test_every_recipe_resolves_and_round_trips_through_yaml(tmp_path):
    for name in RECIPES:
        cfg = get_recipe(name)
        p = tmp_path / f"{name}.yaml"
        p.write_text(cfg.to_yaml())
        assert load_yaml(str(p)) == cfg
        assert get_recipe(str(p)) == cfg


def test_override_sets_nested_values_with_types():
    cfg = get_recipe("tiny", ["train.steps=7", "optim.lr=1e-4", "model.sliding_window=null",
                              "data.paths=a.npy,b.npy", "optim.skip_step.enabled=false"])
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.optim.lr == 1e-4
    assert cfg.model.sliding_window is None
    assert cfg.data.paths == ("a.npy", "b.npy")
    assert cfg.optim.skip_step.enabled is False


def test_optional_section_can_be_created_by_override():
    cfg = get_recipe("tiny", ["model.rope_scaling.factor=4"])
    assert cfg.model.rope_scaling is not None and cfg.model.rope_scaling.factor == 4.0


def test_unknown_key_names_the_key_and_the_closest_valid_one():
    with pytest.raises(ConfigError, match=r"'model.d_moel'.*'model.d_model'"):
        get_recipe("tiny", ["model.d_moel=3"])
    with pytest.raises(ConfigError, match=r"'trian'.*'train'"):
        get_recipe("tiny", ["trian.steps=3"])


def test_wrong_type_names_field_and_expected_type():
    with pytest.raises(ConfigError, match=r"train.steps: expected int, got 'abc'"):
        get_recipe("tiny", ["train.steps=abc"])
    with pytest.raises(ConfigError, match=r"model.param_dtype: expected one of 'float32', 'bfloat16'"):
        get_recipe("tiny", ["model.param_dtype=float16"])
    with pytest.raises(ConfigError, match="not of the form key=value"):
        get_recipe("tiny", ["train.steps"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        get_recipe("tiny", ["train.steps.x=1"])


def test_string_fields_keep_strings():
    cfg = get_recipe("tiny", ["train.init_from=123"])
    assert cfg.train.init_from == "123"


def test_validation_errors_name_fields():
    with pytest.raises(ConfigError, match="model.n_heads .* multiple of model.n_kv_heads"):
        get_recipe("tiny", ["model.n_kv_heads=3"])
    with pytest.raises(ConfigError, match="moments_dtype must be float32.*0.93"):
        get_recipe("tiny", ["optim.moments_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="data.eos_token_id"):
        get_recipe("tiny", ["data.eos_token_id=99999"])
    with pytest.raises(ConfigError, match="padded_vocab_size"):
        get_recipe("tiny", ["model.padded_vocab_size=10"])
    for bad in ("0", "-1"):  # no signal to learn from, or a reward turned into a penalty
        with pytest.raises(ConfigError, match="rl.reward_multiplier must be > 0"):
            get_recipe("tiny_rl", [f"rl.reward_multiplier={bad}"])
    # Held-out label masks without held-out files would be ignored: an error instead.
    with pytest.raises(ConfigError, match="eval.heldout_label_mask_paths .* eval.heldout_paths, which is empty"):
        get_recipe("tiny", ["eval.heldout_label_mask_paths=[m.npy]"])


def test_unknown_recipe_suggests():
    with pytest.raises(ConfigError, match="did you mean 'olmo3_7b_stage1'"):
        get_recipe("olmo3_7b_stag1")


def test_from_dict_rejects_unknown_and_mistyped_keys():
    d = Config().to_dict()
    d["model"]["bogus"] = 1
    with pytest.raises(ConfigError, match="model.bogus"):
        Config.from_dict(d)
    d = Config().to_dict()
    d["train"]["steps"] = "many"
    with pytest.raises(ConfigError, match="train.steps"):
        Config.from_dict(d)


def test_stage1_recipe_numbers_follow_the_olmo_core_scripts():
    cfg = get_recipe("olmo3_7b_stage1")
    tokens_per_step = cfg.train.global_batch_size * cfg.data.sequence_length
    assert tokens_per_step == 4_194_304
    s = cfg.optim.schedule
    assert s.name == "two_part_cosine" and s.warmup == 2000 and s.alpha_f == 0.1
    assert s.t_max == math.ceil(5e12 / tokens_per_step) == 1_192_093
    assert s.switch_step == 1_192_092 // 2 + 1000 == 597_046
    assert s.t_max_2 == math.ceil(7e12 / tokens_per_step)
    assert cfg.train.steps * tokens_per_step == 5_929_965_715_456
    assert (cfg.optim.lr, cfg.optim.beta1, cfg.optim.beta2, cfg.optim.eps, cfg.optim.weight_decay) == (
        3e-4, 0.9, 0.95, 1e-8, 0.1)
    assert cfg.optim.decay_embeddings is False and cfg.optim.z_loss == 1e-5 and cfg.optim.max_grad_norm == 1.0
    assert cfg.data.seed == 34521 and cfg.data.eos_token_id == 100257 and cfg.data.pad_token_id == 100277
    assert cfg.data.bos_token_id is None and cfg.data.repetition_filter is False


def test_stage2_and_32b_recipes():
    s2 = get_recipe("olmo3_7b_stage2")
    assert s2.optim.lr == 2.0712352850360292e-4 and s2.optim.schedule.name == "linear"
    assert s2.optim.schedule.warmup == 0 and s2.train.steps == 47684
    assert s2.train.global_batch_size * s2.data.sequence_length == 2 ** 21 and s2.data.seed == 1337
    b32 = get_recipe("olmo3_32b")
    m = b32.model
    assert (m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.mlp_hidden) == (5120, 64, 40, 8, 27648)
    assert b32.data.repetition_filter and b32.data.repetition_max_period == 13 and b32.data.repetition_max_count == 32
    s3 = get_recipe("olmo3_7b_stage3")
    assert s3.model.rope_scaling.factor == 8.0 and s3.data.sequence_length == 65536


def test_yaml_output_is_plain():
    d = yaml.safe_load(get_recipe("tiny").to_yaml())
    assert d["model"]["d_model"] == 128 and d["data"]["paths"] == []


def test_model_differences_names_architecture_fields_only():
    from dataclasses import replace

    from olmax.config import model_differences
    m = get_recipe("tiny").model
    assert model_differences(m, replace(m, remat="full", compute_dtype="bfloat16", attention_impl="cudnn")) == []
    assert model_differences(m, replace(m, d_model=64, n_heads=2)) == [("d_model", 128, 64), ("n_heads", 4, 2)]
    # No padding (None) and padding to the vocabulary size are the same embedding.
    assert model_differences(replace(m, padded_vocab_size=None), m) == []
    assert model_differences(m, replace(m, padded_vocab_size=4224)) == [("padded_vocab_size", 4096, 4224)]
    assert model_differences(m, replace(m, param_dtype="bfloat16"), ignore=frozenset({"param_dtype"})) == []
