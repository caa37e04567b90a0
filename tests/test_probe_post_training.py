"""A probe of post-training, generation and chat as a new user meets them: bad settings, bad files
and bad interactive input, each through ``olmax.cli.main`` (or the chat loop) in-process.

Every case must end in the error contract: exit status 2 with an error that names the culprit (the
field, flag, file or line). None may end in a traceback, and none may exit 0 on nonsense. ``python
tests/test_probe_post_training.py`` prints the counts as JSON (what the closing note of a change
reports); the parametrised ``test_probe`` asserts each case. Training to a broken state (a run whose
last step is non-finite, a run that trains on nothing) is the integration tests at the end.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

from olmax import cli  # noqa: E402
from olmax.data import chat  # noqa: E402
from olmax.infer.chat import run_chat  # noqa: E402
from trainlib import small_overrides, write_corpus  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "fast", "blue", "sky", "is", "and", "we", "see"]
# A system turn far longer than 8 tokens: at data.sequence_length=8 every example is cut to its prompt.
SYSTEM = " ".join(WORDS * 3)


# --------------------------------------------------------------------------- the files the cases read


def train_tokenizer(folder: Path):
    """A byte-level BPE of 300 tokens with ChatML's special tokens, saved as ``folder/tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    rnd = random.Random(0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(rnd.choices(WORDS, k=10)) + "." for _ in range(300)],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return tok


def build_files(root: Path) -> dict[str, str]:
    """The tokenizer, chat and preference data, RL prompt files and bad files of the probe, in ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(0)
    tok_dir = root / "tok"
    tok = train_tokenizer(tok_dir)
    f = {"tok": str(tok_dir / "tokenizer.json"), "tokdir": str(tok_dir), "root": str(root)}

    def conv(i: int) -> list[dict]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": " ".join(rnd.choices(WORDS, k=4))},
                {"role": "assistant", "content": WORDS[i % len(WORDS)]}]

    def jsonl(name: str, recs: list) -> str:
        p = root / name
        p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))
        return str(p)

    convs = [{"messages": conv(i)} for i in range(40)]
    f["convs"] = jsonl("convs.jsonl", convs)
    chat.tokenize_chat([f["convs"]], root / "sft", tokenizer=f["tok"], progress=False)
    f["sft"] = str(root / "sft")
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "what is blue"}]
    pairs = [{"prompt": prompt, "chosen": "the sky", "rejected": f"{WORDS[i % 15]} {WORDS[(i + 3) % 15]}"}
             for i in range(16)]
    f["pairs_jsonl"] = jsonl("pairs.jsonl", pairs)
    chat.tokenize_chat([f["pairs_jsonl"]], root / "pairs", tokenizer=f["tok"], preference=True, progress=False)
    f["pairs"] = str(root / "pairs")
    same = {"prompt": "hi", "chosen": "the sky", "rejected": "the sky"}
    f["same_jsonl"] = jsonl("same.jsonl", [pairs[0], same, pairs[1]])
    f["same_only_jsonl"] = jsonl("same_only.jsonl", [same])
    ids, mask = chat.encode_conversation(prompt + [{"role": "assistant", "content": "the sky"}],
                                         tok, eos_token_id=0)
    other, omask = chat.encode_conversation(prompt + [{"role": "assistant", "content": "a dog"}], tok, eos_token_id=0)
    chat.write_pairs(root / "same_pairs", [(other, omask, ids, mask), (ids, mask, ids, mask)])
    f["same_pairs"] = str(root / "same_pairs")
    f["mismatch_jsonl"] = jsonl("mismatch.jsonl", [
        {"chosen": [{"role": "user", "content": "alpha"}, {"role": "assistant", "content": "x"}],
         "rejected": [{"role": "user", "content": "omega"}, {"role": "assistant", "content": "y"}]}])
    f["mismatch_len_jsonl"] = jsonl("mismatch_len.jsonl", [
        {"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}],
         "rejected": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                      {"role": "assistant", "content": "y"}]}])
    f["nochosen_jsonl"] = jsonl("nochosen.jsonl", [{"prompt": "hi", "rejected": "no"}])
    f["notjson_jsonl"] = jsonl("notjson.jsonl", ["{\"messages\": ["])
    f["nomessages_jsonl"] = jsonl("nomessages.jsonl", [{"text": "hello"}])
    f["badrole_jsonl"] = jsonl("badrole.jsonl", [{"messages": [{"role": "wizard", "content": "x"},
                                                               {"role": "assistant", "content": "y"}]}])
    f["noassistant_jsonl"] = jsonl("noassistant.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    f["empty_jsonl"] = jsonl("empty.jsonl", [])
    (root / "empty.jsonl").write_text("")
    f["blank_prompts"] = jsonl("blank_prompts.jsonl", ["", "   "])
    f["long_prompts"] = jsonl("long_prompts.jsonl", [{"prompt": " ".join(WORDS * 20), "ground_truth": "a"}])
    f["nogold_prompts"] = jsonl("nogold_prompts.jsonl", [{"prompt": "the cat"}])
    f["notjson_prompts"] = jsonl("notjson_prompts.jsonl", ["[1, 2"])
    f["list_prompts"] = jsonl("list_prompts.jsonl", [[1, 2, 3]])
    f["emptyprompt_prompts"] = jsonl("emptyprompt_prompts.jsonl", [{"prompt": "", "ground_truth": "a"}])
    f["goldtype_prompts"] = jsonl("goldtype_prompts.jsonl", [{"prompt": "the cat", "ground_truth": {"a": 1}}])
    f["ok_prompts"] = jsonl("ok_prompts.jsonl", [{"prompt": "the cat sat", "ground_truth": "a"}] * 4)
    f["ok_ids"] = jsonl("ok_ids.jsonl", [[1, 2, 3]])
    f["bad_ids"] = jsonl("bad_ids.jsonl", [[1, 2], [3, "x"]])
    f["float_ids"] = jsonl("float_ids.jsonl", [[1.5, 2]])
    f["empty_ids"] = jsonl("empty_ids.jsonl", [[]])
    f["notjson_ids"] = jsonl("notjson_ids.jsonl", ["[1, 2"])
    f["text_prompts_bad"] = jsonl("text_prompts_bad.jsonl", [{"messages": "hello"}])
    f["text_prompts_num"] = jsonl("text_prompts_num.jsonl", ["42"])
    f["notutf8"] = str(root / "notutf8.jsonl")
    Path(f["notutf8"]).write_bytes(b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}\n')
    f["missing"] = str(root / "missing.jsonl")
    f["nodir"] = str(root / "no_such_dir")
    f["corpus"] = ",".join(write_corpus(root / "corpus", n_files=1, tokens_per_file=2000))
    return f


# --------------------------------------------------------------------------- the cases


def _train(recipe: str, culprit: str, *sets: str) -> tuple[list[str], str]:
    argv = ["train", recipe, "--run-dir", "{root}/runs/{n}", "--no-progress"]
    for s in sets:
        argv += ["--set", s]
    return argv, culprit


TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
        "model.mlp_hidden=64", "model.vocab_size=384", "model.padded_vocab_size=384"]
SFT = ["data.paths={sft}", "train.epochs=null", "train.steps=2", "data.dtype=uint16", *TINY]
DPO = ["data.preference_path={pairs}", "train.steps=2", "train.global_batch_size=4", *TINY]
RL = ["rl.tokenizer={tokdir}", "rl.prompts_path={ok_prompts}", "rl.reward=operator:contains", "train.steps=2",
      "rl.group_size=2", "rl.prompts_per_step=2", "train.global_batch_size=4", "rl.max_response_length=4",
      "data.sequence_length=32", "rl.max_prompt_length=24", *TINY]


def config_cases() -> list[tuple[list[str], str]]:
    """Post-training fields with values no run can use, through ``olmax print-config`` (the
    validation every training command runs first)."""
    fields = {
        "tiny_rl": {"rl.temperature": ["0", "-1", "1e9", "101", ".nan", ".inf"], "rl.top_p": ["0", "1.5", ".nan"],
                    "rl.group_size": ["0", "-1"], "rl.prompts_per_step": ["0"], "rl.max_prompt_length": ["0"],
                    "rl.max_response_length": ["0"], "rl.num_mini_batches": ["0"], "rl.num_epochs": ["0"],
                    "rl.clip_low": ["-1", "1"], "rl.clip_high": ["-1"], "rl.max_sampling_rounds": ["0"],
                    "rl.generation_batch": ["0"]},
        "tiny_dpo": {"dpo.beta": ["0", "-1", ".nan", ".inf"], "dpo.label_smoothing": ["-1", "1", ".nan"],
                     "dpo.loss": ["bogus"], "data.sequence_length": ["0", "-1"]},
        "tiny_sft": {"data.sequence_length": ["0", "-1"], "data.packing": ["bogus"],
                     "data.long_doc_strategy": ["bogus"], "train.epochs": ["0", "-1"], "optim.lr": ["-1", ".nan"]},
    }
    return [(["print-config", recipe, "--set", f"{k}={v}"], k)
            for recipe, fs in fields.items() for k, vs in fs.items() for v in vs]


def sampling_cases() -> list[tuple[list[str], str]]:
    """``olmax generate`` / ``olmax chat`` flags with nonsense values (refused before any weights load)."""
    out = []
    for cmd in ("generate", "chat"):
        base = [cmd, "--checkpoint", "{nodir}"] + (["--prompt", "hi"] if cmd == "generate" else [])
        for v in ("-1", "1e9", "101", "nan", "inf", "-inf", "hot"):
            out.append((base + ["--temperature", v], "--temperature"))
        for v in ("0", "1.5", "-0.1", "nan"):
            out.append((base + ["--temperature", "1", "--top-p", v], "--top-p"))
        for v in ("0", "-3", "x"):
            out.append((base + ["--temperature", "1", "--top-k", v], "--top-k"))
        out.append((base + ["--top-p", "0.9"], "--temperature"))
        out.append((base + ["--top-k", "5"], "--temperature"))
        out.append((base + ["--stop", ""], "--stop"))
        out.append((base + ["--stop", "x", ""], "--stop"))
        for v in ("0", "-1", "many"):
            out.append((base + ["--max-new-tokens", v], "--max-new-tokens"))
        for v in ("-1", str(2**32), "x"):
            out.append((base + ["--seed", v], "--seed"))
        out.append((base + ["--dtype", "float8"], "--dtype"))
        out.append((base, "does not exist"))
        out.append(([cmd, "--checkpoint", "hf:{nodir}"] + base[3:], "does not exist"))
        out.append((base[:3] + ["--tokenizer", "{missing}"] + base[3:], "does not exist"))
    return out


def generate_input_cases() -> list[tuple[list[str], str]]:
    g = ["generate", "--checkpoint", "{nodir}"]
    return [
        (g + ["--prompt-ids", "{bad_ids}"], "line 2"),
        (g + ["--prompt-ids", "{float_ids}"], "line 1"),
        (g + ["--prompt-ids", "{empty_ids}"], "line 1"),
        (g + ["--prompt-ids", "{notjson_ids}"], "not valid JSON"),
        (g + ["--prompt-ids", "{missing}"], "missing.jsonl"),
        (g + ["--prompt-ids", "{empty_jsonl}"], "no prompts"),
        (g + ["--prompts", "{empty_jsonl}"], "no prompts"),
        (g + ["--prompts", "{text_prompts_bad}"], "line 1"),
        (g + ["--prompts", "{text_prompts_num}"], "line 1"),
        (g + ["--prompts", "{missing}"], "missing.jsonl"),
        (g + ["--prompt-ids", "{ok_ids}", "--chat"], "--chat"),
        (g + ["--prompt-ids", "{ok_ids}", "--system", "S"], "--system"),
        (g + ["--prompt", "hi", "--system", "S"], "--chat"),
        (g + ["--prompt", "hi", "--batch-size", "0"], "--batch-size"),
        (g + ["--prompt", "hi", "--prompt-ids", "{ok_ids}"], "--prompt-ids"),
    ]


def tokenize_cases() -> list[tuple[list[str], str]]:
    t = ["tokenize", "--chat", "--tokenizer", "{tok}", "--no-progress", "--processes", "1", "--out"]
    return [
        (t + ["{root}/out/{n}", "--preference", "{same_jsonl}"], "same.jsonl:2"),
        (t + ["{root}/out/{n}", "--preference", "{same_jsonl}"], "same conversation"),
        (t + ["{root}/out/{n}", "--preference", "--skip-bad", "{same_only_jsonl}"], "identical_pair"),
        (t + ["{root}/out/{n}", "--preference", "{mismatch_jsonl}"], "'alpha'"),
        (t + ["{root}/out/{n}", "--preference", "{mismatch_len_jsonl}"], "rejected has system 's'"),
        (t + ["{root}/out/{n}", "--preference", "{nochosen_jsonl}"], "chosen"),
        (t + ["{root}/out/{n}", "{notjson_jsonl}"], "not valid JSON"),
        (t + ["{root}/out/{n}", "{nomessages_jsonl}"], "messages"),
        (t + ["{root}/out/{n}", "{badrole_jsonl}"], "wizard"),
        (t + ["{root}/out/{n}", "{noassistant_jsonl}"], "noassistant.jsonl:1"),
        (t + ["{root}/out/{n}", "{empty_jsonl}"], "empty.jsonl"),
        (t + ["{root}/out/{n}", "{notutf8}"], "UTF-8"),
        (t + ["{root}/out/{n}", "{missing}"], "missing.jsonl"),
        (t + ["{root}/out/{n}", "--max-length", "0", "{convs}"], "--max-length"),
        (t + ["{sft}", "{convs}"], "sft"),  # an existing output is never overwritten
        (["tokenize", "--chat", "--tokenizer", "{missing}", "--out", "{root}/out/{n}", "{convs}"], "missing.jsonl"),
        (["tokenize", "--preference", "--tokenizer", "{tok}", "--out", "{root}/out/{n}", "{convs}"], "--chat"),
        (["tokenize", "--chat", "--train-bpe", "300", "--out", "{root}/out/{n}", "{convs}"], "--tokenizer"),
    ]


def training_cases() -> list[tuple[list[str], str]]:
    """Post-training runs that would train on nothing or on bad files: refused before compiling."""
    return [
        _train("tiny_sft", "data.sequence_length", *SFT, "data.sequence_length=8"),
        _train("tiny_sft", "data.paths", *SFT[1:], "data.paths={nodir}"),
        _train("tiny_dpo", "data.sequence_length", *DPO, "data.sequence_length=8"),
        _train("tiny_dpo", "identical chosen and rejected", *DPO[1:], "data.preference_path={same_pairs}"),
        _train("tiny_dpo", "data.preference_path", *DPO[1:]),
        _train("tiny_dpo", "data.preference_path", *DPO[1:], "data.preference_path={nodir}"),
        _train("tiny_dpo", "data.preference_path", *DPO[1:], "data.preference_path={sft}"),
        _train("tiny_dpo", "train.global_batch_size", *DPO[:-len(TINY)], "train.global_batch_size=64", *TINY),
        _train("tiny_rl", "holds no prompt", *RL, "rl.prompts_path={blank_prompts}"),
        _train("tiny_rl", "rl.max_prompt_length", *RL, "rl.prompts_path={long_prompts}"),
        _train("tiny_rl", "ground_truth", *RL, "rl.prompts_path={nogold_prompts}"),
        _train("tiny_rl", "not JSON", *RL, "rl.prompts_path={notjson_prompts}"),
        _train("tiny_rl", "list_prompts", *RL, "rl.prompts_path={list_prompts}"),
        _train("tiny_rl", "empty", *RL, "rl.prompts_path={emptyprompt_prompts}"),
        _train("tiny_rl", "ground_truth", *RL, "rl.prompts_path={goldtype_prompts}"),
        _train("tiny_rl", "missing.jsonl", *RL, "rl.prompts_path={missing}"),
        _train("tiny_rl", "rl.tokenizer", *RL, "rl.tokenizer={nodir}"),
        _train("tiny_rl", "rl.reward", *RL, "rl.reward=bogus"),
        _train("tiny", "train.init_from", *small_overrides(["{corpus}"]), "train.init_from=state:{nodir}"),
        _train("tiny", "train.init_from", *small_overrides(["{corpus}"]), "train.init_from=weird:{nodir}"),
    ]


def all_cases() -> list[tuple[list[str], str]]:
    return config_cases() + sampling_cases() + generate_input_cases() + tokenize_cases() + training_cases()


# --------------------------------------------------------------------------- running a case


def fill(argv: list[str], files: dict[str, str], n: int) -> list[str]:
    return [a.format(n=n, **files) for a in argv]


def call(argv: list[str]) -> tuple[object, str, str]:
    """``(exit status or "traceback ...", stdout, stderr)`` of ``olmax ARGV`` in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc: object = cli.main(argv)
        except SystemExit as e:
            rc = e.code
        except BaseException as e:  # noqa: BLE001 - a traceback is what the probe counts
            import traceback
            traceback.print_exc(file=err)
            rc = f"traceback {type(e).__name__}"
    return rc, out.getvalue(), err.getvalue()


def judge(rc: object, err: str, culprit: str) -> str:
    """``clear`` (exit 2, one error line naming the culprit), ``traceback``, ``exit0`` (nonsense
    accepted) or ``unclear`` (anything else)."""
    if isinstance(rc, str) or "Traceback" in err:
        return "traceback"
    if rc == 0:
        return "exit0"
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    if rc == 2 and len(lines) == 1 and culprit in lines[0]:
        return "clear"
    return "unclear"


def chat_cases() -> list[tuple[str, bytes, list[str]]]:
    """Interactive input to ``olmax chat`` (name, stdin bytes, what stderr must say): each bad
    line is refused for its turn and the session goes on to answer the next one."""
    long = (" ".join(WORDS) + " ") * 20
    return [
        ("invalid UTF-8 line", b"\xff\xfe hello\nthe cat\n", ["not valid UTF-8"]),
        ("truncated UTF-8 sequence", b"caf\xc3\nthe cat\n", ["not valid UTF-8"]),
        ("lone surrogate bytes", b"\xed\xa0\x80\nthe cat\n", ["not valid UTF-8"]),
        ("message longer than the context", long.encode() + b"\nthe cat\n", ["leave room for at most", "refused"]),
        ("long message after a turn", b"the cat\n" + long.encode() + b"\nthe dog\n", ["refused"]),
        ("unknown command", b"/frobnicate\nthe cat\n", ["unknown command /frobnicate"]),
        ("NUL and control bytes", b"\x00\x01\x02\nthe cat\n", []),
    ]


class _Codec:
    """A whitespace 'tokenizer' with a chat template: one token per word, 2 per message."""

    template_source = "a test template"

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return [1] * sum(2 + len(m["content"].split()) for m in messages)

    def token_id(self, text: str) -> None:
        return None


class _Model:
    """What ``run_chat`` asks of a loaded checkpoint, without weights: a 64-position model that
    replies "ok"."""

    def __init__(self) -> None:
        self.checkpoint = "stub"
        self.codec = _Codec()
        self.cfg = SimpleNamespace(model=SimpleNamespace(max_position_embeddings=64))
        self.turns: list[list[int]] = []

    def generate(self, prompts: list[list[int]], **kw) -> list[dict]:
        self.turns.append(prompts[0])
        kw["stream"].write("ok")
        return [{"text": "ok", "token_ids": [5], "finish_reason": "stop"}]


def run_chat_case(stdin: bytes) -> tuple[object, str, str, int]:
    """``(exit status or "traceback ...", stdout, stderr, replies)`` of a chat over ``stdin``."""
    model = _Model()
    raw = io.BytesIO(stdin)
    text_in = io.TextIOWrapper(raw, encoding="utf-8", errors="surrogateescape")
    out, err = io.StringIO(), io.StringIO()
    try:
        rc: object = run_chat(model, max_new_tokens=8, stdin=text_in, stdout=out, stderr=err)
    except BaseException as e:  # noqa: BLE001
        rc = f"traceback {type(e).__name__}: {e}"
    return rc, out.getvalue(), err.getvalue(), len(model.turns)


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return build_files(tmp_path_factory.mktemp("probe"))


CASES = all_cases()


@pytest.mark.integration
@pytest.mark.parametrize("i", range(len(CASES)), ids=[" ".join(c[0][:4]) + f" [{c[1]}]" for c in CASES])
def test_probe(i: int, files: dict[str, str]) -> None:
    argv, culprit = CASES[i]
    rc, out, err = call(fill(argv, files, i))
    assert judge(rc, err, culprit.format(**files)) == "clear", (argv, rc, err[-2000:])


@pytest.mark.parametrize("name,stdin,says", chat_cases(), ids=[c[0] for c in chat_cases()])
def test_chat_refuses_a_turn_and_goes_on(name: str, stdin: bytes, says: list[str]) -> None:
    rc, out, err, replies = run_chat_case(stdin)
    assert rc == 0 and "Traceback" not in err, (rc, err)
    assert all(s in err for s in says), err
    assert replies >= 1 and out.count("ok") == replies  # the session answered the good lines after the bad one


# A few fast cases of the unit tier (the probe above is the integration tier's).
FAST = [(["print-config", "tiny_rl", "--set", "rl.temperature=1e9"], "rl.temperature"),
        (["generate", "--checkpoint", "{nodir}", "--prompt", "hi", "--temperature", "1e9"], "--temperature"),
        (["chat", "--checkpoint", "{nodir}", "--stop", ""], "--stop"),
        (["generate", "--checkpoint", "{nodir}", "--prompt-ids", "{bad_ids}"], "line 2")]


@pytest.mark.parametrize("argv,culprit", FAST, ids=[c[1] for c in FAST])
def test_fast_probe_cases(argv: list[str], culprit: str, tmp_path: Path) -> None:
    f = {"nodir": str(tmp_path / "none"), "bad_ids": str(tmp_path / "bad.jsonl")}
    Path(f["bad_ids"]).write_text("[1, 2]\n[3, \"x\"]\n")
    rc, out, err = call(fill(argv, f, 0))
    assert judge(rc, err, culprit) == "clear", (rc, err)


def test_identical_and_mismatched_preference_records_are_refused_with_their_line(tmp_path: Path) -> None:
    same = {"prompt": "hi", "chosen": "yes", "rejected": "yes"}
    with pytest.raises(chat.ChatError, match="same conversation"):
        chat.preference_messages(same)
    other = {"chosen": [{"role": "user", "content": "alpha"}, {"role": "assistant", "content": "x"}],
             "rejected": [{"role": "user", "content": "omega"}, {"role": "assistant", "content": "y"}]}
    with pytest.raises(chat.ChatError, match=r"message 0 differs: chosen has user 'alpha', rejected has user 'omega'"):
        chat.preference_messages(other)


def test_pairs_that_teach_nothing_are_refused_before_training(tmp_path: Path) -> None:
    from olmax.config import ConfigError
    from olmax.objectives.dpo import PairSet, PreferenceDataError
    prompt, answer = [5, 6, 7, 8, 9, 10], [11, 12]
    ids, mask = prompt + answer, [False] * 6 + [True] * 2
    other = prompt + [13, 14, 15]
    omask = [False] * 7 + [True] * 2  # the chosen answer's first token is not trained
    chat.write_pairs(tmp_path / "same", [(other, omask, ids, mask), (ids, mask, ids, mask)])
    with pytest.raises(PreferenceDataError, match="pair 1 has identical chosen and rejected"):
        PairSet(tmp_path / "same", 16, 1)
    chat.write_pairs(tmp_path / "ok", [(other, omask, ids, mask)] * 3)
    assert PairSet(tmp_path / "ok", 16, 1).cut == 0
    assert PairSet(tmp_path / "ok", 7, 1).cut == 3  # 7 tokens: the rejected side trains 1, the chosen none
    with pytest.raises(ConfigError, match=r"data.sequence_length=6: every pair .* keeps no trained"):
        PairSet(tmp_path / "ok", 6, 1)


def test_tokenize_warns_about_conversations_no_sequence_holds(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    train_tokenizer(tmp_path)
    src = tmp_path / "c.jsonl"
    recs = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": c}]}
            for c in ("the cat", "zq" * 20_000, "a dog")]  # "zq": no merge, 2 tokens
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    chat.tokenize_chat([src], tmp_path / "a", tokenizer=tmp_path / "tokenizer.json", progress=False)
    err = capsys.readouterr().err
    assert "WARNING 1 conversations are longer than any recipe's sequence" in err and f"{src}:2" in err, err
    chat.tokenize_chat([src], tmp_path / "b", tokenizer=tmp_path / "tokenizer.json", max_length=200, progress=False)
    err = capsys.readouterr().err
    assert "WARNING 1 conversations were longer than --max-length 200" in err and f"{src}:2" in err, err


def test_tokenizer_is_found_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run trained from a project's root records relative data paths; its tokenizer is found from
    the run directory wherever the command runs, and a missing one says where olmax looked."""
    import hashlib

    from olmax.chat.codec import find_tokenizer, tokenizer_places
    from olmax.config import Config, DataConfig
    project = tmp_path / "project"
    data = project / "runs" / "demo" / "data" / "train"
    data.mkdir(parents=True)
    tok = data / "tokenizer.json"
    tok.write_text("{}")
    (data / "part-00000.npy").write_bytes(b"\0\0")
    (data / "manifest.json").write_text(json.dumps({"tokenizer": {"sha256": hashlib.sha256(b"{}").hexdigest()}}))
    cfg = Config(data=DataConfig(paths=("runs/demo/data/train/part-00000.npy",)))
    run = project / "runs" / "demo" / "run"
    (run / "checkpoints" / "4").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert find_tokenizer(str(run), cfg).resolve() == tok
    assert find_tokenizer(str(run / "checkpoints" / "4"), cfg).resolve() == tok
    monkeypatch.chdir(project)  # and from the project's root, as before
    assert find_tokenizer("runs/demo/run", cfg).resolve() == tok
    tok.unlink()
    places = tokenizer_places(str(run), cfg)
    assert str(run / "tokenizer.json") in places and "runs/demo/data/train/part-00000.npy" in places


def test_nonfinite_weights_are_never_loaded(tmp_path: Path) -> None:
    import jax.numpy as jnp

    from olmax.checkpoint.load import check_finite
    from olmax.config import ConfigError
    check_finite({"a": jnp.ones(3), "ids": jnp.arange(3)}, "checkpoint X")
    with pytest.raises(ConfigError, match=r"checkpoint X: parameter \['b'\] holds non-finite"):
        check_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.nan])}, "checkpoint X")


def test_help_text_for_every_flag() -> None:
    import argparse
    missing = []

    def walk(p: argparse.ArgumentParser, name: str) -> None:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for k, sp in a.choices.items():
                    walk(sp, f"{name} {k}")
            elif not isinstance(a, argparse._HelpAction) and not a.help:
                missing.append(f"{name} {'/'.join(a.option_strings) or a.dest}")
    walk(cli.build_parser(), "olmax")
    assert not missing, missing


# --------------------------------------------------------------------------- runs that end broken


def _run(argv: list[str]) -> tuple[object, str]:
    rc, _, err = call(argv)
    return rc, err


@pytest.mark.integration
def test_a_run_never_ends_on_a_nonfinite_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN at the last step of a 2-step run (shorter than the non-finite limit): exit 2, the
    message names the step and the cause, and no checkpoint of that state exists."""
    import jax
    import jax.numpy as jnp

    from olmax.objectives import accumulate as step_module
    real = step_module.apply_update

    def nan_at_2(params, grads, opt_state, loss, **kw):
        hit = opt_state.step + 1 == 2
        grads = jax.tree.map(lambda g: jnp.where(hit, jnp.nan, g), grads)
        return real(params, grads, opt_state, jnp.where(hit, jnp.nan, loss), **kw)
    monkeypatch.setattr(step_module, "apply_update", nan_at_2)
    corpus = write_corpus(tmp_path / "corpus", n_files=1)
    argv = ["train", "tiny", "--run-dir", str(tmp_path / "run"), "--no-progress"]
    for o in small_overrides(corpus, "train.steps=2", "checkpoint.interval=1"):
        argv += ["--set", o]
    rc, err = _run(argv)
    assert rc == 2 and "Traceback" not in err, err
    line = [ln for ln in err.splitlines() if ln.startswith("error:")][0]
    assert "step 2, the last of this run" in line and "optim.lr=" in line and "checkpoint 2 is not written" in line
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["1"]


@pytest.mark.integration
def test_rl_at_a_huge_learning_rate_ends_in_an_error_not_a_checkpoint(tmp_path: Path) -> None:
    """RL at optim.lr=1e9 for 2 steps (shorter than the non-finite limit): exit 2 naming step 2 and
    the learning rate (step 1's update breaks the policy; step 2's rollout refuses its non-finite
    logits, or its own non-finite update ends the run); no checkpoint for generate or chat to pick."""
    from trainlib import rl_overrides, write_rl_data
    data = write_rl_data(tmp_path / "data")
    argv = ["train", "tiny_rl", "--run-dir", str(tmp_path / "run"), "--no-progress"]
    for o in rl_overrides(data, "train.steps=2", "optim.lr=1e9", *TINY[:6]):
        argv += ["--set", o]
    rc, err = _run(argv)
    line = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and "Traceback" not in err and len(line) == 1, err
    assert ("step 2, the last of this run" in line[0] or "RL step 2: the policy's rollout" in line[0]), line
    assert "optim.lr=1000000000.0" in line[0], line
    assert not (tmp_path / "run" / "checkpoints").exists() or not os.listdir(tmp_path / "run" / "checkpoints")


@pytest.mark.integration
def test_sft_batches_without_trained_tokens_are_counted(tmp_path: Path, files: dict[str, str]) -> None:
    """Most conversations cut to their prompt: the run trains, and names the steps whose batch
    held no trained token (read here from the loader itself)."""
    from olmax.data.chat import tokenize_chat
    from olmax.data.loader import DataLoader
    from olmax.recipes import get_recipe
    mixed = tmp_path / "mixed.jsonl"
    short = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "the cat"}]}
    mixed.write_text(Path(files["convs"]).read_text() + "".join(json.dumps(short) + "\n" for _ in range(8)))
    tokenize_chat([mixed], tmp_path / "mixed", tokenizer=files["tok"], progress=False)
    sets = [f"data.paths={tmp_path / 'mixed'}", "train.epochs=null", "data.dtype=uint16",
            "data.sequence_length=32", "train.global_batch_size=2", *TINY]
    with DataLoader(get_recipe("tiny_sft", [*sets, "train.steps=12"])) as dl:
        empty = [s + 1 for s in range(12) if not dl.batch(s)["label_mask"][:, 1:].any()]
    # The run ends on a step that trains (a last step over no token is an error, tested above).
    steps = max(s for s in range(1, 13) if s not in empty)
    empty = [s for s in empty if s < steps]
    assert empty, "the data make both kinds of steps"
    sets.append(f"train.steps={steps}")
    argv = ["train", "tiny_sft", "--run-dir", str(tmp_path / "run"), "--no-progress"]
    for o in sets:
        argv += ["--set", o]
    rc, err = _run(argv)
    assert rc == 0 and "Traceback" not in err, err
    assert f"WARNING {len(empty)} of this run's {steps} steps held no trained token (steps " \
        f"{', '.join(map(str, empty))})" in err, (empty, err)
    for step in empty[:3]:
        assert f"WARNING step {step}: its batch holds no trained token" in err


if __name__ == "__main__":  # the counts of the probe
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        fs = build_files(Path(d))
        counts = {"cases": 0, "clear": 0, "tracebacks": 0, "exit0_on_nonsense": 0, "unclear": 0}
        bad = []
        for n, (argv, culprit) in enumerate(all_cases()):
            rc, out, err = call(fill(argv, fs, n))
            verdict = judge(rc, err, culprit.format(**fs))
            counts["cases"] += 1
            key = {"traceback": "tracebacks", "exit0": "exit0_on_nonsense"}.get(verdict, verdict)
            counts[key] += 1
            if verdict != "clear":
                bad.append(f"{verdict}: {' '.join(argv)} -> {rc}: {err.strip()[-300:]}")
        for name, stdin, says in chat_cases():
            rc, out, err, replies = run_chat_case(stdin)
            counts["cases"] += 1
            ok = rc == 0 and "Traceback" not in err and all(s in err for s in says) and replies >= 1
            counts["clear" if ok else ("tracebacks" if isinstance(rc, str) else "unclear")] += 1
            if not ok:
                bad.append(f"chat {name}: {rc} {err[-300:]}")
        print("\n".join(bad), file=sys.stderr)
        print(json.dumps(counts))
