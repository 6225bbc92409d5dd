"""Image inputs on llmcli's text-only models (issue 40): an image content part (OpenAI chat's ``image_url``, the
Responses API's ``input_image``) or an image field of a record (``images``, ``image``, vLLM's
``multi_modal_data``) is an input error naming the file, the line and the field, never dropped silently
(before, a top-level ``images`` field was an unknown field: a warning, and the text answered without it).
"""
from __future__ import annotations

import orjson
import pytest
from typer.testing import CliRunner

from llmcli.cli.app import app
from llmcli.engine.chat_messages import template_message
from processes import REPO

MODEL = REPO / "examples" / "tiny-qwen3"
ENGINE = ["--model", str(MODEL), "--device", "cpu", "--max-model-len", "64", "--max-tokens", "2",
          "--temperature", "0"]
NO_IMAGES = "llmcli runs the language model only and reads no images"
IMAGE_PART = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}

# record -> (field, words of the message)
PLAIN = [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, IMAGE_PART]}]},
     "messages[0].content[1]", ['an image part ("type": "image_url")', NO_IMAGES]),
    ({"messages": [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
     "messages[1].content[0]", ['an image part ("type": "input_image")', NO_IMAGES]),
    ({"prompt": "describe it", "images": ["cat.png"]}, "images", [NO_IMAGES]),
    ({"prompt": "describe it", "image": "cat.png"}, "image", [NO_IMAGES]),
    ({"prompt": "describe it", "multi_modal_data": {"image": "cat.png"}}, "multi_modal_data", [NO_IMAGES]),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": ""}}]}]},
     "messages[0].content[0]", ['a part of type "input_audio"', "text-only model"]),
]
OPENAI = [
    ({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
      "body": {"model": "m", "messages": [{"role": "user", "content": [IMAGE_PART]}]}},
     "body.messages[0].content[0]", ['an image part ("type": "image_url")', NO_IMAGES]),
    ({"custom_id": "r2", "method": "POST", "url": "/v1/completions",
      "body": {"model": "m", "prompt": "hi", "images": ["x.png"]}}, "body.images", [NO_IMAGES]),
]


@pytest.mark.parametrize("cases", [PLAIN, OPENAI], ids=["plain", "openai"])
def test_image_inputs_are_input_errors_naming_file_line_and_field(tmp_path, cases):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ok = ({"id": "ok", "prompt": "hello"} if cases is PLAIN else
          {"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "hello"}})
    records = [rec if cases is OPENAI else {"id": f"r{i}", **rec} for i, (rec, _, _) in enumerate(cases)]
    inp.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in [*records, ok]))
    refused = CliRunner().invoke(app, ["generate", str(inp), "-o", str(out), *ENGINE])
    assert refused.exit_code == 2 and not out.exists(), refused.output
    for line, (_, field, words) in enumerate(cases, start=1):
        said = next((s for s in refused.output.splitlines() if s.startswith(f"{inp}:{line}: ")), None)
        assert said is not None and said.startswith(f"{inp}:{line}: {field}: "), (line, refused.output)
        assert all(w in said for w in words), said
    # with --on-error skip: an error record for each, and the text-only record answered
    result = CliRunner().invoke(app, ["generate", str(inp), "-o", str(out), *ENGINE, "--on-error", "skip", "-q"])
    assert result.exit_code == 1, result.output
    lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    assert len(lines) == len(cases) + 1
    for got, (_, field, _) in zip(lines, cases):
        error = got["error"] if cases is PLAIN else got["response"]["body"]["error"]
        assert (error.get("field") or error.get("param")) == field, got
    answered = lines[-1] if cases is PLAIN else lines[-1]["response"]["body"]
    assert "error" not in answered or answered["error"] is None


def test_the_python_api_names_the_image_part():
    with pytest.raises(ValueError, match=r'an image part \("type": "image_url"\): llmcli runs the language model'):
        template_message({"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE_PART]})
