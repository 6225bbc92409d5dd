"""Log probabilities on the device: the chosen token's and the top k, from the raw logits.

"Raw" is the model's own distribution, ``log_softmax(logits)``, before penalties,
temperature and the top-k / top-p / min-p filters (vLLM's default). Nothing of
size vocab is written or leaves the device: a logprob is ``logit - logsumexp(row)``
and the top k logprobs are those of the top k logits. On CUDA one Triton kernel
reads the logits once (``llmcli.kernels.triton_logprobs``); elsewhere (and with
LLMCLI_EAGER=1) the same in torch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class TokenLogprobs:
    """Per row: the target token's logprob and rank (1 = likeliest), and the k likeliest tokens."""

    logprobs: torch.Tensor  # [R] float32
    ranks: torch.Tensor  # [R] int64
    top_ids: torch.Tensor  # [R, k] int64
    top_logprobs: torch.Tensor  # [R, k] float32


def _target_logprobs(logits: torch.Tensor, targets: torch.Tensor):
    """Logsumexp, the target's logprob and its rank."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    chosen = x.gather(1, targets[:, None]).squeeze(1)
    ranks = (x > chosen[:, None]).sum(dim=-1) + 1
    return chosen - lse, ranks, lse


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> TokenLogprobs:
    """Logprobs of ``targets`` [R] under ``logits`` [R, V], and the top ``k`` (k may be 0)."""
    if logits.is_cuda and os.environ.get("LLMCLI_EAGER") != "1":
        from llmcli.kernels.triton_logprobs import token_logprobs_triton

        return TokenLogprobs(*token_logprobs_triton(logits, targets, k))
    chosen, ranks, lse = _target_logprobs(logits, targets)
    if k > 0:
        top_values, top_ids = logits.topk(k, dim=-1)  # in the logits' own dtype: the order is the same
        top_logprobs = top_values.float() - lse[:, None]
    else:
        top_logprobs = lse.new_zeros(logits.shape[0], 0)
        top_ids = targets.new_zeros(logits.shape[0], 0)
    return TokenLogprobs(chosen, ranks, top_ids, top_logprobs)


PROMPT_CHUNK = 256  # rows of prompt logits at a time; every tensor-parallel rank cuts the same chunks


def chunked_token_logprobs(hidden: torch.Tensor, targets: torch.Tensor, k: int, compute_logits,
                           chunk: int = PROMPT_CHUNK) -> TokenLogprobs:
    """``token_logprobs`` over many rows of hidden states, ``chunk`` rows of logits at a time (prompts).

    A chunk's logits stay below what start-up measured for the sampler (``max_num_seqs`` rows), so a long
    prompt cannot push the step past the memory the KV pool left free."""
    parts = [token_logprobs(compute_logits(hidden[i:i + chunk]), targets[i:i + chunk], k)
             for i in range(0, hidden.shape[0], chunk)]
    return TokenLogprobs(*(torch.cat([getattr(p, f) for p in parts]) for f in
                           ("logprobs", "ranks", "top_ids", "top_logprobs")))


def worker_prompt_logits(hidden: torch.Tensor, compute_logits, chunk: int = PROMPT_CHUNK) -> None:
    """A tensor-parallel worker's part of ``chunked_token_logprobs``: the same ``compute_logits`` calls, chunk
    for chunk (each gathers every rank's vocabulary shard on rank 0), with nothing kept."""
    for i in range(0, hidden.shape[0], chunk):
        compute_logits(hidden[i:i + chunk])
