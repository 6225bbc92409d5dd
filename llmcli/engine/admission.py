"""A request's way in: its prompt as token ids, and the admission rule (whether it can ever run on this engine)."""
from __future__ import annotations

from typing import Any

from llmcli.config import Config
from llmcli.engine.kv_groups import blocks_needed
from llmcli.engine.prompt_encoding import encode_texts
from llmcli.engine.sequence import PoolTooSmall, RequestRejected
from llmcli.sampling_params import SamplingParams


def check_request_fits(token_ids: list[int], params: SamplingParams, config: Config,
                       num_blocks: int | None = None, kv_windows: tuple[int | None, ...] = (None,)) -> None:
    """The admission rule: a prompt leaving room to generate, valid ids, and (given the pool and its KV groups'
    windows) enough blocks for the most the request holds at once."""
    n, limit = len(token_ids), config.max_model_len
    if n == 0:
        raise RequestRejected("the prompt is empty: at least one token is needed")
    if n >= limit:
        raise RequestRejected(f"the prompt has {n} tokens but max_model_len is {limit}, which leaves no room "
                              "to generate; shorten the prompt or raise max_model_len")
    vocab = config.hf_config.vocab_size
    if max(token_ids) >= vocab or min(token_ids) < 0:
        raise RequestRejected(f"prompt token ids must be in [0, {vocab}) for this model")
    for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise RequestRejected(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")
    longest = min(n + (params.max_tokens or limit), limit)
    bs, pool = config.kvcache_block_size, num_blocks
    need = blocks_needed(longest, kv_windows, bs, bs)  # a window group's prompt chunks shrink to what is free
    if pool is None or need <= pool:
        return
    alone = blocks_needed(n + 1, kv_windows, bs, bs)
    if alone > pool:  # max_tokens is not the cause: no request this long fits, whatever it generates
        raise PoolTooSmall(f"the prompt is {n} tokens, which with one generated token need {alone} KV blocks, "
                           f"but the whole pool has {pool}; shorten the prompt or give the cache more memory",
                           prompt_alone=True, blocks=alone, pool=pool)
    raise PoolTooSmall(f"the request may grow to {longest} tokens, which needs {need} KV blocks, but "
                       f"the whole pool has {pool}; lower max_tokens or give the cache more memory",
                       blocks=need, pool=pool)


def encode_prompt(tokenizer: Any | None, prompt: str | list[int], model: str) -> list[int]:
    """Token ids of a prompt given as plain text (with the tokenizer's special tokens, BOS for Llama 3 and
    Mistral) or already as ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestRejected(f"model {model} has no tokenizer: give prompts as token ids")
        return encode_texts(tokenizer, [prompt])[0]
    return list(prompt)


def truncate_prompt(token_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt cut to its last ``truncate_prompt_tokens`` tokens (-1: what leaves room to generate one)."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return token_ids
    keep = max_model_len - 1 if keep == -1 else keep
    return token_ids[-keep:] if len(token_ids) > keep else token_ids


def bad_word_ids(tokenizer: Any | None, words: list[str] | None) -> list[int]:
    """The token ids that ``bad_words`` ban: each word as one token, with and without a leading space.

    A word that is several tokens would need the previous tokens at every step (ban the last one only
    after the others): not supported, so refused rather than half-applied."""
    if not words:
        return []
    if tokenizer is None:
        raise RequestRejected("bad_words needs the model's tokenizer, which it does not have")
    banned: list[int] = []
    for word in words:
        for spelling in (word.strip(), " " + word.strip()):
            ids = tokenizer.encode(spelling, add_special_tokens=False)
            if len(ids) != 1:
                raise RequestRejected(f"bad_words: {spelling!r} is {len(ids)} tokens; only words of one token "
                                      "(with and without a leading space) can be banned")
            banned += ids
    return sorted(set(banned))
