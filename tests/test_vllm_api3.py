"""A vLLM script with only its import changed (issue 42): vLLM's LLM keyword arguments, what lm-eval's vLLM
backend reads, detokenize=False, content parts and tool-call turns in chat, num_cached_tokens."""
from __future__ import annotations

import logging

import pytest

from llmcli import LLM, SamplingParams
from llmcli.config import ConfigError
from llmcli.sampling_params import SamplingParamsError
from llmcli.vllm_args import config_kwargs

# What lm-eval's vLLM backend passes to LLM(...) (lm_eval/models/vllm_causallms.py), and common vLLM arguments.
LM_EVAL_ARGS = dict(revision=None, dtype="float32", tokenizer=None, tokenizer_mode="auto", tokenizer_revision=None,
                    trust_remote_code=True, tensor_parallel_size=1, max_model_len=256, max_num_seqs=None,
                    quantization=None, seed=1234, enable_lora=False, max_lora_rank=16)
VLLM_ARGS = dict(block_size=16, enable_chunked_prefill=True, disable_log_stats=True, swap_space=4,
                 gpu_memory_utilization=0.9, enforce_eager=True, num_gpu_blocks_override=128)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(model=str(tiny_model), device="cpu", **LM_EVAL_ARGS, **VLLM_ARGS)


def test_vllm_keyword_arguments_are_mapped(llm, tiny_model):
    cfg = llm.llm_engine.model_config
    assert cfg.max_model_len == 256 and cfg.kvcache_block_size == 16 and cfg.num_kvcache_blocks == 128
    assert cfg.seed == 1234 and cfg.max_num_seqs == 1024  # None: the default, as vLLM's callers mean it
    assert llm.get_tokenizer() is llm.tokenizer and llm.get_tokenizer().eos_token == "<|im_end|>"
    assert llm.llm_engine.get_tokenizer() is llm.tokenizer


def test_vllm_arguments_without_meaning_are_noted_once_and_incompatible_ones_refused(caplog):
    with caplog.at_level(logging.WARNING, logger="llmcli"):
        assert config_kwargs({"swap_space": 16, "enable_chunked_prefill": False, "block_size": 32}) == {
            "kvcache_block_size": 32}
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 2 and "swap_space=16" in notes[0] and "recomputed" in notes[0]
    with caplog.at_level(logging.WARNING, logger="llmcli"):
        caplog.clear()
        seeded = config_kwargs({"seed": None})
    assert isinstance(seeded["seed"], int) and str(seeded["seed"]) in caplog.records[0].getMessage()
    for bad, why in [({"enable_lora": True}, "LoRA"), ({"pipeline_parallel_size": 2}, "pipeline"),
                     ({"revision": "v2"}, "revision"), ({"cpu_offload_gb": 4}, "offload")]:
        with pytest.raises(ConfigError, match=why) as err:
            config_kwargs(bad)
        assert str(err.value).startswith(f"LLM({next(iter(bad))}=") and "\n" not in str(err.value)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_knob'"):
        config_kwargs({"no_such_knob": 1})


def test_refused_argument_fails_before_the_model_loads(tmp_path):
    with pytest.raises(ConfigError, match="LoRA"):
        LLM(str(tmp_path / "no-model-here"), enable_lora=True)


def test_detokenize_false_leaves_texts_empty(llm):
    ids = [[5, 9, 30, 41], [7, 7, 8]]
    plain = llm.generate(ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    bare = llm.generate(ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False,
                                            prompt_logprobs=1))
    for a, b in zip(plain, bare):
        assert b.outputs[0].text == "" and a.outputs[0].text != ""
        assert b.outputs[0].token_ids == a.outputs[0].token_ids and len(b.prompt_logprobs) == len(b.prompt_token_ids)
    with pytest.raises(SamplingParamsError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["x"])


def test_chat_joins_text_parts_with_newlines_as_vllm(llm):
    params = SamplingParams(temperature=0, max_tokens=3)
    parts = [{"role": "user", "content": [{"type": "text", "text": "the quick"}, {"type": "text", "text": "fox"}]}]
    joined = [{"role": "user", "content": "the quick\nfox"}]
    a, b = llm.chat(parts, params)[0], llm.chat(joined, params)[0]
    assert a.prompt_token_ids == b.prompt_token_ids and a.outputs[0].token_ids == b.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"message 0: content\[0\]"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params)


def test_chat_accepts_tool_call_history(llm):
    tool_turns = [{"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"a\": 1}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = llm.chat(tool_turns, SamplingParams(temperature=0, max_tokens=2))[0]
    text = llm.tokenizer.decode(out.prompt_token_ids)
    assert "<|im_start|>assistant\n<|im_end|>" in text and "<|im_start|>tool\nsunny" in text


def test_num_cached_tokens_counts_prefix_cache_hits(llm):
    prompt = list(range(5, 5 + 40))
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32  # two whole 16-token blocks
    assert second.num_cached_tokens == second.metrics.num_cached_prompt_tokens


def test_skip_reading_prefix_cache_computes_the_whole_prompt(llm):
    """vLLM's per-request switch: the cached prompt is computed again (and the tokens stay those of the cold run);
    None skips it only with prompt_logprobs; False there is an error, since cached positions have no logits."""
    prompt = list(range(7, 7 + 40))
    greedy = SamplingParams(temperature=0, max_tokens=4)
    cold = llm.generate([prompt], greedy)[0]
    skipped = llm.generate([prompt], greedy.replace(skip_reading_prefix_cache=True))[0]
    warm = llm.generate([prompt], greedy)[0]
    assert (cold.num_cached_tokens, skipped.num_cached_tokens, warm.num_cached_tokens) == (0, 0, 32)
    assert skipped.outputs[0].token_ids == cold.outputs[0].token_ids == warm.outputs[0].token_ids
    scored = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert scored.num_cached_tokens == 0 and all(p is not None for p in scored.prompt_logprobs[1:])
    with pytest.raises(SamplingParamsError, match="skip_reading_prefix_cache: cannot be False with prompt_logprobs"):
        SamplingParams(prompt_logprobs=1, skip_reading_prefix_cache=False)
    with pytest.raises(SamplingParamsError, match="skip_reading_prefix_cache: must be true, false or None"):
        SamplingParams(skip_reading_prefix_cache=1)


def _record(obj):
    import orjson

    from llmcli.cli.io.records import parse_line
    from llmcli.cli.io.source import RawLine

    return parse_line(RawLine(1, orjson.dumps(obj)))


def test_cli_records_join_text_parts_and_accept_tool_call_turns():
    rec = _record({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                             {"type": "text", "text": "b"}]}]})
    assert rec.error is None and rec.prompt[0]["content"] == "a\nb"
    call = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
    rec = _record({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}})
    assert rec.error is None and rec.prompt[1]["content"] == "" and rec.prompt[1]["tool_calls"][0]["function"][
        "arguments"] == {}
    rec = _record({"messages": [{"role": "user", "content": None}]})
    assert rec.error.field == "messages[0].content" and "null only in an assistant turn" in rec.error.message
