"""llmcli's Triton attention at head size 512 (Gemma 4's global layers) without a fallback to torch: its launch
shapes, the kernels under Triton's interpreter (float32, float16) against a plain softmax
(tests/attention_reference.py), and with CUDA bfloat16 at model sizes against the torch backend. Their sm_90 build
within Hopper's shared memory (no GPU needed) is tests/test_triton_window.py's, with every other variant."""
from __future__ import annotations

import pytest
import torch

from attention_reference import paged_case
from test_triton_window import (
    DEVICE, ON_GPU, check, check_bf16_against_torch, run_decode, run_prefill,
)

from llmcli.config import fastest_backend
from llmcli.kernels.triton_backend import TritonAttentionBackend
from llmcli.kernels.triton_decode import HEAD256_TUNING, HEAD512_TUNING, default_tuning
from llmcli.kernels.triton_prefill import HEAD256, HEAD512, _tiles


def test_head_dim_512_launch_choices():
    """512 gets its own prefill tiles and 16-key decode tiles (256 keeps its own, also in a model of both), and
    ``auto`` picks llmcli's Triton kernels for it on Hopper."""
    assert _tiles(512, 2, 16, 8) == HEAD512 and _tiles(512, 2, 8192, 8) == HEAD512 and _tiles(512, 4, 16, 8) == HEAD512
    assert _tiles(256, 2, 16, 4) == HEAD256 and HEAD512.block_n == 16
    assert default_tuning(512) == HEAD512_TUNING and HEAD512_TUNING.block_n == 16
    assert default_tuning(256) == HEAD256_TUNING
    assert TritonAttentionBackend(32, 4, 512, 0.1, 16).decode_tuning == HEAD512_TUNING
    # Gemma 4: a backend built at the local layers' 256 decodes a global layer with 512's tiles
    gemma4 = TritonAttentionBackend(32, 16, 256, 0.1, 16)
    assert gemma4.decode_tuning_for(256) == HEAD256_TUNING and gemma4.decode_tuning_for(512) == HEAD512_TUNING
    assert fastest_backend((9, 0), 512, True, None) == "triton"


@pytest.mark.parametrize("dtype,window", [(torch.float32, None), (torch.float16, 20)])
def test_head_dim_512_prefill_and_decode(dtype, window):
    """Chunks with and without a cached prefix, and decode over two splits, at GQA group 4, through the default
    launch shapes; full attention in float32 (Gemma 4's global layers), a window in float16 (the other rounding and
    the windowed variant, which tests/test_triton_window.py covers at every head dim below)."""
    shape = (8, 2, 512, 16)
    case = paged_case([0, 40], [30, 9], shape, dtype, DEVICE, window)
    check(run_prefill(case, window, paged=True), case, dtype)
    plain = paged_case([0], [21], shape, dtype, DEVICE, window)
    check(run_prefill(plain, window, paged=False), plain, dtype)
    dec = paged_case([70, 5], [1, 1], shape, dtype, DEVICE, window)
    check(run_decode(dec, window, 2), dec, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 1024])
@pytest.mark.parametrize("shape", [(32, 4, 512, 16), (16, 2, 512, 256)])
def test_gpu_bf16_head_dim_512_matches_torch(window, shape):
    """Gemma-4-31B's global layers (32 heads over 4 KV heads) and 26B-A4B's (16 over 2), bfloat16: long chunked
    prefills behind prefixes, and decode over contexts to 12k keys with 1 and 8 splits."""
    check_bf16_against_torch(shape, window)
