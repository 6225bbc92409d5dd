"""Repetition, presence and frequency penalties: the device maths against a direct computation and
transformers' RepetitionPenaltyLogitsProcessor, then whole greedy runs against transformers.
"""
from __future__ import annotations

import pytest
import torch

from llmcli import LLM, SamplingParams
from llmcli.layers.penalties import PenaltyTables, apply_penalties

V = 64


def direct(logits: list[float], prompt: list[int], output: list[int], rep: float, pres: float, freq: float):
    """The definitions, one token at a time in plain Python."""
    out = []
    for t, x in enumerate(logits):
        if t in prompt or t in output:
            x = x / rep if x > 0 else x * rep
        count = output.count(t)
        x -= freq * count + pres * (count > 0)
        out.append(x)
    return out


def random_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, generator=g) * 3
    prompt = torch.randint(0, V, (12,), generator=g).tolist()
    output = torch.randint(0, V, (9,), generator=g).tolist()
    return logits, prompt, output


@pytest.mark.parametrize("rep,pres,freq", [(1.3, 0.0, 0.0), (0.8, 0.5, 0.0), (1.0, -0.4, 0.7), (2.0, 1.5, -1.0)])
def test_tables_match_the_definitions(rep, pres, freq):
    tables = PenaltyTables(V, torch.device("cpu"))
    tables.reserve(3)
    cases = [random_case(s) for s in range(3)]
    rows = torch.tensor([2, 0, 1])
    prompt_rows = torch.tensor([r for r, (_, p, _) in zip(rows.tolist(), cases) for _ in p])
    tables.start(rows, prompt_rows, torch.tensor([t for _, p, _ in cases for t in p]))
    # the output arrives one token per step, as in decoding
    for j in range(9):
        tables.add(rows, torch.tensor([o[j] for _, _, o in cases]))
    logits = torch.stack([c[0] for c in cases])
    n = len(cases)
    got = tables.apply(logits, torch.arange(n), rows, torch.full((n,), rep), torch.full((n,), pres),
                       torch.full((n,), freq))
    for i, (row_logits, prompt, output) in enumerate(cases):
        want = direct(row_logits.tolist(), prompt, output, rep, pres, freq)
        assert torch.allclose(got[i], torch.tensor(want), atol=1e-5), f"row {i}"


@pytest.mark.parametrize("penalty", [0.5, 1.2, 3.0])
def test_repetition_matches_transformers_processor(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, V, generator=g) * 4
    seen_ids = torch.randint(0, V, (4, 20), generator=g)
    want = RepetitionPenaltyLogitsProcessor(penalty)(seen_ids, logits.clone())
    seen = torch.zeros(4, V, dtype=torch.bool).scatter(1, seen_ids, True)
    got = apply_penalties(logits, seen, torch.zeros(4, V, dtype=torch.int32), torch.full((4,), penalty),
                          torch.zeros(4), torch.zeros(4))
    assert torch.equal(got, want)


def make_llm(model_dir, **kw) -> LLM:
    args = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=128,
                max_num_batched_tokens=256, max_num_seqs=8, max_model_len=256)
    args.update(kw)
    return LLM(str(model_dir), **args)


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 600, (n,), generator=g).tolist() for n in lengths]


def test_greedy_repetition_penalty_matches_transformers_generate(tiny_model, hf_oracle):
    """Overlapped decoding, a chunked prompt and a request without penalty in the same batch."""
    ps = prompts([3, 20, 70], seed=4)
    llm = make_llm(tiny_model, max_num_batched_tokens=32)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=0.7)]
    outs = llm.generate(ps, params)
    model = hf_oracle.model(tiny_model)
    for p, sp, out in zip(ps, params, outs):
        ids = torch.tensor([p])
        with torch.no_grad():
            want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                  do_sample=False, repetition_penalty=sp.repetition_penalty, eos_token_id=None,
                                  pad_token_id=0, temperature=None, top_p=None, top_k=None)[0, len(p):].tolist()
        assert out.token_ids == want
    plain = llm.generate(ps[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert plain.token_ids != outs[0].token_ids  # the penalty changed something (or the test proves nothing)


def test_greedy_presence_and_frequency_match_a_reference_loop(tiny_model, hf_oracle):
    """Decoding step by step on transformers' logits with the OpenAI definitions applied in Python."""
    ps = prompts([5, 33], seed=5)
    settings = [(0.0, -2.0), (-2.0, 0.5)]  # negative: the tiny model rarely repeats on its own
    llm = make_llm(tiny_model)
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=pres,
                             frequency_penalty=freq) for pres, freq in settings]
    outs = llm.generate(ps, params)
    model = hf_oracle.model(tiny_model)
    for p, (pres, freq), out in zip(ps, settings, outs):
        ids = list(p)
        for _ in range(10):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].float()
            penalised = torch.tensor(direct(logits.tolist(), [], ids[len(p):], 1.0, pres, freq))
            ids.append(int(penalised.argmax()))
        assert out.token_ids == ids[len(p):]
    plain = llm.generate(ps, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in plain] != [o.token_ids for o in outs]  # else the test proves nothing


def test_preemption_keeps_counts_and_logprobs(tiny_model):
    """A pool too small for the batch preempts and recomputes sequences; their penalty counts (kept on the
    device across the recompute) and logprobs must come out as in a run with room for everything."""
    ps = prompts([40, 60, 25, 50, 35, 45, 30, 55], seed=6)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.4,
                            frequency_penalty=-0.5, logprobs=2, prompt_logprobs=1)
    roomy = make_llm(tiny_model).generate(ps, params)
    tight = make_llm(tiny_model, num_kvcache_blocks=12, max_num_batched_tokens=24)
    outs = tight.generate(ps, params)
    assert tight.engine.stats.num_preemptions > 0
    for a, b in zip(roomy, outs):
        assert a.token_ids == b.token_ids
        assert [sorted(p) for p in a.outputs[0].logprobs] == [sorted(p) for p in b.outputs[0].logprobs]
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids)
        assert [p and sorted(p) for p in a.prompt_logprobs] == [p and sorted(p) for p in b.prompt_logprobs]
