"""A request's way in: its prompt as token ids, and the admission rule (whether it can ever run on this engine)."""
from __future__ import annotations

from typing import Any

from llmcli.config import Config
from llmcli.engine.sequence import RequestRejected
from llmcli.sampling_params import SamplingParams


def check_request_fits(token_ids: list[int], params: SamplingParams, config: Config,
                       num_blocks: int | None = None) -> None:
    """The admission rule: a prompt leaving room to generate, valid ids, and (given the pool) enough blocks."""
    n, limit = len(token_ids), config.max_model_len
    if n == 0:
        raise RequestRejected("the prompt is empty: at least one token is needed")
    if n >= limit:
        raise RequestRejected(f"the prompt has {n} tokens but max_model_len is {limit}, which leaves no room "
                              "to generate; shorten the prompt or raise max_model_len")
    vocab = config.hf_config.vocab_size
    if max(token_ids) >= vocab or min(token_ids) < 0:
        raise RequestRejected(f"prompt token ids must be in [0, {vocab}) for this model")
    if params.prompt_logprobs is not None and config.tensor_parallel_size > 1:
        raise RequestRejected("prompt_logprobs is not supported with tensor parallelism yet "
                              "(logprobs of generated tokens are)")
    longest = min(n + (params.max_tokens or limit), limit)
    bs, pool = config.kvcache_block_size, num_blocks
    if pool is not None and (longest + bs - 1) // bs > pool:
        raise RequestRejected(f"the request may grow to {longest} tokens, which needs "
                              f"{(longest + bs - 1) // bs} KV blocks, but the whole pool has {pool}; "
                              "lower max_tokens or give the cache more memory")


def encode_prompt(tokenizer: Any | None, prompt: str | list[int], model: str) -> list[int]:
    """Token ids of a prompt given as text (no special tokens added) or already as ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestRejected(f"model {model} has no tokenizer: give prompts as token ids")
        return tokenizer.encode(prompt, add_special_tokens=False)
    return list(prompt)
