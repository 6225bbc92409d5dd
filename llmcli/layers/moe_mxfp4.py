"""gpt-oss's experts kept in MXFP4 as shipped (on CUDA): codes and e8m0 scales, this rank's intermediate share.

The checkpoint's ``experts.gate_up_proj_blocks`` [E, 2I, H/32, 16] (gate and up rows interleaved, gate at even
rows) and ``_scales`` [E, 2I, H/32] load as ``gate_up_proj_blocks`` [E, 2 I_local, H/2] (gate rows then up rows,
the layout of ``moe.StackedExperts``) and ``gate_up_proj_scales`` [E, 2 I_local, H/32]; ``down_proj_blocks``
[E, H, I/32, 16] and its scales as [E, H, I_local/2] and [E, H, I_local/32]: tensor parallelism cuts whole
32-value groups along the intermediate dimension, so each rank's share must be a multiple of 32.
``kernels/triton_moe_mxfp4.py`` reads these tensors as they are. Where ``mxfp4_kernel`` picks ``frag`` (Hopper,
bfloat16), ``finish_mxfp4`` turns them into that kernel's layout once after loading (``kernels/mxfp4_fragments.py``)
and drops the checkpoint-order tensors: the same bytes, in the order the tensor cores read them.
"""
from __future__ import annotations

import torch
from torch import nn

from llmcli.kernels.mxfp4_fragments import Mxfp4Fragments, fragment_codes, to_fragments
from llmcli.layers.quantization.mxfp4 import DUMMY_SCALES, GROUP, mxfp4_values
from llmcli.layers.weight_shape import expect_shape


def check_mxfp4_split(intermediate_size: int, tp: int) -> str | None:
    """Why ``tp`` ranks cannot share MXFP4 experts of ``intermediate_size`` (None: they can)."""
    if intermediate_size % tp or (intermediate_size // tp) % GROUP:
        return (f"intermediate_size {intermediate_size} over {tp} ranks would split the MXFP4 experts' 32-value "
                "scale groups: use a tensor_parallel_size that divides it into multiples of 32")
    return None


class Mxfp4Experts(nn.Module):
    """E experts' gate/up and down projections as uint8 codes and scales (4.25 bits a weight), and their biases."""

    def __init__(self, num_experts: int, hidden_size: int, local_inter: int, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        problem = check_mxfp4_split(local_inter * tp_size, tp_size) or (
            f"hidden_size {hidden_size} is not a multiple of 32 (MXFP4 groups)" if hidden_size % GROUP else None)
        if problem:
            raise ValueError(problem)
        self.tp_rank, self.tp_size, self.local_inter = tp_rank, tp_size, local_inter
        e, h, n = num_experts, hidden_size, local_inter
        shapes = {"gate_up_proj_blocks": (e, 2 * n, h // 2), "gate_up_proj_scales": (e, 2 * n, h // GROUP),
                  "down_proj_blocks": (e, h, n // 2), "down_proj_scales": (e, h, n // GROUP)}
        for name, shape in shapes.items():
            param = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
            param.weight_loader, param.checkpoint_shards = self.weight_loader, {}
            param.mxfp4_packed = True  # the loader passes these checkpoint tensors as stored
            param.dummy_range = (0, 256) if name.endswith("blocks") else DUMMY_SCALES  # load_dummy's random ints
            setattr(self, name, param)
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * n), requires_grad=False)  # the block loads it
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n, start = self.local_inter, self.tp_rank * self.local_inter
        full = n * self.tp_size
        num_experts, hidden = self.down_proj_blocks.shape[:2]
        pairs = (16,) if param is self.gate_up_proj_blocks or param is self.down_proj_blocks else ()  # uint8: loader
        if param is self.gate_up_proj_blocks or param is self.gate_up_proj_scales:  # this rank's gate and up rows
            expect_shape(loaded, (num_experts, 2 * full, hidden // GROUP, *pairs))
            mine = loaded.unflatten(1, (full, 2)).narrow(1, start, n).transpose(1, 2)  # [E, (gate, up), n, ...]
        else:  # down: whole groups of this rank's intermediate columns
            expect_shape(loaded, (num_experts, hidden, full // GROUP, *pairs))
            mine = loaded.narrow(2, start // GROUP, n // GROUP)
        param.data.copy_(mine.reshape(param.shape))

    # (rows, cols, parts, wide) of the gate/up and down fragments once converted; their tensors are parameters only
    # (``ModelRunner.shutdown`` frees every parameter's memory, so a tensor held elsewhere would outlive it)
    fragment_shapes: tuple[tuple[int, int, int, bool], ...] | None = None

    def to_fragments(self) -> None:
        """Keep the experts in ``frag``'s layout only (``kernels/mxfp4_fragments.py``), after loading."""
        names = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
        q13, s13, q2, s2 = (getattr(self, n) for n in names)
        made = (to_fragments(q13, s13, parts=2), to_fragments(q2, s2))
        for name in names:
            delattr(self, name)
        for tag, f in zip(("gate_up_proj", "down_proj"), made):  # parameters: the probe counts them
            setattr(self, f"{tag}_frag_codes", nn.Parameter(f.codes, requires_grad=False))
            setattr(self, f"{tag}_frag_scales", nn.Parameter(f.scales, requires_grad=False))
        self.fragment_shapes = tuple((f.rows, f.cols, f.parts, f.wide) for f in made)

    @property
    def fragments(self) -> tuple[Mxfp4Fragments, Mxfp4Fragments] | None:
        """(gate/up, down) in the frag layout, over this module's parameters; None before ``to_fragments``."""
        if self.fragment_shapes is None:
            return None
        return tuple(Mxfp4Fragments(getattr(self, f"{tag}_frag_codes"), getattr(self, f"{tag}_frag_scales"), *shape)
                     for tag, shape in zip(("gate_up_proj", "down_proj"), self.fragment_shapes))

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 [E, 2I, H], w2 [E, H, I])`` in ``dtype``: the reference loop's operands (a 16-bit copy: tests and
        ``LLMCLI_MOE=reference`` only)."""
        fragments = self.fragments
        if fragments is not None:
            return tuple(mxfp4_values(*fragment_codes(f)).to(dtype) for f in fragments)
        return (mxfp4_values(self.gate_up_proj_blocks, self.gate_up_proj_scales).to(dtype),
                mxfp4_values(self.down_proj_blocks, self.down_proj_scales).to(dtype))


def finish_mxfp4(model: nn.Module, dtype: torch.dtype) -> int:
    """After loading: the MXFP4 experts into ``frag``'s layout where ``mxfp4_kernel`` picks it for ``dtype`` on
    their device; how many layers were converted."""
    from llmcli.kernels.triton_moe_mxfp4 import mxfp4_kernel

    converted = 0
    for module in model.modules():
        if isinstance(module, Mxfp4Experts) and module.fragments is None \
                and mxfp4_kernel(dtype, None, module.down_proj_blocks.device) == "frag":
            module.to_fragments()
            converted += 1
    if converted and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the conversion's temporaries: not the memory probe's to count
    return converted
