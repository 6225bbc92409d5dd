"""Output lines of score records: per-token logprobs, totals, ``is_greedy`` and perplexity."""
from __future__ import annotations

import math
from typing import Any

from llmcli.cli.io.records import InputRecord
from llmcli.engine.outputs import RequestOutput


def _scored(out: RequestOutput, first: int) -> tuple[list[float], bool]:
    """Prompt logprobs of the tokens from position ``first`` on, and whether each is the likeliest token."""
    ids, positions = out.prompt_token_ids, out.prompt_logprobs
    chosen = [positions[j][ids[j]] for j in range(first, len(ids))]
    return [lp.logprob for lp in chosen], all(lp.rank == 1 for lp in chosen)


def score_result(rec: InputRecord, outputs: list[RequestOutput], include_token_ids: bool = False) -> dict[str, Any]:
    """The line answering a score record (``rec.score``); ``outputs``: one per continuation, or one."""
    line: dict[str, Any] = {"id": rec.out_id}
    if rec.score.kind == "perplexity":
        out = outputs[0]
        logprobs, greedy = _scored(out, 1)  # the first token has no context
        total = sum(logprobs)
        line.update({"logprob": total, "num_scored_tokens": len(logprobs),
                     "perplexity": math.exp(-total / len(logprobs)), "is_greedy": greedy,
                     "token_logprobs": [None, *logprobs]})
        if include_token_ids:
            line["token_ids"] = list(out.prompt_token_ids)
        line["usage"] = {"prompt_tokens": len(out.prompt_token_ids)}
        return line
    items = []
    for text, cont, out in zip(rec.score.continuations, rec.score.continuation_ids, outputs):
        logprobs, greedy = _scored(out, len(out.prompt_token_ids) - len(cont))
        item = {"continuation": text, "logprob": sum(logprobs), "is_greedy": greedy, "token_logprobs": logprobs}
        if include_token_ids:
            item["token_ids"] = list(cont)
        items.append(item)
    line["continuations"] = items
    line["usage"] = {"prompt_tokens": len(outputs[0].prompt_token_ids) - len(rec.score.continuation_ids[0])}
    return line
