"""Chat-format evaluation: olmax's adapter with the chat template scores as lm-eval's own ``hf`` model
with ``--apply_chat_template`` on the HF export of the same checkpoint.

The checkpoint is a "post-trained" tiny OLMo 3 as olmax holds one: an olmax weights directory (a
random HF ``Olmo3ForCausalLM`` converted with ``hf_to_olmax``) with a byte-level BPE tokenizer that has
the ChatML tokens and OLMo 3 Instruct's chat template as ``chat_template.jinja``. lm-eval's ``hf``
model runs on ``olmax_to_hf``'s export of it; olmax runs through ``olmax eval lm-eval``. Tasks: the
local chat fixtures (``olmax_chat_*``: CoT exact match with few-shot turns, math-verify, instruction
checks, multiple choice by CoT generation) with a system instruction, and the log-likelihood
multiple-choice fixture (``olmax_mc``, two few-shot examples in one user turn).

Per-sample agreement, in tests/test_lm_eval.py's terms: the same prompts, identical generated
strings, filtered answers and per-sample metrics; log-likelihoods within 1e-4 with identical
is_greedy flags and accuracies; identical aggregate scores.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import accelerate  # noqa: E402,F401  (lm-eval's HF model needs it)
import pytest  # noqa: E402

from olmax.chat.template import render_olmo3_chat  # noqa: E402
from olmax.compat.hf import hf_to_olmax, olmax_to_hf, random_hf_model  # noqa: E402
from olmax.config import ConfigError  # noqa: E402
from olmax.eval import suite  # noqa: E402

GEN_TASKS = ["olmax_chat_gsm", "olmax_chat_math", "olmax_chat_if", "olmax_chat_mc_cot"]
MAX_LENGTH = 256
BATCH = 4
LL_TOL = 1e-4  # tests/test_lm_eval.py's per-request tolerance
SYSTEM = "You are a careful assistant. Answer briefly."
SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]


def olmo3_jinja() -> str:
    """OLMo 3 Instruct's template as jinja, written independently of the Python renderer (the one
    tests/test_chat.py checks against it)."""
    from test_chat import JINJA
    return JINJA.replace("THINK", "false")


def train_tokenizer(out: Path) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    data = suite.LOCAL_TASKS_DIR / "data"
    corpus = [line for f in sorted([*data.glob("*.jsonl"), *data.glob("chat/*.jsonl")])
              for line in f.read_text().splitlines()] + [render_olmo3_chat([{"role": "user", "content": "hi"}])]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.save_pretrained(str(out))
    (out / "chat_template.jinja").write_text(olmo3_jinja())
    return fast


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(olmax weights dir, its HF export)."""
    root = tmp_path_factory.mktemp("chat_olmo3")
    src, ckpt, export = root / "hf_src", root / "olmax", root / "hf_export"
    src.mkdir()
    tok = train_tokenizer(src)
    random_hf_model(src, seed=1, vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=16,
                    rms_norm_eps=1e-6, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    hf_to_olmax(src, ckpt)
    olmax_to_hf(ckpt, export)
    assert (ckpt / "chat_template.jinja").is_file() and (export / "chat_template.jinja").is_file()
    return ckpt, export


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="olmax eval")
    sub = p.add_subparsers(dest="command", required=True)
    suite.register(sub)
    return p.parse_args(["lm-eval", *argv])


# --------------------------------------------------------------------------- arguments (fast)


def test_chat_arguments(tmp_path: Path) -> None:
    ck = str(tmp_path)
    a = parse(["--checkpoint", ck, "--tasks", "x"])
    assert suite.chat_options(a).resolved() == {"apply_chat_template": False, "system_instruction": None,
                                                "fewshot_as_multiturn": False}
    # As lm-eval's CLI: a chat template turns few-shot turns on unless told otherwise.
    a = parse(["--checkpoint", ck, "--tasks", "x", "--apply-chat-template", "--system-instruction", "Be brief."])
    assert a.apply_chat_template is True
    assert suite.chat_options(a).resolved() == {"apply_chat_template": True, "system_instruction": "Be brief.",
                                                "fewshot_as_multiturn": True}
    a = parse(["--checkpoint", ck, "--tasks", "x", "--apply-chat-template", "olmo3-think", "--no-fewshot-as-multiturn"])
    assert a.apply_chat_template == "olmo3-think"
    assert suite.chat_options(a).resolved()["fewshot_as_multiturn"] is False
    # The post-training suite is in chat format without being told.
    a = parse(["--checkpoint", ck, "--suite", "olmo3-adapt"])
    assert suite.chat_options(a).apply_chat_template and suite.chosen_suite(a).max_gen_toks
    assert not suite.chat_options(parse(["--checkpoint", ck])).apply_chat_template
    bad = {("--fewshot-as-multiturn",): "--fewshot-as-multiturn needs --apply-chat-template",
           ("--apply-chat-template", "no/such/template.jinja"): "--apply-chat-template no/such",
           ("--think-end-token", ""): "--think-end-token",
           ("--log-samples",): "--log-samples"}
    for extra, msg in bad.items():
        with pytest.raises(ConfigError, match=msg):
            suite.check_args(parse(["--checkpoint", ck, "--tasks", "x", *extra]))


def test_instruction_checks() -> None:
    import importlib.util
    spec = importlib.util.spec_from_file_location("chat_scoring", suite.LOCAL_TASKS_DIR / "chat_scoring.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    doc = {"instructions": ["no_comma", "lowercase", "max_words:3", "include:honey"]}
    assert m.instruction_results(doc, ["bees make honey"]) == {"prompt_level_strict_acc": 1,
                                                               "inst_level_strict_acc": [True] * 4}
    r = m.instruction_results(doc, ["Bees, sadly, make no honey today"])
    assert r == {"prompt_level_strict_acc": 0, "inst_level_strict_acc": [False, False, False, True]}
    assert m.agg_inst_level_acc([[True, False], [True]]) == pytest.approx(2 / 3)
    assert m.math_verify_results({"solution": "so $x = \\boxed{\\frac{3}{4}}$"}, ["x is 0.75"])["math_verify"] == 1
    assert m.math_verify_results({"solution": "$\\boxed{5}$"}, ["it is $\\boxed{6}$"])["math_verify"] == 0
    with pytest.raises(ValueError, match="unknown instruction"):
        m.instruction_results({"instructions": ["shout"]}, ["x"])


# --------------------------------------------------------------------------- olmax == lm-eval hf (slow)


def olmax_run(ckpt: Path, tmp: Path, tasks: list[str], extra: list[str], name: str = "olmax") -> dict:
    out = tmp / f"{name}_{tasks[0]}.json"
    args = parse(["--checkpoint", str(ckpt), "--include-path", str(suite.LOCAL_TASKS_DIR), "--tasks", ",".join(tasks),
                  "--max-length", str(MAX_LENGTH), "--batch-size", str(BATCH), "--out", str(out), "--log-samples",
                  "--json", *extra])
    assert args.func(args) == 0
    return json.loads(out.read_text())


def hf_run(export: Path, tasks: list[str], model_args: dict | None = None, **chat: object) -> dict:
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    hf = HFLM(pretrained=str(export), dtype="float32", max_length=MAX_LENGTH, batch_size=BATCH, device="cpu",
              **(model_args or {}))
    tm = TaskManager(include_path=str(suite.LOCAL_TASKS_DIR), include_defaults=False)
    return lm_eval.simple_evaluate(model=hf, tasks=tasks, task_manager=tm, bootstrap_iters=0, apply_chat_template=True,
                                   **chat)


def pairs(hf: dict, ox: dict, task: str) -> list[tuple[dict, dict]]:
    a = sorted(hf["samples"][task], key=lambda s: s["doc_id"])
    b = sorted(ox["samples"][task], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in a] == [s["doc_id"] for s in b] and a
    for x, y in zip(a, b):
        # Same prompts: JSON turns the argument tuples into lists.
        assert json.loads(json.dumps(x["arguments"], default=str)) == y["arguments"]
    return list(zip(a, b))


@pytest.mark.integration
def test_chat_generation_matches_lm_eval_hf(checkpoint: tuple[Path, Path], tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    ckpt, export = checkpoint
    ox = olmax_run(ckpt, tmp_path, GEN_TASKS, ["--apply-chat-template", "--system-instruction", SYSTEM])
    assert "has no chat template" not in capsys.readouterr().err  # the checkpoint ships one
    hf = hf_run(export, GEN_TASKS, system_instruction=SYSTEM, fewshot_as_multiturn=True)
    assert ox["apply_chat_template"] and ox["fewshot_as_multiturn"] and ox["system_instruction"] == SYSTEM
    for task in GEN_TASKS:
        ps = pairs(hf, ox, task)
        for a, b in ps:
            prompt = b["arguments"][0][0]
            # olmax_chat_math prefills the reply (gen_prefix): the assistant turn is left open after it.
            opening = "<|im_start|>assistant\n" + ("Solution:" if task == "olmax_chat_math" else "")
            assert prompt.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n") and prompt.endswith(opening), prompt
            assert a["resps"] == b["resps"], (task, a["doc_id"])
            assert a["filtered_resps"] == b["filtered_resps"]
            for k in a:
                if k not in ("doc", "arguments", "resps", "filtered_resps", "doc_hash", "prompt_hash",
                             "target_hash", "target", "doc_id", "filter", "metrics"):
                    assert a[k] == b[k], (task, a["doc_id"], k)
        # Not trivially equal: the model wrote something for most prompts.
        assert sum(bool(b["resps"][0][0].strip()) for _, b in ps) >= len(ps) // 2, (task, [b["resps"] for _, b in ps])
        for k, v in hf["results"][task].items():
            if isinstance(v, (int, float)) and "_stderr" not in k:
                assert ox["results"][task][k] == v, (task, k)
    # Few-shot examples are turns of the conversation (3 user turns: two shots and the question).
    gsm = pairs(hf, ox, "olmax_chat_gsm")[0][1]["arguments"][0][0]
    assert gsm.count("<|im_start|>user\n") == 3 and gsm.count("<|im_start|>assistant\n") == 3
    # The scores are not all trivial: some instruction checks hold on a random model's answers.
    assert 0 < ox["results"]["olmax_chat_if"]["inst_level_strict_acc,none"] < 1
    print({t: ox["tasks"][t] for t in GEN_TASKS})


@pytest.mark.integration
def test_chat_loglikelihood_matches_lm_eval_hf(checkpoint: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, export = checkpoint
    ox = olmax_run(ckpt, tmp_path, ["olmax_mc"], ["--apply-chat-template", "--no-fewshot-as-multiturn"])
    hf = hf_run(export, ["olmax_mc"], fewshot_as_multiturn=False)
    worst = 0.0
    for a, b in pairs(hf, ox, "olmax_mc"):
        ctx = b["arguments"][0][0]
        # Default system message, both shots in the one user turn, then the open assistant turn.
        assert ctx.startswith("<|im_start|>system\nYou are a helpful function-calling AI assistant.")
        assert ctx.count("<|im_start|>user\n") == 1 and ctx.endswith("<|im_start|>assistant\n")
        for (ll_a, g_a), (ll_b, g_b) in zip([r[0] for r in a["resps"]], [r[0] for r in b["resps"]]):
            worst = max(worst, abs(ll_a - ll_b))
            assert abs(ll_a - ll_b) <= LL_TOL, (a["doc_id"], ll_a, ll_b)
            assert g_a == g_b
        assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"])
    for k in ("acc,none", "acc_norm,none"):
        assert ox["results"]["olmax_mc"][k] == hf["results"]["olmax_mc"][k]
    print(f"olmax_mc (chat): max |delta loglikelihood| {worst:.2e}")


@pytest.mark.integration
def test_builtin_template_when_checkpoint_has_none(checkpoint: tuple[Path, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    """A checkpoint without a chat template is prompted with OLMo 3 Instruct's built-in one (the
    same text as its jinja template), and the command says so."""
    ckpt, _ = checkpoint
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ckpt.iterdir():
        if f.name != "chat_template.jinja":
            (bare / f.name).symlink_to(f)
    ox = olmax_run(bare, tmp_path, ["olmax_chat_if"], ["--apply-chat-template", "--limit", "2"])
    assert "has no chat template" in capsys.readouterr().err
    assert ox["chat_template"] == "olmo3"
    with_jinja = olmax_run(ckpt, tmp_path, ["olmax_chat_if"], ["--apply-chat-template", "--limit", "2"], name="jinja")
    assert [s["arguments"] for s in ox["samples"]["olmax_chat_if"]] == [
        s["arguments"] for s in with_jinja["samples"]["olmax_chat_if"]]
    assert [s["resps"] for s in ox["samples"]["olmax_chat_if"]] == [
        s["resps"] for s in with_jinja["samples"]["olmax_chat_if"]]


def test_unsafe_tasks_are_found_in_groups() -> None:
    from types import SimpleNamespace as NS
    safe, unsafe = NS(task_name="gsm", UNSAFE_CODE=False), NS(task_name="humaneval_plus", UNSAFE_CODE=True)
    group = NS(get_all_tasks=lambda: [safe, unsafe])
    assert suite.unsafe_tasks([("g", None, [group]), ("gsm", 0, [safe])]) == ["humaneval_plus"]
    assert suite.unsafe_tasks([("gsm", 0, [safe])]) == []


def test_filtered_metrics_keep_their_filter() -> None:
    r = {"t": {"exact_match,strict-match": 0.5, "exact_match,flexible-extract": 0.75, "exact_match_stderr,strict-match":
               0.1, "acc,none": 0.25, "alias": "t"}}
    assert suite.summarize(r, ["t"])["tasks"]["t"] == {"exact_match,strict-match": 0.5,
                                                       "exact_match,flexible-extract": 0.75, "acc": 0.25}


@pytest.mark.integration
def test_adapt_suite_tasks_are_lm_evals() -> None:
    """Every task of the post-training suite is in lm-eval's registry (the index the suite command builds)."""
    known = set(suite.task_manager((str(suite.LOCAL_TASKS_DIR),)).all_tasks)
    missing = [n for n, _ in suite.SUITES["olmo3-adapt"].tasks if n not in known]
    assert not missing, missing
    assert suite.SUITES["olmo3-adapt"].chat and not suite.SUITES["olmo3"].chat


@pytest.mark.integration
def test_think_end_token_and_max_gen_toks_match_lm_eval_hf(checkpoint: tuple[Path, Path], tmp_path: Path) -> None:
    """--think-end-token and --max-gen-toks as lm-eval's hf model arg and --gen_kwargs: a reasoning
    model's answer is what follows the marker (here "e", which random text is full of)."""
    ckpt, export = checkpoint
    tasks = ["olmax_chat_if", "olmax_chat_gsm"]
    ox = olmax_run(ckpt, tmp_path, tasks, ["--apply-chat-template", "--think-end-token", "e", "--max-gen-toks", "12"])
    hf = hf_run(export, tasks, model_args={"think_end_token": "e"}, fewshot_as_multiturn=True,
                gen_kwargs={"max_gen_toks": 12})
    plain = olmax_run(ckpt, tmp_path, tasks, ["--apply-chat-template", "--max-gen-toks", "12"], name="plain")
    cut = 0
    for task in tasks:
        for (a, b), (_, c) in zip(pairs(hf, ox, task), pairs(hf, plain, task)):
            assert a["arguments"][0][1]["max_gen_toks"] == 12 == b["arguments"][0][1]["max_gen_toks"]
            assert a["resps"] == b["resps"] and a["filtered_resps"] == b["filtered_resps"]
            full, answer = c["resps"][0][0], b["resps"][0][0]
            if "e" in full:
                cut += 1
                assert answer == full.split("e")[-1].lstrip()
    assert cut > 0


@pytest.mark.integration
def test_template_refusing_system_role_retries_without_it(checkpoint: tuple[Path, Path], tmp_path: Path) -> None:
    """As lm-eval's hf model: a jinja template that raises on a system message is rendered again
    without the system messages."""
    from lm_eval.models.huggingface import HFLM

    from olmax.eval.lm_eval_adapter import OlmaxLM
    ckpt, export = checkpoint
    tok = tmp_path / "tok"
    tok.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (ckpt / f).is_file():
            (tok / f).write_bytes((ckpt / f).read_bytes())
    (tok / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    ox = OlmaxLM(str(ckpt), tokenizer=str(tok), batch_size=BATCH, max_length=MAX_LENGTH)
    hf = HFLM(pretrained=str(export), tokenizer=str(tok), batch_size=BATCH, max_length=MAX_LENGTH, device="cpu")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What do bees make?"}]
    assert ox.apply_chat_template(msgs) == hf.apply_chat_template(msgs) == (
        "<|im_start|>user\nWhat do bees make?<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ConfigError, match="System role"):
        ox.chat.render(msgs, True)


def test_code_running_tasks_need_consent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite indexes olmax's own task YAMLs, and stops before loading weights when a task would
    run model-written code without --confirm-run-unsafe-code (which also lets HF evaluate's
    code_eval load)."""
    from types import SimpleNamespace as NS
    (tmp_path / "tokenizer.json").write_text("{}")
    seen: dict = {}

    def fake_load(entries: list, tm: object) -> list:
        seen["include"], seen["env"] = tm, os.environ.get("HF_ALLOW_CODE_EVAL")
        return [(n, s, [NS(task_name=n, UNSAFE_CODE=n == "olmax_humaneval_plus_instruct")]) for n, s in entries]

    # setenv first records the variable's original state, so the command's own setting is undone too.
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "0")
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL")
    monkeypatch.setattr(suite, "task_manager", lambda include: include)
    monkeypatch.setattr(suite, "load_tasks", fake_load)
    with pytest.raises(ConfigError, match="olmax_humaneval_plus_instruct execute.*--confirm-run-unsafe-code"):
        suite.cmd_lm_eval(parse(["--checkpoint", str(tmp_path), "--suite", "olmo3-adapt"]))
    assert str(suite.LOCAL_TASKS_DIR) in seen["include"] and seen["env"] is None

    def no_model(**kw: object) -> None:
        raise RuntimeError("model loads")

    import olmax.eval.lm_eval_adapter as adapter
    monkeypatch.setattr(adapter, "OlmaxLM", no_model)
    with pytest.raises(RuntimeError, match="model loads"):  # past the consent check
        suite.cmd_lm_eval(parse(["--checkpoint", str(tmp_path), "--suite", "olmo3-adapt",
                                 "--confirm-run-unsafe-code"]))
    assert seen["env"] == "1"
