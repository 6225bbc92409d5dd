"""The torch attention backend (kernels/torch_backend.py over kernels/torch_attention.py): sliding windows
against a plain masked softmax (tests/attention_reference.py), and memory that does not grow with
``q_len x k_len``."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attention_reference import masked_softmax_attention, paged_case, rel_err
from llmcli.kernels import torch_attention
from llmcli.kernels.backend import AttentionMetadata
from llmcli.kernels.torch_attention import causal_attention
from llmcli.kernels.torch_backend import TorchAttentionBackend
from llmcli.layers.attention import Attention

CPU = torch.device("cpu")


def run_backend(case, shape, window, decode=False):
    num_heads, num_kv_heads, head_dim, block_size = shape
    backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, block_size)
    meta = AttentionMetadata(is_prefill=not decode, slot_mapping=torch.full_like(case.slots, -1),
                             context_lens=case.lens, block_tables=case.tables,
                             cu_seqlens_q=None if decode else case.cu_q, cu_seqlens_k=None if decode else case.cu_k,
                             max_seqlen_q=int((case.cu_q[1:] - case.cu_q[:-1]).max()),
                             max_seqlen_k=int(case.lens.max()), has_prefix=not decode)
    backend.prepare(meta)  # the new keys are in the cache already: slot -1 stores nothing again
    return backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, window=window)


@pytest.mark.parametrize("window", [None, 1, 7, 40])
@pytest.mark.parametrize("shape", [(4, 2, 16, 16), (6, 3, 8, 64)])
def test_prefill_with_a_cached_prefix_across_the_window_edge(window, shape):
    """Chunks after prefixes shorter than, crossing and many times the window; the blocks no query of a chunk
    sees are NaN (poisoned), so reading one fails."""
    case = paged_case([0, 5, 37, 150, 300], [30, 9, 20, 3, 1], shape, torch.float32, CPU, window)
    if window in (1, 7):
        assert case.poisoned_blocks > 0  # the case this test is about
    out = run_backend(case, shape, window)
    assert torch.isfinite(out).all()
    assert rel_err(out, case.ref) < 1e-5


@pytest.mark.parametrize("window", [None, 1, 16, 33])
def test_decode_over_contexts_many_windows_long(window):
    shape = (4, 1, 16, 16)
    lens = [1, 16, 17, 250, 513]
    case = paged_case([n - 1 for n in lens], [1] * len(lens), shape, torch.float32, CPU, window)
    out = run_backend(case, shape, window, decode=True)
    assert torch.isfinite(out).all() and rel_err(out, case.ref) < 1e-5


@pytest.mark.parametrize("budget", [1 << 22, 700, 64])
@pytest.mark.parametrize("window", [None, 3, 50])
@pytest.mark.parametrize("q_len,k_len", [(1, 1), (1, 300), (77, 77), (40, 200)])
def test_blocked_attention_matches_the_masked_softmax(budget, window, q_len, k_len):
    """Every way the blocks fall: one block, query blocks, key chunks with the online softmax (a budget too small
    for one query block's keys), GQA groups of 3."""
    q, k, v = torch.randn(q_len, 6, 8), torch.randn(k_len, 2, 8), torch.randn(k_len, 2, 8)
    out = causal_attention(q, k, v, 0.3, window, score_budget=budget)
    assert rel_err(out, masked_softmax_attention(q, k, v, 0.3, window)) < 1e-5


def test_half_precision_inputs_come_back_in_their_dtype():
    q, k, v = (torch.randn(20, 4, 8, dtype=torch.float16) for _ in range(3))
    out = causal_attention(q, k, v, 0.3, 5, score_budget=100)
    assert out.dtype == torch.float16
    assert rel_err(out, masked_softmax_attention(q, k, v, 0.3, 5)) < 2e-3


class LargestTensor(TorchDispatchMode):
    """The element count of the largest tensor any torch op creates while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("window", [None, 64])
def test_a_long_prompt_never_forms_its_whole_score_matrix(window, monkeypatch):
    """A 2048-token prompt through the backend: no tensor along the way (scores, masks, softmax) is larger than
    the score budget (patched small) or the prompt's own keys, where the whole score matrix would be 2048^2 per
    head (and the mask alone 2048^2): the bound that keeps a 20k-token prompt from taking GBs."""
    budget = 1 << 15
    monkeypatch.setattr(torch_attention, "SCORE_BUDGET", budget)
    n, shape = 2048, (4, 2, 16, 16)
    case = paged_case([0], [n], shape, torch.float32, CPU, window)
    backend = TorchAttentionBackend(4, 2, 16, 0.25, 16)
    backend.prepare(AttentionMetadata(is_prefill=True, slot_mapping=case.slots, context_lens=case.lens,
                                      block_tables=None, cu_seqlens_q=case.cu_q, cu_seqlens_k=case.cu_k,
                                      max_seqlen_q=n, max_seqlen_k=n))
    with LargestTensor() as seen:
        out = backend.forward(case.q, case.k, case.v, None, None, **({} if window is None else {"window": window}))
    linear = n * 4 * 16  # the prompt's queries (or keys, as float32) themselves
    assert seen.largest <= max(2 * budget, linear), f"a tensor of {seen.largest} elements"
    assert rel_err(out, case.ref) < 1e-5


def test_the_attention_layer_hands_its_window_to_the_backend():
    """Only a windowed layer passes ``window`` (a full layer calls the backend as before), and the torch backend
    then gives the masked-softmax answer for that window."""
    shape = (4, 2, 16, 16)
    case = paged_case([0], [50], shape, torch.float32, CPU, 8)
    backend = TorchAttentionBackend(4, 2, 16, 0.25, 16)
    backend.prepare(AttentionMetadata(is_prefill=True, slot_mapping=torch.full_like(case.slots, -1),
                                      context_lens=case.lens, block_tables=None, cu_seqlens_q=case.cu_q,
                                      cu_seqlens_k=case.cu_k, max_seqlen_q=50, max_seqlen_k=50))
    calls = []
    real = backend.forward
    backend.forward = lambda *a, **kw: calls.append(kw) or real(*a, **kw)
    windowed, full = Attention(4, 2, 16, backend, sliding_window=8), Attention(4, 2, 16, backend)
    assert windowed.sliding_window == 8 and full.sliding_window is None
    out = windowed(case.q, case.k, case.v)
    full(case.q, case.k, case.v)
    assert calls == [{"window": 8}, {}]
    assert rel_err(out, case.ref) < 1e-5
    with pytest.raises(ValueError, match="sliding_window"):
        Attention(4, 2, 16, backend, sliding_window=0)
