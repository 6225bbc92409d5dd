"""The Gated DeltaNet's sequence mixing in plain torch: the causal depthwise conv1d with a carried state, and the
gated delta rule, chunked (prefill) and recurrent (decode). The CPU path and the oracle of the CUDA kernels.

Shapes follow one sequence (or a batch of single tokens for the decode forms); float32 inside. The rule, per
value head with key ``k_t``, value ``v_t``, decay ``g_t`` (log space, <= 0) and rate ``beta_t``:

    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t

with q and k L2-normalised and q scaled by ``head_k_dim ** -0.5``. The chunked form computes the same thing a
chunk of tokens at a time: inside a chunk the updates are a unit lower-triangular system (solved once), and
the state crosses chunk boundaries only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C] of one sequence, weight [C, K], state [C, K-1] (the K-1 inputs before x; None: zeros) ->
    (silu(conv) [T, C], the new state [C, K-1])."""
    channels, width = weight.shape
    if state is None:
        state = x.new_zeros(channels, width - 1)
    full = torch.cat([state.to(weight.dtype), x.t().to(weight.dtype)], dim=1)  # [C, K-1+T]
    out = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=channels)[0]  # [C, T]
    return F.silu(out).t().to(x.dtype), full[:, full.shape[1] - (width - 1):]


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token per sequence: x [B, C], state [B, C, K-1] -> (silu(conv) [B, C], new state [B, C, K-1])."""
    full = torch.cat([state.to(weight.dtype), x.to(weight.dtype).unsqueeze(-1)], dim=-1)  # [B, C, K]
    out = (full * weight).sum(-1)
    return F.silu(out).to(x.dtype), full[..., 1:]


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the head dimension, in float32 (eps inside the root, as fla)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q/k to float32, L2-normalised, grouped heads repeated to the value heads, q scaled."""
    group = v.shape[-2] // q.shape[-2]
    q, k = l2_normalized(q), l2_normalized(k)
    if group > 1:
        q, k = q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)
    return q * q.shape[-1] ** -0.5, k, v.float()


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             state: torch.Tensor | None, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q/k [T, Hk, Dk], v [T, Hv, Dv], g/beta [T, Hv], state [Hv, Dk, Dv] (None: zeros) ->
    (out [T, Hv, Dv] in v's dtype, final state [Hv, Dk, Dv] float32)."""
    length, heads, dv = v.shape
    dtype = v.dtype
    q, k, v = _prepare(q, k, v)
    g, beta = g.float(), beta.float()
    s = q.new_zeros(heads, q.shape[-1], dv) if state is None else state.float()
    out = q.new_empty(length, heads, dv)
    # heads first: [H, T, ...]
    q, k, v, g, beta = (x.transpose(0, 1) for x in (q, k, v, g, beta))
    for lo in range(0, length, chunk):
        hi = min(lo + chunk, length)
        qc, kc, vc, bc = q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], beta[:, lo:hi]
        cum = g[:, lo:hi].cumsum(-1)  # [H, C]: log decay from the chunk's start through each token
        n = hi - lo
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # [H, C, C]: i >= j
        kb = kc * bc[..., None]
        # token i's correction u_i = beta_i (v_i - k_i^T S_{i-1}); S_{i-1} holds the chunk's earlier u_j:
        # (I + strict_lower(beta k k^T * decay)) u = beta (v - (k * exp(cum)) S0)
        system = (kb @ kc.transpose(-1, -2)) * decay
        system = torch.eye(n, device=q.device) + system.masked_fill(~lower.tril(-1), 0.0)
        rhs = vc * bc[..., None] - (kb * cum.exp()[..., None]) @ s
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        scores = (qc @ kc.transpose(-1, -2)) * decay
        out[lo:hi] = ((qc * cum.exp()[..., None]) @ s + scores @ u).transpose(0, 1)
        last = cum[:, -1:]
        s = s * last.exp()[..., None] + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ u
    return out.to(dtype), s


def gated_delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: q/k [B, Hk, Dk], v [B, Hv, Dv], g/beta [B, Hv], state [B, Hv, Dk, Dv] ->
    (out [B, Hv, Dv] in v's dtype, new state [B, Hv, Dk, Dv] float32)."""
    dtype = v.dtype
    q, k, v = _prepare(q, k, v)
    s = state.float() * g.float().exp()[..., None, None]
    delta = (v - (s * k[..., None]).sum(-2)) * beta.float()[..., None]
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(-2).to(dtype), s
