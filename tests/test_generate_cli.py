"""``olmax generate`` and ``olmax chat`` end to end on tiny random OLMo 3 models (CPU).

Two checkpoints: a ``random_hf_model`` alone (token ids in, token ids out: ``--prompt-ids``
needs no tokenizer) and the same kind of model beside a byte-level BPE trained here with OLMo 3's
special tokens (``<|endoftext|>`` = EOS, ``<|pad|>``, ``<|im_start|>``, ``<|im_end|>``). The
commands run in-process through ``olmax.cli.main``; a persistent XLA compilation cache in a
temporary folder lets each command reuse the programs the previous ones compiled.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import re
import shutil
from pathlib import Path

import jax
import pytest

from olmax import cli
from olmax.chat import codec as chat_codec
from olmax.chat import template as chat_template
from olmax.compat.hf import random_hf_model
from olmax.config import Config, DataConfig
from olmax.infer.chat import run_chat
from olmax.infer.run import Model, first_stop, read_prompt_ids, read_prompts, unsafe_tail

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
MODEL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, sliding_window=16, rms_norm_eps=1e-6, bos_token_id=None)


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory: pytest.TempPathFactory):
    """Each command loads its own model and jits afresh; identical programs come from this cache."""
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    old = {k: getattr(jax.config, k) for k in keys}
    for k, v in zip(keys, (str(tmp_path_factory.mktemp("xla_cache")), 0, 0)):
        jax.config.update(k, v)
    yield
    for k, v in old.items():
        jax.config.update(k, v)


def _corpus() -> list[str]:
    rnd = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "fast", "blue", "sky", "is", "and", "we", "see",
             "hello", "world", "what", "color", "grass", "green", "answer", "question", "model", "token"]
    return [" ".join(rnd.choices(words, k=rnd.randint(4, 12))) + rnd.choice([".", "?", "!"]) for _ in range(400)]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    d = tmp_path_factory.mktemp("olmo3_with_tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    random_hf_model(d, seed=1, vocab_size=tok.get_vocab_size(), eos_token_id=0, pad_token_id=1, **MODEL)
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture(scope="module")
def ids_model(text_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same random model without its tokenizer (same shapes: the compiled programs are shared)."""
    d = tmp_path_factory.mktemp("random_olmo3") / "hf"
    shutil.copytree(text_model, d, ignore=shutil.ignore_patterns("tokenizer*"))
    return d


# A minimal ChatML template (no default system message), so chat prompts stay short.
JINJA = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_tokenizer(text_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("chat_tokenizer")
    (d / "tokenizer.json").write_bytes((text_model / "tokenizer.json").read_bytes())
    (d / "chat_template.jinja").write_text(JINJA)
    return d


def run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def jsonl(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


# --------------------------------------------------------------------------- token ids, no tokenizer


@pytest.mark.integration
def test_prompt_ids_on_a_random_model(ids_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from olmax.checkpoint.load import load_params
    from olmax.engine import generate
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [3]]
    f = tmp_path / "ids.jsonl"
    f.write_text("".join(json.dumps(p) + "\n" for p in prompts[:2]) + "\n" + json.dumps(prompts[2]) + "\n")
    rc, out, err = run(["generate", "--checkpoint", f"hf:{ids_model}", "--prompt-ids", str(f), "--max-new-tokens",
                        "12", "--json"], capsys)
    assert rc == 0, err
    res = jsonl(out)
    assert len(res) == 3
    for r in res:
        assert set(r) == {"token_ids", "logprobs", "finish_reason"}  # no tokenizer: no text
        assert len(r["token_ids"]) == len(r["logprobs"]) and all(lp <= 0 for lp in r["logprobs"])
        assert r["finish_reason"] in ("stop", "length")
        assert r["finish_reason"] == "stop" or len(r["token_ids"]) == 12
    # The same as the library call on the same weights, in prompt order (greedy, fp32).
    params, cfg = load_params(f"hf:{ids_model}")
    from dataclasses import replace
    m = replace(cfg.model, compute_dtype="float32")
    ref = generate(params, m, prompts, max_new_tokens=12, eos_ids=(0,))
    assert [r["token_ids"] for r in res] == [c.token_ids for c in ref]

    # Sampling: reproducible with a seed, and the same whatever the batch size.
    base = ["generate", "--checkpoint", f"hf:{ids_model}", "--prompt-ids", str(f), "--max-new-tokens", "12",
            "--json", "--temperature", "1.0", "--top-k", "20", "--seed", "3"]
    a = jsonl(run(base, capsys)[1])
    b = jsonl(run(base + ["--batch-size", "1"], capsys)[1])
    assert [r["token_ids"] for r in a] == [r["token_ids"] for r in b]
    # and whether the prompts are prefilled together or one per round trip (a 16-token bound)
    c = jsonl(run(base + ["--prefill-tokens", "16"], capsys)[1])
    assert [(r["token_ids"], r["logprobs"]) for r in a] == [(r["token_ids"], r["logprobs"]) for r in c]
    assert [r["token_ids"] for r in a] != [r["token_ids"] for r in res]
    # The static engine has no such bound: asking for one is an error, not silently ignored.
    rc, _, err = run(base + ["--batching", "static", "--prefill-tokens", "16"], capsys)
    assert rc == 2 and "--prefill-tokens bounds the continuous engine" in err

    # Without --json: one line of token ids per prompt.
    rc, out, _ = run(["generate", "--checkpoint", f"hf:{ids_model}", "--prompt-ids", str(f), "--max-new-tokens",
                      "12"], capsys)
    assert rc == 0 and " ".join(map(str, res[1]["token_ids"])) in out


# --------------------------------------------------------------------------- text, stop strings, streaming


def test_text_prompts_stop_strings_and_streaming(text_model: Path, capsys: pytest.CaptureFixture) -> None:
    ck = ["generate", "--checkpoint", f"hf:{text_model}", "--max-new-tokens", "24"]
    rc, out, err = run(ck + ["--prompt", "the cat sat", "hello world", "", "--json"], capsys)
    assert rc == 0, err
    full = jsonl(out)
    assert [set(r) for r in full] == [{"token_ids", "text", "logprobs", "finish_reason"}] * 3
    codec = chat_codec.TextCodec.load(text_model, _cfg(text_model))
    for r in full:
        assert r["text"] == codec.decode(r["token_ids"])
    text, ids = full[0]["text"], full[0]["token_ids"]
    assert len(text) > 12, text
    stop = text[6:9]
    cut = text.find(stop)

    # A single prompt streams to stdout; the stop string and everything after it never appear.
    rc, out, err = run(ck + ["--prompt", "the cat sat", "--stop", stop], capsys)
    assert rc == 0, err
    assert out == text[:cut] + "\n"
    assert "finish: stop" in err

    rc, out, _ = run(ck + ["--prompt", "the cat sat", "--stop", stop, "--json"], capsys)
    (r,) = jsonl(out)
    assert r["text"] == text[:cut] and r["finish_reason"] == "stop"
    assert r["token_ids"] == ids[:len(r["token_ids"])] and len(r["token_ids"]) < len(ids)
    assert stop in codec.decode(r["token_ids"]) and stop not in codec.decode(r["token_ids"][:-1])

    # Streamed text without a stop string is the whole completion.
    rc, out, _ = run(ck + ["--prompt", "hello world"], capsys)
    assert out == full[1]["text"] + "\n"


def test_converted_checkpoint_keeps_its_tokenizer(text_model: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    """olmax convert carries the tokenizer files, so a converted checkpoint generates as its HF
    directory does, with no --tokenizer."""
    from olmax.compat.hf import hf_to_olmax
    out = tmp_path / "olmax_weights"
    hf_to_olmax(text_model, out)
    assert (out / "tokenizer.json").read_bytes() == (text_model / "tokenizer.json").read_bytes()
    got = [run(["generate", "--checkpoint", ck, "--prompt", "hello world", "--max-new-tokens", "24", "--json"],
               capsys) for ck in (str(out), f"hf:{text_model}")]
    assert got[0][0] == 0 and jsonl(got[0][1]) == jsonl(got[1][1]), got


def _cfg(d: Path) -> Config:
    from olmax.compat.hf import config_from_hf, read_hf_config
    return config_from_hf(read_hf_config(d))


def test_chat_prompts_and_templates(text_model: Path, chat_tokenizer: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture) -> None:
    cfg = _cfg(text_model)
    codec = chat_codec.TextCodec.load(text_model / "tokenizer.json", cfg)
    assert codec.template is None  # no template in the folder: the built-in one
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "and?"}]
    assert codec.render_chat(msgs) == (
        "<|im_start|>system\n" + chat_template.OLMO3_DEFAULT_SYSTEM + "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n")
    # A final assistant turn ends with EOS; a system message replaces the default one.
    assert chat_template.render_olmo3_chat([{"role": "system", "content": "S"}, {"role": "assistant", "content": "x"}],
                                        add_generation_prompt=False) == \
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>assistant\nx<|endoftext|>"
    ids = codec.encode_chat(msgs)
    assert ids.count(codec.token_id("<|im_start|>")) == 5 and codec.token_id("<|im_end|>") in ids

    # A checkpoint's own template wins: chat_template.jinja, else tokenizer_config.json's.
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((text_model / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "X{{ eos_token }}",
                                                          "eos_token": "<|endoftext|>"}))
    assert chat_codec.TextCodec.load(d, cfg).render_chat(msgs) == "X<|endoftext|>"
    (d / "chat_template.jinja").write_text(JINJA)
    c2 = chat_codec.TextCodec.load(d / "tokenizer.json", cfg)
    assert c2.template_source.endswith("chat_template.jinja")
    assert c2.render_chat(msgs[:1]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    # --chat: prompts are user turns; <|im_end|> is an EOS id; {"messages"} lines use the template.
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps("the cat") + "\n"
                 + json.dumps({"messages": [{"role": "user", "content": "the cat"}]}) + "\n"
                 + json.dumps({"prompt": "sky"}) + "\n")
    rc, out, err = run(["generate", "--checkpoint", f"hf:{text_model}", "--tokenizer", str(chat_tokenizer),
                        "--prompts", str(f), "--chat", "--max-new-tokens", "6", "--json"], capsys)
    assert rc == 0, err
    res = jsonl(out)
    assert len(res) == 3 and res[0]["token_ids"] == res[1]["token_ids"]
    assert "chat_template.jinja" in err
    m = Model(f"hf:{text_model}")
    assert m.eos_ids(chat=True) == (0, codec.token_id("<|im_end|>")) and m.eos_ids(chat=False) == (0,)


def test_chat_loop(text_model: Path, chat_tokenizer: Path) -> None:
    m = Model(f"hf:{text_model}", tokenizer=str(chat_tokenizer))
    seen: list[list[dict]] = []
    replies: list[str] = []
    render, generate = m.codec.render_chat, m.generate
    m.codec.render_chat = lambda msgs, add_generation_prompt=True: (seen.append([dict(x) for x in msgs]),
                                                                   render(msgs, add_generation_prompt))[1]
    m.generate = lambda *a, **k: (r := generate(*a, **k), replies.append(r[0]["text"]))[0]
    # Short turns: every prompt fits a 64-slot cache, as in the other tests (fewer compiles).
    stdin = io.StringIO("cat\n\nsky\n/help\n/reset\ncat\n/exit\nnever read\n")
    out, err = io.StringIO(), io.StringIO()
    assert run_chat(m, max_new_tokens=3, stdin=stdin, stdout=out, stderr=err) == 0
    assert len(replies) == 3 and replies[0] == replies[2]  # greedy: the same first turn after /reset
    assert out.getvalue() == "".join(r + "\n" for r in replies)  # streamed, one reply per turn
    assert [len(s) for s in seen] == [1, 3, 1]
    assert seen[1][:2] == [{"role": "user", "content": "cat"}, {"role": "assistant", "content": replies[0]}]
    assert "/reset" in err.getvalue() and "new conversation" in err.getvalue()
    # Turn n draws with --seed + n, wrapped into the seeds' range: the largest seed keeps chatting.
    seeds: list[int] = []
    m.generate = lambda *a, **k: (seeds.append(k["seed"]), generate(*a, **k))[1]
    assert run_chat(m, max_new_tokens=3, seed=2**32 - 1, stdin=io.StringIO("cat\nsky\n"), stdout=io.StringIO(),
                    stderr=io.StringIO()) == 0
    assert seeds == [2**32 - 1, 0]


# --------------------------------------------------------------------------- errors


def test_errors_are_one_line(ids_model: Path, text_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2]\n\n[3, \"x\"]\n")
    notjson = tmp_path / "notjson.jsonl"
    notjson.write_text("[1, 2\n")
    ok = tmp_path / "ok.jsonl"
    ok.write_text("[1, 2]\n")
    ck = ["generate", "--checkpoint", f"hf:{ids_model}"]
    cases = [
        (["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt-ids", str(ok)], "does not exist"),
        (["generate", "--checkpoint", f"hf:{tmp_path / 'nope'}", "--prompt-ids", str(ok)], "does not exist"),
        (ck + ["--prompt", "hi"], "ships no tokenizer"),
        (ck + ["--prompt-ids", str(bad)], "line 3"),
        (ck + ["--prompt-ids", str(notjson)], "line 1: not valid JSON"),
        (ck + ["--prompt-ids", str(tmp_path / "missing.jsonl")], "does not exist"),
        (ck + ["--prompt-ids", str(ok), "--chat"], "--chat"),
        (ck + ["--prompt-ids", str(ok), "--top-p", "0.9"], "--temperature"),
        (ck + ["--prompt-ids", str(ok), "--temperature", "-1"], "--temperature"),
        (ck + ["--prompt-ids", str(ok), "--temperature", "inf"], "--temperature"),
        (ck + ["--prompt-ids", str(ok), "--stop", "x"], "ships no tokenizer"),
        (ck + ["--prompt-ids", str(ok), "--tokenizer", str(tmp_path / "no.json")], "--tokenizer"),
        (ck + ["--prompt-ids", str(ok), "--max-new-tokens", "300"], "max_position_embeddings"),
        (["generate", "--checkpoint", f"hf:{text_model}", "--prompt", "hi", "--system", "S"], "--chat"),
    ]
    for argv, msg in cases:
        rc, out, err = run(argv + ["--json"], capsys)
        assert rc == 2, (argv, out, err)
        assert msg in err and err.count("\n") == 1 and "Traceback" not in err, (argv, err)
        assert msg in json.loads(out)["error"]
    # Refused while parsing (argparse's usage, then one error line naming the flag).
    for flag, value in (("--max-new-tokens", "0"), ("--seed", "-1")):
        with pytest.raises(SystemExit) as e:
            cli.main(ck + ["--prompt-ids", str(ok), flag, value, "--json"])
        out, err = capsys.readouterr()
        assert e.value.code == 2 and flag in json.loads(out)["error"] and "Traceback" not in err, (flag, err)
    (tmp_path / "big.jsonl").write_text("[1, 999]\n")
    rc, _, err = run(ck + ["--prompt-ids", str(tmp_path / "big.jsonl"), "--max-new-tokens", "4"], capsys)
    assert rc == 2 and "999" in err and "vocabulary" in err
    for argv in (ck + ["--prompt", "a", "--prompt-ids", str(ok)], ck):  # exactly one prompt source
        with pytest.raises(SystemExit):
            cli.main(argv)
    capsys.readouterr()
    rc, _, err = run(["chat", "--checkpoint", f"hf:{ids_model}"], capsys)
    assert rc == 2 and "ships no tokenizer" in err


@pytest.mark.integration
def test_paged_kv_cache_flags(ids_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--kv-cache paged``: the same token ids and log-probs as the contiguous cache (four rows of
    two prompts, sampled), a stderr line on the cache; bad settings refused in one line."""
    f = tmp_path / "ids.jsonl"
    f.write_text("[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]\n[40, 41]\n" * 2)
    base = ["generate", "--checkpoint", f"hf:{ids_model}", "--prompt-ids", str(f), "--max-new-tokens", "6",
            "--temperature", "1.0", "--seed", "4", "--json"]
    want = jsonl(run(base, capsys)[1])
    rc, out, err = run(base + ["--kv-cache", "paged", "--page-size", "8"], capsys)
    assert rc == 0, err
    assert [(r["token_ids"], r["logprobs"]) for r in jsonl(out)] == [(r["token_ids"], r["logprobs"]) for r in want]
    assert "paged KV cache, peak" in err and "prompt tokens from shared pages" in err
    for extra, msg in ((["--kv-cache", "paged", "--batching", "static"], "pages the continuous engine"),
                       (["--kv-cache", "paged", "--page-size", "48"], "must be a positive power of two"),
                       (["--kv-cache", "paged", "--kv-budget", "lots"], "neither a size"),
                       (["--kv-cache", "paged", "--kv-budget", "1KiB"], "cannot hold one sequence"),
                       (["--kv-budget", "1KiB"], "cannot hold one sequence")):
        rc, out, err = run(base + extra, capsys)
        assert rc == 2 and msg in err and err.count("\n") == 1 and "Traceback" not in err, (extra, err)


# --------------------------------------------------------------------------- helpers


def test_stop_string_helpers() -> None:
    assert first_stop("abcXYdefXY", ["XY", "de"]) == 3
    assert first_stop("abc", ["x", ""]) is None
    assert unsafe_tail("hello wor", ["world"]) == 3 and unsafe_tail("hello", ["xyz"]) == 0
    assert unsafe_tail("ab<|im", ["<|im_end|>", "b<"]) == 4


def test_prompt_files_not_utf8_name_the_flag_and_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'\xff"a prompt"\n')
    with pytest.raises(ValueError, match=rf"--prompt-ids {re.escape(str(bad))}: not UTF-8"):
        read_prompt_ids(str(bad))
    with pytest.raises(ValueError, match=rf"--prompts {re.escape(str(bad))}: not UTF-8"):
        read_prompts(str(bad))


def test_tokenizer_beside_the_training_data(tmp_path: Path, text_model: Path) -> None:
    """A run trained on an ``olmax tokenize`` folder (the demo's) finds that folder's tokenizer."""
    data = tmp_path / "data" / "train"
    data.mkdir(parents=True)
    tok = data / "tokenizer.json"
    tok.write_bytes((text_model / "tokenizer.json").read_bytes())
    (data / "part-00000.npy").write_bytes(b"\0\0")
    man = {"tokenizer": {"file": "tokenizer.json", "sha256": hashlib.sha256(tok.read_bytes()).hexdigest()}}
    (data / "manifest.json").write_text(json.dumps(man))
    cfg = Config(data=DataConfig(paths=(str(data / "part-00000.npy"),)))
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "4").mkdir(parents=True)
    assert chat_codec.find_tokenizer(str(run_dir), cfg) == tok
    assert chat_codec.find_tokenizer(str(run_dir / "checkpoints" / "4"), cfg) == tok
    (run_dir / "tokenizer.json").write_bytes(tok.read_bytes())
    assert chat_codec.find_tokenizer(str(run_dir / "checkpoints" / "4"), cfg) == run_dir / "tokenizer.json"
    tok.write_text("{}")  # edited since olmax tokenize recorded it: not the run's tokenizer
    assert chat_codec.find_tokenizer(str(tmp_path / "other"), cfg) is None
