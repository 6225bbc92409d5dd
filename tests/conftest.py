"""Shared fixtures: tiny random checkpoints (Qwen3, and one of every other family) and the HuggingFace oracle.

HF oracle convention (``hf_greedy``): greedy decoding with ``do_sample=False``,
one prompt at a time (batch of one, so no padding), and EOS *disabled*
(``eos_token_id=None``), so exactly ``max_new_tokens`` come out for every
prompt. Engine runs compared with it use ``ignore_eos=True`` for the same
reason. Greedy continuations are prefix-closed, so the cache keeps the longest
continuation computed per (model folder, prompt) and slices it for shorter
requests.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_qwen3 import write_tiny_model, write_tiny_qwen3  # noqa: E402

# Tiny models: one thread avoids OpenMP hand-off stalls that dominate on a busy 2-core machine.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


# --------------------------------------------------------------------------
# a hang is a failure, not a stuck suite
# --------------------------------------------------------------------------
TEST_TIMEOUT_S = int(os.environ.get("LLMCLI_TEST_TIMEOUT", "240"))


class TestTimeout(Exception):
    pass


@pytest.fixture(autouse=True)
def _per_test_timeout(request):
    """Fail a test that runs longer than LLMCLI_TEST_TIMEOUT seconds (SIGALRM; main thread only).

    Skipped when pytest-timeout is installed and active, or where SIGALRM does not exist."""
    if (request.config.pluginmanager.hasplugin("timeout") or not hasattr(signal, "SIGALRM")
            or threading.current_thread() is not threading.main_thread() or TEST_TIMEOUT_S <= 0):
        yield
        return

    def on_alarm(signum, frame):
        raise TestTimeout(f"{request.node.nodeid} ran longer than {TEST_TIMEOUT_S}s (hang?)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# --------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """Untied tiny Qwen3 (separate lm_head.weight), one safetensors file."""
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_tied(tmp_path_factory) -> Path:
    """Tied tiny Qwen3: no lm_head.weight in the checkpoint."""
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_tied"), tie_word_embeddings=True, seed=1)


@pytest.fixture(scope="session")
def tiny_model_sharded(tmp_path_factory) -> Path:
    """Untied tiny Qwen3 split over several shards plus model.safetensors.index.json."""
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_sharded"), sharded=True, seed=2)


# Every family but plain Qwen3 (the fixtures above), each with what sets it apart (tests/tiny_qwen3.py FAMILIES):
# Qwen3 + YaRN run past max_position_embeddings, Llama with llama3 rope scaling, biases and derived head_dim,
# Qwen2 with q/k/v bias and tied embeddings, Mistral v0.3-style, Qwen3-MoE (top-2 of 8 unnormalised, top-8 of 16
# normalised, each with dense layers mixed in).
OTHER_FAMILIES = ("qwen3-yarn", "llama", "qwen2", "mistral", "qwen3-moe-top2", "qwen3-moe-top8")
FAMILIES = ("qwen3", *OTHER_FAMILIES)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_model):
    """``tiny_checkpoint(family) -> Path``: one tiny checkpoint per family, written once per session."""
    made = {"qwen3": tiny_model}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = write_tiny_model(tmp_path_factory.mktemp(f"tiny_{family}"), family, seed=3)
        return made[family]

    return get


@pytest.fixture(params=FAMILIES)
def family_model(request, tiny_checkpoint) -> Path:
    """The tiny checkpoint of each family in turn (tests that take it run once per family)."""
    return tiny_checkpoint(request.param)


# --------------------------------------------------------------------------
# the HuggingFace oracle
# --------------------------------------------------------------------------
class HFOracle:
    """Loads each model once per session and caches greedy continuations."""

    def __init__(self) -> None:
        self._models: dict[str, torch.nn.Module] = {}
        self._tokenizers: dict[str, object] = {}
        self._cache: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def model(self, model_path) -> torch.nn.Module:
        key = str(Path(model_path).resolve())
        if key not in self._models:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32)
            model.eval()
            self._models[key] = model
        return self._models[key]

    def tokenizer(self, model_path):
        key = str(Path(model_path).resolve())
        if key not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[key] = AutoTokenizer.from_pretrained(key)
        return self._tokenizers[key]

    def greedy(self, model_path, prompts_token_ids, max_new_tokens: int) -> list[list[int]]:
        """Exactly ``max_new_tokens`` greedy token ids for each prompt (EOS ignored)."""
        key_model = str(Path(model_path).resolve())
        results = []
        for prompt in prompts_token_ids:
            prompt = tuple(int(t) for t in prompt)
            if not prompt:
                raise ValueError("empty prompt")
            cached = self._cache.get((key_model, prompt))
            if cached is None or len(cached) < max_new_tokens:
                cached = self._generate(key_model, prompt, max_new_tokens)
                self._cache[(key_model, prompt)] = cached
            results.append(list(cached[:max_new_tokens]))
        return results

    def _generate(self, model_path: str, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
        model = self.model(model_path)
        ids = torch.tensor([prompt], dtype=torch.long)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                eos_token_id=None,
                pad_token_id=0,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        new = out[0, len(prompt):].tolist()
        assert len(new) == max_new_tokens, (len(new), max_new_tokens)
        return new

    def next_token_logits(self, model_path, token_ids) -> torch.Tensor:
        """Float32 logits of the next token after ``token_ids`` (one full forward)."""
        model = self.model(model_path)
        with torch.no_grad():
            return model(torch.tensor([list(token_ids)], dtype=torch.long)).logits[0, -1].float()


@pytest.fixture(scope="session")
def hf_oracle() -> HFOracle:
    return HFOracle()


@pytest.fixture(scope="session")
def hf_greedy(hf_oracle):
    """``hf_greedy(model_path, prompts_token_ids, max_new_tokens) -> list[list[int]]``."""
    return hf_oracle.greedy


@pytest.fixture(scope="session")
def trained_tiny_model(tmp_path_factory) -> Path:
    """A tiny Qwen3 trained for a few seconds on CPU on the tokenizer's corpus: confident, structured
    predictions (random weights are no signal for numerics that only perturb the logits, like an FP8 cache)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiny_qwen3 import training_corpus

    path = write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_trained"), seed=7, initializer_range=0.02)
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor(tok("\n".join(training_corpus() * 2))["input_ids"])
    seq = 64
    windows = ids[: len(ids) // seq * seq].view(-1, seq)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        batch = windows[torch.randint(0, len(windows), (8,), generator=g)]
        loss = model(input_ids=batch, labels=batch).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return path
