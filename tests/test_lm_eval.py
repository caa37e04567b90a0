"""The lm-eval adapter scores like ``lm_eval --model hf`` on the same tiny OLMo 3, and the suite command.

A random HF ``Olmo3ForCausalLM`` (4 layers, d 64, sliding window 16, full attention in layer 3) is
saved beside a byte-level BPE tokenizer trained here, converted to olmax in memory (``hf:DIR``), and
both models run the local tasks in ``olmax/eval/tasks`` in-process on CPU with max_length 48, so
multiple-choice contexts are left-truncated and every long document spans several rolling windows.

Tolerances (fp32 forward passes on both sides; torch and XLA differ in summation order):
- loglikelihood requests: |delta log-prob| <= 1e-4 per request, identical is_greedy flags;
- loglikelihood_rolling: |delta| <= 1e-4 per window (each window is one loglikelihood request inside
  lm-eval; a document's score is the sum over its windows). A window here sums to -300..-700, where
  fp32's spacing is 3e-5..6e-5, and HF sums it in fp32 (olmax in fp64);
- word and byte perplexity, bits per byte: relative difference <= 1e-4;
- accuracies and greedy generations: identical.
"""

from __future__ import annotations

import os

# Never reach for the network (set before datasets / huggingface_hub read them, where possible).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse
import json
from pathlib import Path

# The references must run: a missing install fails here instead of skipping.
import accelerate  # noqa: E402,F401  (lm-eval's HF model needs it)
import lm_eval  # noqa: E402
import pytest
from lm_eval import utils as lm_utils  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from olmax.compat.hf import random_hf_model  # noqa: E402
from olmax.config import ConfigError  # noqa: E402
from olmax.engine import Sampling  # noqa: E402
from olmax.eval import suite  # noqa: E402
from olmax.eval.lm_eval_adapter import OlmaxLM  # noqa: E402

TASKS = ["olmax_mc", "olmax_ppl", "olmax_gen"]
MAX_LENGTH = 48
BATCH = 4
LL_TOL = 1e-4
PPL_RTOL = 1e-4


def train_tokenizer(out: Path) -> object:
    """A 400-token byte-level BPE trained on the local task texts, saved as an HF tokenizer with
    OLMo 3's special-token roles (eos ``<|endoftext|>``, pad ``<|pad|>``, no bos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    corpus = [line for f in sorted((suite.LOCAL_TASKS_DIR / "data").glob("*.jsonl"))
              for line in f.read_text().splitlines()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.save_pretrained(str(out))
    return fast


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny_olmo3")
    tok = train_tokenizer(d)
    random_hf_model(d, seed=0, vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, sliding_window=16,
                    rms_norm_eps=1e-6, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    return d


@pytest.fixture(scope="module")
def models(hf_dir: Path) -> tuple[object, OlmaxLM]:
    from lm_eval.models.huggingface import HFLM
    hf = HFLM(pretrained=str(hf_dir), dtype="float32", max_length=MAX_LENGTH, batch_size=BATCH, device="cpu")
    ox = OlmaxLM(checkpoint=f"hf:{hf_dir}", max_length=MAX_LENGTH, batch_size=BATCH)
    return hf, ox


@pytest.fixture(scope="module")
def results(models: tuple[object, OlmaxLM]) -> dict[str, dict]:
    # Local tasks only: skips indexing lm-eval's ~15k bundled task files.
    tm = TaskManager(include_path=str(suite.LOCAL_TASKS_DIR), include_defaults=False)
    return {name: lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=tm, bootstrap_iters=0)
            for name, lm in zip(("hf", "olmax"), models)}


def samples(results: dict[str, dict], task: str) -> list[tuple[dict, dict]]:
    hf = sorted(results["hf"]["samples"][task], key=lambda s: s["doc_id"])
    ox = sorted(results["olmax"]["samples"][task], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in hf] == [s["doc_id"] for s in ox] and hf
    for a, b in zip(hf, ox):
        assert a["arguments"] == b["arguments"]  # same prompts (few-shot sampling included)
    return list(zip(hf, ox))


# --------------------------------------------------------------------------- adapter == HF


def test_loglikelihood_matches_hf(results: dict[str, dict], models: tuple[object, OlmaxLM]) -> None:
    pairs = samples(results, "olmax_mc")
    worst, truncated = 0.0, 0
    for hf, ox in pairs:
        for (ll_hf, greedy_hf), (ll_ox, greedy_ox) in zip([r[0] for r in hf["resps"]], [r[0] for r in ox["resps"]]):
            worst = max(worst, abs(ll_hf - ll_ox))
            assert abs(ll_hf - ll_ox) <= LL_TOL, (hf["doc_id"], ll_hf, ll_ox)
            assert greedy_hf == greedy_ox
        ctx, cont = ox["arguments"][0]
        truncated += len(models[1].tok_encode(ctx + cont)) > MAX_LENGTH + 1
        assert (hf["acc"], hf["acc_norm"]) == (ox["acc"], ox["acc_norm"])
    assert truncated > 0, "no request exercised left truncation"
    for k in ("acc,none", "acc_norm,none"):
        assert results["hf"]["results"]["olmax_mc"][k] == results["olmax"]["results"]["olmax_mc"][k]
    print(f"olmax_mc: max |delta loglikelihood| {worst:.2e} over {sum(len(h['resps']) for h, _ in pairs)} requests")


def test_rolling_loglikelihood_and_perplexity_match_hf(results: dict[str, dict],
                                                       models: tuple[object, OlmaxLM]) -> None:
    ox_lm = models[1]
    windows, deltas = [], []
    for hf, ox in samples(results, "olmax_ppl"):
        n = len(list(lm_utils.get_rolling_token_windows(ox_lm.tok_encode(ox["arguments"][0][0]), ox_lm.prefix_token_id,
                                                        MAX_LENGTH, 1)))
        windows.append(n)
        delta = abs(hf["resps"][0][0] - ox["resps"][0][0])
        deltas.append(delta)
        assert delta <= LL_TOL * n, (hf["doc_id"], hf["resps"], ox["resps"], n)
    assert max(windows) >= 3, f"documents should span several windows, got {windows}"
    r_hf, r_ox = results["hf"]["results"]["olmax_ppl"], results["olmax"]["results"]["olmax_ppl"]
    for k in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert r_ox[k] == pytest.approx(r_hf[k], rel=PPL_RTOL), k
        print(f"olmax_ppl {k}: hf {r_hf[k]:.10g} olmax {r_ox[k]:.10g} rel {abs(r_ox[k] / r_hf[k] - 1):.2e}")
    print(f"olmax_ppl: windows per document {windows}, |delta loglikelihood| {[f'{d:.1e}' for d in deltas]}")


def test_generations_match_hf(results: dict[str, dict], models: tuple[object, OlmaxLM]) -> None:
    pairs = samples(results, "olmax_gen")
    for hf, ox in pairs:
        assert hf["resps"] == ox["resps"]
    assert (results["hf"]["results"]["olmax_gen"]["exact_match,none"]
            == results["olmax"]["results"]["olmax_gen"]["exact_match,none"])
    # Both stopping paths are exercised: some prompts stop on a stop sequence, some run to max_gen_toks.
    ox_lm = models[1]
    until = pairs[0][1]["arguments"][0][1]["until"]
    contexts = [ox_lm._encode_context(ox["arguments"][0][0]) for _, ox in pairs]
    full = [ox_lm.tok_decode(toks) for i in range(0, len(contexts), BATCH)
            for toks in ox_lm._greedy(contexts[i:i + BATCH], 12, [], set())]
    stopped = [any(s in text for s in until) for text in full]
    assert any(stopped) and not all(stopped), (full, until)


def test_greedy_flag_and_token_level_parity(models: tuple[object, OlmaxLM]) -> None:
    """A continuation that is the model's own greedy decode scores is_greedy=True on both sides."""
    hf, ox = models
    ctx = ox.tok_encode("Q: What color is grass?\nA:")
    gen = ox._greedy([ctx], 8, [], set())[0]
    (ll_ox, g_ox), = ox._loglikelihood_tokens([(None, ctx, gen)], disable_tqdm=True)
    (ll_hf, g_hf), = hf._loglikelihood_tokens([(None, ctx, gen)], disable_tqdm=True)
    assert g_ox and g_hf
    assert abs(ll_ox - ll_hf) <= LL_TOL


def test_jit_programs_are_bucketed(results: dict[str, dict], models: tuple[object, OlmaxLM]) -> None:
    # Batch buckets {1, 2, 4} x length buckets {16, 32, 48}: at most 9 programs each, however many calls.
    ox = models[1]
    assert 0 < ox._score._cache_size() <= 9
    # Generation: one KV-cache decoder for every sampling setting; two sampled settings (other
    # temperature, top-k and seed) share one more program beside the greedy one.
    ctx = [ox.tok_encode("Q: What color is grass?\nA:")]
    ox._greedy(ctx, 8, [], set())
    dec, n = ox._decoder, ox._decoder._chunk._cache_size()
    ox._generate(ctx, 8, [], set(), Sampling(temperature=0.7, seed=1))
    ox._generate(ctx, 8, [], set(), Sampling(temperature=0.9, top_k=5, seed=2))
    assert ox._decoder is dec and dec._chunk._cache_size() == n + 1


@pytest.mark.integration
def test_sampled_generation(models: tuple[object, OlmaxLM]) -> None:
    """gen_kwargs that ask for sampling sample: reproducibly, whatever the batch size, and greedy
    again when do_sample is false."""
    from types import SimpleNamespace
    ox = models[1]
    ctxs = ["Q: What color is grass?\nA:", "Q: What do bees make?\nA:", "Question: sky?", "hello"]
    sampled = {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": True, "temperature": 0.8, "top_k": 40, "seed": 3}
    greedy = {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False, "temperature": 0.8}

    def run(kw: dict) -> list[str]:
        return ox.generate_until([SimpleNamespace(args=(c, dict(kw))) for c in ctxs], disable_tqdm=True)

    a = run(sampled)
    assert a == run(sampled)
    ox._batch_size = 1
    try:
        assert a == run(sampled)
    finally:
        ox._batch_size = BATCH
    g = run(greedy)
    assert g == [ox.tok_decode(t).split("\n\n")[0] for t in ox._greedy([ox._encode_context(c) for c in ctxs], 8, [],
                                                                      {ox.eot_token_id})] and g != a
    with pytest.raises(ValueError, match="top_p"):
        run({**sampled, "top_p": 1.5})


def test_tokenizer_json_file_and_dir_agree(hf_dir: Path, models: tuple[object, OlmaxLM]) -> None:
    """A bare tokenizer.json takes its special-token roles from the checkpoint config."""
    from olmax.eval.lm_eval_adapter import load_tokenizer
    ox = models[1]
    tok = load_tokenizer(hf_dir / "tokenizer.json", ox.cfg)
    assert tok.eos_token_id == ox.eot_token_id and tok.bos_token_id is None
    text = "Question: What do bees make?\nAnswer: honey"
    assert tok.encode(text) == ox.tok_encode(text) == ox.tokenizer.encode(text)
    # OLMo 3 adds no BOS: the empty-context prefix is EOS, as in lm-eval's HF model.
    assert ox.prefix_token_id == models[0].prefix_token_id == ox.eot_token_id


# ChatML with the final assistant turn closed by EOS, as OLMo 3's templates close it.
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
          "{% if loop.last and m['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '<|im_end|>\\n' }}{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_chat_template_renders_as_hf(hf_dir: Path, models: tuple[object, OlmaxLM], tmp_path: Path) -> None:
    """--apply_chat_template: a tokenizer's jinja template gives HFLM's prompts, with and without a
    generation prompt (a prefilled reply left open); without one, the built-in OLMo 3 template."""
    from lm_eval.models.huggingface import HFLM

    from olmax.chat.template import render_olmo3_chat
    d = tmp_path / "tok"
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).write_bytes((hf_dir / f).read_bytes())
    (d / "chat_template.jinja").write_text(CHATML)
    ox = OlmaxLM(f"hf:{hf_dir}", tokenizer=str(d), batch_size=BATCH, max_length=MAX_LENGTH)
    hf = HFLM(pretrained=models[0].model, tokenizer=str(d), batch_size=BATCH, max_length=MAX_LENGTH)
    shots = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What do bees make?"},
             {"role": "assistant", "content": "honey"}, {"role": "user", "content": "And cows?"}]
    prefilled = shots + [{"role": "assistant", "content": "Answer: "}]
    assert ox.apply_chat_template(shots) == hf.apply_chat_template(shots)
    assert ox.apply_chat_template(prefilled, False) == hf.apply_chat_template(prefilled, False)
    assert ox.apply_chat_template(prefilled, False).endswith("<|im_start|>assistant\nAnswer: ")
    assert ox.chat_template(True) == CHATML
    builtin = models[1]
    assert builtin.apply_chat_template(shots) == render_olmo3_chat(shots, True)
    assert builtin.apply_chat_template(prefilled, False) == render_olmo3_chat(prefilled, False)[:-len("<|endoftext|>")]


# --------------------------------------------------------------------------- suite command


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="olmax eval")
    sub = p.add_subparsers(dest="command", required=True)
    suite.register(sub)
    return p.parse_args(["lm-eval", *argv])


def test_suite_arguments(hf_dir: Path) -> None:
    args = parse(["--checkpoint", f"hf:{hf_dir}"])
    assert suite.parse_entries(args) == [("mmlu", 5), ("hellaswag", 0), ("arc_easy", 0), ("arc_challenge", 0),
                                         ("openbookqa", 0), ("piqa", 0), ("boolq", 0), ("winogrande", 0)]
    assert suite.check_args(args) is None
    assert suite.parse_entries(parse(["--checkpoint", "x", "--tasks", "arc_easy, piqa"])) == [("arc_easy", None),
                                                                                             ("piqa", None)]
    assert suite.check_args(parse(["--checkpoint", f"hf:{hf_dir}", "--limit", "3"])) == 3
    assert suite.check_args(parse(["--checkpoint", f"hf:{hf_dir}", "--limit", "0.5"])) == 0.5
    with pytest.raises(SystemExit):
        parse(["--checkpoint", "x", "--suite", "olmo3", "--tasks", "piqa"])
    with pytest.raises(SystemExit):
        parse(["--checkpoint", "x", "--suite", "nope"])
    with pytest.raises(SystemExit):
        parse(["--tasks", "piqa"])  # --checkpoint is required
    with pytest.raises(SystemExit):
        parse(["--checkpoint", "x", "--batch-size", "0"])  # refused while parsing
    bad = {("--tasks", "piqa,,boolq"): "empty task name", ("--limit", "1.5"): "--limit", ("--limit", "0"): "--limit",
           ("--include-path", "no/such/dir"): "--include-path",
           ("--tokenizer", "no/such/tokenizer.json"): "--tokenizer"}
    for extra, msg in bad.items():
        a = parse(["--checkpoint", f"hf:{hf_dir}", *extra])
        with pytest.raises(ConfigError, match=msg):
            suite.parse_entries(a)
            suite.check_args(a)
    with pytest.raises(ConfigError, match="does not exist"):
        suite.cmd_lm_eval(parse(["--checkpoint", "hf:no/such/dir"]))


def test_a_remote_checkpoint_is_not_looked_up_locally_and_needs_a_tokenizer(hf_dir: Path) -> None:
    # Remote run directories load where they lie (checkpoint.load); only their tokenizer is not
    # searched for there, so the arguments name --tokenizer instead of calling the bucket missing.
    tok = str(hf_dir / "tokenizer.json")
    assert suite.check_args(parse(["--checkpoint", "s3://bucket/run", "--tasks", "x", "--tokenizer", tok])) is None
    assert suite.check_args(parse(["--checkpoint", "gs://bucket/run/checkpoints/4", "--tasks", "x",
                                   "--tokenizer", tok])) is None
    with pytest.raises(ConfigError, match="s3://bucket/run: a remote checkpoint's tokenizer .* pass --tokenizer"):
        suite.check_args(parse(["--checkpoint", "s3://bucket/run", "--tasks", "x"]))


@pytest.fixture
def empty_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, with nothing cached (whatever this machine's real HF cache holds)."""
    import datasets.config
    import huggingface_hub.constants
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


@pytest.mark.integration
def test_missing_datasets_are_named(hf_dir: Path, empty_hf_cache: None) -> None:
    # Same --include-path as the end-to-end test below, so both share one (cached) task index.
    base = ["--checkpoint", f"hf:{hf_dir}", "--include-path", str(suite.LOCAL_TASKS_DIR)]
    with pytest.raises(ConfigError, match="local HF cache") as e:
        suite.cmd_lm_eval(parse(base))
    for name, _ in suite.SUITES["olmo3"].tasks:
        assert name in str(e.value), name
    with pytest.raises(ConfigError, match=r"dataset of task\(s\): hellaswag \(") as e:
        suite.cmd_lm_eval(parse([*base, "--tasks", "hellaswag,olmax_mc"]))
    assert "olmax_mc" not in str(e.value)
    with pytest.raises(ConfigError, match="unknown lm-eval task.*no_such_task"):
        suite.cmd_lm_eval(parse([*base, "--tasks", "no_such_task"]))


@pytest.mark.integration
def test_suite_command_on_local_tasks(hf_dir: Path, results: dict[str, dict], tmp_path: Path,
                                      capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "lm_eval.json"
    args = parse(["--checkpoint", f"hf:{hf_dir}", "--include-path", str(suite.LOCAL_TASKS_DIR),
                  "--tasks", "olmax_local", "--max-length", str(MAX_LENGTH), "--batch-size", str(BATCH), "--json",
                  "--out", str(out)])
    assert args.func(args) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(printed["tasks"]) == sorted(TASKS)
    mc = results["olmax"]["results"]["olmax_mc"]
    assert printed["tasks"]["olmax_mc"]["acc"] == mc["acc,none"]
    assert printed["tasks"]["olmax_mc"]["acc_norm"] == mc["acc_norm,none"]
    assert printed["macro_acc"] == mc["acc,none"] and printed["n_tasks_with_acc"] == 1
    assert printed["n_shot"]["olmax_mc"] == 2
    written = json.loads(out.read_text())
    assert written["tasks"] == printed["tasks"] and "results" in written
    # The human-readable table carries the same numbers.
    print(suite.format_table(written))
    assert "macro average over 1 tasks" in capsys.readouterr().out
