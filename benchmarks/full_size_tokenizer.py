"""A byte-level BPE tokenizer the size of Qwen3's (151,643 tokens + 3 specials = 151,646 ids), built offline.

Grammar engines precompute per-token tables, so their compile and mask times depend on the vocabulary's
size and on what its tokens look like; the tiny test tokenizer (~600 ids) says little about either. No
Qwen tokenizer is available offline (nor on the GPU machine), so this one is made from deterministic
pseudo-random merges of text-like pieces: letters with and without a leading space, digits, punctuation
and JSON-ish pairs, as a real byte-level BPE vocabulary mostly is. Its ids do not match Qwen3's, which does
not matter with dummy weights.
"""
from __future__ import annotations

import random
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
REGULAR_TOKENS = 151_643


def _byte_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def build(regular_tokens: int = REGULAR_TOKENS, seed: int = 0):
    """A ``PreTrainedTokenizerFast`` whose ids 0..regular_tokens-1 are BPE tokens, then the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    alphabet = _byte_alphabet()
    vocab = {tok: i for i, tok in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    space = "Ġ"  # byte-level for " "
    letters = [c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    starts = letters + [space] * 20 + list("0123456789\"{}[]:,._-()'")
    tokens_by_start = {c: [c] for c in starts}
    word_like = list(letters)
    while len(vocab) < regular_tokens:
        roll = rng.random()
        if roll < 0.55:  # extend a word piece by a letter or short piece
            left = rng.choice(word_like[-20000:] if rng.random() < 0.7 else word_like)
            right = rng.choice(letters) if rng.random() < 0.6 else rng.choice(word_like[:2000])
        elif roll < 0.85:  # a word with a leading space
            left, right = space, rng.choice(word_like)
        else:  # digits, punctuation and their pairs
            left = rng.choice(tokens_by_start[rng.choice(starts)])
            right = rng.choice(starts)
        merged = left + right
        if merged in vocab or left not in vocab or right not in vocab or len(merged) > 16:
            continue
        vocab[merged] = len(vocab)
        merges.append((left, right))
        tokens_by_start.setdefault(merged[0], []).append(merged)
        if merged[0] != space:
            word_like.append(merged)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)  # Qwen's order: <|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS, model_max_length=1 << 20)


def save(path: str | Path, regular_tokens: int = REGULAR_TOKENS) -> Path:
    """Write the tokenizer files into ``path`` (for ``--tokenizer PATH``); returns the folder."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    build(regular_tokens).save_pretrained(out)
    return out


if __name__ == "__main__":
    import sys
    import time

    start = time.perf_counter()
    tok = build()
    print(f"{len(tok):,} ids in {time.perf_counter() - start:.1f} s;", tok.tokenize(' {"name": "Ada", "age": 37}'))
    if len(sys.argv) > 1:
        save(sys.argv[1])
