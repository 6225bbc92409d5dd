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
from llmcli.engine.chat_messages import NO_IMAGES, ContentPartError, template_message

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


# -- type checks ----------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_stop(v: Any) -> bool:
    return v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


def _is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(t) for t in v)


_SAMPLING_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (_is_number, "a number"),
    "top_p": (_is_number, "a number"),
    "top_k": (_is_int, "an integer"),
    "min_p": (_is_number, "a number"),
    "max_tokens": (lambda v: v is None or _is_int(v), "an integer or null"),
    "stop": (_is_stop, "a string or a list of strings"),
    "stop_token_ids": (_is_int_list, "a list of integers"),
    "seed": (lambda v: v is None or _is_int(v), "an integer or null"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
    "n": (_is_int, "an integer"),
    "logprobs": (lambda v: v is None or _is_int(v), "an integer from 0 to 20 or null"),
    "prompt_logprobs": (lambda v: v is None or _is_int(v), "an integer from 0 to 20 or null"),
    "repetition_penalty": (_is_number, "a number"),
    "presence_penalty": (_is_number, "a number"),
    "frequency_penalty": (_is_number, "a number"),
    "min_tokens": (_is_int, "an integer"),
    "include_stop_str_in_output": (lambda v: isinstance(v, bool), "true or false"),
    "skip_special_tokens": (lambda v: isinstance(v, bool), "true or false"),
    "logit_bias": (lambda v: v is None or (isinstance(v, dict) and all(_is_number(x) for x in v.values())),
                   "an object of token id: number"),
    "bad_words": (lambda v: v is None or _is_stop(v), "a string or a list of strings"),
    "allowed_token_ids": (lambda v: v is None or _is_int_list(v), "a list of integers or null"),
    "truncate_prompt_tokens": (lambda v: v is None or _is_int(v), "an integer or null"),
    "skip_reading_prefix_cache": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
    "thinking_token_budget": (lambda v: v is None or _is_int(v), "an integer or null"),
}
SAMPLING_FIELDS = tuple(_SAMPLING_CHECKS)


def _type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


def _take_sampling(src: dict[str, Any], prefix: str) -> dict[str, Any]:
    found = {}
    for name, (check, wanted) in _SAMPLING_CHECKS.items():
        if name in src:
            value = src[name]
            if not check(value):
                raise FieldProblem(prefix + name, f"must be {wanted}, got {_describe(value)}")
            found[name] = value
    return found


def _describe(value: Any) -> str:
    # JSON integers past 64 bits are read as floats: say so rather than blame a number the user never wrote.
    if isinstance(value, float) and value.is_integer() and abs(value) >= 2**63:
        return f"an integer too large for 64 bits ({_short(value)})"
    return f"{_type_name(value)} {_short(value)}"


def _short(value: Any) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= 40 else text[:37] + "..."


# -- prompts --------------------------------------------------------------------
def _check_messages(messages: Any, name: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise FieldProblem(name, "must be a non-empty array of {role, content} objects")
    checked = []
    for i, msg in enumerate(messages):
        where = f"{name}[{i}]"
        if not isinstance(msg, dict):
            raise FieldProblem(where, f"must be an object, got {_type_name(msg)}")
        if not isinstance(msg.get("role"), str):
            raise FieldProblem(f"{where}.role", "must be a string")
        calls = msg.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
            raise FieldProblem(f"{where}.tool_calls", "must be an array of tool-call objects")
        try:  # OpenAI content parts (only text, for a text-only model); null beside tool_calls
            msg = template_message(msg)
        except ContentPartError as exc:
            raise FieldProblem(f"{where}.content[{exc.index}]", str(exc)) from None
        except ValueError:
            raise FieldProblem(f"{where}.content", f"must be a string, got {_type_name(msg.get('content'))}"
                               + (" (null only in an assistant turn with tool_calls)"
                                  if msg.get("content") is None else "")) from None
        if not isinstance(msg["content"], str):
            raise FieldProblem(f"{where}.content", f"must be a string, got {_type_name(msg['content'])}")
        checked.append(msg)
    return checked


def _check_token_ids(ids: Any, name: str) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise FieldProblem(name, "must be a non-empty array of token ids")
    for i, t in enumerate(ids):
        if not _is_int(t) or t < 0:
            raise FieldProblem(name, f"item {i} must be a non-negative integer, got {_describe(t)}")
    return ids


def _check_text(text: Any, name: str) -> str:
    if not isinstance(text, str):
        raise FieldProblem(name, f"must be a string, got {_type_name(text)}")
    if not text:
        raise FieldProblem(name, "is empty")
    return text


# constraint fields, parsed by cli/io/structured_fields.py
STRUCTURED_FIELDS = ("structured_outputs", "response_format", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")


def _known(openai_body: bool) -> set[str]:
    # Read at call time, so sampling fields added to _SAMPLING_CHECKS are known at once.
    if openai_body:
        return {"messages", "prompt", "chat_template_kwargs", "reasoning_effort", "top_logprobs", *STRUCTURED_FIELDS,
                *OPENAI_BODY_EXTRA, *OPENAI_ONLY_FIELDS, *_SAMPLING_CHECKS}
    return {"id", "chat_template_kwargs", "reasoning_effort", *PROMPT_FIELDS, *_SAMPLING_CHECKS, *STRUCTURED_FIELDS,
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
        raise FieldProblem(name, f"must be an object, got {_type_name(value)}")
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
        if isinstance(value, list) and value and all(_is_int(t) for t in value):
            rec.kind, rec.prompt = "prompt_token_ids", _check_token_ids(value, "prompt")
        else:
            rec.prompt = _check_text(value, "prompt")
    elif rec.kind == "messages":
        rec.prompt = _check_messages(value, "messages")
    else:
        rec.prompt = _check_token_ids(value, "prompt_token_ids")
    rec.sampling = _take_sampling(obj, "")
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
        raise FieldProblem("method", f'must be "POST", got {_short(method)}')
    url = obj.get("url")
    if url not in OPENAI_ENDPOINTS:
        raise FieldProblem("url", f"must be one of {', '.join(OPENAI_ENDPOINTS)}, got {_short(url)}")
    rec.openai.url = url
    body = obj.get("body")
    if not isinstance(body, dict):
        raise FieldProblem("body", f"must be an object, got {_type_name(body)}")
    _refuse_media(body, "body.")
    rec.unknown = (unknown_fields(obj, ("custom_id", "method", "url", "body"))
                   + unknown_fields(body, _known(openai_body=True), prefix="body."))
    body = _aliased(body, "body.")
    check_unhonoured(body)
    rec.chat_template_kwargs = _template_kwargs(body, "body.chat_template_kwargs")
    if rec.openai.chat:
        if "echo" in body:
            raise FieldProblem("body.echo", "is a /v1/completions field")
        rec.kind, rec.prompt = "messages", _check_messages(body.get("messages"), "body.messages")
        sampling = _take_sampling({k: v for k, v in body.items() if k != "logprobs"}, "body.")
        sampling.update(_chat_logprobs(body))
        rec.chat_template_kwargs = take_tools(body, rec.chat_template_kwargs)
    else:
        for name in ("tools", "tool_choice"):
            if name in body:
                raise FieldProblem(f"body.{name}", "is a /v1/chat/completions field")
        rec.kind, rec.prompt = _openai_prompt(body.get("prompt"))
        sampling = _take_sampling(body, "body.")
        rec.openai.echo = take_echo(body, sampling)
    rec.chat_template_kwargs = take_reasoning_effort(body, "body.", rec.chat_template_kwargs, rec.openai.chat)
    rec.sampling = sampling
    _take_structured(rec, body, "body.")


def _chat_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    """Chat completions ask with ``logprobs: true`` and ``top_logprobs: k``; plain records with ``logprobs: k``."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise FieldProblem("body.logprobs", f"must be true or false, got {_type_name(wanted)} {_short(wanted)}")
    if top is not None and (not _is_int(top) or not 0 <= top <= 20):
        raise FieldProblem("body.top_logprobs", f"must be an integer from 0 to 20, got {_describe(top)}")
    if top is not None and not wanted:
        raise FieldProblem("body.top_logprobs", "needs \"logprobs\": true")
    return {"logprobs": top or 0} if wanted else {}


def _openai_prompt(prompt: Any) -> tuple[str, Any]:
    name = "body.prompt"
    if isinstance(prompt, list) and prompt and not all(_is_int(t) for t in prompt):
        # OpenAI allows a batch of prompts in one request; one line is one request here.
        if len(prompt) != 1:
            raise FieldProblem(name, "holds several prompts; put one prompt per line")
        prompt = prompt[0]
    if isinstance(prompt, list):
        return "prompt_token_ids", _check_token_ids(prompt, name)
    return "prompt", _check_text(prompt, name)


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
        rec.fail(None, f"must be a JSON object, got {_type_name(obj)}")
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
                                   + ("none" if custom_id is None else _describe(custom_id)))
        elif "id" in obj:
            if not (isinstance(obj["id"], str) or _is_int(obj["id"])):
                raise FieldProblem("id", f"must be a string or an integer, got {_type_name(obj['id'])}")
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
    rec.fail(name, f"duplicate {name} {_short(rec.out_id)} (first used on {where} {first_line})")
