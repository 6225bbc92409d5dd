"""Input records: parse and type-check one JSONL line into a request (plain or OpenAI batch)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import orjson

from llmcli.cli.io.field_problem import FieldProblem
from llmcli.cli.io.reasoning_effort import take_reasoning_effort
from llmcli.cli.io.openai_fields import OPENAI_ONLY_FIELDS, Echo, check_unhonoured, take_echo, take_tools
from llmcli.cli.io.fields import OPENAI_BODY_EXTRA, AliasConflict, resolve_aliases, unknown_fields
from llmcli.cli.io.score_fields import SCORE_FIELDS, Score, take_score
from llmcli.cli.io.source import RawLine
from llmcli.cli.io.value_checks import (SAMPLING_CHECKS, check_messages, check_text, check_token_ids, describe,
                                       is_int, short, take_sampling, type_name)
from llmcli.engine.chat_messages import NO_IMAGES

PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
# vLLM's offline multi-modal inputs and the image fields of datasets: refused, never dropped with a warning
MEDIA_FIELDS = ("images", "image", "multi_modal_data")
# Deepest nesting a record may hold (README, reliability): the input fingerprint and the constraint
# compiler recurse, and orjson writes no more than 254 levels.
MAX_DEPTH = 128
OPENAI_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class OpenAIRequest:
    """What an OpenAI batch line adds to a plain request: its name and endpoint."""

    custom_id: str
    url: str  # one of OPENAI_ENDPOINTS
    echo: Echo | None = None  # /v1/completions with "echo": true

    @property
    def chat(self) -> bool:
        return self.url == "/v1/chat/completions"


@dataclass
class RecordError:
    """Why a line cannot be run; ``field`` is dotted (``body.temperature``) or None for the whole line."""

    line: int
    field: str | None
    message: str
    row: bool = False  # a table's row: ``line`` is its row number and ``field`` a column

    def describe(self, source: str) -> str:
        if self.row:
            where = f"{source}: row {self.line}"
            return f"{where}, column {self.field}: {self.message}" if self.field else f"{where}: {self.message}"
        where = f"{source}:{self.line}"
        return f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"


@dataclass
class InputRecord:
    """One input line, parsed. Exactly one of ``prompt`` (by ``kind``) or ``error`` is meaningful."""

    line: int  # 1-based line number
    out_id: Any  # what the output line's "id" says: the record's id, else the 0-based line index
    key: str  # resume key: which output line answers this input
    kind: str = ""  # "prompt" | "messages" | "prompt_token_ids"
    written: str = ""  # the prompt field as the record names it ("prompt" holding token ids is kind prompt_token_ids)
    prompt: Any = None  # str | list[dict] | list[int], by kind
    sampling: dict[str, Any] = field(default_factory=dict)  # per-record overrides, type-checked
    openai: OpenAIRequest | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    unknown: list[str] = field(default_factory=list)  # fields llmcli does not know (dotted), ignored
    error: RecordError | None = None
    structured_field: str | None = None  # the field that gave sampling["structured_outputs"], as written
    carry: dict[str, Any] | None = None  # a table row's kept columns, copied to its output line as they are
    columns: Callable[[str | None], str | None] | None = None  # a table row: the column a field came from
    score: Score | None = None  # a score record: continuations' log-likelihoods or the prompt's perplexity

    def fail(self, field_name: str | None, message: str) -> None:
        if self.columns is not None:
            self.error = RecordError(self.line, self.columns(field_name), message, row=True)
            return
        self.error = RecordError(self.line, field_name, message)

    def prompt_field(self) -> str:
        """The field that holds the prompt, as the user wrote it."""
        if self.openai is not None:
            return "body.messages" if self.kind == "messages" else "body.prompt"
        return self.written or self.kind or "prompt"

    def field_name(self, name: str) -> str:
        """The name of a field as the user wrote it (OpenAI fields live under ``body``)."""
        return f"body.{name}" if self.openai is not None else name


def record_key(value: Any, openai: bool) -> str:
    """Resume key of an input (or output) naming ``value`` as its id or custom_id."""
    return ("custom_id:" if openai else "id:") + orjson.dumps(value).decode()


def output_key(obj: dict[str, Any]) -> str | None:
    """Resume key of an output line, or None if it names no input."""
    if "custom_id" in obj and "response" in obj:
        return record_key(obj["custom_id"], openai=True)
    if "id" in obj:
        return record_key(obj["id"], openai=False)
    return None


# constraint fields, parsed by cli/io/structured_fields.py
STRUCTURED_FIELDS = ("structured_outputs", "response_format", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")


def _known(openai_body: bool) -> set[str]:
    # Read at call time, so sampling fields added to SAMPLING_CHECKS are known at once.
    if openai_body:
        return {"messages", "prompt", "chat_template_kwargs", "reasoning_effort", "top_logprobs", *STRUCTURED_FIELDS,
                *OPENAI_BODY_EXTRA, *OPENAI_ONLY_FIELDS, *SAMPLING_CHECKS}
    return {"id", "chat_template_kwargs", "reasoning_effort", *PROMPT_FIELDS, *SAMPLING_CHECKS, *STRUCTURED_FIELDS,
            *SCORE_FIELDS}


def did_you_mean(name: str) -> str | None:
    """The known field closest to an unknown (dotted) one, if any is close."""
    import difflib

    body = name.startswith("body.")
    bare = name[5:] if body else name
    match = difflib.get_close_matches(bare, sorted(_known(openai_body=body)), n=1, cutoff=0.75)
    return (("body." if body else "") + match[0]) if match else None


def _aliased(obj: dict[str, Any], prefix: str) -> dict[str, Any]:
    try:
        return resolve_aliases(obj)
    except AliasConflict as exc:
        raise FieldProblem(prefix + exc.alias, str(exc)) from None


def _template_kwargs(src: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = src.get("chat_template_kwargs")
    if value is not None and not isinstance(value, dict):
        raise FieldProblem(name, f"must be an object, got {type_name(value)}")
    return value


def _refuse_media(src: dict[str, Any], prefix: str) -> None:
    name = next((f for f in MEDIA_FIELDS if f in src), None)
    if name is not None:
        raise FieldProblem(prefix + name, f"{NO_IMAGES}; give the text alone")


def _parse_plain(rec: InputRecord, obj: dict[str, Any]) -> None:
    _refuse_media(obj, "")
    rec.unknown = unknown_fields(obj, _known(openai_body=False))
    obj = _aliased(obj, "")
    present = [f for f in PROMPT_FIELDS if f in obj]
    if not present:
        raise FieldProblem("prompt", "missing: give one of prompt, messages, prompt_token_ids")
    if len(present) > 1:
        raise FieldProblem(present[1], f"conflicts with {present[0]}: give only one prompt field")
    rec.kind = rec.written = present[0]
    value = obj[rec.kind]
    if rec.kind == "prompt":
        # A list of ints under "prompt" is the OpenAI convention for token ids.
        if isinstance(value, list) and value and all(is_int(t) for t in value):
            rec.kind, rec.prompt = "prompt_token_ids", check_token_ids(value, "prompt")
        else:
            rec.prompt = check_text(value, "prompt")
    elif rec.kind == "messages":
        rec.prompt = check_messages(value, "messages")
    else:
        rec.prompt = check_token_ids(value, "prompt_token_ids")
    rec.sampling = take_sampling(obj, "")
    rec.chat_template_kwargs = take_reasoning_effort(obj, "", _template_kwargs(obj, "chat_template_kwargs"),
                                                     rec.kind == "messages")
    _take_structured(rec, obj, "")
    rec.score = take_score(obj, rec.sampling)


def _take_structured(rec: InputRecord, src: dict[str, Any], prefix: str) -> None:
    from llmcli.cli.io.structured_fields import take_structured

    spec, rec.structured_field = take_structured(src, prefix)
    if spec is not None:
        rec.sampling["structured_outputs"] = spec


def _parse_openai(rec: InputRecord, obj: dict[str, Any]) -> None:
    method = obj.get("method", "POST")
    if method != "POST":
        raise FieldProblem("method", f'must be "POST", got {short(method)}')
    url = obj.get("url")
    if url not in OPENAI_ENDPOINTS:
        raise FieldProblem("url", f"must be one of {', '.join(OPENAI_ENDPOINTS)}, got {short(url)}")
    rec.openai.url = url
    body = obj.get("body")
    if not isinstance(body, dict):
        raise FieldProblem("body", f"must be an object, got {type_name(body)}")
    _refuse_media(body, "body.")
    rec.unknown = (unknown_fields(obj, ("custom_id", "method", "url", "body"))
                   + unknown_fields(body, _known(openai_body=True), prefix="body."))
    body = _aliased(body, "body.")
    check_unhonoured(body)
    rec.chat_template_kwargs = _template_kwargs(body, "body.chat_template_kwargs")
    if rec.openai.chat:
        if "echo" in body:
            raise FieldProblem("body.echo", "is a /v1/completions field")
        rec.kind, rec.prompt = "messages", check_messages(body.get("messages"), "body.messages")
        sampling = take_sampling({k: v for k, v in body.items() if k != "logprobs"}, "body.")
        sampling.update(_chat_logprobs(body))
        rec.chat_template_kwargs = take_tools(body, rec.chat_template_kwargs)
    else:
        for name in ("tools", "tool_choice"):
            if name in body:
                raise FieldProblem(f"body.{name}", "is a /v1/chat/completions field")
        rec.kind, rec.prompt = _openai_prompt(body.get("prompt"))
        sampling = take_sampling(body, "body.")
        rec.openai.echo = take_echo(body, sampling)
    rec.chat_template_kwargs = take_reasoning_effort(body, "body.", rec.chat_template_kwargs, rec.openai.chat)
    rec.sampling = sampling
    _take_structured(rec, body, "body.")


def _chat_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    """Chat completions ask with ``logprobs: true`` and ``top_logprobs: k``; plain records with ``logprobs: k``."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise FieldProblem("body.logprobs", f"must be true or false, got {type_name(wanted)} {short(wanted)}")
    if top is not None and (not is_int(top) or not 0 <= top <= 20):
        raise FieldProblem("body.top_logprobs", f"must be an integer from 0 to 20, got {describe(top)}")
    if top is not None and not wanted:
        raise FieldProblem("body.top_logprobs", "needs \"logprobs\": true")
    return {"logprobs": top or 0} if wanted else {}


def _openai_prompt(prompt: Any) -> tuple[str, Any]:
    name = "body.prompt"
    if isinstance(prompt, list) and prompt and not all(is_int(t) for t in prompt):
        # OpenAI allows a batch of prompts in one request; one line is one request here.
        if len(prompt) != 1:
            raise FieldProblem(name, "holds several prompts; put one prompt per line")
        prompt = prompt[0]
    if isinstance(prompt, list):
        return "prompt_token_ids", check_token_ids(prompt, name)
    return "prompt", check_text(prompt, name)


def _json_problem(data: bytes, exc: orjson.JSONDecodeError) -> str:
    if "not valid UTF-8" in str(exc):  # orjson says "surrogates not allowed" for any bad byte
        try:
            data.decode()
        except UnicodeDecodeError as bad:
            return (f"not valid UTF-8 (byte {bad.start + 1} of the line, {data[bad.start:bad.start + 1]!r}); "
                    "save the file as UTF-8")
    return f"not valid JSON ({exc})"


def _too_deep(obj: dict[str, Any]) -> str | None:
    """The top-level field holding values nested past MAX_DEPTH, if any (walked without recursion)."""
    for name, value in obj.items():
        stack = [(value, 2)]  # the record itself is level 1
        while stack:
            node, depth = stack.pop()
            if depth > MAX_DEPTH:
                return name
            values = node.values() if isinstance(node, dict) else node
            stack.extend((v, depth + 1) for v in values if isinstance(v, (dict, list)))
    return None


def parse_line(raw: RawLine) -> InputRecord:
    """Parse one input line. Problems are recorded in ``.error``, never raised."""
    index = raw.number - 1
    rec = InputRecord(line=raw.number, out_id=index, key=record_key(index, openai=False))
    try:
        obj = orjson.loads(raw.data)
    except orjson.JSONDecodeError as exc:
        rec.fail(None, _json_problem(raw.data, exc))
        return rec
    if not isinstance(obj, dict):
        rec.fail(None, f"must be a JSON object, got {type_name(obj)}")
        return rec
    try:
        if "custom_id" in obj or "body" in obj:
            custom_id = obj.get("custom_id")
            # Even a bad custom_id is an OpenAI line: its error line keeps the batch output's shape, whose
            # custom_id is a string: the one written, else "line-N" (the same name on every run, so --resume
            # finds it).
            named = custom_id if isinstance(custom_id, str) else f"line-{raw.number}"
            rec.openai = OpenAIRequest(custom_id=named, url="")
            rec.out_id, rec.key = named, record_key(named, openai=True)
            if not isinstance(custom_id, str) or not custom_id:
                raise FieldProblem("custom_id", "an OpenAI batch line needs a non-empty string custom_id, got "
                                   + ("none" if custom_id is None else describe(custom_id)))
        elif "id" in obj:
            if not (isinstance(obj["id"], str) or is_int(obj["id"])):
                raise FieldProblem("id", f"must be a string or an integer, got {type_name(obj['id'])}")
            rec.out_id, rec.key = obj["id"], record_key(obj["id"], openai=False)
        # Checked once the record's name is known, so its error line carries its own id. Nesting deeper than
        # MAX_DEPTH needs more brackets than that: most lines are not walked at all.
        deep = _too_deep(obj) if raw.data.count(b"{") + raw.data.count(b"[") > MAX_DEPTH else None
        if deep is not None:
            raise FieldProblem(deep, f"is nested more than {MAX_DEPTH} levels deep, which llmcli does not accept")
        if rec.openai is not None:
            _parse_openai(rec, obj)
        else:
            _parse_plain(rec, obj)
    except FieldProblem as problem:
        rec.prompt = None
        rec.fail(problem.field, problem.message)
    return rec


def mark_duplicates(records: list[InputRecord]) -> list[InputRecord]:
    """Two inputs with one id could not be told apart in the output (nor by --resume); returns the repeats.

    A record without an id is named by its 0-based line index, so an explicit id equal to another line's
    index is a repeat too."""
    first_line: dict[str, int] = {}
    repeats = []
    for rec in records:
        if rec.key in first_line:
            describe_duplicate(rec, first_line[rec.key])
            repeats.append(rec)
        else:
            first_line[rec.key] = rec.line
    return repeats


def describe_duplicate(rec: InputRecord, first_line: int) -> None:
    """Mark ``rec`` as repeating the id of the record on ``first_line``."""
    name = "custom_id" if rec.openai is not None else "id"
    rec.prompt = None
    where = "row" if rec.columns is not None else "line"  # a table's rows are its lines
    rec.fail(name, f"duplicate {name} {short(rec.out_id)} (first used on {where} {first_line})")
