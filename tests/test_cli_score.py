"""Score records (issue 42): continuations' log-likelihoods and a text's perplexity from the command line,
against transformers' log-softmax on the same tiny fp32 weights; bad score records; --resume."""
from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import orjson
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cli import generate, read_jsonl, write_jsonl  # noqa: E402

PROMPT = "the quick brown"
TEXT = "the quick brown fox jumps over the lazy dog"
RECORDS = [
    {"id": "c", "prompt": PROMPT, "continuations": [" fox", " dog jumps over", [5, 6, 7]]},
    {"id": "p", "prompt": TEXT, "score": "perplexity"},
    {"id": "t", "prompt_token_ids": [9, 10, 11, 12, 13], "score": "perplexity"},
    {"id": "sampling", "prompt": "x y", "continuations": [" a"], "temperature": 0.5},
    {"id": "kind", "prompt": "x y", "score": "ppl"},
    {"id": "both", "prompt": "x y", "score": "perplexity", "continuations": [" a"]},
]


def hf_logprobs(hf_oracle, model, ids: list[int]) -> list[float]:
    """transformers' log-probability of each token after the first, given the tokens before it."""
    with torch.no_grad():
        logits = hf_oracle.model(model)(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[j - 1, ids[j]].item() for j in range(1, len(ids))]


@pytest.fixture(scope="module")
def answered(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("score")
    inp, out = write_jsonl(tmp / "in.jsonl", RECORDS), tmp / "out.jsonl"
    result = generate(tiny_model, inp, out, "--on-error", "skip", "--include-token-ids")
    assert result.exit_code == 1, result.output  # the three bad records
    return inp, out, {line["id"]: line for line in read_jsonl(out)}


def test_continuations_are_scored_as_transformers_scores_them(answered, tiny_model, hf_oracle):
    line = answered[2]["c"]
    tok = hf_oracle.tokenizer(tiny_model)
    prompt = tok(PROMPT)["input_ids"]
    assert line["usage"]["prompt_tokens"] == len(prompt)
    for item, cont in zip(line["continuations"], [" fox", " dog jumps over", [5, 6, 7]]):
        ids = cont if isinstance(cont, list) else tok(cont, add_special_tokens=False)["input_ids"]
        assert item["continuation"] == cont and item["token_ids"] == ids
        want = hf_logprobs(hf_oracle, tiny_model, prompt + ids)[len(prompt) - 1:]
        assert item["token_logprobs"] == pytest.approx(want, abs=1e-4)
        assert item["logprob"] == pytest.approx(sum(want), abs=1e-4)
        with torch.no_grad():
            logits = hf_oracle.model(tiny_model)(torch.tensor([prompt + ids])).logits[0]
        greedy = logits[len(prompt) - 1:-1].argmax(-1).tolist() == ids
        assert item["is_greedy"] is greedy


def test_perplexity_of_a_text_and_of_token_ids(answered, tiny_model, hf_oracle):
    tok = hf_oracle.tokenizer(tiny_model)
    for key, ids in (("p", tok(TEXT)["input_ids"]), ("t", [9, 10, 11, 12, 13])):
        line = answered[2][key]
        want = hf_logprobs(hf_oracle, tiny_model, ids)
        assert line["token_ids"] == ids and line["token_logprobs"][0] is None
        assert line["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
        assert line["num_scored_tokens"] == len(ids) - 1
        assert line["perplexity"] == pytest.approx(math.exp(-sum(want) / len(want)), rel=1e-4)


def test_bad_score_records_are_errors_naming_the_field(answered):
    lines = answered[2]
    assert lines["sampling"]["error"]["field"] == "temperature"
    assert lines["kind"]["error"]["field"] == "score" and "perplexity" in lines["kind"]["error"]["message"]
    assert lines["both"]["error"]["field"] == "score"


def test_resume_answers_each_score_record_once(answered, tiny_model, tmp_path):
    inp, out, _ = answered
    lines = out.read_bytes().splitlines(keepends=True)
    part = tmp_path / "part.jsonl"
    part.write_bytes(lines[1] + lines[0][:9])  # as a crash leaves it: one line done, a torn tail
    result = generate(tiny_model, inp, part, "--on-error", "skip", "--include-token-ids", "--resume")
    assert result.exit_code == 1, result.output
    resumed = read_jsonl(part)
    assert sorted(line["id"] for line in resumed) == sorted(r["id"] for r in RECORDS)
    assert {orjson.dumps(line) for line in resumed} == {orjson.dumps(orjson.loads(line)) for line in lines}


def test_continuations_share_their_prompt_through_the_prefix_cache(tiny_model, tmp_path):
    """A record's continuations ask for their own tokens' logprobs only, so the prompt they share is computed
    once and served from the prefix cache to the others (in the same run: they are queued together); the
    scores equal a run with the cache off (fp32, within 1e-5)."""
    from test_cli import engine_args, runner
    from llmcli.cli.app import app

    prompt = "the quick brown fox jumps over the lazy dog while the farmer watches from the gate and"
    records = [{"id": i, "prompt": prompt + tail, "continuations": [" the sea", " a dog", " river", [5, 6, 7]]}
               for i, tail in enumerate(["", " then"])]
    inp = write_jsonl(tmp_path / "in.jsonl", records)
    args = [a if a != "16" else "4" for a in engine_args(tiny_model)]  # 4-token blocks: the prompt fills several
    lines, rates = {}, {}
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        out = tmp_path / f"{flag}.jsonl"
        result = runner.invoke(app, ["generate", str(inp), "-o", str(out), *args, flag, "--dtype", "float32"])
        assert result.exit_code == 0, result.output
        lines[flag] = read_jsonl(out)
        rates[flag] = float(re.search(r"prefix-cache hit rate\s*│?\s*([\d.]+)%", result.stderr).group(1))
    assert rates["--no-enable-prefix-caching"] == 0 and rates["--enable-prefix-caching"] > 50
    for got, want in zip(*lines.values()):
        for a, b in zip(got["continuations"], want["continuations"]):
            assert a["is_greedy"] == b["is_greedy"]
            assert a["token_logprobs"] == pytest.approx(b["token_logprobs"], abs=1e-5)
