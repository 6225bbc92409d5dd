"""Why a prepared record's request can never run on this engine, in the record's words: the field the user
wrote that causes it, and the flags that fix it (only a pool too small is fixed by a bigger KV cache)."""
from __future__ import annotations

from llmcli.cli.io.prepare import PreparedRequest
from llmcli.engine.engine_api import EngineAPI
from llmcli.engine.sequence import PoolTooSmall, RequestRejected

POOL_FLAGS = "--num-kvcache-blocks / --gpu-memory-utilization"


def first_rejection(engine: EngineAPI, item: PreparedRequest) -> tuple[int, RequestRejected] | None:
    """The first of ``item``'s engine requests the engine can never run, with its refusal; None if all can."""
    for i, params in enumerate(item.params):
        try:
            engine.check_fits(item.prompt_of(i), params)
        except RequestRejected as exc:
            return i, exc
    return None


def rejection(item: PreparedRequest, index: int, exc: RequestRejected) -> tuple[str, str]:
    """``(field, message)`` for the ``index``-th engine request of ``item``, refused with ``exc``."""
    rec = item.record
    if not isinstance(exc, PoolTooSmall):
        return rec.prompt_field(), str(exc)
    if rec.score is not None:  # one generated token that nobody reads, and no max_tokens to lower
        n = len(item.prompt_of(index))
        if rec.score.kind == "perplexity":
            field, what = rec.prompt_field(), f"the text is {n} tokens"
        else:
            field, what = f"continuations[{index}]", f"prompt and continuation are {n} tokens"
        return field, (f"{what}, which need {exc.blocks} KV blocks to score, but the whole pool has {exc.pool}; "
                       f"give the cache more memory ({POOL_FLAGS})")
    if exc.prompt_alone:
        return rec.prompt_field(), f"{exc} ({POOL_FLAGS})"
    message = f"{exc} ({POOL_FLAGS})"
    if not item.limit_set:
        message += "; the record sets no max_tokens, so it may run to max_model_len: give it one, or --max-tokens"
    return rec.field_name("max_tokens"), message
