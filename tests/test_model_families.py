"""Each family through the command line (its chat template, each of its EOS ids), the start-up refusals
(architecture, rope type, sliding window where a family does not apply it), and the rotary tables of the published configs against transformers'.

The token-level parity of every family through chunked prefill, prefix hits, preemption, block sizes and TP lives
in test_engine_vs_hf.py and test_tensor_parallel.py (parametrized over conftest.FAMILIES).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from llmcli.cli.app import app

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()

# What each family's template must turn one user turn into (written from the formats, not from the templates).
EXPECTED_CHAT = {
    "qwen3": "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
    "qwen2": "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
    "llama": ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "mistral": "<s>[INST] {} [/INST]",
}
QUESTIONS = ["What is the capital of France?", "Tell me about the river and the railway.",
             "Write a story about a robot.", "How do birds fly south in winter?",
             "Explain how a computer stores numbers.", "The garden was full of roses."]
MAX_NEW = 12


def cli_generate(model: Path, inp: Path, *flags: str):
    return runner.invoke(app, ["generate", str(inp), "--model", str(model), "--device", "cpu", "--dtype", "float32",
                               "--num-kvcache-blocks", "64", "--kvcache-block-size", "16", "--max-model-len", "128",
                               "-q", *flags])


def eos_ids_of(model: Path) -> list[int]:
    return json.loads((model / "generation_config.json").read_text())["eos_token_id"]


def steer_to_eos(src: Path, dst: Path, first_tokens: list[int], eos_ids: list[int]) -> None:
    """A copy of ``src`` whose output row of EOS id ``eos_ids[i]`` is twice the row of ``first_tokens[i]``: where
    that token was the (positive) best logit, the EOS id now is, so each EOS id gets emitted somewhere."""
    shutil.copytree(src, dst)
    file = dst / "model.safetensors"
    tensors = load_file(str(file))
    head = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    for token, eos in zip(first_tokens, eos_ids):
        tensors[head][eos] = 2.0 * tensors[head][token]
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "mistral"])
def test_chat_record_uses_the_family_template_and_stops_on_each_eos_id(family, tiny_checkpoint, hf_oracle,
                                                                       tmp_path):
    base = tiny_checkpoint(family)
    tok = hf_oracle.tokenizer(base)
    eos_ids = eos_ids_of(base)
    prompts = [tok(EXPECTED_CHAT[family].format(q), add_special_tokens=False)["input_ids"] for q in QUESTIONS]
    # one question per EOS id, each with its own first greedy token (kept in QUESTIONS' order)
    chosen, firsts = [], []
    for q, p, first in zip(QUESTIONS, prompts, (w[0] for w in hf_oracle.greedy(base, prompts, 1))):
        if first not in firsts and first not in eos_ids and len(chosen) < len(eos_ids):
            chosen.append((q, p))
            firsts.append(first)
    assert len(chosen) == len(eos_ids), "QUESTIONS give too few distinct first tokens"
    model = tmp_path / "steered"
    steer_to_eos(base, model, firsts, eos_ids)

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": q}]}) + "\n"
                           for i, (q, _) in enumerate(chosen)))
    out = tmp_path / "out.jsonl"
    result = cli_generate(model, inp, "-o", str(out), "--temperature", "0", "--max-tokens", str(MAX_NEW),
                          "--include-token-ids")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == list(range(len(chosen)))
    stopped_on = set()
    for line, (q, prompt) in zip(lines, chosen):
        assert line["prompt_token_ids"] == prompt, f"{family}: the chat record was not rendered with its template"
        [want] = hf_oracle.greedy(model, [prompt], MAX_NEW)
        k = min(want.index(e) for e in eos_ids if e in want)
        assert line["token_ids"] in (want[:k], want[:k + 1]) and line["finish_reason"] == "stop", (
            f"{family} {q!r}: should stop at new token {k} (EOS {want[k]}); HF {want}, llmcli {line['token_ids']}")
        stopped_on.add(want[k])
    assert stopped_on == set(eos_ids), f"{family}: stopped on {stopped_on}, EOS ids {eos_ids}"


def _with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("family,changes,words", [
    ("qwen3", {"architectures": ["GPT2LMHeadModel"]},
     ["architectures=['GPT2LMHeadModel']", "Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM",
      "MistralForCausalLM"]),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
     ["rope_parameters.rope_type='dynamic'", "default, linear, llama3, yarn"]),
    ("gemma3", {"attn_logit_softcapping": 50.0}, ["attn_logit_softcapping=50.0"]),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 32}, ["use_sliding_window=true", "sliding_window=32"]),
])
def test_unsupported_config_fails_at_start_up_in_one_line(family, changes, words, tiny_checkpoint, tmp_path):
    model = _with_config(tiny_checkpoint(family), tmp_path / "m", **changes)
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    result = cli_generate(model, inp, "-o", str(tmp_path / "out.jsonl"))
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and all(w in line for w in words), line
    assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_text()


def test_a_sliding_window_no_shorter_than_max_model_len_runs(tiny_checkpoint, tmp_path):
    """A window every sequence fits in cuts nothing off: full attention is exact there (Mistral v0.1 at 4096)."""
    model = _with_config(tiny_checkpoint("mistral"), tmp_path / "m", sliding_window=128)
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    result = cli_generate(model, inp, "--max-tokens", "2")
    assert result.exit_code == 0, result.output


def test_yarn_lets_max_model_len_pass_max_position_embeddings(tiny_checkpoint, tmp_path):
    """Qwen3 + YaRN (factor 4 over 128): up to 512 positions are allowed, 513 is refused naming the limit."""
    from llmcli.config import Config, ConfigError

    model = tiny_checkpoint("qwen3-yarn")
    assert Config(str(model), device="cpu", max_model_len=512).max_model_len == 512
    with pytest.raises(ConfigError, match="at most 512 positions"):
        Config(str(model), device="cpu", max_model_len=513)
    with pytest.raises(ConfigError, match="at most 2048 positions"):
        Config(str(tiny_checkpoint("qwen3")), device="cpu", max_model_len=4096)


ROPE_CONFIGS = ["Llama-3.1-8B", "Llama-3.2-1B", "Qwen2.5-7B", "Qwen2.5-0.5B", "Mistral-7B-v0.3", "Qwen3-8B",
                "Qwen3-8B+yarn", "gpt-oss-20b"]


@pytest.mark.parametrize("name", ROPE_CONFIGS)
def test_rotary_tables_of_published_configs_match_transformers(name):
    """Our cos/sin tables at the real head_dim, theta and scaling (llama3 at 8B, YaRN as Qwen documents it for
    131k, gpt-oss's untruncated YaRN) against transformers' rotary embedding, at positions up to the end of the
    stretched context."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from llmcli.models import max_model_positions, model_class

    folder = REPO / "configs" / name.split("+")[0]
    config = AutoConfig.from_pretrained(str(folder))
    if name.endswith("+yarn"):
        config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                                  "rope_theta": config.rope_parameters["rope_theta"]}
    spec = model_class(config).spec(config)
    limit = max_model_positions(config)
    assert limit == (131072 if name.endswith("+yarn") else config.max_position_embeddings)
    positions = torch.tensor([0, 1, 7, 1000, 8191, 8192, 20000, limit - 1])
    from llmcli.layers.rotary import RotaryEmbedding

    ours = RotaryEmbedding(spec.head_dim, limit, spec.rope.theta, spec.rope, spec.max_position_embeddings)
    theirs = LlamaRotaryEmbedding(config)  # the rotary every one of these families uses in transformers
    x = torch.zeros(1, len(positions), spec.head_dim)
    cos, sin = theirs(x, positions[None])
    torch.testing.assert_close(ours.cos[positions], cos[0], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ours.sin[positions], sin[0], rtol=1e-5, atol=2e-5)


def test_transformers_4_spelling_of_the_rope_settings():
    """transformers 4 configs (the GPU machine may have one) say top-level ``rope_theta`` and ``rope_scaling``
    with ``type`` or ``rope_type``; linear scaling divides every frequency by the factor."""
    from types import SimpleNamespace

    from llmcli.layers.rotary import RotaryEmbedding, UnsupportedRopeError, rope_settings

    old = SimpleNamespace(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 4.0})
    rope = rope_settings(old)
    assert (rope.theta, rope.kind, rope.params) == (10000.0, "linear", {"factor": 4.0})
    table = RotaryEmbedding(8, 64, rope.theta, rope, 64)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 8, 2) / 8) / 4.0
    torch.testing.assert_close(table.cos[40, :4], torch.cos(40 * inv_freq))
    assert rope_settings(SimpleNamespace(rope_theta=5.0, rope_scaling=None)).kind == "default"
    with pytest.raises(UnsupportedRopeError, match="rope_scaling.rope_type='dynamic'"):
        rope_settings(SimpleNamespace(rope_theta=5.0, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
