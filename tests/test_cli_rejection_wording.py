"""The words a user reads when a record can never run (issue 42's "CLI hint wording tested"): each error names
the field that causes it and the fix that works — prompt logprobs and score records included (a score has no
max_tokens to lower, and cutting its text would change it), the KV cache flags only where a bigger cache is
the fix, and prompt logprobs with tensor parallelism answered, not refused.

One run of examples/tiny-qwen3 with a pool of 2 blocks of 16 tokens and max_model_len 48; the same records
checked ahead of the first token and, with LLMCLI_CHECK_AHEAD=1, at admission.
"""
from __future__ import annotations

import subprocess
import sys

import orjson
import pytest
from typer.testing import CliRunner

from llmcli.cli.app import app
from processes import REPO, env

MODEL = REPO / "examples" / "tiny-qwen3"
ENGINE = ["--model", str(MODEL), "--device", "cpu", "--num-kvcache-blocks", "2", "--kvcache-block-size", "16",
          "--max-model-len", "48"]
POOL = "(--num-kvcache-blocks / --gpu-memory-utilization)"
IDS = list(range(300, 360))

# id -> (record, field, words the message must hold, words it must not)
CASES = {
    "prompt logprobs, prompt too big for the pool": (
        {"prompt_token_ids": IDS[:40], "prompt_logprobs": 1, "max_tokens": 1}, "prompt_token_ids",
        ["the prompt is 40 tokens", "need 3 KV blocks", "whole pool has 2", "shorten the prompt", POOL],
        ["max_tokens"]),
    "ids under prompt": (
        {"prompt": IDS[:40], "prompt_logprobs": 0, "max_tokens": 1}, "prompt", ["the prompt is 40 tokens", POOL], []),
    "max_tokens too big for the pool": (
        {"prompt_token_ids": IDS[:10], "prompt_logprobs": 1, "max_tokens": 40}, "max_tokens",
        ["may grow to 48 tokens", "lower max_tokens", POOL], ["shorten the prompt", "sets no max_tokens"]),
    "no max_tokens": (
        {"prompt_token_ids": IDS[:10]}, "max_tokens",
        ["may grow to 48 tokens", POOL, "the record sets no max_tokens", "--max-tokens"], []),
    "continuation too big for the pool": (
        {"prompt": [300, 301, 302], "continuations": [IDS[:40]]}, "continuations[0]",
        ["prompt and continuation are 43 tokens", "need 3 KV blocks to score", "whole pool has 2", POOL],
        ["max_tokens", "generated"]),
    "perplexity text too big for the pool": (
        {"prompt": IDS[:40], "score": "perplexity"}, "prompt",
        ["the text is 40 tokens", "need 3 KV blocks to score", POOL], ["max_tokens", "generated"]),
    "perplexity text longer than max_model_len": (
        {"prompt": IDS, "score": "perplexity"}, "prompt",
        ["prompt is 60 tokens, too long for max_model_len=48", "raise --max-model-len"],
        ["truncate_prompt_tokens", "generated", "KV"]),
    "continuation past max_model_len": (
        {"prompt": IDS[:30], "continuations": [IDS[:20]]}, "continuations[0]",
        ["prompt and continuation are 50 tokens, too long for max_model_len=48", "raise --max-model-len"],
        ["truncate_prompt_tokens", "KV"]),
    "prompt logprobs, prompt longer than max_model_len": (
        {"prompt_token_ids": IDS, "prompt_logprobs": 1}, "prompt_token_ids",
        ["prompt is 60 tokens, too long for max_model_len=48", "truncate_prompt_tokens: -1 keeps its end"], ["KV"]),
    "logit_bias outside the vocabulary": (
        {"prompt_token_ids": IDS[:5], "logit_bias": {"999999": 1}, "max_tokens": 1}, "logit_bias",
        ["token id 999999 is outside the vocabulary"], ["KV", "--num-kvcache-blocks"]),
}


@pytest.mark.parametrize("ahead", ["default", "1"])
def test_each_refusal_names_its_field_and_the_fix_that_works(tmp_path, monkeypatch, ahead):
    if ahead != "default":
        monkeypatch.setenv("LLMCLI_CHECK_AHEAD", ahead)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ok = {"prompt_token_ids": IDS[:5], "prompt_logprobs": 1, "max_tokens": 1}
    lines = [{"id": "ok", **ok}] + [{"id": name, **rec} for name, (rec, *_) in CASES.items()]
    inp.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in lines))
    result = CliRunner().invoke(app, ["generate", str(inp), "-o", str(out), *ENGINE, "--on-error", "skip", "-q"])
    assert result.exit_code == 1, result.output
    got = {r["id"]: r for r in map(orjson.loads, out.read_bytes().splitlines())}
    assert got["ok"].get("error") is None and len(got["ok"]["prompt_logprobs"]) == 5
    for name, (_, field, must, must_not) in CASES.items():
        error = got[name]["error"]
        assert error["field"] == field, (name, error)
        for words in must:
            assert words in error["message"], (name, words, error["message"])
        for words in must_not:
            assert words not in error["message"], (name, words, error["message"])
        # stderr says the same line, naming the record's line and field
        assert f"in.jsonl:{error['line']}: {field}: {error['message']}" in result.output, (name, result.output)


def test_prompt_logprobs_with_tensor_parallelism_are_answered_as_with_one_rank(tmp_path):
    """-tp 2 (gloo): no refusal blaming the KV cache or prompt_token_ids; the same prompt logprobs as -tp 1."""
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(orjson.dumps({"id": "a", "prompt_token_ids": IDS[:12], "prompt_logprobs": 2, "max_tokens": 2,
                                  "temperature": 0}) + b"\n")
    flags = ["--model", str(MODEL), "--device", "cpu", "--max-model-len", "64", "-q"]
    result = CliRunner().invoke(app, ["generate", str(inp), "-o", str(tmp_path / "one.jsonl"), *flags])
    assert result.exit_code == 0, result.output
    done = subprocess.run([sys.executable, "-m", "llmcli.cli.app", "generate", str(inp), "-o",
                           str(tmp_path / "two.jsonl"), *flags, "-tp", "2"],
                          env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    answers = {tp: orjson.loads((tmp_path / f"{tp}.jsonl").read_bytes()) for tp in ("one", "two")}
    one, two = answers["one"], answers["two"]
    assert two.get("error") is None and len(two["prompt_logprobs"]) == 12 and two["prompt_logprobs"][0] is None
    assert [p["token_id"] for p in two["prompt_logprobs"][1:]] == IDS[1:12]
    for a, b in zip(one["prompt_logprobs"][1:], two["prompt_logprobs"][1:]):
        assert abs(a["logprob"] - b["logprob"]) < 1e-4
        assert [t["token_id"] for t in a["top_logprobs"]] == [t["token_id"] for t in b["top_logprobs"]]
