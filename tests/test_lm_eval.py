"""lm-evaluation-harness on llmcli's engine (issue 42): the model "llmcli" against lm-eval's own "hf" model on
the same tiny fp32 weights and local tasks (tests/lm_eval_tasks/): multiple choice, rolling perplexity and
greedy generation."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
TASKS = ["llmcli_tiny_mc", "llmcli_tiny_ppl", "llmcli_tiny_gen"]
ENGINE = "dtype=float32,kvcache_block_size=16,num_kvcache_blocks=64,max_num_seqs=16"


def evaluate(model: str, model_args: str):
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, device="cpu", batch_size=4,
                                   task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False), log_samples=True,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def by_doc(results, task):
    """Each document's responses: [(loglikelihood, is_greedy), ...], [loglikelihood] or [text]."""
    return {s["doc_id"]: [r[0] for r in s["resps"]] for s in results["samples"][task]}


@pytest.fixture(scope="module")
def both(tiny_model, monkeypatch_module):
    monkeypatch_module.chdir(TASKS_DIR)  # the tasks' data_files are relative to their folder
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    import llmcli.lm_eval  # noqa: F401  (registers "llmcli")

    ours = evaluate("llmcli", f"pretrained={tiny_model},{ENGINE}")
    theirs = evaluate("hf", f"pretrained={tiny_model},dtype=float32")
    return ours, theirs


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_multiple_choice_equals_the_hf_model(both):
    ours, theirs = both
    assert ours["results"]["llmcli_tiny_mc"]["acc,none"] == theirs["results"]["llmcli_tiny_mc"]["acc,none"]
    a, b = by_doc(ours, "llmcli_tiny_mc"), by_doc(theirs, "llmcli_tiny_mc")
    assert a.keys() == b.keys() and len(a) == 8
    for doc in a:
        assert [g for _, g in a[doc]] == [g for _, g in b[doc]]  # is_greedy
        for (ll, _), (want, _) in zip(a[doc], b[doc]):
            assert abs(float(ll) - float(want)) < 1e-3


def test_rolling_perplexity_equals_the_hf_model(both):
    ours, theirs = both
    a, b = by_doc(ours, "llmcli_tiny_ppl"), by_doc(theirs, "llmcli_tiny_ppl")
    assert a.keys() == b.keys() and len(a) == 4
    for doc in a:
        assert float(a[doc][0]) == pytest.approx(float(b[doc][0]), rel=1e-4)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        got, want = ours["results"]["llmcli_tiny_ppl"][metric], theirs["results"]["llmcli_tiny_ppl"][metric]
        assert math.isfinite(got) and got == pytest.approx(want, rel=1e-4)


def test_greedy_generation_equals_the_hf_model(both):
    ours, theirs = both
    a, b = by_doc(ours, "llmcli_tiny_gen"), by_doc(theirs, "llmcli_tiny_gen")
    assert a == b and any(text for texts in a.values() for text in texts)


@pytest.mark.slow  # lm-eval's command line indexes all of its built-in tasks first (~30 s on 2 cores)
def test_python_m_entry_runs_lm_eval_with_the_llmcli_model(tiny_model, tmp_path):
    cmd = [sys.executable, "-m", "llmcli.lm_eval", "--model", "llmcli", "--model_args",
           f"pretrained={tiny_model},{ENGINE}", "--tasks", "llmcli_tiny_mc", "--include_path", str(TASKS_DIR),
           "--limit", "2", "--output_path", str(tmp_path / "out")]
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(cmd, cwd=TASKS_DIR, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(root), "HF_DATASETS_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "llmcli_tiny_mc" in done.stdout and "acc" in done.stdout


@pytest.mark.slow
def test_data_parallel_replicas_give_the_same_log_likelihoods(tiny_model):
    import llmcli.lm_eval

    engine = dict(dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=16, device="cpu")
    requests = [(None, [5, 9, 30 + i], [41, 7, i + 1]) for i in range(6)]
    one = llmcli.lm_eval.LLMCLIModel(str(tiny_model), **engine)
    want = one._loglikelihood_tokens(requests)
    one.engine.shutdown()
    two = llmcli.lm_eval.LLMCLIModel(str(tiny_model), data_parallel_size=2, **engine)
    try:
        got = two._loglikelihood_tokens(requests)
    finally:
        two.engine.shutdown()
    assert [g for _, g in got] == [g for _, g in want]
    assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in want], abs=1e-5)


def test_choices_of_a_question_share_its_context_through_the_prefix_cache(tiny_model):
    """A multiple-choice question's requests ask for the continuation's logprobs only
    (``prompt_logprobs_start``), so all but the first choice take the context's KV blocks from the prefix cache,
    in the same engine run; the log-likelihoods equal a run with the cache off (fp32, within 1e-5)."""
    import json

    import llmcli.lm_eval
    from lm_eval.api.instance import Instance

    docs = [json.loads(line) for line in (TASKS_DIR / "tiny_mc.jsonl").read_text().splitlines()]
    preamble = "Pick the ending that fits the sentence best. "  # a longer context: several 4-token blocks
    requests = [Instance("loglikelihood", doc, (preamble + doc["question"], choice), i)
                for i, doc in enumerate(docs) for choice in doc["choices"]]
    engine = dict(dtype="float32", kvcache_block_size=4, num_kvcache_blocks=256, max_num_seqs=16, device="cpu")
    got = {}
    for caching in (True, False):
        model = llmcli.lm_eval.LLMCLIModel(str(tiny_model), enable_prefix_caching=caching, **engine)
        try:
            got[caching] = model.loglikelihood(requests, disable_tqdm=True)
            stats = model.engine.stats
        finally:
            model.engine.shutdown()
        if caching:
            # every choice after a question's first takes the context's blocks that end before the position
            # whose logits give the continuation's first token
            contexts = [model.tok_encode(preamble + doc["question"]) for doc in docs]
            assert min(len(c) for c in contexts) > 8
            least = sum((len(doc["choices"]) - 1) * ((len(c) - 1) // 4 * 4) for doc, c in zip(docs, contexts))
            assert stats.prefix_cache_hit_tokens >= least > 0
    assert [g for _, g in got[True]] == [g for _, g in got[False]]
    assert [ll for ll, _ in got[True]] == pytest.approx([ll for ll, _ in got[False]], abs=1e-5)


# Pairs lm-eval's _encode_pair and empty-context rule treat specially: trailing whitespace moved to the
# continuation (spaces, a tab, newlines, a context of whitespace only), an empty context (with and without the
# prefix token opening the continuation), a context that opens with the prefix token's text, empty and repeated
# continuations, non-ASCII text.
TRICKY = [("The sky is", " blue"), ("The sky is ", "blue"), ("ends with spaces   ", "x  "), ("tab\t", "\tnext"),
          ("Question: why?\n\n", "Answer: because"), ("   ", "only spaces before"), ("", "no context at all"),
          ("", "{prefix}opens with the prefix token"), ("{prefix}Question: 2+2=", " 4"), ("a", ""),
          ("same context", " one"), ("same context", " one"), ("same context", " two"), ("café ", "crème brûlée")]


@pytest.mark.parametrize("family", ["qwen3", "llama"])  # no BOS (prefix: EOS) / a BOS its post-processor adds
@pytest.mark.parametrize("add_bos_token", [None, True, False])
def test_batched_loglikelihood_encoding_equals_lm_evals_encode_pair(family, add_bos_token):
    """``LLMCLIModel.loglikelihood`` encodes every distinct string in one batch; the (context, continuation)
    tokens it hands ``_loglikelihood_tokens`` equal those of lm-eval's own ``TemplateLM.loglikelihood``, which
    calls ``tok_encode`` (the tokenizer's per-string ``encode``) twice per request through ``_encode_pair``."""
    import llmcli.lm_eval
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import TemplateLM
    from tiny_qwen3 import build_family_tokenizer

    model = llmcli.lm_eval.LLMCLIModel.__new__(llmcli.lm_eval.LLMCLIModel)
    TemplateLM.__init__(model)
    model.tokenizer = build_family_tokenizer(family)
    model.add_bos_token, model.custom_prefix_token_id = add_bos_token, None
    model._loglikelihood_tokens = lambda reqs, **kwargs: reqs  # what each would score
    prefix = model.tokenizer.decode(model.prefix_token_id)
    assert prefix and (model.tokenizer.bos_token_id is not None) == (family == "llama")
    pairs = [(c.format(prefix=prefix), x.format(prefix=prefix)) for c, x in TRICKY]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    ours = model.loglikelihood(requests, disable_tqdm=True)
    theirs = TemplateLM.loglikelihood(model, requests, disable_tqdm=True)
    assert [key for key, _, _ in ours] == pairs
    assert ours == theirs
    # the cases are live: the BOS is added (or not) as asked, and trailing spaces really move
    (_, ctx, cont), = [r for r in ours if r[0] == ("The sky is ", "blue")]
    assert cont == model.tokenizer.encode(" blue", add_special_tokens=False)
    bos = model.tokenizer.bos_token_id
    assert (ctx[0] == bos) == (family == "llama" and add_bos_token is not False)
    if family == "llama":  # a context that opens with the BOS's text gets no second one unless asked
        (_, ctx, _), = [r for r in ours if r[0][1] == " 4"]
        assert ctx.count(bos) == (2 if add_bos_token else 1)
    assert model.tok_encode_many([p[0] for p in pairs]) == [model.tok_encode(p[0]) for p in pairs]
