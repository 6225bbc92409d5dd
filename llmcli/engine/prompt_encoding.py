"""Prompt texts as token ids: plain texts with the tokenizer's special tokens, rendered chat templates without."""
from __future__ import annotations

from typing import Any


def encode_texts(tokenizer: Any, texts: list[str], *, chat: bool = False) -> list[list[int]]:
    """Token ids of whole prompts, in order.

    A plain text gets the special tokens its tokenizer adds (Llama 3 and Mistral: a BOS first; Qwen: none), as
    vLLM and ``tokenizer(text)`` do, since that is the input the model was trained on. A text rendered by a
    chat template (``chat=True``) gets none: the template already wrote the ones it wants, and a second BOS
    would change the model's input.

    A fast tokenizer's own batch encoding runs on several threads outside the GIL. It is called directly (not
    through ``tokenizer(...)``, which first resets truncation and padding on the shared Rust tokenizer and so
    cannot run while another thread decodes with it).
    """
    if not texts:
        return []
    special = not chat
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        return [enc.ids for enc in backend.encode_batch(texts, add_special_tokens=special)]
    return [list(tokenizer.encode(t, add_special_tokens=special)) for t in texts]
