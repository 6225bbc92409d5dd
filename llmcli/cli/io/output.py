"""Output records: what one finished (or rejected) input becomes in OUT."""
from __future__ import annotations

from typing import Any

from llmcli.engine.outputs import RequestOutput
from llmcli.cli.io.logprobs_format import plain_logprobs, plain_prompt_logprobs
from llmcli.cli.io.openai_format import openai_error, openai_result
from llmcli.cli.io.records import InputRecord


def _completion(out: RequestOutput, include_token_ids: bool, logprobs_k: int | None) -> dict[str, Any]:
    item: dict[str, Any] = {"text": out.text, "finish_reason": out.finish_reason}
    if include_token_ids:
        item["token_ids"] = list(out.token_ids)
    if logprobs_k is not None and out.logprobs is not None:
        item["logprobs"] = plain_logprobs(out.token_ids, out.logprobs, logprobs_k)
    return item


def result_record(rec: InputRecord, outputs: list[RequestOutput], *, model: str,
                  include_token_ids: bool = False) -> dict[str, Any]:
    """The output line for ``rec``; ``outputs`` are its n completions in index order."""
    if rec.openai is not None:
        return openai_result(rec, outputs, model)
    line: dict[str, Any] = {"id": rec.out_id}
    k = rec.sampling.get("logprobs")
    if len(outputs) == 1:
        line.update(_completion(outputs[0], include_token_ids, k))
    else:
        line["choices"] = [{"index": i, **_completion(o, include_token_ids, k)} for i, o in enumerate(outputs)]
    prompt_k = rec.sampling.get("prompt_logprobs")
    if prompt_k is not None and outputs[0].prompt_logprobs is not None:
        line["prompt_logprobs"] = plain_prompt_logprobs(outputs[0].prompt_token_ids, outputs[0].prompt_logprobs,
                                                        prompt_k)
    line["usage"] = {
        "prompt_tokens": len(outputs[0].prompt_token_ids),
        "completion_tokens": sum(len(o.token_ids) for o in outputs),
    }
    return line


def error_record(rec: InputRecord) -> dict[str, Any]:
    """The output line saying why ``rec`` was not run."""
    if rec.openai is not None:
        return openai_error(rec)
    err = rec.error
    return {"id": rec.out_id, "error": {"message": err.message, "line": err.line, "field": err.field}}
