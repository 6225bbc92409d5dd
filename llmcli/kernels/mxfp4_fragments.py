"""MXFP4 experts stored in the order Hopper's tensor cores take them from registers: the ``frag`` layout.

``triton_moe_mxfp4_frag.py`` computes an expert's output transposed (weights times activations), so the weights
are the left operand of the warpgroup MMA, which it reads from registers: rows ``16w + g`` and ``16w + g + 8`` of
a 64-row tile in warp ``w`` (lane ``4g + c``), at ``k = 2c, 2c + 1, 2c + 8, 2c + 9`` of each 16-deep step. Here
a matrix of ``N`` rows over ``K`` inputs is cut into 64 x 64 sub-tiles, one after another along ``K`` within each
64-row tile; a sub-tile is 2,048 bytes of codes and 512 of scales, and thread ``t`` of the warpgroup finds its
32 values at bytes ``16t`` to ``16t + 15`` and their four scales at bytes ``4t`` to ``4t + 3`` (row ``g`` then
``g + 8``, of the first 32-value group, then of the second). A warp's loads are 512 contiguous bytes, and after
unpacking no value moves between threads.

Each 4-byte word is one 16-deep step: four bf16 pairs, register ``p = 2 * (k >= 8) + (row is g + 8)``. Its bits
are placed so that each pair comes out of the word with a shift and a mask (the e2m1 sign on bf16's sign bit,
exponent and mantissa on bf16's lowest exponent bits and top mantissa bit): ``p = 0, 1, 2`` take bits
``{6-8, 15} - 3p`` of each half, ``p = 3`` the four left (``13-14`` the exponent, ``11`` the mantissa, ``10``
the sign). Such a pair is the e2m1 value times ``2^-126`` (zero and 0.5 become bf16 subnormals), so one bf16
multiply by ``2^(scale - 1)`` gives the weight exactly: possible while the scale's e8m0 byte is at most 128
(``2^1``). Checkpoints whose scales go higher are marked ``wide`` and take two multiplies.

``to_fragments`` converts the checkpoint's layout (codes [E, N, K / 2], scales [E, N, K / 32]) a few experts at a
time (no copy of a whole layer at once); ``fragment_codes`` gives it back, for the dequantized reference path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


SUB = 64  # rows and inputs of a sub-tile
THREADS = 128  # a warpgroup
CODE_BYTES, SCALE_BYTES = SUB * SUB // 2, THREADS * 4  # 16 and 4 bytes a thread
NARROW_MAX_SCALE = 128  # e8m0 2^1: the largest scale 2^(scale - 1) holds as a bf16 multiplier


@dataclass(frozen=True)
class Mxfp4Fragments:
    """One layer's stacked experts in the ``frag`` layout: ``codes`` [E, parts * tiles_n, tiles_k, 2048] and
    ``scales`` [E, parts * tiles_n, tiles_k, 512], uint8. ``parts`` row blocks of ``rows`` each (gate then up:
    2; down: 1), each padded to whole 64-row tiles; ``cols`` inputs padded to whole 64-value sub-tiles (zero codes).
    ``wide``: some scale exceeds 2^1, and the kernel multiplies twice."""

    codes: torch.Tensor
    scales: torch.Tensor
    rows: int
    cols: int
    parts: int
    wide: bool

    @property
    def tiles_n(self) -> int:
        return self.codes.shape[1] // self.parts

    @property
    def tiles_k(self) -> int:
        return self.codes.shape[2]

    @property
    def num_experts(self) -> int:
        return self.codes.shape[0]


def _tiles(size: int) -> int:
    return -(-size // SUB)


def _code_bits(nib: torch.Tensor, p: int) -> torch.Tensor:
    """Where register ``p``'s e2m1 code ``nib`` (int64) sits in the low half of its word."""
    sign = nib >> 3
    if p < 3:
        return ((nib & 7) << (6 - 3 * p)) | (sign << (15 - 3 * p))
    return (((nib >> 1) & 3) << 13) | ((nib & 1) << 11) | (sign << 10)


def _code_of(half: torch.Tensor, p: int) -> torch.Tensor:
    """The inverse of ``_code_bits``: the e2m1 code in a word's 16-bit ``half`` (int64) for register ``p``."""
    if p < 3:
        return ((half >> (6 - 3 * p)) & 7) | (((half >> (15 - 3 * p)) & 1) << 3)
    return (((half >> 13) & 3) << 1) | ((half >> 11) & 1) | (((half >> 10) & 1) << 3)


def _codes(codes: torch.Tensor, rows: int, tiles_n: int, tiles_k: int) -> torch.Tensor:
    """Experts' codes [e, rows, K / 2] -> [e, tiles_n, tiles_k, 2048] uint8."""
    e = codes.shape[0]
    nib = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(-2).long()  # [e, rows, K], K order
    nib = torch.nn.functional.pad(nib, (0, tiles_k * SUB - nib.shape[2], 0, tiles_n * SUB - rows))
    # row = 16 w + 8 r8 + g, k = 16 j + 8 J + 2 c + h  ->  [tile, sub-tile, thread (w, g, c), word j, (J, r8), h]
    n = nib.view(e, tiles_n, 4, 2, 8, tiles_k, 4, 2, 4, 2).permute(0, 1, 5, 2, 4, 8, 6, 7, 3, 9)
    n = n.reshape(e, tiles_n, tiles_k, THREADS, 4, 4, 2)
    word = torch.zeros(n.shape[:5], dtype=torch.int64, device=codes.device)
    for p in range(4):
        for h in range(2):
            word |= _code_bits(n[..., p, h], p) << (16 * h)
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    return word.view(torch.uint8).reshape(e, tiles_n, tiles_k, CODE_BYTES)  # little-endian: byte 0 = bits 0-7


def _scales(scales: torch.Tensor, rows: int, tiles_n: int, tiles_k: int) -> torch.Tensor:
    """Experts' scales [e, rows, K / 32] -> [e, tiles_n, tiles_k, 512] uint8 (padding: 2^0)."""
    e = scales.shape[0]
    s = torch.nn.functional.pad(scales, (0, tiles_k * 2 - scales.shape[2], 0, tiles_n * SUB - rows), value=127)
    s = s.view(e, tiles_n, 4, 2, 8, tiles_k, 2).permute(0, 1, 5, 2, 4, 6, 3)  # [tile, sub-tile, w, g, group, r8]
    return s.unsqueeze(5).expand(-1, -1, -1, -1, -1, 4, -1, -1).reshape(e, tiles_n, tiles_k, SCALE_BYTES)


EXPERTS_AT_ONCE = 8  # the conversion's temporaries: ~0.5 GB at gpt-oss's 2880 x 2880


def to_fragments(codes: torch.Tensor, scales: torch.Tensor, parts: int = 1) -> Mxfp4Fragments:
    """The checkpoint's layout (codes [E, N, K / 2], scales [E, N, K / 32], uint8) in the ``frag`` layout, on the
    tensors' device; ``parts`` equal row blocks padded apart (a gate/up tensor: 2)."""
    num_experts, n, half_k = codes.shape
    rows, cols = n // parts, 2 * half_k
    tiles_n, tiles_k = _tiles(rows), _tiles(cols)
    out_codes = torch.empty(num_experts, parts * tiles_n, tiles_k, CODE_BYTES, dtype=torch.uint8, device=codes.device)
    out_scales = torch.empty(num_experts, parts * tiles_n, tiles_k, SCALE_BYTES, dtype=torch.uint8,
                             device=codes.device)
    for first in range(0, num_experts, EXPERTS_AT_ONCE):
        some = slice(first, first + EXPERTS_AT_ONCE)
        for part in range(parts):
            block = slice(part * rows, (part + 1) * rows)
            tiles = slice(part * tiles_n, (part + 1) * tiles_n)
            out_codes[some, tiles] = _codes(codes[some, block], rows, tiles_n, tiles_k)
            out_scales[some, tiles] = _scales(scales[some, block], rows, tiles_n, tiles_k)
    wide = bool(scales.numel()) and int(scales.max()) > NARROW_MAX_SCALE
    return Mxfp4Fragments(out_codes, out_scales, rows, cols, parts, wide)


def fragment_codes(f: Mxfp4Fragments) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint's layout back: codes [E, parts * rows, cols / 2] and scales [E, parts * rows, cols / 32]."""
    e, tn, tk = f.num_experts, f.tiles_n, f.tiles_k
    word = f.codes.view(e, f.parts * tn, tk, THREADS * 4 * 4).view(torch.int32).long() & 0xFFFFFFFF
    word = word.view(e, f.parts, tn, tk, THREADS, 4)
    halves = [[_code_of((word >> (16 * h)) & 0xFFFF, p) for h in range(2)] for p in range(4)]
    n = torch.stack([torch.stack(hs, dim=-1) for hs in halves], dim=-2)  # [..., thread, word, p, h]
    n = n.view(e, f.parts, tn, tk, 4, 8, 4, 4, 2, 2, 2)  # w, g, c, j, J, r8, h
    n = n.permute(0, 1, 2, 4, 9, 5, 3, 7, 8, 6, 10).reshape(e, f.parts, tn * SUB, tk * SUB)
    n = n[:, :, :f.rows, :f.cols].reshape(e, f.parts * f.rows, f.cols // 2, 2)
    codes = (n[..., 0] | (n[..., 1] << 4)).to(torch.uint8)
    s = f.scales.view(e, f.parts, tn, tk, 4, 8, 4, 2, 2)[:, :, :, :, :, :, 0]  # one copy of the 4 lanes c
    s = s.permute(0, 1, 2, 4, 7, 5, 3, 6).reshape(e, f.parts, tn * SUB, tk * 2)  # w, r8, g; sub-tile, group
    scales = s[:, :, :f.rows, :f.cols // 32].reshape(e, f.parts * f.rows, f.cols // 32)
    return codes, scales.contiguous()
