"""A sparse mixture-of-experts block: a replicated router and every expert's weights stacked in two tensors.

``w13`` is [E, 2*I, H] (each expert's gate rows then its up rows), ``w2`` [E, H, I]. Tensor parallelism splits
every expert's intermediate dimension like the dense MLP's (each rank holds I/tp of all E experts: no token
moves between ranks), so the down projection's partial sums need one all-reduce per block. The checkpoint's
per-expert ``experts.N.gate_proj/up_proj/down_proj`` tensors reach their slices through ``weight_loader``;
``checkpoint_shards`` tells the loader which names feed which parameter. Checkpoints that store the experts
already stacked (Gemma 4's ``experts.gate_up_proj`` / ``experts.down_proj``) load whole (``stored_stacked``).

The experts run as ``kernels/triton_moe.fused_moe`` on CUDA (gpt-oss's MXFP4 experts:
``kernels/triton_moe_mxfp4.fused_moe_mxfp4``) and as the reference loop elsewhere.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from llmcli.kernels.moe_reference import moe_reference, route
from llmcli.layers.moe_mxfp4 import Mxfp4Experts
from llmcli.layers.weight_shape import expect_shape
from llmcli.parallel import all_reduce, tp_rank, tp_size

MOE_BACKENDS = ("auto", "triton", "reference")
SLOTS = ("gate_proj", "up_proj", "down_proj")


def fused_moe_on(device: torch.device) -> bool:
    """The fused kernel on CUDA, the loop elsewhere; ``LLMCLI_MOE=reference`` runs the loop on CUDA too and
    ``LLMCLI_MOE=triton`` the kernel on the CPU too (under TRITON_INTERPRET=1): benchmarks compare the two."""
    mode = os.environ.get("LLMCLI_MOE", "auto") or "auto"
    if mode not in MOE_BACKENDS:
        raise ValueError(f"LLMCLI_MOE={mode!r}: expected one of {', '.join(MOE_BACKENDS)}")
    return mode == "triton" or (mode == "auto" and device.type == "cuda")


def use_fused_moe(x: torch.Tensor) -> bool:
    return fused_moe_on(x.device)


def local_intermediate(size: int, field: str) -> int:
    """This rank's share of every expert's intermediate dimension (``field``: config.json's name for it)."""
    if size % tp_size():
        raise ValueError(f"{field} ({size}) is not divisible by tensor_parallel_size ({tp_size()})")
    return size // tp_size()


class SparseMoeBlock(nn.Module):
    """Router softmax top-k (renormalised when ``norm_topk_prob``), then each token through its k experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 normalize: bool) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.local_inter = local_intermediate(intermediate_size, "moe_intermediate_size")
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router, the same on every rank
        self.gate.weight.requires_grad_(False)
        self.experts = StackedExperts(num_experts, hidden_size, self.local_inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(F.linear(x, self.gate.weight), self.top_k, self.normalize)
        return all_reduce(self.experts(x, weights, ids))


class StackedExperts(nn.Module):
    """The experts' weights as two parameters, named after transformers' own stacked layout."""

    def __init__(self, num_experts: int, hidden_size: int, local_inter: int, stored_stacked: bool = False,
                 gelu: bool = False, bias: bool = False, clamp: tuple[float, float] | None = None) -> None:
        """``gelu``: GeGLU experts (tanh GELU, Gemma 4) rather than SwiGLU; ``bias``: each projection has one
        (``gate_up_proj_bias`` [E, 2I/tp], ``down_proj_bias`` [E, H], gpt-oss); ``clamp``: ``(alpha, limit)`` of
        gpt-oss's clamped SwiGLU (``kernels/moe_reference.expert_activation``)."""
        super().__init__()
        self.tp_rank, self.tp_size, self.local_inter = tp_rank(), tp_size(), local_inter
        self.gelu, self.clamp = gelu, clamp
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local_inter, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, local_inter), requires_grad=False)
        self.gate_up_proj_bias = self.down_proj_bias = None
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * local_inter), requires_grad=False)
            # replicated: the loader's default (a shape-checked copy)
            self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size), requires_grad=False)
        for param, slots in ((self.gate_up_proj, SLOTS[:2]), (self.down_proj, SLOTS[2:])):
            param.weight_loader = self.load_stacked if stored_stacked else self.weight_loader
            if not stored_stacked:
                # checkpoint name (relative to this module) -> the weight_loader's shard argument
                param.checkpoint_shards = {f"{e}.{slot}.weight": (e, slot) for e in range(num_experts)
                                           for slot in slots}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's part of each token's weighted experts (the caller all-reduces, so the down bias is added on
        rank 0 only)."""
        switches = dict(b13=self.gate_up_proj_bias, b2=self.down_proj_bias if self.tp_rank == 0 else None,
                        gelu=self.gelu, clamp=self.clamp)
        if use_fused_moe(x):
            from llmcli.kernels.triton_moe import fused_moe  # imported on use: see kernels/__init__.py

            return fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids, **switches)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("LLMCLI_MOE=reference reads expert counts back to the host, which a CUDA graph "
                               "cannot hold: run it with enforce_eager=True (--enforce-eager)")
        return moe_reference(x, self.gate_up_proj, self.down_proj, weights, ids, **switches)

    def load_stacked(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """All experts at once: gate_up [E, 2I, H] (this rank's gate rows and up rows), down [E, H, I]."""
        n, start = self.local_inter, self.tp_rank * self.local_inter
        full = n * self.tp_size
        if param is self.down_proj:
            expect_shape(loaded, (param.shape[0], param.shape[1], full))
            param.data.copy_(loaded.narrow(2, start, n))
        else:
            expect_shape(loaded, (param.shape[0], 2 * full, param.shape[2]))
            param.data[:, :n].copy_(loaded.narrow(1, start, n))
            param.data[:, n:].copy_(loaded.narrow(1, full + start, n))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, str]) -> None:
        expert, slot = shard
        n, start = self.local_inter, self.tp_rank * self.local_inter
        full = n * self.tp_size  # moe_intermediate_size
        expect_shape(loaded, (param.shape[1], full) if slot == "down_proj" else (full, param.shape[2]))
        if slot == "down_proj":  # [H, I]: this rank's columns
            param.data[expert].copy_(loaded.narrow(1, start, n))
        else:  # [I, H]: this rank's rows, into the gate or the up half
            offset = 0 if slot == "gate_proj" else n
            param.data[expert].narrow(0, offset, n).copy_(loaded.narrow(0, start, n))


class SharedExpertMoeBlock(nn.Module):
    """Sparse experts beside one always-on shared expert whose output a sigmoid gate scales (Qwen3-Next,
    Qwen3.5-MoE): ``experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)``. The shared expert is a
    dense gated MLP (tensor-parallel like any); the one-row gate is replicated."""

    def __init__(self, sparse: SparseMoeBlock, shared_expert: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.gate, self.experts = sparse.gate, sparse.experts  # the checkpoint's names: mlp.gate, mlp.experts.N
        self.sparse = [sparse]  # held outside the module tree so its parameters keep the names above
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.shared_expert_gate.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        return self.sparse[0](x) + shared


class GptOssMoeBlock(nn.Module):
    """gpt-oss's experts: a router with a bias whose ``top_k`` largest logits are softmaxed among themselves, and
    experts with biases and the clamped SwiGLU (``StackedExperts`` with ``bias`` and ``clamp``).

    The checkpoint stacks each layer's experts as transformers does: ``experts.gate_up_proj`` [E, H, 2I] with
    gate and up *interleaved* along the last dimension (gate at even columns), ``gate_up_proj_bias`` [E, 2I] the
    same way, ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]. They load into ``StackedExperts``' layout
    (gate rows then up rows, [E, 2I, H]; down [E, H, I]), this rank's intermediate slice. The down bias is
    added on rank 0 only, before the all-reduce that sums the ranks' partial outputs. With ``mxfp4`` (an MXFP4
    checkpoint on CUDA) the experts stay in the checkpoint's 4-bit form (``moe_mxfp4.Mxfp4Experts``) and run in
    ``kernels/triton_moe_mxfp4.py``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, alpha: float,
                 limit: float, mxfp4: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.local_inter = local_intermediate(intermediate_size, "intermediate_size")
        self.top_k = top_k
        self.router = nn.Linear(hidden_size, num_experts, bias=True)  # replicated
        self.router.requires_grad_(False)
        self.mxfp4 = mxfp4  # experts kept as the checkpoint's MXFP4 codes and scales (layers/moe_mxfp4.py)
        self.clamp = (alpha, limit)
        if mxfp4:
            self.experts = Mxfp4Experts(num_experts, hidden_size, self.local_inter, self.tp_rank, self.tp_size)
            self.experts.gate_up_proj_bias.weight_loader = self._load_stacked
            return
        self.experts = experts = StackedExperts(num_experts, hidden_size, self.local_inter, bias=True,
                                                clamp=self.clamp)
        for param in (experts.gate_up_proj, experts.down_proj, experts.gate_up_proj_bias):
            param.weight_loader = self._load_stacked  # one stacked tensor each, not a tensor per expert
            param.checkpoint_shards = {}

    def _load_stacked(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n, start = self.local_inter, self.tp_rank * self.local_inter
        full = n * self.tp_size
        experts = self.experts
        num_experts, hidden = param.shape[0], experts.down_proj_bias.shape[1]
        if param is getattr(experts, "down_proj", None):  # [E, I, H] -> [E, H, I_local]
            expect_shape(loaded, (num_experts, full, hidden))
            param.data.copy_(loaded.narrow(1, start, n).transpose(1, 2))
            return
        if param is getattr(experts, "gate_up_proj", None):  # [E, H, 2I] interleaved -> [E, 2 I_local, H]: gate, up
            expect_shape(loaded, (num_experts, hidden, 2 * full))
            pairs = loaded.unflatten(2, (full, 2)).narrow(2, start, n)  # [E, H, I_local, (gate, up)]
            param.data.copy_(pairs.permute(0, 3, 2, 1).reshape(num_experts, 2 * n, hidden))
            return
        expect_shape(loaded, (num_experts, 2 * full))  # the gate/up bias, interleaved as its weight
        param.data.copy_(loaded.unflatten(1, (full, 2)).narrow(1, start, n).transpose(1, 2).reshape(num_experts, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(F.linear(x, self.router.weight, self.router.bias), self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=torch.float32)
        if not self.mxfp4:
            return all_reduce(self.experts(x, weights, ids))
        e = self.experts
        b2 = e.down_proj_bias if self.tp_rank == 0 else None  # once over the ranks' sum
        if use_fused_moe(x):
            from llmcli.kernels.triton_moe_mxfp4 import fused_moe_mxfp4
            from llmcli.kernels.triton_moe_mxfp4_frag import fused_moe_mxfp4_frag

            fragments = e.fragments  # built over the parameters on each access: once a step
            if fragments is not None:
                out = fused_moe_mxfp4_frag(x, *fragments, weights, ids, b13=e.gate_up_proj_bias, b2=b2,
                                           clamp=self.clamp)
            else:
                out = fused_moe_mxfp4(x, e.gate_up_proj_blocks, e.gate_up_proj_scales, e.down_proj_blocks,
                                      e.down_proj_scales, weights, ids, b13=e.gate_up_proj_bias, b2=b2,
                                      clamp=self.clamp)
        else:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("LLMCLI_MOE=reference reads expert counts back to the host, which a CUDA graph "
                                   "cannot hold: run it with enforce_eager=True (--enforce-eager)")
            w13, w2 = e.dequantized(x.dtype)
            out = moe_reference(x, w13, w2, weights, ids, b13=e.gate_up_proj_bias, b2=b2, clamp=self.clamp)
        return all_reduce(out)
