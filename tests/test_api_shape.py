"""The Python API as a vLLM user meets it: prompt forms, n, RequestOutput's shape, chat, and the
model's generation_config.json defaults (also on the command line)."""
from __future__ import annotations

import json
import shutil

import orjson
import pytest
from typer.testing import CliRunner

from llmcli import LLM, SamplingParams
from llmcli.cli.app import app

KW = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=128, max_num_seqs=8,
          max_model_len=256)
GEN_DEFAULTS = {"temperature": 0.0, "top_k": 20, "repetition_penalty": 1.8}


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model), **KW)


@pytest.fixture(scope="module")
def model_with_defaults(tiny_model, tmp_path_factory):
    """The tiny model whose generation_config.json asks for greedy decoding with a repetition penalty."""
    folder = tmp_path_factory.mktemp("gen_defaults") / "model"
    shutil.copytree(tiny_model, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, **GEN_DEFAULTS}))
    return folder


def test_prompt_forms_give_the_same_answer(llm):
    ids = llm.tokenizer.encode("hello world", add_special_tokens=False)
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(["hello world", {"prompt": "hello world"}, {"prompt_token_ids": ids}, ids], p)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == ["hello world", "hello world", None, None]
    assert all(o.prompt_token_ids == ids for o in outs)
    single = llm.generate({"prompt_token_ids": ids}, p)
    assert len(single) == 1 and single[0].token_ids == outs[0].token_ids


def test_n_completions_and_the_old_access(llm):
    p = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True, n=3)
    (out,) = llm.generate(["abc"], p)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    # completion j is the request seeded seed + j, alone
    for j, c in enumerate(out.outputs):
        alone = llm.generate(["abc"], SamplingParams(temperature=1.0, seed=11 + j, max_tokens=6, ignore_eos=True))
        assert c.token_ids == alone[0].token_ids and c.text == alone[0].outputs[0].text
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out["text"] == out.outputs[0].text and out["token_ids"] == out.outputs[0].token_ids
    assert out["finish_reason"] == out.outputs[0].finish_reason == "length"
    assert out.finished and out.request_id == 0
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time


def test_chat_applies_the_template(llm):
    conversation = [{"role": "user", "content": "hi there"}]
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    text = llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    want = llm.generate([text], p)[0]
    got = llm.chat(conversation, p)
    assert len(got) == 1 and got[0].token_ids == want.token_ids and got[0].prompt == text
    both = llm.chat([conversation, [{"role": "user", "content": "other"}]], p)
    assert len(both) == 2 and both[0].token_ids == want.token_ids


def test_generation_config_applies_only_without_sampling_params(model_with_defaults):
    """As vLLM's LLM.generate: the model's values fill in only when no SamplingParams are given (issue 29)."""
    auto = LLM(str(model_with_defaults), **KW)
    ignore = LLM(str(model_with_defaults), generation_config="ignore", **KW)
    defaults = auto.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.repetition_penalty) == (0.0, 20, 1.8)
    assert ignore.get_default_sampling_params().temperature == 1.0
    prompt = ["some prompt"]
    model_values = SamplingParams(temperature=0, top_k=20, repetition_penalty=1.8)
    # no params: the model's values (and SamplingParams' own max_tokens=16)
    assert auto.generate(prompt)[0].token_ids == ignore.generate(prompt, model_values)[0].token_ids
    # given params run as written: unset fields take the neutral values, not the model's
    unset = SamplingParams(max_tokens=8, ignore_eos=True, seed=3)
    neutral = SamplingParams(max_tokens=8, ignore_eos=True, seed=3, temperature=1.0, top_k=-1, repetition_penalty=1.0)
    got = auto.generate(prompt, unset)[0].token_ids
    assert got == ignore.generate(prompt, neutral)[0].token_ids
    # the model's values, asked for explicitly
    chosen = auto.get_default_sampling_params().replace(max_tokens=8, ignore_eos=True, seed=3)
    want = ignore.generate(prompt, model_values.replace(max_tokens=8, ignore_eos=True, seed=3))[0].token_ids
    assert auto.generate(prompt, chosen)[0].token_ids == want
    assert want != got  # the two settings differ, else nothing is shown


def test_command_line_generation_config(model_with_defaults, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(orjson.dumps({"prompt": "some prompt", "max_tokens": 8, "ignore_eos": True}) + b"\n")
    args = ["generate", str(inp), "--model", str(model_with_defaults), "--device", "cpu", "--num-kvcache-blocks",
            "64", "--kvcache-block-size", "16", "--max-model-len", "256", "--seed", "3"]
    ref = LLM(str(model_with_defaults), generation_config="ignore", **KW)

    def run(*extra):
        out = tmp_path / f"out{len(extra)}.jsonl"
        result = CliRunner().invoke(app, args + ["-o", str(out), *extra])
        assert result.exit_code == 0, result.output
        return orjson.loads(out.read_bytes())["text"], result.output

    text, log = run()
    assert "generation_config.json sets temperature=0.0, top_k=20, repetition_penalty=1.8" in log
    greedy = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0, top_k=20, repetition_penalty=1.8)
    assert text == ref.generate(["some prompt"], greedy)[0].text
    text, log = run("--generation-config", "ignore")
    assert "generation_config.json" not in log
    assert text == ref.generate(["some prompt"], SamplingParams(max_tokens=8, ignore_eos=True, seed=3))[0].text
    text, log = run("--temperature", "1.0", "--repetition-penalty", "1.0")
    assert "sets top_k=20 for records" in log
    sampled = SamplingParams(max_tokens=8, ignore_eos=True, seed=3, temperature=1.0, top_k=20)
    assert text == ref.generate(["some prompt"], sampled)[0].text
