"""Start-up passes of the model runner: the activation-peak probe and the kernel-variant pass, on dummy inputs."""
from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn

from llmcli.config import Config
from llmcli.engine.state_pool import has_linear_layers
from llmcli.kernels.backend import AttentionBackend, AttentionMetadata
from llmcli.layers.logprobs import token_logprobs
from llmcli.layers.sampler import Sampler, SamplingRows

log = logging.getLogger("llmcli")
CPU_WARMUP_TOKENS = 256


class WarmupTarget(Protocol):
    """What these passes use of the model runner (it calls them while it starts, so they cannot import it)."""

    config: Config
    device: torch.device
    backend: AttentionBackend
    model: nn.Module
    sampler: Sampler
    num_blocks: int
    sampler_checked: bool  # the one-pass sampler's start-up check ran


def prefill_metadata(runner: WarmupTarget, q_lens: list[int], k_lens: list[int], tables: list[list[int]] | None,
                     ) -> AttentionMetadata:
    """A prefill step of chunks with these query and key counts, storing nothing (slots -1)."""
    dev = runner.device
    cu_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(dev)
    cu_k = torch.tensor([0] + k_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(dev)
    return AttentionMetadata(
        is_prefill=True, slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int64, device=dev),
        context_lens=torch.tensor(k_lens, dtype=torch.int32, device=dev),
        block_tables=None if tables is None else torch.tensor(tables, dtype=torch.int32, device=dev),
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens),
        has_prefix=tables is not None,
        rows=torch.full((len(q_lens),), -1, dtype=torch.int64, device=dev),  # the state pool's scratch slot
        has_initial_state=torch.tensor([k > q for q, k in zip(q_lens, k_lens)], dtype=torch.bool, device=dev),
    )


def prefill_dummy(runner: WarmupTarget, q_lens: list[int], k_lens: list[int], tables: list[list[int]] | None = None,
                  ) -> torch.Tensor:
    """The hidden states of a forward over such a prefill step, on token 0 (``prefill_metadata``)."""
    runner.backend.prepare(prefill_metadata(runner, q_lens, k_lens, tables))
    positions = torch.cat([torch.arange(k - q, k, device=runner.device) for q, k in zip(q_lens, k_lens)])
    return runner.model(torch.zeros(sum(q_lens), dtype=torch.int64, device=runner.device), positions)


def probe_lens(cfg: Config, tokens: int, many_rows: bool = False) -> list[int]:
    """The probe's chunks: ``tokens`` in chunks as long as ``max_model_len`` allows. ``many_rows`` (a hybrid model
    on CUDA): ``max_num_seqs`` rows, single tokens taken off the first chunk, as in a mixed step of that many decode
    rows: each row's linear-attention state is copied in and out of every Gated DeltaNet layer's varlen pass (the
    initial and final states: 2 MiB each per row on Qwen3.5-9B, gigabytes at a thousand rows), which one long
    chunk would leave out of the peak."""
    seq_len = min(cfg.max_model_len, tokens)
    lens = [seq_len] * min(tokens // seq_len, cfg.max_num_seqs)
    singles = min(cfg.max_num_seqs - len(lens), lens[0] - 1) if lens and many_rows else 0
    return [1] * singles + [lens[0] - singles] + lens[1:] if singles > 0 else lens


@torch.inference_mode()
def measure_activation_peak(runner: WarmupTarget) -> int:
    """Run the largest prefill the scheduler may send (no cache yet) and return its activation peak."""
    cfg, device = runner.config, runner.device
    tokens = cfg.max_num_batched_tokens if device.type == "cuda" else min(cfg.max_num_batched_tokens,
                                                                          CPU_WARMUP_TOKENS)
    lens = probe_lens(cfg, tokens, many_rows=device.type == "cuda" and has_linear_layers(cfg.hf_config))
    if not lens:
        return 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    hidden = prefill_dummy(runner, lens, lens)
    # the sampler at the largest decode batch is part of the peak too
    rows = torch.arange(min(cfg.max_num_seqs, hidden.shape[0]), device=device) % hidden.shape[0]
    logits = runner.model.compute_logits(hidden[rows])
    if logits is not None:
        check_finite(runner, logits)
        check_sampler(runner, logits.shape[-1])  # before the sampler's first use, so a failure falls back
        sample_dummy(runner, logits, use_filters=True)
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del hidden, logits
    torch.cuda.empty_cache()
    return peak


def check_finite(runner: WarmupTarget, logits: torch.Tensor) -> None:
    """Refuse a model whose logits on the warm-up prompt are not finite: it could answer nothing."""
    if not bool(torch.isfinite(logits).all()):
        from llmcli.models.loader import CheckpointError

        dtype = str(runner.config.torch_dtype).removeprefix("torch.")
        hint = "" if dtype == "float32" else f", or {dtype} overflows (try --dtype float32)"
        raise CheckpointError(f"the model {runner.config.model} produces non-finite logits (NaN or inf) on the "
                              f"start-up warm-up prompt in {dtype}: its weights or config.json values are "
                              f"damaged{hint}")


def check_sampler(runner: WarmupTarget, vocab_size: int) -> None:
    """Once, on CUDA: the one-pass Triton sampler against the torch path; off for good if it fails."""
    if runner.device.type != "cuda" or runner.sampler_checked:
        return
    runner.sampler_checked = True
    failure = runner.sampler.check_one_pass(vocab_size, runner.device)
    if failure:
        log.warning("the one-pass Triton sampler is off (%s); sampling uses the torch path", failure)


def sample_dummy(runner: WarmupTarget, logits: torch.Tensor, use_filters: bool) -> torch.Tensor:
    """One sampler call over ``logits`` with every sampling knob set (top-k/top-p only with ``use_filters``)."""
    b, dev = logits.shape[0], runner.device
    ones = torch.ones(b, device=dev)
    zeros = torch.zeros(b, dtype=torch.int64, device=dev)
    return runner.sampler(logits, SamplingRows(ones, torch.full((b,), 50, device=dev), ones * 0.9, ones * 0.05,
                                               zeros, zeros, use_filters))


@torch.inference_mode()
def compile_variants(runner: WarmupTarget) -> None:
    """Run every kernel variant a step can need once now, so no real step stops to compile one.

    Triton compiles one kernel per combination of compile-time choices (paged or not, the tile size
    that follows from the longest chunk, the sampler's logits dtype with and without top-k/top-p); left
    to the first real steps, those compilations stall them. Most were compiled meanwhile by the side
    compile's threads (llmcli.engine.side_compile), and then these launches only find them. Inputs are
    dummies over existing blocks; nothing is stored.
    """
    cfg = runner.config
    bs = cfg.kvcache_block_size
    biggest = min(cfg.max_num_batched_tokens, cfg.max_model_len - 1)
    for q_len in sorted({min(n, biggest) for n in runner.backend.prefill_variant_lengths}):
        prefill_dummy(runner, [q_len], [q_len])
        k_len = q_len + min(bs, cfg.max_model_len - q_len)  # a cached prefix: the paged path
        if k_len > q_len and -(-k_len // bs) <= runner.num_blocks:
            prefill_dummy(runner, [q_len], [k_len], [list(range(-(-k_len // bs)))])
    logits = runner.model.compute_logits(torch.zeros(2, cfg.hf_config.hidden_size, device=runner.device,
                                                     dtype=cfg.torch_dtype))
    if logits is not None:
        check_sampler(runner, logits.shape[-1])
        sample_dummy(runner, logits, use_filters=False)
        sample_dummy(runner, logits, use_filters=True)
        for k in (1, 5):  # builds the logprobs kernels too (top-k widths 1 and 8; others on first use)
            token_logprobs(logits, logits.argmax(dim=-1), k)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
