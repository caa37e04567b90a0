"""Chat tokenization (``olmax.data.chat``, ``olmax tokenize --chat``): open-instruct's label rule
checked against spans found independently of the code under test, ids equal to the ``tokenizers``
encoding of the rendered text, OLMo-core reading the files, byte-identical output for 1 and 3
processes, bad lines named file:line, and preference pairs."""

from __future__ import annotations

import glob
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from olmax.chat.template import load_template, render_olmo3_chat
from olmax.data import DataError, chat

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
EOS, PAD = 0, 1
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": {"type": "string"}}}}]
WORDS = ["hello", "world", "what", "is", "the", "weather", "in", "paris", "sunny", "rain", "think", "answer",
         "call", "function", "result", "yes", "no", "maybe", "é", "ok"]

# Conversations: tools + function calls + environment/tool turns, multi-turn, system message, Think.
CONVS = [
    ([{"role": "system", "content": "Be brief."},
      {"role": "user", "content": "What is the weather in Paris?"},
      {"role": "assistant", "content": "", "function_calls": 'get_weather(city="paris")'},
      {"role": "environment", "content": "sunny, 21C"},
      {"role": "assistant", "content": "It is sunny."},
      {"role": "user", "content": "And tomorrow?"},
      {"role": "assistant", "content": "Let me check.",
       "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "paris"}}}]},
      {"role": "tool", "content": "rain"},
      {"role": "assistant", "content": "Rain, sadly."}], TOOLS),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
      {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine"}], None),
    ([{"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "<think>two and two</think>4"},
      {"role": "user", "content": "and 3+3?"},
      {"role": "assistant", "content": "<think>three and three</think>6"}], None),
    ([{"role": "user", "content": "weather?"},
      {"role": "assistant", "content": "<think>call the tool</think>", "function_calls": 'get_weather(city="x")'},
      {"role": "environment", "content": "sunny"},
      {"role": "assistant", "content": "<think>ok</think>Sunny."}], TOOLS),
]

# A jinja template that should render exactly as the built-in OLMo 3 Instruct (and, with THINK,
# the Think variant): written independently of render_olmo3_chat.
JINJA = (
    "{%- set think = THINK -%}{%- set NL = '\\n' -%}"
    "{%- if not messages|selectattr('role', 'equalto', 'system')|list -%}"
    "<|im_start|>system{{ NL }}"
    "{%- if think -%}You are Olmo, a helpful AI assistant built by Ai2. Your date cutoff is December 2024, and your "
    "model weights are available at https://huggingface.co/allenai.{% if tools %} <functions>{{ tools|tojson }}"
    "</functions>{% endif %}"
    "{%- elif tools -%}You are a helpful function-calling AI assistant. You are provided with function signatures "
    "within <functions></functions> XML tags. You may call one or more functions to assist with the user query. "
    "Output any function calls within <function_calls></function_calls> XML tags. Do not make assumptions about "
    "what values to plug into functions.<functions>{{ tools|tojson }}</functions>"
    "{%- else -%}You are a helpful function-calling AI assistant. You do not currently have access to any "
    "functions. <functions></functions>{%- endif -%}<|im_end|>{{ NL }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|im_start|>system{{ NL }}{{ m.content }}"
    "{%- if tools -%}{{ ' ' if think else '' }}<functions>{{ tools|tojson }}</functions>"
    "{%- elif think %} You do not currently have access to any functions. <functions></functions>{%- endif -%}"
    "<|im_end|>{{ NL }}"
    "{%- elif m.role == 'assistant' -%}<|im_start|>assistant{{ NL }}{{ m.content or '' }}"
    "{%- if m.function_calls %}<function_calls>{{ m.function_calls }}</function_calls>{% endif -%}"
    "{%- if loop.last %}{{ eos_token }}{% else %}<|im_end|>{{ NL }}{% endif -%}"
    "{%- else -%}<|im_start|>{{ 'environment' if m.role == 'tool' else m.role }}{{ NL }}"
    "{{ m.content }}<|im_end|>{{ NL }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ NL }}{% if think %}<think>{% endif %}{% endif -%}"
)


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    d = tmp_path_factory.mktemp("chat_tok")
    rnd = random.Random(0)
    corpus = [" ".join(rnd.choices(WORDS, k=12)) + rnd.choice([".", "?", "\n"]) for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A post-processor that trims offsets (as many tokenizer.json files have): ids must not change.
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    return d / "tokenizer.json"


@pytest.fixture(scope="module")
def tok(tok_file: Path):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(tok_file))


def _count(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False).ids)


def _expected_mask(tok, msgs: list[dict], tools, think: bool) -> tuple[list[int], np.ndarray]:
    """Label mask from spans found here by rendering message prefixes: an assistant turn is trained
    from the end of the prompt (add_generation_prompt=True, without a trailing <think>) up to where
    the next message starts (found by following the turn with a probe message), or to the end."""
    full = render_olmo3_chat(msgs, False, tools=tools, think=think)
    ids = tok.encode(full, add_special_tokens=False).ids
    mask = np.zeros(len(ids), dtype=bool)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        head = render_olmo3_chat(msgs[:i], True, tools=tools, think=think)
        if think:
            assert head.endswith("<think>")
            head = head[:-len("<think>")]
        assert full.startswith(head)
        if i == len(msgs) - 1:
            end = len(full)
        else:
            probe = render_olmo3_chat(msgs[:i + 1] + [{"role": "user", "content": "PROBE"}], False, tools=tools,
                                      think=think)
            end = probe.index("<|im_start|>user\nPROBE")
            assert full.startswith(probe[:end])
        mask[_count(tok, full[:len(head)]):_count(tok, full[:end])] = True
    return ids, mask


@pytest.mark.parametrize("think", [False, True])
@pytest.mark.parametrize("k", range(len(CONVS)))
def test_masks_follow_prefix_spans(tok, k: int, think: bool) -> None:
    msgs, tools = CONVS[k]
    ids, mask = chat.encode_conversation(msgs, tok, "olmo3-think" if think else "olmo3", tools=tools)
    want_ids, want_mask = _expected_mask(tok, msgs, tools, think)
    assert ids.tolist() == want_ids  # the tokenizers library's encoding of the rendered text
    np.testing.assert_array_equal(mask, want_mask)
    assert ids.dtype == np.int64 and mask.dtype == np.bool_
    assert (ids == EOS).sum() == 1 and ids[-1] == EOS  # one EOS, at the end


@pytest.mark.parametrize("think", [False, True])
def test_open_instruct_count_rule(tok, think: bool) -> None:
    """--labels open-instruct-counts (open-instruct before #1746, OLMo 3's SFT data): the same
    labels except the \\n after each non-final <|im_end|>, which token counts of the prefix
    renders (the turn rendered last, with EOS in place of <|im_end|>\\n) put in the next message."""
    im_end = tok.token_to_id("<|im_end|>")
    template = "olmo3-think" if think else "olmo3"
    for msgs, tools in CONVS:
        ids, mask = chat.encode_conversation(msgs, tok, template, tools=tools)
        ids2, counted = chat.encode_conversation(msgs, tok, template, tools=tools, labels="open-instruct-counts")
        np.testing.assert_array_equal(ids, ids2)
        want = mask.copy()
        after = np.flatnonzero((ids[:-1] == im_end) & mask[:-1]) + 1
        assert len(after) == sum(m["role"] == "assistant" for m in msgs) - 1
        assert all(tok.id_to_token(int(ids[i])) == "Ċ" for i in after)  # byte-level "\\n"
        want[after] = False
        np.testing.assert_array_equal(counted, want)


def test_trained_text(tok) -> None:
    """Readable form of the rule: assistant content + <|im_end|>\\n, or EOS after the final turn;
    <think> trained under the Think template; tools in the (masked) system turn."""
    def trained(msgs, template="olmo3", tools=None) -> str:
        ids, mask = chat.encode_conversation(msgs, tok, template, tools=tools)
        runs, cur = [], []
        for t, m in zip(ids.tolist(), mask.tolist()):
            if m:
                cur.append(t)
            elif cur:
                runs.append(tok.decode(cur, skip_special_tokens=False))
                cur = []
        return runs + ([tok.decode(cur, skip_special_tokens=False)] if cur else [])

    assert trained(CONVS[1][0]) == ["yo<|im_end|>\n", "fine<|endoftext|>"]
    assert trained(CONVS[2][0], "olmo3-think") == ["<think>two and two</think>4<|im_end|>\n",
                                                   "<think>three and three</think>6<|endoftext|>"]
    assert trained(CONVS[0][0], tools=TOOLS) == [
        '<function_calls>get_weather(city="paris")</function_calls><|im_end|>\n', "It is sunny.<|im_end|>\n",
        'Let me check.<function_calls>get_weather(city="paris")</function_calls><|im_end|>\n',
        "Rain, sadly.<|endoftext|>"]
    text = render_olmo3_chat(CONVS[0][0], False, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.<functions>" + json.dumps(TOOLS) + "</functions><|im_end|>\n")
    assert "<|im_start|>environment\nrain<|im_end|>\n" in text
    assert render_olmo3_chat(CONVS[1][0][:1], True, think=True).endswith("<|im_start|>assistant\n<think>")


@pytest.mark.parametrize("think", [False, True])
def test_jinja_template_agrees_with_builtin(tok, tok_file: Path, tmp_path: Path, think: bool) -> None:
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes(tok_file.read_bytes())
    (d / "chat_template.jinja").write_text(JINJA.replace("THINK", "true" if think else "false"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    builtin = "olmo3-think" if think else "olmo3"
    for msgs, tools in CONVS:
        if any("tool_calls" in m for m in msgs):  # the jinja above prints only function_calls strings
            msgs = [{k: v for k, v in m.items() if k != "tool_calls"} for m in msgs]
        t = load_template(str(d))
        assert t.render(msgs, True, tools) == render_olmo3_chat(msgs, True, tools=tools, think=think)
        a = chat.encode_conversation(msgs, d / "tokenizer.json", "tokenizer", tools=tools)
        b = chat.encode_conversation(msgs, tok, builtin, tools=tools)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])


def test_unreadable_templates_and_configs_name_the_file(tmp_path: Path) -> None:
    """A template or tokenizer_config.json that is not UTF-8, a config that is not an object and a
    chat_template that is not a string are errors naming the file (and field), not tracebacks."""
    from olmax.chat.template import read_template, tokenizer_template
    from olmax.config import ConfigError
    jinja = tmp_path / "bad.jinja"
    jinja.write_bytes(b"\xff{{ messages }}")
    with pytest.raises(ConfigError, match=rf"chat template {re.escape(str(jinja))}: not UTF-8"):
        load_template(str(jinja))
    d = tmp_path / "tok"
    d.mkdir()
    (d / "chat_template.jinja").write_bytes(b"\xff{{ messages }}")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(d / 'chat_template.jinja'))}: not UTF-8"):
        load_template(str(d))
    (d / "chat_template.jinja").unlink()
    cfg = d / "tokenizer_config.json"
    cfg.write_bytes(b'\xff{"eos_token": "<|endoftext|>"}')
    with pytest.raises(ConfigError, match=rf"{re.escape(str(cfg))}: not a tokenizer config \(invalid JSON: .*utf-8"):
        tokenizer_template(d)
    cfg.write_text("[]")
    not_object = rf"{re.escape(str(cfg))}: not a tokenizer config \(expected a JSON object, got list"
    with pytest.raises(ConfigError, match=not_object):
        read_template(d)
    cfg.write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(ConfigError, match=rf"{re.escape(str(cfg))}: chat_template must be a string"):
        read_template(d)
    # A .jinja file beside a tokenizer_config.json whose chat_template it replaces is read as before.
    (d / "my.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_template(str(d / "my.jinja")).render([{"role": "user", "content": "hi"}], False) == "hi"


def _dataset(path: Path, n: int = 40, seed: int = 0) -> list[dict]:
    """JSONL records: the fixed conversations plus random multi-turn ones (with tools, environment turns)."""
    rnd = random.Random(seed)
    recs = [{"messages": m, **({"tools": t} if t else {})} for m, t in CONVS]
    for _ in range(n):
        msgs: list[dict] = []
        if rnd.random() < 0.3:
            msgs.append({"role": "system", "content": " ".join(rnd.choices(WORDS, k=4))})
        for _ in range(rnd.randint(1, 4)):
            msgs.append({"role": "user", "content": " ".join(rnd.choices(WORDS, k=rnd.randint(1, 30)))})
            if rnd.random() < 0.3:
                msgs.append({"role": "assistant", "content": "", "function_calls": "get_weather(city=\"x\")"})
                msgs.append({"role": rnd.choice(["environment", "tool"]), "content": rnd.choice(WORDS)})
            msgs.append({"role": "assistant", "content": " ".join(rnd.choices(WORDS, k=rnd.randint(1, 40)))})
        recs.append({"messages": msgs, **({"tools": TOOLS} if rnd.random() < 0.3 else {})})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_tokenize_chat_layout_processes_and_olmo_core(tok, tok_file: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    from olmax import cli
    src = tmp_path / "conv.jsonl"
    recs = _dataset(src)
    want = [chat.encode_conversation(r["messages"], tok, tools=r.get("tools")) for r in recs]
    ids = np.concatenate([w[0] for w in want])
    mask = np.concatenate([w[1] for w in want])

    outs = {}
    for p in (1, 3):
        out = tmp_path / f"out{p}"
        assert cli.main(["tokenize", "--chat", "--tokenizer", str(tok_file), "--out", str(out), "--processes", str(p),
                         "--shard-tokens", "700", "--no-progress", str(src)]) == 0
        outs[p] = _files(out)
    assert outs[1] == outs[3]  # byte-identical for any process count
    assert f"{len(recs)} conversations" in capsys.readouterr().out

    out = tmp_path / "out1"
    man = json.loads((out / "manifest.json").read_text())
    assert man["format"] == chat.SFT_FORMAT and man["dtype"] == "uint16" and man["eos_token_id"] == EOS
    assert (out / "tokenizer.json").read_bytes() == tok_file.read_bytes()
    r = man["report"]
    assert r["conversations"] == len(recs) and r["tokens"] == len(ids) and r["trained_tokens"] == int(mask.sum())
    assert 0 < r["trained_share"] < 1 and r["truncated"] == 0 and r["skipped"] == 0
    paths = sorted(glob.glob(str(out / "token_ids_part_*.npy")))
    masks = sorted(glob.glob(str(out / "labels_mask_part_*.npy")))
    assert len(paths) == len(masks) == -(-len(ids) // 700) > 1
    # headerless arrays, parts of 700 tokens cut anywhere (a conversation may cross parts)
    np.testing.assert_array_equal(np.concatenate([np.fromfile(p, dtype="<u2") for p in paths]), ids)
    np.testing.assert_array_equal(np.concatenate([np.fromfile(p, dtype=np.bool_) for p in masks]), mask)

    from olmo_core.data import NumpyFSLDataset, NumpyPackedFSLDataset
    L = 64
    fsl = NumpyFSLDataset(*paths, sequence_length=L, pad_token_id=PAD, eos_token_id=EOS, vocab_size=360,
                          dtype=np.uint16, label_mask_paths=masks)
    fsl.work_dir = tmp_path / "work_fsl"
    fsl.prepare()
    got_ids = np.concatenate([fsl[i]["input_ids"].numpy() for i in range(len(fsl))])
    got_mask = np.concatenate([fsl[i]["label_mask"].numpy() for i in range(len(fsl))])
    # FSL chunks each part file separately, dropping each part's remainder
    starts = np.cumsum([0] + [700] * (len(paths) - 1))
    keep = np.concatenate([np.arange(s, s + (min(700, len(ids) - s) // L) * L) for s in starts])
    np.testing.assert_array_equal(got_ids, ids[keep])
    np.testing.assert_array_equal(got_mask, mask[keep])

    # Packed (one part, so every conversation is whole): every document comes back with its mask,
    # both with boundaries read from the .csv.gz files and found by EOS.
    one = tmp_path / "one"
    chat.tokenize_chat([src], one, tokenizer=tok_file, processes=1, progress=False)
    for from_metadata in (False, True):
        pk = NumpyPackedFSLDataset(str(one / "token_ids_part_0000.npy"), sequence_length=1024, pad_token_id=PAD,
                                   eos_token_id=EOS, vocab_size=360, dtype=np.uint16,
                                   label_mask_paths=[str(one / "labels_mask_part_0000.npy")],
                                   generate_doc_lengths=True, use_array_if_local=not from_metadata)
        pk.work_dir = tmp_path / f"work_packed{from_metadata}"
        pk.prepare()
        docs = []
        for i in range(len(pk)):
            item = pk[i]
            a, m = item["input_ids"].numpy().astype(np.uint16), item["label_mask"].numpy()
            pos = 0
            for n in item["doc_lens"].tolist():
                if m[pos:pos + n].any():  # padding segments carry no labels
                    docs.append((a[pos:pos + n].tobytes(), m[pos:pos + n].tobytes()))
                pos += n
        assert sorted(docs) == sorted((w[0].astype(np.uint16).tobytes(), w[1].tobytes()) for w in want)


def test_bad_lines_name_file_and_line_or_are_skipped(tok_file: Path, tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    bad = {
        "unknown_role": {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"},
                                      {"role": "assistant", "content": "yo"}]},
        "empty_assistant": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]},
        "not_a_list": {"messages": "hi"},
        "no_assistant": {"messages": [{"role": "user", "content": "hi"}]},
        "not_ending_with_assistant": {"messages": good["messages"] + [{"role": "user", "content": "more"}]},
        "eos_in_text": {"messages": [{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "a<|endoftext|>b"}]},
    }
    for i, rec in enumerate(bad.values()):
        f = tmp_path / f"bad{i}.jsonl"
        f.write_text(json.dumps(good) + "\n\n" + json.dumps(rec) + "\n")
        with pytest.raises(DataError, match=rf"{f}:3: .*--skip-bad"):
            chat.tokenize_chat([f], tmp_path / f"o{i}", tokenizer=tok_file, progress=False)
        assert not (tmp_path / f"o{i}").exists()
    f = tmp_path / "json.jsonl"
    f.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(DataError, match=rf"{f}:2: not valid JSON"):
        chat.tokenize_chat([f], tmp_path / "oj", tokenizer=tok_file, progress=False)

    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(x) + "\n" for x in [good, *bad.values(), good]) + "{oops\n")
    man = chat.tokenize_chat([mixed], tmp_path / "skip", tokenizer=tok_file, skip_bad=True, processes=1,
                             progress=False)
    r = man["report"]
    assert r["conversations"] == 2 and r["skipped"] == len(bad) + 1
    assert r["skipped_by_reason"] == {**{k: 1 for k in bad}, "bad_json": 1}


def test_max_length_truncates_like_open_instruct(tok, tok_file: Path, tmp_path: Path) -> None:
    src = tmp_path / "c.jsonl"
    long_prompt = {"messages": [{"role": "user", "content": " ".join(["weather"] * 200)},
                                {"role": "assistant", "content": "ok"}]}
    recs = [{"messages": m} for m, t in CONVS if t is None] + [long_prompt]
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    full = [chat.encode_conversation(r["messages"], tok) for r in recs]
    n = len(full[0][0]) - 2  # cuts the EOS and <|im_end|> of the shortest; the long prompt keeps no label
    man = chat.tokenize_chat([src], tmp_path / "o", tokenizer=tok_file, max_length=n, progress=False)
    r = man["report"]
    # first n tokens kept (EOS lost); a conversation with no trained token left is dropped
    assert r["truncated"] == sum(len(f[0]) > n for f in full) == 3 and r["dropped_no_labels"] == 1
    kept = [(i[:n], m[:n]) for i, m in full if m[:n].any()]
    assert r["conversations"] == len(kept)
    got = np.fromfile(tmp_path / "o" / "token_ids_part_0000.npy", dtype="<u2")
    np.testing.assert_array_equal(got, np.concatenate([k[0] for k in kept]))
    with gzip_open(tmp_path / "o" / "token_ids_part_0000.csv.gz") as f:
        bounds = [tuple(map(int, line.split(","))) for line in f.read().split()]
    ends = np.cumsum([len(k[0]) for k in kept])
    assert bounds == list(zip([0, *ends[:-1].tolist()], ends.tolist()))


def gzip_open(p: Path):
    import gzip
    return gzip.open(p, "rt")


def test_preference_pairs(tok, tok_file: Path, tmp_path: Path) -> None:
    src = tmp_path / "pref.jsonl"
    msgs = CONVS[0][0]
    recs = [
        # open-instruct's shape: two whole conversations sharing the prompt
        {"chosen": msgs, "rejected": msgs[:-1] + [{"role": "assistant", "content": "No idea."}], "tools": TOOLS},
        # prompt + completions
        {"prompt": "what is the weather", "chosen": "sunny", "rejected": [{"role": "assistant", "content": "rain"}]},
        {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "hello"}],
         "rejected": [{"role": "assistant", "content": "go away"}]},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    outs = {}
    for p in (1, 3):
        man = chat.tokenize_chat([src], tmp_path / f"p{p}", tokenizer=tok_file, preference=True, processes=p,
                                 progress=False)
        outs[p] = _files(tmp_path / f"p{p}")
    assert outs[1] == outs[3]
    assert man["format"] == chat.PAIRS_FORMAT and man["pairs"] == 3 and man["tokenizer"]["sha256"]
    ids, mask, index = chat.read_pairs(tmp_path / "p1")
    assert ids.dtype == np.uint32 and mask.dtype == np.bool_ and index.dtype == np.int64 and index.shape == (3, 4)
    sides = [(recs[0]["chosen"], recs[0]["rejected"]),
             ([{"role": "user", "content": "what is the weather"}, {"role": "assistant", "content": "sunny"}],
              [{"role": "user", "content": "what is the weather"}, {"role": "assistant", "content": "rain"}]),
             (recs[2]["prompt"] + recs[2]["chosen"], recs[2]["prompt"] + recs[2]["rejected"])]
    for (c, rj), (co, cl, ro, rl), rec in zip(sides, index.tolist(), recs):
        for m, o, n in ((c, co, cl), (rj, ro, rl)):
            want = chat.encode_conversation(m, tok, tools=rec.get("tools"))
            np.testing.assert_array_equal(ids[o:o + n], want[0])
            np.testing.assert_array_equal(mask[o:o + n], want[1])

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(recs[2]) + "\n" + json.dumps(
        {"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}],
         "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "y"}]}) + "\n")
    with pytest.raises(DataError, match=rf"{bad}:2: chosen and rejected do not share the prompt"):
        chat.tokenize_chat([bad], tmp_path / "pb", tokenizer=tok_file, preference=True, progress=False)

    # read_pairs checks what it reads and names the file
    d = tmp_path / "p3"
    idx = np.load(d / chat.PAIRS_INDEX)
    idx[1, 0] += 1
    np.save(d / chat.PAIRS_INDEX, idx)
    with pytest.raises(DataError, match=r"pairs_index\.npy: pair 1 "):
        chat.read_pairs(d)
    np.save(d / chat.PAIRS_INDEX, idx.astype(np.int32))
    with pytest.raises(DataError, match=r"pairs_index\.npy: int32"):
        chat.read_pairs(d)
    (d / chat.PAIRS_LABELS_MASK).unlink()
    with pytest.raises(DataError, match=r"pairs_labels_mask\.npy: not found"):
        chat.read_pairs(d)
    sft = _sft_folder(tok_file, tmp_path)
    with pytest.raises(DataError, match=r"manifest\.json: format 'olmax-chat/1'"):
        chat.read_pairs(sft)


def _sft_folder(tok_file: Path, tmp_path: Path) -> Path:
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({"messages": CONVS[1][0]}) + "\n")
    chat.tokenize_chat([src], tmp_path / "sft", tokenizer=tok_file, progress=False)
    return tmp_path / "sft"
