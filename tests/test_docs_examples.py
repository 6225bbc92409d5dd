"""README.md and docs/*.md stay true: their examples are run, or checked against the Typer app and Config.

A Python or JSON block that cannot run on a CPU says why on the line before it: ``<!-- not-tested: needs a GPU -->``.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
import typer
from typer.testing import CliRunner

from llmcli.cli.app import app
from tiny_qwen3 import write_tiny_qwen3

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARK = re.compile(r"^<!-- not-tested: (\S.*?) -->$")
KNOWN_LANGS = {"python", "json", "bash", "toml", ""}
RUN_LANGS = {"python", "json"}  # what the marker may exempt; shell and TOML blocks are always checked
INPUT_KEYS = {"prompt", "messages", "prompt_token_ids"}
OUTPUT_KEYS = {"text", "choices", "response", "error"}
TINY = "examples/tiny-qwen3"
# Inline code that starts with one of these is another tool's command line, whose flags are not llmcli's.
OTHER_PROGRAMS = {"python", "pip", "pytest", "ray", "kill", "jq", "cat", "git", "grep", "ulimit"}
COMMANDS = typer.main.get_command(app).commands


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the block's first content line
    lang: str
    text: str
    not_tested: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.match(before.strip())
        found.append(Block(page, i + 2, fence.group(1), "\n".join(lines[i + 1:end]), mark and mark.group(1)))
        i = end + 1
    return found


def inline_spans(page: Path) -> list[tuple[str, str]]:
    """(where, text) of every inline code span outside code blocks."""
    spans, in_block = [], False
    for n, line in enumerate(page.read_text().split("\n"), 1):
        if line.startswith("```"):
            in_block = not in_block
        elif not in_block:
            spans += [(f"{page.relative_to(REPO)}:{n}", s) for s in re.findall(r"`([^`]+)`", line)]
    return spans


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]


def shell_commands(text: str) -> list[list[str]]:
    """The llmcli invocations in a shell snippet, as argv lists without the program name."""
    commands = []
    for line in text.replace("\\\n", " ").split("\n"):
        line = line.strip().removeprefix("$ ")
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"\s\|\s", line.split(" # ")[0]):
            words = shlex.split(part.replace("[", " ").replace("]", " "))
            if words[:3] == ["python", "-m", "llmcli"]:
                words = words[2:]
            if words and words[0] == "llmcli":
                commands.append(words[1:])
    return commands


def command_problems(argv: list[str]) -> list[str]:
    if not argv or argv[0] in ("--version", "--help"):
        return []
    if argv[0] not in COMMANDS:
        return [f"no command {argv[0]!r}"]
    command = COMMANDS[argv[0]]
    options = {name: p for p in command.params if p.param_type_name == "option" for name in p.opts + p.secondary_opts}
    problems, words = [], iter(argv[1:])
    for word in words:
        if not word.startswith("-") or word == "-":
            continue
        name, _, value = word.partition("=")
        if name == "--help":
            continue
        param = options.get(name)
        if param is None:
            problems.append(f"{argv[0]} has no option {name}")
            continue
        if param.is_flag or param.count:
            continue
        value = value or next(words, "")
        allowed = choices_of(param)
        if allowed is not None and value not in allowed:
            problems.append(f"{name} {value!r} is not one of {allowed}")
        if name in ("--model", "-m", "--config") and value.startswith(("configs/", "examples/")) \
                and not (REPO / value).exists():
            problems.append(f"{name} {value}: no such path in the repository")
    return problems


def choices_of(param) -> list[str] | None:
    """The values an option accepts, or None when it takes any (Typer >= 0.29 keeps them off click's type)."""
    desc = getattr(param, "type_descriptor", None)
    raw = desc.choices if desc is not None and desc.is_choice else getattr(getattr(param, "type", None), "choices", None)
    return None if raw is None else [c.value if isinstance(c, enum.Enum) else str(c) for c in raw]


def all_flags() -> set[str]:
    return {name for c in COMMANDS.values() for p in c.params if p.param_type_name == "option"
            for name in p.opts + p.secondary_opts} | {"--help", "--version"}


def test_blocks_are_of_a_kind_this_test_checks():
    bad = [f"{b.where}: ```{b.lang}" for b in ALL_BLOCKS if b.lang not in KNOWN_LANGS]
    bad += [f"{b.where}: not-tested only exempts python and json blocks (```{b.lang} is always checked)"
            for b in ALL_BLOCKS if b.not_tested and b.lang not in RUN_LANGS]
    assert not bad, "\n".join(bad)


def test_command_lines_use_real_commands_flags_and_paths():
    lines = [(b.where, b.text) for b in ALL_BLOCKS if b.lang in ("bash", "")]
    lines += [(where, span) for page in PAGES for where, span in inline_spans(page)]
    checked, bad = 0, []
    for where, text in lines:
        for argv in shell_commands(text):
            checked += 1
            bad += [f"{where}: llmcli {' '.join(argv)}: {p}" for p in command_problems(argv)]
    assert checked >= 20, f"only {checked} llmcli command lines found: is the extraction broken?"
    assert not bad, "\n".join(bad)


def test_flags_in_inline_code_exist():
    flags, bad = all_flags(), []
    for page in PAGES:
        for where, span in inline_spans(page):
            if span.split()[0] in OTHER_PROGRAMS:
                continue
            bad += [f"{where}: {flag} (in `{span}`)" for flag in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", span)
                    if flag not in flags]
    assert not bad, "flags the docs name that no llmcli command has:\n" + "\n".join(bad)


def test_cli_page_documents_every_option():
    page = (REPO / "docs" / "cli.md").read_text()
    documented = set(re.findall(r"`(--[\w-]+)`", page))
    missing = sorted({f"{name} {flag}" for name, c in COMMANDS.items() for p in c.params if p.param_type_name == "option"
                      for flag in p.opts + p.secondary_opts if flag.startswith("--") and flag not in documented})
    assert not missing, "options docs/cli.md does not name: " + ", ".join(missing)


def test_toml_examples_use_real_option_names():
    def known(command: str, key: str) -> bool:
        return "--" + key.replace("_", "-") in {o for p in COMMANDS[command].params for o in p.opts}

    bad = []
    for b in (b for b in ALL_BLOCKS if b.lang == "toml"):
        for key, value in tomllib.loads(b.text).items():
            if isinstance(value, dict):
                bad += [f"{b.where}: [{key}] {k}" for k in value if key not in COMMANDS or not known(key, k)]
            elif not any(known(c, key) for c in COMMANDS):
                bad.append(f"{b.where}: {key}")
    assert not bad, "\n".join(bad)


def json_examples() -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """(inputs, outputs) as (where, record); a block line that is not JSON fails the test."""
    inputs, outputs = [], []
    found = [(f"{b.where[:b.where.rindex(':')]}:{b.line + i}", line)
             for b in ALL_BLOCKS if b.lang == "json" and not b.not_tested
             for i, line in enumerate(b.text.split("\n")) if line.strip()]
    for where, line in found:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            pytest.fail(f"{where}: not a JSON line ({e}); mark the block <!-- not-tested: why --> if it is abridged")
        (inputs if is_input(record) else outputs).append((where, record))
    for page in PAGES:  # inline records, e.g. the table of input kinds
        for where, span in inline_spans(page):
            if span.startswith("{"):
                try:
                    record = json.loads(span)
                except json.JSONDecodeError:
                    continue  # a fragment such as {"type": "json_schema", ...}, not a record
                if is_input(record):
                    inputs.append((where, record))
    return inputs, outputs


def is_input(record: dict) -> bool:
    if OUTPUT_KEYS & record.keys():  # an output may echo its prompt_token_ids (--include-token-ids)
        return False
    return bool(INPUT_KEYS & record.keys()) or {"custom_id", "body"} <= record.keys()


def test_output_examples_name_their_input():
    _, outputs = json_examples()
    assert len(outputs) >= 5
    bad = [where for where, r in outputs if not ("custom_id" in r and "response" in r) and "id" not in r]
    assert not bad, "output examples that name no input: " + ", ".join(bad)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    """A tiny checkpoint whose vocabulary holds the real Qwen3 token ids the examples use (e.g. 9707)."""
    return write_tiny_qwen3(tmp_path_factory.mktemp("docs_qwen3"), vocab_size=16384, num_hidden_layers=1)


def test_jsonl_input_examples_are_answered(wide_model, tmp_path):
    inputs, _ = json_examples()
    assert len(inputs) >= 8
    lines = []
    for where, record in inputs:
        record = json.loads(json.dumps(record))
        params = record["body"] if "body" in record else record
        record["custom_id" if "body" in record else "id"] = where  # unique, and says where a failure came from
        if "max_tokens" in params:
            params["max_tokens"] = min(params["max_tokens"], 4)  # the tiny model's text is noise anyway
        lines.append(orjson.dumps(record))
    src = tmp_path / "examples.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["generate", str(src), "-o", str(out), "--model", str(wide_model), "--device",
                                      "cpu", "--max-model-len", "256", "--max-num-seqs", "16", "--max-tokens", "4",
                                      "--strict", "--on-error", "skip", "-q"])
    answers = {r.get("custom_id", r.get("id")): r for r in map(orjson.loads, out.read_bytes().splitlines())}
    failed = {k: r.get("error") or r["response"]["body"].get("error") for k, r in answers.items()
              if "error" in r and r["error"] or "response" in r and r["response"]["status_code"] != 200}
    assert not failed, "documented input examples llmcli rejects:\n" + "\n".join(f"{k}: {e}" for k, e in failed.items())
    assert set(answers) == {where for where, _ in inputs}
    assert result.exit_code == 0, result.output


def test_commands_on_the_bundled_model_run(monkeypatch):
    runs = [(b.where, argv) for b in ALL_BLOCKS if b.lang == "bash" for argv in shell_commands(b.text)
            if TINY in argv]
    assert runs, f"no documented command uses {TINY}"
    monkeypatch.chdir(REPO)  # the docs' paths are relative to the checkout
    for where, argv in runs:
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 0, f"{where}: llmcli {' '.join(argv)}\n{result.output}"
        if argv[0] == "generate" and "-o -" in " ".join(argv):
            assert [orjson.loads(line) for line in result.stdout.splitlines()], f"{where}: nothing on stdout"


@pytest.mark.parametrize("page", [p for p in PAGES if any(b.lang == "python" and not b.not_tested
                                                            for b in blocks(p))], ids=lambda p: p.name)
def test_python_examples_run(page, wide_model, monkeypatch):
    from llmcli import LLM

    monkeypatch.chdir(REPO)
    namespace: dict = {"__name__": "docs_example"}
    try:
        for b in (b for b in blocks(page) if b.lang == "python" and not b.not_tested):
            # A hub id stands for any checkpoint: the tiny one with the real token ids runs offline.
            source = re.sub(r"\"Qwen/Qwen3-[\w.-]+\"", repr(str(wide_model)), b.text)
            exec(compile(source, b.where, "exec"), namespace)
    finally:
        for value in namespace.values():
            if isinstance(value, LLM):
                value.shutdown()


def test_engine_settings_table_lists_every_config_field():
    from llmcli.config import Config

    page = (REPO / "docs" / "python-api.md").read_text()
    section = page[page.index("## Engine settings"):]
    section = section[:section.index("\n## ", 1)]
    documented = set(re.findall(r"^\| `(\w+)` \|", section, flags=re.M))
    fields = {f.name for f in dataclasses.fields(Config) if f.init and f.repr} - {"model"}  # LLM's first argument
    assert documented == fields, f"not documented: {sorted(fields - documented)}; no such field: {sorted(documented - fields)}"


def test_relative_links_resolve():
    def slug(heading: str) -> str:
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    pages = PAGES + [REPO / "ARCHITECTURE.md"]
    headings = {p: {slug(h) for h in re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", p.read_text(), flags=re.S),
                                                 flags=re.M)} for p in pages}
    bad = []
    for page in pages:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"\w+:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                bad.append(f"{page.name}: {link}: no such file")
            elif anchor and target.suffix == ".md" and anchor not in headings.get(target, set()):
                bad.append(f"{page.name}: {link}: no such heading")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("page", ["README.md", "docs/models.md"])
def test_family_tables_list_every_architecture_once(page):
    """Each architecture the registry runs has exactly one row in the page's family table (its first column), so a
    merged family (gpt-oss, Gemma 4) is neither missing nor listed twice."""
    from collections import Counter

    from llmcli.models import MODEL_REGISTRY

    rows = [line.split("|")[1] for line in (REPO / page).read_text().splitlines()
            if re.match(r"^\| `\w+For(CausalLM|ConditionalGeneration)`", line)]
    named = Counter(name for cell in rows for name in re.findall(r"`(\w+ForCausalLM)`", cell))
    wrong = {arch: named[arch] for arch in MODEL_REGISTRY if named[arch] != 1}
    assert not wrong, f"{page}: rows per architecture {wrong}"
    assert set(named) <= set(MODEL_REGISTRY), f"{page}: no such architecture {sorted(set(named) - set(MODEL_REGISTRY))}"
