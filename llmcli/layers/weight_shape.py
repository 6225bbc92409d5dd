"""The one shape rule of every weight loader: a checkpoint tensor has exactly the shape its parameter needs.

``copy_`` broadcasts (a [1, 64] tensor fills 32 rows), ``narrow`` cuts, and a short embedding used to be
zero-filled: each would load a wrong checkpoint silently. Loaders call ``expect_shape`` with the full
(pre-tensor-parallel) shape of the checkpoint tensor they take; the model loader names the tensor.
"""
from __future__ import annotations

import torch


class WeightShapeError(ValueError):
    """A checkpoint tensor's shape differs from the one its parameter needs."""

    def __init__(self, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
        super().__init__(f"shape {got} in the checkpoint, the model expects {expected}")
        self.got, self.expected = got, expected


def expect_shape(loaded: torch.Tensor, expected: tuple[int, ...] | torch.Size) -> None:
    """Raise ``WeightShapeError`` unless ``loaded`` has exactly ``expected``'s shape."""
    if tuple(loaded.shape) != tuple(expected):
        raise WeightShapeError(tuple(loaded.shape), tuple(int(n) for n in expected))
