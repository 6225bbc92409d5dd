"""The gated delta rule on CUDA through fla-core (flash-linear-attention's Triton ops): the chunked form over a
varlen batch with per-sequence initial and final states (prefill; decode runs ``triton_gated_delta``). Imported
on CUDA only (fla queries the GPU driver at import). Same conventions as ``gated_delta_torch``: q/k
L2-normalised first (here, not by fla), q scaled by head_k_dim ** -0.5, states [N, Hv, Dk, Dv] in float32.
"""
from __future__ import annotations

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule

from llmcli.kernels.gated_delta_torch import l2_normalized


def _value_heads(q: torch.Tensor, k: torch.Tensor, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    group = hv // q.shape[-2]
    if group == 1:
        return q, k
    return q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)


def chunked_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   initial: torch.Tensor, cu_seqlens: torch.Tensor,
                   chunk_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k [T, Hk, Dk], v [T, Hv, Dv], g/beta [T, Hv] of the chunks ``cu_seqlens`` (int64) cuts; initial [N, Hv,
    Dk, Dv] -> (out [T, Hv, Dv], final states [N, Hv, Dk, Dv]). ``chunk_indices`` (layers/state_segments.py's,
    for fla's chunk length): given, fla reads nothing back from the device; None, it derives them with a sync."""
    # normalised here, in the inputs' dtype, not by fla: its l2norm autotunes 25 configurations for every new
    # bucket of 65,536 rows, about 10 s each time a step's token count first reaches one, mid-run
    q, k = _value_heads(l2_normalized(q).to(q.dtype), l2_normalized(k).to(k.dtype), v.shape[-2])
    out, final = chunk_gated_delta_rule(q[None], k[None], v[None], g=g[None].float(), beta=beta[None].to(q.dtype),
                                        initial_state=initial.float(), output_final_state=True,
                                        use_qk_l2norm_in_kernel=False, cu_seqlens=cu_seqlens.long(),
                                        chunk_indices=chunk_indices)
    return out[0], final

