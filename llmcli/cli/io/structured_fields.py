"""Structured-output fields of a record (vLLM's ``structured_outputs``, OpenAI ``response_format``, the older
vLLM ``guided_*``) and the
``--response-format`` / ``--json-schema`` files, as StructuredOutputsParams checked before the engine starts."""
from __future__ import annotations

from typing import Any

from llmcli.cli.io.field_problem import FieldProblem
from llmcli.sampling_params import SamplingParamsError, StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# vLLM's StructuredOutputsParams (>= 0.12): the constraints llmcli honours, and the keys it knows but cannot
# honour (an input error when set, never ignored). disable_fallback is moot: llmcli has one grammar backend.
STRUCTURED_OUTPUTS_KINDS = ("json", "regex", "choice", "grammar", "json_object")
STRUCTURED_OUTPUTS_UNSUPPORTED = {
    "structural_tag": "structural tags are not supported",
    "whitespace_pattern": "a custom whitespace pattern is not supported",
    "disable_any_whitespace": "JSON without any whitespace is not supported",
    "disable_additional_properties": "this switch is not supported (set additionalProperties: false in the schema)",
}
STRUCTURED_OUTPUTS_MOOT = ("disable_fallback",)
NO_CONSTRAINT = "text"  # response_format {"type": "text"}: explicitly unconstrained (overrides a CLI default)


def response_format(value: Any, name: str) -> StructuredOutputsParams | str:
    """OpenAI's ``response_format`` object as a constraint, or NO_CONSTRAINT."""
    if not isinstance(value, dict):
        raise FieldProblem(name, 'must be an object such as {"type": "json_object"}')
    kind = value.get("type")
    if kind == "text":
        return NO_CONSTRAINT
    if kind == "json_object":
        return _params(name, json_object=True)
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict):
            raise FieldProblem(f"{name}.json_schema", 'must be an object {"name": ..., "schema": {...}}')
        schema = inner.get("schema")
        if not isinstance(schema, dict):
            raise FieldProblem(f"{name}.json_schema.schema", "must be a JSON schema object")
        return _params(f"{name}.json_schema.schema", json=schema)
    raise FieldProblem(f"{name}.type", f'must be "json_schema", "json_object" or "text", got {kind!r}')


def structured_outputs(value: Any, name: str) -> tuple[StructuredOutputsParams, str]:
    """vLLM's ``structured_outputs`` object as a constraint, and the dotted name of the key that gave it."""
    if not isinstance(value, dict):
        raise FieldProblem(name, 'must be an object such as {"json": {...}}, {"regex": "..."} or {"choice": [...]}')
    for key, item in value.items():
        if key in STRUCTURED_OUTPUTS_UNSUPPORTED and item not in (None, False):
            raise FieldProblem(f"{name}.{key}", STRUCTURED_OUTPUTS_UNSUPPORTED[key] + " by llmcli (it honours "
                                                + ", ".join(STRUCTURED_OUTPUTS_KINDS) + ")")
        if key not in STRUCTURED_OUTPUTS_KINDS and key not in STRUCTURED_OUTPUTS_UNSUPPORTED \
                and key not in STRUCTURED_OUTPUTS_MOOT:
            raise FieldProblem(f"{name}.{key}", "unknown constraint; give one of " + ", ".join(STRUCTURED_OUTPUTS_KINDS))
    given = {k: value[k] for k in STRUCTURED_OUTPUTS_KINDS if value.get(k) not in (None, False)}
    if len(given) != 1:
        raise FieldProblem(name, "give exactly one of " + ", ".join(STRUCTURED_OUTPUTS_KINDS)
                           + f" (got {', '.join(given) or 'none'})")
    (kind, item), = given.items()
    if kind == "json_object" and item is not True:
        raise FieldProblem(f"{name}.json_object", "must be true or false")
    return _params(f"{name}.{kind}", **{kind: item}), f"{name}.{kind}"


def _params(name: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except SamplingParamsError as exc:
        raise FieldProblem(name, str(exc).split(": ", 1)[-1]) from None


def take_structured(src: dict[str, Any], prefix: str) -> tuple[StructuredOutputsParams | str | None, str | None]:
    """The record's constraint (or NO_CONSTRAINT, or None when it gives none) and the field that gave it."""
    given = [f for f in ("structured_outputs", "response_format", *GUIDED_FIELDS) if f in src and src[f] is not None]
    if not given:
        return None, None
    if len(given) > 1:
        raise FieldProblem(prefix + given[1], f"conflicts with {given[0]}: give one structured-output field")
    name = prefix + given[0]
    if given[0] == "structured_outputs":
        return structured_outputs(src["structured_outputs"], name)
    if given[0] == "response_format":
        spec = response_format(src["response_format"], name)
        return spec, (f"{name}.json_schema.schema" if getattr(spec, "json", None) is not None else name)
    return _params(name, **{GUIDED_FIELDS[given[0]]: src[given[0]]}), name


def check(spec: StructuredOutputsParams, name: str) -> None:
    """Compile-check ``spec`` (cached per distinct constraint), reporting a problem as one of field ``name``."""
    from llmcli.engine.structured import GrammarError, check_constraint

    try:
        check_constraint(spec)
    except GrammarError as exc:
        raise FieldProblem(name, f"invalid {spec.kind.replace('_', ' ')}: {exc}") from None


def default_constraint(response_format_file: Any, json_schema_file: Any) -> StructuredOutputsParams | None:
    """The constraint of ``--response-format FILE`` or ``--json-schema FILE``, checked (UsageError if bad)."""
    import orjson

    from llmcli.cli.usage_error import UsageError

    if response_format_file is not None and json_schema_file is not None:
        raise UsageError("--response-format and --json-schema: give only one")
    path, flag = (response_format_file, "--response-format") if response_format_file is not None \
        else (json_schema_file, "--json-schema")
    if path is None:
        return None
    try:
        value = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise UsageError(f"{flag} {path}: cannot read it as JSON ({exc})") from None
    try:
        if flag == "--json-schema":
            if not isinstance(value, dict):
                raise FieldProblem(None, "must hold a JSON schema object")
            spec: Any = _params(flag, json=value)
        else:
            spec = response_format(value, flag)
        if spec == NO_CONSTRAINT:
            return None
        check(spec, flag)
    except FieldProblem as problem:
        raise UsageError(f"{flag} {path}: {problem.message}") from None
    return spec


def flag_constraint(choice: list[str] | None, regex: str | None) -> StructuredOutputsParams | None:
    """The constraint of ``--choice a,b,c`` or ``--regex R``, compile-checked (UsageError if bad)."""
    from llmcli.cli.usage_error import UsageError

    if choice is not None and regex is not None:
        raise UsageError("--choice and --regex: give only one")
    if choice is None and regex is None:
        return None
    flag, kwargs = ("--choice", {"choice": choice}) if choice is not None else ("--regex", {"regex": regex})
    try:
        spec = _params(flag, **kwargs)
        check(spec, flag)
    except FieldProblem as problem:
        raise UsageError(f"{flag}: {problem.message}") from None
    return spec
