"""On CUDA: fla-core's gated delta rule (varlen chunked with initial/final states; fused recurrent) against the
torch reference, and the engine on a tiny Qwen3.5 against transformers with fla's kernels in the loop.

Run on the GPU machine: ``python -m pytest -q tests/test_gpu_gated_delta.py``.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _inputs(length: int, n: int, hk: int = 4, hv: int = 8, dk: int = 128, dv: int = 128):
    g = torch.Generator(device="cuda").manual_seed(0)
    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda")
    return (rnd(length, hk, dk), rnd(length, hk, dk), rnd(length, hv, dv), -torch.rand(length, hv, generator=g,
            device="cuda") * 0.5, torch.rand(length, hv, generator=g, device="cuda"), rnd(n, hv, dk, dv) * 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_varlen_chunked_and_recurrent_match_the_torch_reference(dtype):
    from llmcli.kernels.gated_delta_fla import chunked_varlen, recurrent_step
    from llmcli.kernels.gated_delta_torch import gated_delta_rule_chunked, gated_delta_rule_step

    cuts = [0, 1, 70, 200, 333]
    q, k, v, decay, beta, states = _inputs(cuts[-1], len(cuts) - 1)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    states[1] = 0  # a fresh sequence among continued ones
    out, final = chunked_varlen(q, k, v, decay, beta, states, torch.tensor(cuts, device="cuda"))
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=2e-3, atol=2e-3)
    for i in range(len(cuts) - 1):
        lo, hi = cuts[i], cuts[i + 1]
        want, want_state = gated_delta_rule_chunked(q[lo:hi], k[lo:hi], v[lo:hi], decay[lo:hi], beta[lo:hi], states[i])
        torch.testing.assert_close(out[lo:hi].float(), want.float(), **tol)
        torch.testing.assert_close(final[i], want_state, **tol)
    b = 5
    o, s = recurrent_step(q[:b], k[:b], v[:b], decay[:b], beta[:b], states[:1].expand(b, -1, -1, -1).contiguous())
    want, want_s = gated_delta_rule_step(q[:b], k[:b], v[:b], decay[:b], beta[:b], states[:1].expand(b, -1, -1, -1))
    torch.testing.assert_close(o.float(), want.float(), **tol)
    torch.testing.assert_close(s, want_s, **tol)


def test_engine_on_cuda_with_fla_matches_transformers(tmp_path):
    """fp32 on the GPU, eager and with decode graphs (the state rows in the graph's inputs): the tiny Qwen3.5's
    greedy tokens equal transformers' (on the CPU), prompts past a 64-token chunk, chunked prefill."""
    from tiny_qwen3 import write_tiny_model
    from transformers import AutoModelForCausalLM

    from llmcli import LLM, SamplingParams

    model = write_tiny_model(tmp_path / "q35", "qwen3.5", seed=3)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 600, (n,), generator=g).tolist() for n in (1, 30, 100, 150)]
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    want = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                        max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            for p in prompts]
    for eager in (True, False):
        llm = LLM(str(model), device="cuda", dtype="float32", max_model_len=256, max_num_batched_tokens=64,
                  enforce_eager=eager, gpu_memory_utilization=0.3)
        try:
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        finally:
            llm.shutdown()
        assert [o["token_ids"] for o in outs] == want, f"enforce_eager={eager}"
