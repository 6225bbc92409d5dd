"""Sampling: the sampler on fixed logits, and seeds through the engine.

The allowed sets (top-k, top-p nucleus, min-p) and the reference distribution
are computed here in float64 from the full softmax, independently of
``llmcli.layers.sampler``. Filters act on the temperature-scaled distribution
(the vLLM / transformers convention).
"""
from __future__ import annotations

import pytest
import torch

from llmcli.layers.sampler import Sampler, SamplingRows


def sampled(logits, *rows):
    """``Sampler`` over rows given as (temperatures, top_ks, top_ps, min_ps, seeds, steps[, use_filters])."""
    return Sampler()(logits, SamplingRows(*rows))

V = 48
N_DRAWS = 20000


def fixed_logits(seed: int = 0, vocab: int = V, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, generator=g, dtype=torch.float64) * scale).float()


def draw(row: torch.Tensor, n: int = N_DRAWS, *, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0,
         seed0: int = 0, step=None) -> torch.Tensor:
    """``n`` samples from one logits row, one per (seed, step) pair: seeds seed0..seed0+n-1."""
    b = n
    logits = row[None, :].expand(b, -1).contiguous()
    seeds = torch.arange(seed0, seed0 + b, dtype=torch.int64)
    steps = torch.full((b,), 3 if step is None else step, dtype=torch.int64)
    out = sampled(
        logits,
        torch.full((b,), float(temperature), dtype=torch.float32),
        torch.full((b,), int(top_k), dtype=torch.int64),
        torch.full((b,), float(top_p), dtype=torch.float32),
        torch.full((b,), float(min_p), dtype=torch.float32),
        seeds,
        steps,
    )
    assert out.shape == (b,)
    return out.long()


def probs64(row: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return torch.softmax(row.double() / temperature, dim=-1)


def nucleus(p: torch.Tensor, top_p: float) -> set[int]:
    """Smallest set of most likely tokens whose mass reaches top_p."""
    order = torch.argsort(p, descending=True)
    mass, keep = 0.0, set()
    for idx in order.tolist():
        keep.add(idx)
        mass += float(p[idx])
        if mass >= top_p:
            break
    return keep


# --------------------------------------------------------------------------
# the sampler on fixed logits
# --------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_only_emits_the_k_largest(k):
    row = fixed_logits(1)
    allowed = set(torch.topk(row.double(), k).indices.tolist())
    seen = set(draw(row, top_k=k).tolist())
    assert seen <= allowed, f"top_k={k} emitted {sorted(seen - allowed)}"
    if k > 1:
        assert len(seen) > 1, "top-k sampling never varied"


@pytest.mark.parametrize("top_p,temperature", [(0.5, 1.0), (0.79, 1.0), (0.9, 0.7), (0.3, 1.5)])
def test_top_p_only_emits_the_nucleus(top_p, temperature):
    row = fixed_logits(2)
    p = probs64(row, temperature)
    cum = torch.sort(p, descending=True).values.cumsum(0)
    assert (cum - top_p).abs().min() > 1e-3, "test setup: top_p too close to a boundary of the nucleus"
    allowed = nucleus(p, top_p)
    seen = set(draw(row, temperature=temperature, top_p=top_p).tolist())
    assert seen <= allowed, f"top_p={top_p}: emitted {sorted(seen - allowed)} outside the nucleus {sorted(allowed)}"
    # Every member of a nucleus with enough mass shows up in 20000 draws.
    for idx in allowed:
        if float(p[idx]) / float(p[list(allowed)].sum()) > 0.01:
            assert idx in seen, f"token {idx} of the nucleus never sampled"


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.6])
def test_min_p_never_emits_unlikely_tokens(min_p):
    row = fixed_logits(3)
    p = probs64(row)
    allowed = set(torch.nonzero(p >= min_p * p.max()).flatten().tolist())
    seen = set(draw(row, min_p=min_p).tolist())
    assert seen <= allowed, f"min_p={min_p}: emitted {sorted(seen - allowed)}"
    assert int(p.argmax()) in seen


def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 1000, generator=g) * 3
    b = logits.shape[0]
    # Greedy rows ignore the filters and the seed.
    out = sampled(
        logits,
        torch.zeros(b),
        torch.full((b,), 5, dtype=torch.int64),
        torch.full((b,), 0.5),
        torch.full((b,), 0.1),
        torch.arange(b, dtype=torch.int64),
        torch.arange(b, dtype=torch.int64),
    )
    assert out.long().tolist() == logits.argmax(-1).tolist()


def test_greedy_rows_mixed_with_sampled_rows():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(32, 200, generator=g) * 3
    temps = torch.tensor([0.0, 1.0] * 16)
    b = logits.shape[0]
    out = sampled(logits, temps, torch.full((b,), -1, dtype=torch.int64), torch.ones(b), torch.zeros(b),
                    torch.arange(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int64)).long()
    assert out[0::2].tolist() == logits[0::2].argmax(-1).tolist()


def _chi_square(samples: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    counts = torch.bincount(samples, minlength=p.numel()).double()
    expected = p * samples.numel()
    big = expected >= 5  # pool the rare tokens into one cell
    stat = float(((counts[big] - expected[big]) ** 2 / expected[big]).sum())
    rest_c, rest_e = float(counts[~big].sum()), float(expected[~big].sum())
    cells = int(big.sum())
    if rest_e > 0:
        stat += (rest_c - rest_e) ** 2 / rest_e
        cells += 1
    return stat, cells - 1


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_unfiltered_sampling_matches_softmax(temperature):
    row = fixed_logits(6, vocab=24, scale=1.0)
    p = probs64(row, temperature)
    samples = draw(row, n=40000, temperature=temperature)
    stat, dof = _chi_square(samples, p)
    # Mean dof, sd sqrt(2 dof); a bound of dof + 10 sd is only crossed by a wrong distribution.
    assert stat < dof + 10 * (2 * dof) ** 0.5, f"chi-square {stat:.1f} with {dof} degrees of freedom"


def test_sampling_over_steps_matches_softmax():
    """One seed, many steps (how a single request draws its tokens)."""
    row = fixed_logits(7, vocab=24, scale=1.0)
    p = probs64(row)
    b = 40000
    out = sampled(row[None].expand(b, -1).contiguous(), torch.ones(b), torch.full((b,), -1, dtype=torch.int64),
                    torch.ones(b), torch.zeros(b), torch.full((b,), 1234, dtype=torch.int64),
                    torch.arange(b, dtype=torch.int64)).long()
    stat, dof = _chi_square(out, p)
    assert stat < dof + 10 * (2 * dof) ** 0.5, f"chi-square {stat:.1f} with {dof} degrees of freedom"


def test_top_k_distribution_is_renormalised():
    row = fixed_logits(8, vocab=30, scale=1.0)
    k = 6
    top = torch.topk(row.double(), k).indices
    p = torch.zeros(30, dtype=torch.float64)
    p[top] = torch.softmax(row.double()[top], 0)
    samples = draw(row, n=30000, top_k=k)
    assert set(samples.tolist()) <= set(top.tolist())
    stat, dof = _chi_square(samples, p)
    assert stat < dof + 10 * (2 * dof) ** 0.5, f"chi-square {stat:.1f} with {dof} degrees of freedom"


def test_same_seed_same_draw_whatever_the_batch():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(16, 100, generator=g)
    b = logits.shape[0]
    args = (torch.ones(b), torch.full((b,), -1, dtype=torch.int64), torch.full((b,), 0.95), torch.zeros(b),
            torch.arange(100, 100 + b, dtype=torch.int64), torch.full((b,), 7, dtype=torch.int64))
    together = sampled(logits, *args).long()
    for i in (0, 5, 15):
        alone = sampled(logits[i:i + 1], *(a[i:i + 1] for a in args)).long()
        assert int(alone) == int(together[i])
    # A different seed for the same row and step gives, over many rows, different draws.
    other = sampled(logits, *args[:4], args[4] + 1000, args[5]).long()
    assert (other != together).any()


# --------------------------------------------------------------------------
# seeds through the engine
# --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_model):
    from llmcli import LLM

    engine = LLM(str(tiny_model), device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=512,
                 max_num_batched_tokens=1024, max_num_seqs=16, max_model_len=256)
    yield engine
    engine.shutdown()


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 600, (n,), generator=g).tolist() for n in lengths]


def test_seeded_request_is_independent_of_its_batch(llm):
    from llmcli import SamplingParams

    target = _prompts([21], 1)[0]
    others = _prompts([5, 40, 77, 12], 2)
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate([target], sp)[0]["token_ids"]
    assert len(alone) == 24
    batch = llm.generate(others[:2] + [target] + others[2:], sp)
    assert list(batch[2]["token_ids"]) == list(alone)
    # Other, different, requests alongside it, each with its own seed.
    from llmcli import SamplingParams as SP

    mixed = llm.generate([others[0], target], SP(temperature=0.8, max_tokens=24, seed=99, ignore_eos=True))
    again = llm.generate([target, others[0]], SP(temperature=0.8, max_tokens=24, seed=99, ignore_eos=True))
    assert list(mixed[1]["token_ids"]) == list(again[0]["token_ids"])
    assert list(mixed[0]["token_ids"]) == list(again[1]["token_ids"])


def test_different_seeds_differ(llm):
    from llmcli import SamplingParams

    target = _prompts([21], 1)[0]
    outs = [llm.generate([target], SamplingParams(temperature=1.0, max_tokens=24, seed=s, ignore_eos=True))[0]
            for s in (1, 2, 3)]
    ids = [tuple(o["token_ids"]) for o in outs]
    assert len(set(ids)) == 3, "different seeds gave identical samples"
    # Sampling is not greedy: at temperature 1 the output differs from the greedy one.
    greedy_ids = tuple(llm.generate([target], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
                       ["token_ids"])
    assert any(i != greedy_ids for i in ids)


def test_seeded_sampling_respects_top_k_through_the_engine(llm, hf_oracle, tiny_model):
    """top_k=1 at any temperature is greedy: the engine must give HF's greedy tokens."""
    from llmcli import SamplingParams

    prompts = _prompts([9, 33], 3)
    want = hf_oracle.greedy(tiny_model, prompts, 16)
    outs = llm.generate(prompts, SamplingParams(temperature=1.3, top_k=1, max_tokens=16, seed=5, ignore_eos=True))
    assert [list(o["token_ids"]) for o in outs] == want


# Request 213 of structured_bench.py (seed 213) at its 535th token (step 534): the hash of token 86015 is the
# largest 24-bit value, whose uniform (2**24 - 0.5) / 2**24 rounds to 1.0 in float32. Gumbel noise there was
# -log(-log 1) = +inf, and a masked (-inf) logit plus +inf is NaN, which argmax picks: the engine sampled a
# token the grammar's mask had removed, and the matcher refused it. (Noise now finite: gumbel_noise.)
EDGE_SEED, EDGE_STEP, EDGE_TOKEN = 213, 534, 86015


def test_the_edge_case_input_hits_the_top_hash_value():
    from llmcli.layers.sampler import _mix32, row_keys

    key = row_keys(torch.tensor([EDGE_SEED]), torch.tensor([EDGE_STEP]))
    assert int(_mix32(key ^ EDGE_TOKEN) >> 8) == (1 << 24) - 1  # else pick another input for the tests below


@pytest.mark.parametrize("min_p", [0.0, 0.2])
def test_a_masked_token_is_never_drawn_even_at_the_top_hash_value(min_p):
    vocab = EDGE_TOKEN + 100
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    logits[:, EDGE_TOKEN] = float("-inf")  # what a token bitmask does to a disallowed token
    ones = torch.ones(2)
    seeds, steps = torch.tensor([EDGE_SEED, EDGE_SEED]), torch.tensor([EDGE_STEP, EDGE_STEP])
    for use_filters in (False, True):
        got = sampled(logits, ones * 0.6, torch.full((2,), -1), ones, ones * min_p, seeds, steps, use_filters)
        assert EDGE_TOKEN not in got.tolist()
        assert torch.isfinite(logits.gather(1, got[:, None])).all()


def test_an_allowed_token_at_the_top_hash_value_is_not_forced():
    """The same hash value on an allowed token gave it infinite noise: drawn whatever its logit."""
    vocab = EDGE_TOKEN + 100
    logits = torch.zeros(1, vocab)
    logits[0, EDGE_TOKEN] = -60.0  # probability ~e^-100 at temperature 0.6: never drawn
    logits[0, 7] = 10.0
    one = torch.ones(1)
    got = sampled(logits, one * 0.6, torch.full((1,), -1), one, one * 0.0, torch.tensor([EDGE_SEED]),
                    torch.tensor([EDGE_STEP]), False)
    assert got.item() != EDGE_TOKEN


def test_graph_sampling_rows_and_which_sampler_graph_a_step_takes():
    """The decode graph's sampling rows (``RowTable.graph_sampling``: settings kept per block-table row, set
    when a row changes hands) carry each row's temperature, min-p, top-p, top-k, seed and step, and a step
    takes the filtered sampler graph exactly when a sampling row has top-k or top-p (a greedy row's filters
    change no argmax); a row handed to another sequence takes that one's settings."""
    import numpy as np

    from llmcli.engine.plan_builder import row_settings
    from llmcli.engine.row_table import RowTable
    from llmcli.engine.sequence import Sequence
    from llmcli.sampling_params import SamplingParams

    table = RowTable(4, 16, torch.device("cpu"), rows=2)  # grows to row 4 below
    owners: dict[int, int] = {}

    def seq(prompt: int, done: int, row: int, table_id: int, seed: int, **params) -> Sequence:
        s = Sequence(list(range(3, 3 + prompt)), SamplingParams(**params), 16, seed=seed)
        s.token_ids += [5] * done
        s.table_row, s.table_id = row, table_id
        return s

    def gather(seqs: list[Sequence]):
        for s in seqs:
            if owners.get(s.table_row) != s.table_id:  # the row changed hands: its settings arrive once
                owners[s.table_row] = s.table_id
                table.set(s.table_row, row_settings(s))
        rows = np.array([s.table_row for s in seqs])
        return table.graph_sampling(rows, np.array([len(s.token_ids) for s in seqs]) - table.prompt[rows])

    cases = [  # (sequences, filtered, [temperature, min_p, top_p] rows, top_ks, seeds, steps)
        ([seq(7, 2, 0, 1, 11, temperature=0.0, top_k=5), seq(4, 0, 1, 1, 12, temperature=1.0)],
         False, [[0, 1], [0, 0], [1, 1]], [5, -1], [11, 12], [2, 0]),
        ([seq(7, 3, 0, 2, 13, temperature=1.0), seq(4, 1, 4, 1, 14, temperature=0.7, top_p=0.9, min_p=0.1)],
         True, [[1, 0.7], [0, 0.1], [1, 0.9]], [-1, -1], [13, 14], [3, 1]),
        ([seq(9, 5, 1, 2, 15, temperature=0.6, top_k=20, top_p=0.95), seq(7, 4, 0, 2, 13, temperature=1.0)],
         True, [[0.6, 1], [0, 0], [0.95, 1]], [20, -1], [15, 13], [5, 4]),
        ([seq(2, 1, 1, 3, 16, temperature=0.0, top_p=0.5)], False, [[0], [0], [0.5]], [-1], [0], [0]),
    ]
    for seqs, filtered, f32, top_ks, seeds, steps in cases:
        got = gather(seqs)
        assert got.filtered is filtered
        np.testing.assert_allclose(got.f32, np.array(f32, dtype=np.float32))
        assert got.f32.dtype == np.float32 and got.top_ks.dtype == np.int64
        assert got.top_ks.tolist() == top_ks and got.seeds.tolist() == seeds and got.steps.tolist() == steps

