"""Batched sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Randomness comes from a counter-based hash of (request seed, generation step,
token id), turned into Gumbel noise. Each request's draws therefore depend only on
its own seed and step, never on what it is batched with.

On CUDA the draw itself is the one-pass Triton kernel (llmcli.kernels.triton_sample), behind each row's
top-k/top-p threshold found without a sort (llmcli.kernels.triton_sample_filter); the torch code below is
the CPU path, the fallback, and the reference (the sort-based filter defines the kept set). Nothing here
uses torch.compile: importing Dynamo and Inductor alone costs seconds of start-up.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmcli.kernels.sample_scale import inverse_temperatures, min_p_floors

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer bijection with good avalanche, in int64 arithmetic that cannot overflow."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def _unmix32(x: int) -> int:
    """The inverse of ``_mix32`` on a Python int."""
    inv = pow(0x45D9F3B, -1, 1 << 32)
    x = ((x >> 16) ^ x) * inv & _M32
    x = ((x >> 16) ^ x) * inv & _M32
    return (x >> 16) ^ x


def seed_for_row_key(key: int) -> int:
    """A seed whose row key at step 0 is ``key`` (checks build rows with chosen noise from it)."""
    return _unmix32(_unmix32(key))  # row_keys(seed < 2**32, 0) = _mix32(_mix32(seed)), as _mix32(0) = 0


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[B] 32-bit keys (in int64) of each row's random stream, from its request's seed and step."""
    return _mix32(_mix32((seeds & _M32) ^ _mix32((seeds >> 32) & _M32)) ^ (steps & _M32))


def noise_bits(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] 24-bit integers (in int64), a pure function of (seed, step, token id)."""
    row = row_keys(seeds, steps)
    ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    return _mix32(row[:, None] ^ ids[None, :]) >> 8


def gumbel_noise(bits: torch.Tensor) -> torch.Tensor:
    """float32 ``-log(-log u)`` for ``u = (bits + 0.5) / 2**24``, accurate up to the largest u.

    ``llmcli.kernels.triton_sample._gumbel`` computes it the same way. Nothing takes the log of a number
    near 1: there a float32 ``u`` cannot even be formed (``2**24 - 0.5`` rounds to ``2**24``, so the
    largest u came out as 1.0 and its noise as +inf), and the GPU's fast log is only accurate to an
    absolute 2**-22, all of ``log(u)`` there. For ``u < 1/2`` (exact in float32), ``-log u`` is taken
    directly; above, ``v = 1 - u`` is exact and ``-log(1 - v) = 2 atanh(s)``, ``s = v / (2 - v) <= 1/3``,
    by its odd series (8 terms: float32 precision).
    """
    low = bits < (1 << 23)
    u = (bits.float() + 0.5) * (1.0 / (1 << 24))
    v = (((1 << 24) - 1 - bits).float() + 0.5) * (1.0 / (1 << 24))
    s = v / (2.0 - v)
    s2 = s * s
    series = 1.0 + s2 * (1 / 3 + s2 * (1 / 5 + s2 * (1 / 7 + s2 * (1 / 9 + s2 * (1 / 11 + s2 * (1 / 13 + s2 * (1 / 15)))))))
    minus_log_u = torch.where(low, -torch.log(u), 2.0 * s * series)
    return -torch.log(minus_log_u)


def filter_logits(scaled: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """The exact, sort-based reference filter: tokens outside each row's top-k, then its top-p, set to -inf.

    The rule (``llmcli.kernels.triton_sample_filter`` computes the same set without a sort): top-k keeps
    every token at or above the k-th largest value, ties with it included (vLLM's rule); top-p then keeps
    every token whose probability mass strictly above its value (softmax over the top-k set, in float64
    here) is below p, so tied tokens stay or go together. ``top_ks`` <= 0 or >= V and ``top_ps`` >= 1: off.
    """
    vocab = scaled.shape[-1]
    desc = scaled.sort(dim=-1, descending=True).values
    k = torch.where((top_ks > 0) & (top_ks < vocab), top_ks, vocab).long()
    kth = desc.gather(1, (k - 1)[:, None])
    desc = desc.masked_fill(desc < kth, float("-inf"))
    probs = desc.double().softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # the first position of each value among its ties (clamped: a NaN row finds none; it is flagged anyway)
    first_equal = torch.searchsorted(-desc, -desc).clamp_(max=vocab - 1)
    above = mass_before.gather(1, first_equal)
    kept = (above < top_ps.double()[:, None]) | (top_ps >= 1)[:, None]
    tau = torch.where(kept, desc, float("inf")).amin(dim=-1, keepdim=True)
    return scaled.masked_fill(scaled < torch.maximum(tau, kth), float("-inf"))


NONFINITE = -1  # the token of a row whose logits hold a NaN or +inf: the engine fails that row's request


def mark_nonfinite(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``tokens`` with ``NONFINITE`` where the row of ``logits`` holds a NaN or +inf (its max is not < inf).

    -inf alone is no fault (masks and biases write it). The one-pass Triton sampler flags rows the same way
    inside its kernel; this is the torch path's: small kernels, static shapes, read back with the tokens.
    """
    return torch.where(logits.amax(dim=-1) < float("inf"), tokens, NONFINITE)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row, ``NONFINITE`` for a row holding a NaN or +inf (``max`` gives both at once)."""
    values, tokens = logits.max(dim=-1)
    return torch.where(values < float("inf"), tokens, NONFINITE)


def fused_row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``row_keys`` as one Triton kernel on CUDA (a dozen tiny kernels otherwise, e.g. in a decode graph)."""
    if seeds.is_cuda:
        from llmcli.kernels.triton_sample import row_keys as triton_row_keys

        return triton_row_keys(seeds, steps)
    return row_keys(seeds, steps)


def scale_logits(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """float32 logits times each row's ``1 / T`` (greedy rows left as they are), as every path scales them."""
    return logits.float() * inverse_temperatures(temperatures)[:, None]


def draw(logits, scaled, temperatures, min_ps, seeds, steps):
    """Gumbel-max over the (filtered) scaled logits, after min-p; argmax of the raw logits for greedy rows."""
    floor = scaled.amax(dim=-1, keepdim=True) + torch.log(min_ps.float())[:, None]
    scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    gumbel = gumbel_noise(noise_bits(seeds, steps, logits.shape[-1]))
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


def sample_one_pass(logits, temperatures, top_ks, top_ps, min_ps, seeds, steps, use_filters: bool):
    """``sample`` on CUDA with no sort: each row's top-k/top-p threshold from
    ``llmcli.kernels.triton_sample_filter``, then the one-pass draw (``llmcli.kernels.triton_sample``) over
    the tokens at or above the larger of it and min-p's floor; greedy rows take the raw argmax."""
    from llmcli.kernels.triton_sample import sample_with_floor

    keys = fused_row_keys(seeds, steps)
    inv_t = inverse_temperatures(temperatures)
    floors = min_p_floors(logits, inv_t, min_ps)
    if use_filters:
        from llmcli.kernels.triton_sample_filter import thresholds

        floors = torch.maximum(floors, thresholds(logits, inv_t, top_ks, top_ps))
    return sample_with_floor(logits, temperatures, inv_t, floors, keys)


@dataclass
class SamplingRows:
    """Each sampled row's settings on the device, one entry per row of the logits."""

    temperatures: torch.Tensor  # [B] float; 0 = greedy
    top_ks: torch.Tensor  # [B] int64; <= 0 = off
    top_ps: torch.Tensor  # [B] float; 1 = off
    min_ps: torch.Tensor  # [B] float; 0 = off
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64, index of the token being generated
    use_filters: bool = True  # False when no row uses top-k/top-p (skips the sort)

    def args(self) -> tuple:
        return (self.temperatures, self.top_ks, self.top_ps, self.min_ps, self.seeds, self.steps, self.use_filters)


class Sampler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.one_pass = True  # batches without top-k/top-p on CUDA go through llmcli.kernels.triton_sample

    def check_one_pass(self, vocab_size: int, device: torch.device) -> str | None:
        """Compile the one-pass kernel and compare it with the torch sampler on random logits.

        Two of the rows give a token with a poor logit the largest u's (where a log taken near 1 turns the
        noise into +inf). The draws must agree, or differ only at a float32 near-tie of ``scaled + noise``.
        On any error, or if it picks other tokens, sampling falls back to the torch path for good;
        returns the reason then (for the start-up log), else None.
        """
        gen = torch.Generator(device=device).manual_seed(0)
        logits = torch.randn(6, vocab_size, device=device, generator=gen) * 4
        temps = torch.tensor([0.0, 0.7, 1.0, 1.3, 1.0, 1.0], device=device)
        min_ps = torch.tensor([0.0, 0.1, 0.0, 0.05, 0.0, 0.0], device=device)
        poor = [vocab_size // 3, vocab_size - 1]
        extreme = [seed_for_row_key(_unmix32(((1 << 24) - 1 - i) << 8) ^ t) for i, t in enumerate(poor)]
        seeds = torch.tensor([1, 2, 3, 2**40 + 7] + extreme, device=device)
        steps = torch.tensor([0, 5, 17, 1000, 0, 0], device=device)
        logits[[4, 5], poor] = -40.0
        try:
            from llmcli.kernels.triton_sample import sample_unfiltered

            ours = sample_unfiltered(logits, temps, min_ps, fused_row_keys(seeds, steps))
            no_k, no_p = torch.full_like(seeds, -1), torch.ones_like(temps)
            ref = sample(logits, temps, no_k, no_p, min_ps, seeds, steps, False)
            scaled = scale_logits(logits, temps)
            scores = scaled + gumbel_noise(noise_bits(seeds, steps, vocab_size))
            scores = scores.masked_fill(scaled < scaled.amax(-1, keepdim=True) + torch.log(min_ps)[:, None],
                                        float("-inf"))
            rows = torch.arange(len(seeds), device=device)
            gap = (scores[rows, ours] - scores[rows, ref]).abs()
            near_tie = gap <= 1e-4 * (1.0 + scores[rows, ref].abs())  # float32 logs differing in the last bits
            if ours[0] != ref[0] or not bool(((ours == ref) | near_tie).all()):
                raise RuntimeError(f"tokens {ours.tolist()} != the torch sampler's {ref.tolist()}")
            # behind top-k/top-p too (the threshold kernel): every token inside its row's kept set
            top_ks = torch.tensor([-1, 20, 5, -1, 50, -1], device=device)
            top_ps = torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 0.95], device=device)
            filtered = sample_one_pass(logits, temps, top_ks, top_ps, min_ps, seeds, steps, True)
            kept = filter_logits(scaled, top_ks, top_ps)
            if filtered[0] != ref[0] or not bool(torch.isfinite(kept[rows, filtered]).all()):
                raise RuntimeError(f"tokens {filtered.tolist()} outside top-k/top-p")
            # and the sort-based path's tokens (a top-p boundary within float32 rounding may flip one row)
            sorted_path = sample(logits, temps, top_ks, top_ps, min_ps, seeds, steps, True)
            if int((filtered != sorted_path).sum()) > 1:
                raise RuntimeError(f"tokens {filtered.tolist()} != the sort-based filter's {sorted_path.tolist()}")
        except Exception as exc:  # noqa: BLE001 - any failure: keep the slower path that is known to work
            self.one_pass = False
            return f"{type(exc).__name__}: {exc}"
        return None

    def forward(self, logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        """One token per row of ``logits`` [B, V]; ``NONFINITE`` (-1) for a row holding a NaN or +inf."""
        if logits.is_cuda and self.one_pass:
            return sample_one_pass(logits, *rows.args())  # its kernel flags non-finite rows itself
        return mark_nonfinite(logits, sample(logits, *rows.args()))
