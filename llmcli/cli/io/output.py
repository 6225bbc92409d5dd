"""Output records: what one finished (or rejected) input becomes in OUT."""
from __future__ import annotations

from typing import Any

from llmcli.engine.outputs import RequestOutput
from llmcli.cli.io.logprobs_format import Bytes, plain_logprobs, plain_prompt_logprobs
from llmcli.cli.io.score_format import score_result
from llmcli.cli.io.openai_format import REASONING_FIELD, openai_error, openai_result
from llmcli.cli.io.reasoning import OutputSplitter, split_output
from llmcli.cli.io.records import InputRecord


def _metrics(out: RequestOutput) -> dict[str, Any]:
    first = out.first_token_time
    return {
        "time_to_first_token_s": round(first - out.arrival_time, 6) if first is not None else None,
        "total_time_s": round(out.finish_time - out.arrival_time, 6),
        "cached_prompt_tokens": out.num_cached_prompt_tokens,
    }


def _completion(out: RequestOutput, include_token_ids: bool, include_metrics: bool,
                reasoning: str | OutputSplitter | None, logprobs_k: int | None, reasoning_field: str) -> dict[str, Any]:
    split = split_output(reasoning, out)
    item: dict[str, Any] = {"text": split.content}
    if reasoning is not None:
        item[reasoning_field] = split.reasoning
    if split.tool_calls:
        item["tool_calls"] = split.tool_calls
    item["finish_reason"] = out.finish_reason
    if include_token_ids:
        item["token_ids"] = list(out.token_ids)
    if logprobs_k is not None and out.logprobs is not None:
        item["logprobs"] = plain_logprobs(out.token_ids, out.logprobs, logprobs_k)
    if include_metrics:
        item["metrics"] = _metrics(out)
    return item


def result_record(rec: InputRecord, outputs: list[RequestOutput], *, model: str, include_token_ids: bool = False,
                  include_metrics: bool = False, reasoning: str | OutputSplitter | None = None,
                  token_bytes: Bytes | None = None, reasoning_field: str = REASONING_FIELD) -> dict[str, Any]:
    """The output line for ``rec``; ``outputs`` are its n completions in index order.

    ``reasoning`` is the reasoning parser (its name, or a splitter that reads token ids; None: the text is
    left whole) and ``reasoning_field`` the field
    its thinking goes to; ``token_bytes`` gives chat logprobs' ``bytes`` (None: the UTF-8 of each token's text)."""
    if rec.score is not None:
        return score_result(rec, outputs, include_token_ids)
    if rec.openai is not None:
        return openai_result(rec, outputs, model, reasoning=reasoning, token_bytes=token_bytes,
                             reasoning_field=reasoning_field)
    line: dict[str, Any] = {"id": rec.out_id}
    k = rec.sampling.get("logprobs")
    # One shape whatever n is: the first completion at the top level (``jq .text`` works for any n), and
    # with n > 1 every completion in ``choices`` as well.
    line.update(_completion(outputs[0], include_token_ids, include_metrics, reasoning, k, reasoning_field))
    if len(outputs) > 1:
        line["choices"] = [{"index": i, **_completion(o, include_token_ids, include_metrics, reasoning, k,
                                                      reasoning_field)}
                           for i, o in enumerate(outputs)]
    if include_token_ids:
        line["prompt_token_ids"] = list(outputs[0].prompt_token_ids)
    prompt_k = rec.sampling.get("prompt_logprobs")
    if prompt_k is not None and outputs[0].prompt_logprobs is not None:
        line["prompt_logprobs"] = plain_prompt_logprobs(outputs[0].prompt_token_ids, outputs[0].prompt_logprobs,
                                                        prompt_k)
    prompt = len(outputs[0].prompt_token_ids)
    completion = sum(len(o.token_ids) for o in outputs)
    line["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return _carried(rec, line)


def _carried(rec: InputRecord, line: dict[str, Any]) -> dict[str, Any]:
    """A table row's kept columns after the output's own fields (``cli/io/tables.py`` renames clashes)."""
    if rec.carry:
        line.update(rec.carry)
    return line


def error_record(rec: InputRecord) -> dict[str, Any]:
    """The output line saying why ``rec`` was not run."""
    if rec.openai is not None:
        return openai_error(rec)
    err = rec.error
    return _carried(rec, {"id": rec.out_id, "error": {"message": err.message, "line": err.line, "field": err.field}})
