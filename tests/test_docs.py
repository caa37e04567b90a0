"""The documentation holds together: every relative link in the README, CHANGELOG, docs/ and
benchmarks/results/ resolves (to a heading, by GitHub's anchor rules, where it names one), every
`olmax COMMAND [SUBCOMMAND]` shown in code is one the CLI has, and every dated result carries its
figures as JSON. Fast: builds the argparse parser, compiles nothing."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from olmax.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted(RESULTS.glob("*.md"))]
    return [f for f in files if f.exists()]


FENCE = re.compile(r"^\s*(```|~~~)")
SPAN = re.compile(r"(`+)(.+?)\1")


def split_code(text: str, keep_spans: bool = False) -> tuple[str, list[str]]:
    """(the text outside fenced blocks, code spans blanked unless keep_spans; the code: fenced
    blocks and spans)."""
    prose, code, block, fence = [], [], [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence, block = m.group(1), []
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                code.append("\n".join(block))
                fence = None
            else:
                block.append(line)
            continue
        code.extend(m.group(2) for m in SPAN.finditer(line))
        prose.append(line if keep_spans else SPAN.sub("", line))
    return "\n".join(prose), code


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower case, punctuation other than '-'
    and '_' dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"(\*\*|__|\*)", "", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_code(path.read_text(), keep_spans=True)
    seen: dict[str, int] = {}
    found = set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", path.read_text()))
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose, re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        found.add(s if n == 0 else f"{s}-{n}")
    return found


LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def broken_links(path: Path) -> list[str]:
    prose, _ = split_code(path.read_text())
    problems = []
    for target in LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{path.relative_to(ROOT)}: {target}: no such file")
        elif not dest.is_relative_to(ROOT):
            problems.append(f"{path.relative_to(ROOT)}: {target}: outside the repository")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            problems.append(f"{path.relative_to(ROOT)}: {target}: no heading #{anchor}")
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(path: Path):
    problems = broken_links(path)
    assert not problems, "\n".join(problems)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


WORD = re.compile(r"[a-z][a-z0-9-]*")
GLOBAL_FLAGS = {"--help", "-h", "--debug"}
# `olmax` as a command: not part of a path or a module name (src/olmax/x, olmax.cli, olmax's).
INVOCATION = re.compile(r"(?<![\w.-])olmax[ \t]+([^\s`]+)(?:[ \t]+([^\s`]+))?")


def bad_commands(code: str, commands: dict[str, argparse.ArgumentParser]) -> list[str]:
    problems = []
    for m in INVOCATION.finditer(code):
        words = [w for w in m.groups() if w is not None]
        if words and words[0] in GLOBAL_FLAGS:
            continue
        first = words[0].rstrip(":,;.)")
        if not WORD.fullmatch(first):
            continue  # `olmax (...)`, `olmax ...`: not a command name
        if first not in commands:
            problems.append(f"olmax {first}: no such command")
            continue
        subs = subcommands(commands[first])
        if not subs or first != words[0] or len(words) < 2:
            continue  # no subcommands, or the sentence goes on after the command (`olmax demo,`)
        second = words[1].rstrip(":,;.)")
        if WORD.fullmatch(second) and second not in subs:
            problems.append(f"olmax {first} {second}: no such subcommand (has {', '.join(sorted(subs))})")
    return problems


@pytest.fixture(scope="module")
def commands() -> dict[str, argparse.ArgumentParser]:
    return subcommands(build_parser())


@pytest.mark.parametrize("path", [p for p in doc_files() if p.parent != RESULTS] + sorted(RESULTS.glob("*.md")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_exist(path: Path, commands):
    _, code = split_code(path.read_text())
    problems = [p for chunk in code for p in bad_commands(chunk, commands)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.md")), ids=lambda p: p.name)
def test_results_carry_their_figures(path: Path):
    """A dated result `<what>_<hardware>_<date>.md` has its figures in a .json beside it (its
    own, or the run files it links, such as a device's JSON kept as it came back)."""
    assert re.fullmatch(r"[a-z0-9.-]+(_[a-z0-9.-]+)*_\d{4}-\d{2}-\d{2}(_[a-z0-9-]+)?", path.stem), path.name
    linked = [t for t in LINK.findall(path.read_text()) if t.endswith(".json")]
    assert path.with_suffix(".json").exists() or (linked and all((path.parent / t).exists() for t in linked))


def test_checker_catches_what_it_should(tmp_path: Path, commands, monkeypatch):
    """The checks fail on a missing file, a missing heading and a made-up command."""
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# JSON outputs (`--json`; stable keys)\n## Weights & Biases\n")
    page = tmp_path / "page.md"
    page.write_text("[a](missing.md) [b](other.md#nope) [c](other.md#json-outputs---json-stable-keys)\n"
                    "[d](other.md#weights--biases) [e](#here)\n\n## Here\n\n`olmax [x](gone.md)`\n")
    assert broken_links(page) == ["page.md: missing.md: no such file", "page.md: other.md#nope: no heading #nope"]
    assert bad_commands("olmax deploy --port 1", commands) == ["olmax deploy: no such command"]
    assert bad_commands("olmax eval perplexity --checkpoint x", commands)[0].startswith("olmax eval perplexity")
    assert bad_commands("olmax demo, then olmax verify trl --dpo; src/olmax/rl olmax.cli olmax --help", commands) == []
