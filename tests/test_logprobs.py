"""Logprobs against torch.log_softmax of transformers' logits on the same weights (float32, CPU).

For every generated token llmcli reports ``log_softmax(logits)`` at the position that
produced it (the raw distribution: before penalties and temperature) and the top k
ids; for every prompt token after the first, the same from the previous position.
The reference is one transformers forward over prompt + completion.
"""
from __future__ import annotations

import pytest
import torch

from llmcli import LLM, SamplingParams

ATOL = 1e-4
VOCAB_WORDS = 600


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB_WORDS, (n,), generator=g).tolist() for n in lengths]


def make_llm(model_dir, **kw) -> LLM:
    args = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=256,
                max_num_batched_tokens=256, max_num_seqs=16, max_model_len=256)
    args.update(kw)
    return LLM(str(model_dir), **args)


def reference(hf_oracle, model_dir, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] log_softmax of transformers' float32 logits; row j predicts token j+1."""
    model = hf_oracle.model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_position(entry, token: int, ref_row: torch.Tensor, k: int, where: str) -> None:
    assert token in entry, f"{where}: chosen token {token} missing from {sorted(entry)}"
    assert abs(entry[token].logprob - ref_row[token].item()) < ATOL, \
        f"{where}: logprob {entry[token].logprob} != reference {ref_row[token].item()}"
    assert entry[token].rank == int((ref_row > ref_row[token]).sum()) + 1, f"{where}: rank"
    top_vals, top_ids = ref_row.topk(k)
    ours = sorted(((lp.logprob, tid) for tid, lp in entry.items() if tid != token or token in top_ids.tolist()),
                  reverse=True)
    assert [tid for _, tid in ours] == top_ids.tolist(), f"{where}: top-{k} ids {ours} != {top_ids.tolist()}"
    for (lp, _), want in zip(ours, top_vals.tolist()):
        assert abs(lp - want) < ATOL, f"{where}: top logprob {lp} != {want}"


@pytest.mark.parametrize("temperature,family", [(0.0, "qwen3"), (0.8, "qwen3"), (0.0, "llama")])
def test_logprobs_match_transformers(tiny_checkpoint, hf_oracle, temperature, family):
    """Greedy and sampled (the reported values ignore temperature and penalties), with a penalty on one
    request; chunked prefill (a 100-token prompt over a 48-token budget) and a prompt of one token; on Qwen3
    and on Llama (biases, llama3 rope)."""
    tiny_model = tiny_checkpoint(family)
    ps = prompts([1, 5, 37, 100], seed=1)
    k = 5
    llm = make_llm(tiny_model, max_num_batched_tokens=48)
    params = [SamplingParams(temperature=temperature, seed=7, max_tokens=6, ignore_eos=True, logprobs=k,
                             prompt_logprobs=k, repetition_penalty=1.5 if i == 2 else None) for i in range(len(ps))]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
    for i, (p, out) in enumerate(zip(ps, outs)):
        completion = out.outputs[0]
        assert len(completion.token_ids) == 6 and len(completion.logprobs) == 6
        ref = reference(hf_oracle, tiny_model, p + completion.token_ids)
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            check_position(entry, token, ref[len(p) - 1 + j], k, f"prompt {i} token {j}")
        want_sum = sum(ref[len(p) - 1 + j, t].item() for j, t in enumerate(completion.token_ids))
        assert abs(completion.cumulative_logprob - want_sum) < 1e-3
        assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
        for j in range(1, len(p)):
            check_position(out.prompt_logprobs[j], p[j], ref[j - 1], k, f"prompt {i} prompt token {j}")


def test_mixed_batch_gets_its_own_k(tiny_model, hf_oracle):
    """Requests with different k, and without logprobs (in the middle and at the end of the batch): each
    gets exactly its own k alternatives, the others none, with values from its own rows."""
    ps = prompts([7, 9, 11, 13, 15], seed=3)
    ks = [1, None, 4, 0, None]
    llm = make_llm(tiny_model)
    params = [SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True, logprobs=k) for k in ks]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
    for i, (p, out, k) in enumerate(zip(ps, outs, ks)):
        completion = out.outputs[0]
        if k is None:
            assert completion.logprobs is None and completion.cumulative_logprob is None
            continue
        ref = reference(hf_oracle, tiny_model, p + completion.token_ids)
        assert len(completion.logprobs) == 5
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert len(entry) in (k, k + 1), f"prompt {i} token {j}: {len(entry)} entries for k={k}"
            check_position(entry, token, ref[len(p) - 1 + j], k, f"prompt {i} token {j}")


def test_prompt_logprobs_skip_the_prefix_cache(tiny_model, hf_oracle):
    """A second request with the same 64-token prompt would reuse cached blocks; with prompt_logprobs it
    computes its whole prompt and reports every position."""
    (p,) = prompts([64], seed=2)
    llm = make_llm(tiny_model)
    first = llm.generate([p], SamplingParams(temperature=0, max_tokens=2))[0]
    plain = llm.generate([p], SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.metrics.num_cached_prompt_tokens == 48  # the cache works for a plain request
    again = llm.generate([p], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    assert again.metrics.num_cached_prompt_tokens == 0
    assert again.token_ids == first.token_ids
    ref = reference(hf_oracle, tiny_model, p)
    for j in range(1, len(p)):
        entry = again.prompt_logprobs[j]
        assert list(entry) == [p[j]]  # k=0: only the prompt token itself
        assert abs(entry[p[j]].logprob - ref[j - 1, p[j]].item()) < ATOL


def test_no_logprobs_unless_asked(tiny_model):
    llm = make_llm(tiny_model)
    out = llm.generate([prompts([9])[0]], SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.outputs[0].logprobs is None and out.prompt_logprobs is None
    assert out.outputs[0].cumulative_logprob is None


def test_logprobs_range_is_checked():
    from llmcli.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_chunked_prompt_rows_match_one_pass():
    from llmcli.layers.logprobs import chunked_token_logprobs

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(20, 8, generator=g), torch.randn(50, 8, generator=g)
    targets = torch.randint(0, 50, (20,), generator=g)
    got = chunked_token_logprobs(hidden, targets, 4, lambda h: h @ weight.T, chunk=7)
    ref = torch.log_softmax(hidden @ weight.T, dim=-1)
    assert torch.allclose(got.logprobs, ref.gather(1, targets[:, None]).squeeze(1), atol=1e-5)
    assert torch.equal(got.top_ids, ref.topk(4).indices)
    assert torch.allclose(got.top_logprobs, ref.topk(4).values, atol=1e-5)
    assert torch.equal(got.ranks, (ref > ref.gather(1, targets[:, None])).sum(-1) + 1)


def test_lazy_logprobs_chosen_equals_each_positions_own_entry():
    """``LazyLogprobs.chosen`` (what lm-eval's scorer sums) reads the raw entries, or the built dicts, and gives
    each position's own token's (logprob, rank): the same as indexing the positions."""
    from llmcli.engine.logprob_outputs import LazyLogprobs, TokenText

    tokens = [7, 8, 5, 9]  # positions 2..5; 8 and 5 are not their position's likeliest
    entries = [(-0.5, 1, [7], [-0.5]), (-2.0, 3, [4], [-0.1]), (-1.5, 2, [9], [-0.2]), (-0.25, 1, [9], [-0.25])]

    def fresh():
        return LazyLogprobs(tokens, entries, TokenText(None), leading_nones=2)

    want = [(fresh()[j][tokens[j - 2]].logprob, fresh()[j][tokens[j - 2]].rank) for j in range(3, 6)]
    assert want == [(-2.0, 3), (-1.5, 2), (-0.25, 1)]
    assert fresh().chosen(3) == want
    built = fresh()
    assert built[3] is not None and built.chosen(3) == want  # after the dicts were built
    assert fresh().chosen(6) == []
    with pytest.raises(IndexError):
        fresh().chosen(1)
