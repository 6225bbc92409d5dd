"""Batched sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Randomness comes from a counter-based hash of (request seed, generation step,
token id), turned into Gumbel noise. Each request's draws therefore depend only on
its own seed and step, never on what it is batched with.
"""
from __future__ import annotations

import torch
from torch import nn

from llmcli.layers.compile import compile_on_cuda

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer bijection with good avalanche, in int64 arithmetic that cannot overflow."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[B] 32-bit keys (in int64) of each row's random stream, from its request's seed and step."""
    return _mix32(_mix32((seeds & _M32) ^ _mix32((seeds >> 32) & _M32)) ^ (steps & _M32))


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] floats in (0, 1), a pure function of (seed, step, token id)."""
    row = row_keys(seeds, steps)
    ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix32(row[:, None] ^ ids[None, :]) >> 8  # keep 24 bits: exact in float32
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def filter_logits(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    k = torch.where(top_ks > 0, top_ks, logits.shape[-1])
    drop = ranks[None, :] >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_ps[:, None]  # keeps the smallest prefix whose mass reaches top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


compiled_row_keys = compile_on_cuda(row_keys)  # one fused kernel instead of a dozen tiny ones


@compile_on_cuda
def scale_logits(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """float32 logits divided by each row's temperature (greedy rows left as they are)."""
    logits = logits.float()
    return logits / torch.where(temperatures <= 0, 1.0, temperatures)[:, None]


@compile_on_cuda
def draw(logits, scaled, temperatures, min_ps, seeds, steps):
    """Gumbel-max over the (filtered) scaled logits, after min-p; argmax of the raw logits for greedy rows."""
    floor = scaled.amax(dim=-1, keepdim=True) + torch.log(min_ps)[:, None]
    scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, steps, logits.shape[-1])))
    return torch.where(temperatures <= 0, logits.argmax(dim=-1), (scaled + gumbel).argmax(dim=-1))


def sample(logits, temperatures, top_ks, top_ps, min_ps, seeds, steps, use_filters: bool):
    """Gumbel-max over the filtered, temperature-scaled logits: no softmax is needed.

    ``argmax(logits/T + G)`` with ``G = -log(-log u)`` draws from ``softmax(logits/T)``;
    min-p keeps tokens whose probability is at least ``min_p`` times the largest,
    i.e. whose scaled logit is at least ``max + log(min_p)``.
    """
    scaled = scale_logits(logits, temperatures)
    if use_filters:
        # Eager on purpose: Inductor failed to generate code for this sort/scatter under dynamic shapes on an
        # H200 (torch 2.11, InductorError in get_block_shape) once a new batch size came along mid-run.
        scaled = filter_logits(scaled, top_ks, top_ps)
    return draw(logits.float(), scaled, temperatures, min_ps, seeds, steps)


class Sampler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.one_pass = True  # batches without top-k/top-p on CUDA go through llmcli.kernels.triton_sample

    def check_one_pass(self, vocab_size: int, device: torch.device) -> str | None:
        """Compile the one-pass kernel and compare it with the torch sampler on random logits.

        On any error, or if it picks other tokens, sampling falls back to the torch path for good;
        returns the reason then (for the start-up log), else None.
        """
        gen = torch.Generator(device=device).manual_seed(0)
        logits = torch.randn(4, vocab_size, device=device, generator=gen) * 4
        temps = torch.tensor([0.0, 0.7, 1.0, 1.3], device=device)
        min_ps = torch.tensor([0.0, 0.1, 0.0, 0.05], device=device)
        seeds = torch.tensor([1, 2, 3, 2**40 + 7], device=device)
        steps = torch.tensor([0, 5, 17, 1000], device=device)
        try:
            from llmcli.kernels.triton_sample import sample_unfiltered

            ours = sample_unfiltered(logits, temps, min_ps, compiled_row_keys(seeds, steps))
            no_k, no_p = torch.full_like(seeds, -1), torch.ones_like(temps)
            ref = sample(logits, temps, no_k, no_p, min_ps, seeds, steps, False)
            # the sampled rows may differ only where float32 logs differ at a near-tie: one row at most
            if ours[0] != ref[0] or int((ours != ref).sum()) > 1:
                raise RuntimeError(f"tokens {ours.tolist()} != the torch sampler's {ref.tolist()}")
        except Exception as exc:  # noqa: BLE001 - any failure: keep the slower path that is known to work
            self.one_pass = False
            return f"{type(exc).__name__}: {exc}"
        return None

    def forward(
        self,
        logits: torch.Tensor,  # [B, V]
        temperatures: torch.Tensor,  # [B] float; 0 = greedy
        top_ks: torch.Tensor,  # [B] int64; -1 = off
        top_ps: torch.Tensor,  # [B] float; 1 = off
        min_ps: torch.Tensor,  # [B] float; 0 = off
        seeds: torch.Tensor,  # [B] int64
        steps: torch.Tensor,  # [B] int64, index of the token being generated
        use_filters: bool = True,  # False when no row uses top-k/top-p (skips the sort)
    ) -> torch.Tensor:
        if not use_filters and logits.is_cuda and self.one_pass:
            # the same draw in one pass (llmcli.kernels.triton_sample); top-k/top-p need the sort below
            from llmcli.kernels.triton_sample import sample_unfiltered

            return sample_unfiltered(logits, temperatures, min_ps, compiled_row_keys(seeds, steps))
        return sample(logits, temperatures, top_ks, top_ps, min_ps, seeds, steps, use_filters)
