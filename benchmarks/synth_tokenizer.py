"""A full-size (151,646 ids) byte-level BPE tokenizer made without training or network, next to a model config.

The GPU machine has no internet, and the CLI's overhead is mostly tokenizer work,
so a benchmark needs a tokenizer as big as Qwen3's. This one is built from a
synthetic merges list: deterministic pseudo-words made of syllables, each
spelled out merge by merge (with and without the byte-level space mark "Ġ"),
until the vocabulary has Qwen3's size. ``words(n, seed)`` makes text from the
same pseudo-words, so that text is tokenized with real merges at realistic
speed. Building takes seconds.

    python benchmarks/synth_tokenizer.py configs/Qwen3-0.6B /tmp/qwen3-0.6b-synth
"""
from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

VOCAB_SIZE = 151_646  # Qwen3: 151,643 regular ids and 3 special tokens
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + list("aeiou")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def pseudo_words(seed: int = 0) -> "iter[str]":
    """An endless, deterministic stream of distinct pseudo-words of 2-5 syllables."""
    rng, seen = random.Random(seed), set()
    while True:
        word = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 5)))
        if word not in seen:
            seen.add(word)
            yield word


def build(vocab_size: int = VOCAB_SIZE, seed: int = 0):
    """A ``tokenizers.Tokenizer`` with ``vocab_size`` ids, the last ones the special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    limit = vocab_size - len(SPECIALS)

    def add(left: str, right: str) -> bool:
        if left + right in vocab:
            return True
        if len(vocab) >= limit:
            return False
        vocab[left + right] = len(vocab)
        merges.append((left, right))
        return True

    for word in pseudo_words(seed):
        full = True
        for start in ("\u0120", ""):  # "Ġ": a word after a space; and a word at the start of the text
            piece = start + word[0] if start else word[0]
            if start:
                full &= add(start, word[0])
            for ch in word[1:]:
                full &= add(piece, ch)
                piece += ch
        if not full:
            break
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def words(n: int, rng: random.Random, vocabulary: list[str]) -> str:
    return " ".join(rng.choice(vocabulary) for _ in range(n))


def vocabulary(count: int = 20_000, seed: int = 0) -> list[str]:
    """The first ``count`` pseudo-words (every one of them fully merged in the tokenizer)."""
    gen = pseudo_words(seed)
    return [next(gen) for _ in range(count)]


def write_model_dir(config_dir: str | Path, out: str | Path, vocab_size: int | None = None) -> Path:
    """A copy of ``config_dir``'s config files plus the tokenizer files (sized to config.json's tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    config_dir, out = Path(config_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (config_dir / name).exists():
            shutil.copy(config_dir / name, out / name)
    size = vocab_size or VOCAB_SIZE
    model_vocab = json.loads((config_dir / "config.json").read_text())["vocab_size"]
    size = min(size, model_vocab)
    fast = PreTrainedTokenizerFast(tokenizer_object=build(size), eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return out


if __name__ == "__main__":
    import time

    start = time.perf_counter()
    path = write_model_dir(sys.argv[1], sys.argv[2])
    print(f"wrote {path} in {time.perf_counter() - start:.1f} s")
