"""Plain-text prompts get the tokenizer's special tokens (Llama 3 and Mistral: BOS), as ``tokenizer(text)`` and
vLLM give them; chat prompts get only what their template writes (one BOS); Qwen's prompts get nothing added.

The tiny Llama and Mistral tokenizers put a BOS before a plain text as the published ones do (tests/tiny_qwen3.py).
"""
from __future__ import annotations

import json

import orjson
import pytest
from typer.testing import CliRunner

from llmcli import LLM, SamplingParams
from llmcli.cli.app import app
from llmcli.cli.io.prepare import Preparer
from llmcli.cli.io.records import parse_line
from llmcli.cli.io.source import RawLine
from llmcli.models.hub import load_tokenizer

TEXT = "The quick brown fox jumps over the lazy dog"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
BOS = {"llama": "<|begin_of_text|>", "mistral": "<s>"}
KW = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=128)


def records() -> list[dict]:
    """A plain record, an OpenAI completions line, a plain chat record and an OpenAI chat line."""
    return [{"id": "plain", "prompt": TEXT},
            {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
             "body": {"model": "m", "prompt": TEXT, "max_tokens": 2}},
            {"id": "chat", "messages": CHAT},
            {"custom_id": "chat-line", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "m", "messages": CHAT, "max_tokens": 2}}]


def rendered(tok) -> str:
    return tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_the_cli_encodes_plain_texts_with_special_tokens_and_chats_as_rendered(family, tiny_checkpoint):
    tok = load_tokenizer(tiny_checkpoint(family))
    plain = tok(TEXT).input_ids
    if family in BOS:
        assert plain[0] == tok.convert_tokens_to_ids(BOS[family]) and plain[1:] == tok(
            TEXT, add_special_tokens=False).input_ids
    else:  # Qwen's tokenizer adds nothing: the same ids as before
        assert plain == tok(TEXT, add_special_tokens=False).input_ids
    chat = tok(rendered(tok), add_special_tokens=False).input_ids
    preparer = Preparer(tok, max_model_len=128, vocab_size=len(tok), defaults={})
    # one batch holding both kinds: each is encoded its own way and the order is kept
    got = preparer.prepare_all([parse_line(RawLine(i + 1, orjson.dumps(r))) for i, r in enumerate(records())])
    assert [g.prompt_token_ids for g in got] == [plain, plain, chat, chat]
    if family in BOS:
        assert chat.count(tok.convert_tokens_to_ids(BOS[family])) == 1  # the template's, not a second one


def test_truncate_prompt_tokens_keeps_the_last_tokens_so_it_drops_bos(tiny_checkpoint):
    """As in vLLM: the cut is taken from the encoded prompt, BOS included (documented in docs/python-api.md)."""
    tok = load_tokenizer(tiny_checkpoint("llama"))
    preparer = Preparer(tok, max_model_len=128, vocab_size=len(tok), defaults={})
    req = preparer.prepare(parse_line(RawLine(1, orjson.dumps({"prompt": TEXT, "truncate_prompt_tokens": 3}))))
    assert req.prompt_token_ids == tok(TEXT).input_ids[-3:]


def test_cli_output_shows_the_bos_of_plain_records_and_one_bos_in_chats(tiny_checkpoint, tmp_path):
    model = tiny_checkpoint("llama")
    tok = load_tokenizer(model)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in records()))
    result = CliRunner().invoke(app, ["generate", str(inp), "-o", str(out), "--model", str(model), "--device", "cpu",
                                      "--dtype", "float32", "--num-kvcache-blocks", "64", "--max-model-len", "128",
                                      "--max-tokens", "2", "--temperature", "0", "--include-token-ids", "-q"])
    assert result.exit_code == 0, result.output
    lines = {line.get("custom_id", line.get("id")): line for line in map(json.loads, out.read_text().splitlines())}
    assert lines["plain"]["prompt_token_ids"] == tok(TEXT).input_ids
    assert lines["cmpl"]["response"]["body"]["usage"]["prompt_tokens"] == len(tok(TEXT).input_ids)
    assert lines["chat"]["prompt_token_ids"] == tok(rendered(tok), add_special_tokens=False).input_ids
    assert lines["chat"]["prompt_token_ids"].count(tok.convert_tokens_to_ids(BOS["llama"])) == 1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_llm_generate_encodes_text_as_the_tokenizer_does_and_chat_as_rendered(family, tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint(family)), **KW)
    tok = llm.tokenizer
    p = SamplingParams(temperature=0, max_tokens=1)
    outs = llm.generate([TEXT, {"prompt": TEXT}], p)
    assert [o.prompt_token_ids for o in outs] == [tok(TEXT).input_ids] * 2
    [reply] = llm.chat(CHAT, p)
    assert reply.prompt_token_ids == tok(rendered(tok), add_special_tokens=False).input_ids
    if family == "llama":
        assert outs[0].prompt_token_ids[0] == tok.bos_token_id
        assert reply.prompt_token_ids.count(tok.bos_token_id) == 1
    llm.shutdown()
