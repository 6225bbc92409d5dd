"""Attention sinks (gpt-oss: one learned logit per head in every softmax's denominator, weighing no value) in
the torch attention, llmcli's Triton prefill and decode kernels and the backends, against the plain masked
softmax with a sink column of tests/attention_reference.py, with and without sliding windows.

Without CUDA the kernels run under Triton's interpreter in float32 (float16 too), as tests/test_triton_window.py,
whose sm_90 build check compiles the sink variants too.
"""
from __future__ import annotations

import pytest
import torch
from attention_reference import interpret_triton_without_cuda, masked_softmax_attention, paged_case, rel_err

ON_GPU = interpret_triton_without_cuda()

from llmcli.kernels.backend import AttentionMetadata  # noqa: E402
from llmcli.kernels.torch_attention import causal_attention  # noqa: E402
from llmcli.kernels.torch_backend import TorchAttentionBackend  # noqa: E402
from llmcli.kernels.triton_backend import TritonAttentionBackend  # noqa: E402
from llmcli.kernels.triton_decode import paged_decode, scratch_numel  # noqa: E402
from llmcli.kernels.triton_prefill import Tiles, prefill_paged, prefill_varlen  # noqa: E402
from llmcli.layers.attention import Attention  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
TOL = {torch.float32: 5e-3 if ON_GPU else 1e-5, torch.float16: 5e-3}


def sinks_for(num_heads: int, seed: int = 3) -> torch.Tensor:
    """Sink logits from well below to well above typical scores, so some heads put most weight on the sink."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_heads, generator=gen) * 3).float()


def check(out, ref, dtype):
    assert torch.isfinite(out).all(), "unwritten output, or a key outside the window was read"
    assert rel_err(out, ref) <= TOL[dtype]


def test_a_sink_changes_the_output_and_a_very_low_one_does_not():
    """The oracle's own sanity: a sink of -1e4 is no sink, a sink of +30 takes nearly all the weight."""
    q, k, v = torch.randn(5, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    plain = masked_softmax_attention(q, k, v, 0.25)
    assert torch.allclose(masked_softmax_attention(q, k, v, 0.25, sinks=torch.full((4,), -1e4)), plain)
    assert masked_softmax_attention(q, k, v, 0.25, sinks=torch.full((4,), 30.0)).abs().max() < 1e-6
    assert rel_err(masked_softmax_attention(q, k, v, 0.25, sinks=sinks_for(4)), plain) > 0.05


# -- torch --------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 1, 7])
@pytest.mark.parametrize("budget", [None, 64], ids=["sdpa", "online"])
def test_torch_causal_attention_with_sinks(window, budget):
    """Both of the torch path's ways (one SDPA with the sink as an extra key, and the chunked online softmax a
    small score budget forces), a GQA group of 3, queries after a prefix."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(20, 6, 16, generator=gen)
    k, v = torch.randn(33, 2, 16, generator=gen), torch.randn(33, 2, 16, generator=gen)
    sinks = sinks_for(6)
    ref = masked_softmax_attention(q, k, v, 0.25, window, sinks)
    got = causal_attention(q, k, v, 0.25, window, score_budget=budget, sinks=sinks)
    check(got, ref, torch.float32)


# -- triton -------------------------------------------------------------------------
def run_prefill(case, window, sinks, paged, tiles=None):
    out = torch.full_like(case.q, float("nan"))
    max_q = int((case.cu_q[1:] - case.cu_q[:-1]).max())
    scale = case.q.shape[-1] ** -0.5
    if paged:
        prefill_paged(case.q, case.k, case.v, case.k_cache, case.v_cache, case.tables, case.cu_q, case.lens, max_q,
                      scale, out=out, tiles=tiles, window=window, sinks=sinks)
    else:
        prefill_varlen(case.q, case.k, case.v, case.cu_q, max_q, scale, out=out, tiles=tiles, window=window,
                       sinks=sinks)
    return out


# every window in float32; float16's rounding once, at the window that cuts the most tiles
PREFILL_CASES = [(torch.float32, None), (torch.float32, 1), (torch.float32, 24), (torch.float16, 24)]


@pytest.mark.parametrize("dtype,window", PREFILL_CASES)
@pytest.mark.parametrize("paged", [False, True], ids=["varlen", "paged"])
def test_triton_prefill_with_sinks(dtype, window, paged):
    """Chunks of 1 to 60 tokens, with cached prefixes (paged) shorter and many windows longer than the window."""
    shape = (8, 2, 32, 16)
    prefix = [0, 21, 130] if paged else [0, 0, 0]
    sinks = sinks_for(8).to(DEVICE)
    case = paged_case(prefix, [60, 1, 17], shape, dtype, DEVICE, window, sinks=sinks)
    check(run_prefill(case, window, sinks, paged), case.ref, dtype)


@pytest.mark.parametrize("tiles", [Tiles(16, 16, 4, 1), Tiles(64, 32, 4, 2, one_loop=True)], ids=["16x16", "1loop"])
def test_triton_prefill_sinks_with_other_tiles_and_a_group_of_5(tiles):
    shape = (10, 2, 32, 16)
    sinks = sinks_for(10).to(DEVICE)
    case = paged_case([45, 3], [40, 9], shape, torch.float32, DEVICE, 21, seed=1, sinks=sinks)
    check(run_prefill(case, 21, sinks, True, tiles), case.ref, torch.float32)


@pytest.mark.parametrize("dtype,num_splits,window", [
    (torch.float32, 1, None), (torch.float32, 3, None), (torch.float32, 1, 40), (torch.float32, 3, 40),
    (torch.float16, 3, 40)])
def test_triton_decode_with_sinks(dtype, num_splits, window):
    """Split or not: the sink joins the denominator once (the combine's), never once per split; a context of 1."""
    shape = (8, 2, 32, 16)
    lens = [1, 39, 130, 300]
    sinks = sinks_for(8).to(DEVICE)
    case = paged_case([n - 1 for n in lens], [1] * len(lens), shape, dtype, DEVICE, window, sinks=sinks)
    batch, num_heads, head_dim = case.q.shape
    n_out, n_lse = scratch_numel(batch, num_heads, head_dim, num_splits)
    out = torch.full_like(case.q, float("nan"))
    paged_decode(case.q, case.k_cache, case.v_cache, case.tables, case.lens, head_dim ** -0.5, num_splits,
                 torch.full((max(n_out, 1),), float("nan"), device=DEVICE),
                 torch.full((max(n_lse, 1),), float("nan"), device=DEVICE), out=out, window=window, sinks=sinks)
    check(out, case.ref, dtype)


# -- backends and the layer ---------------------------------------------------------
@pytest.mark.parametrize("window", [None, 24])
def test_backends_mixed_step_with_sinks_match_the_reference(window):
    """A mixed step (decode rows, then prompt chunks with a prefix) through the Attention layer on the triton
    and the torch backend, the sinks handed over by the layer."""
    shape = (8, 2, 32, 16)
    sinks = sinks_for(8).to(DEVICE)
    case = paged_case([300, 5, 200, 0], [1, 1, 30, 25], shape, torch.float32, DEVICE, window, sinks=sinks)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.full_like(case.slots, -1), context_lens=case.lens,
                             block_tables=case.tables, cu_seqlens_q=case.cu_q, cu_seqlens_k=case.cu_k,
                             max_seqlen_q=30, max_seqlen_k=int(case.lens.max()), has_prefix=True, num_decode=2,
                             rest_max_seqlen_q=30, rest_has_prefix=True)
    for backend_cls in (TritonAttentionBackend, TorchAttentionBackend):
        backend = backend_cls(8, 2, 32, 32 ** -0.5, 16)
        backend.prepare(meta)
        layer = Attention(8, 2, 32, backend, sliding_window=window, sinks=sinks)
        layer.k_cache, layer.v_cache = case.k_cache, case.v_cache
        check(layer(case.q, case.k, case.v), case.ref, torch.float32)


def test_attention_layer_keeps_the_models_sinks_by_reference_and_checks_their_shape():
    sinks = torch.nn.Parameter(torch.zeros(4))
    layer = Attention(4, 2, 16, TorchAttentionBackend(4, 2, 16, 0.25, 16), sinks=sinks)
    assert layer.sinks is sinks and "sinks" not in dict(layer.named_parameters())
    with pytest.raises(ValueError, match="one logit per head"):
        Attention(4, 2, 16, TorchAttentionBackend(4, 2, 16, 0.25, 16), sinks=torch.zeros(2))


def test_flash_attn_refuses_sinks_in_one_line():
    from llmcli.kernels.flash_backend import FlashAttentionBackend

    backend = object.__new__(FlashAttentionBackend)  # flash_attn itself is not needed to reach the refusal
    with pytest.raises(NotImplementedError, match="flash-attn has no attention sinks.*'triton'"):
        backend.forward(None, None, None, None, None, sinks=torch.zeros(4))
