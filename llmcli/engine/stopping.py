"""When a sequence is done, and what its text is: EOS, stop tokens, stop strings, length limits."""
from __future__ import annotations

from typing import Any

from llmcli.engine.harmony import HarmonyTokens, closes_final
from llmcli.engine.sequence import Sequence


class StopChecker:
    def __init__(self, tokenizer: Any, eos_token_ids: list[int], max_model_len: int,
                 harmony: HarmonyTokens | None = None) -> None:
        """``harmony``: a Harmony model's tokens; its ``<|end|>`` ends a generation when it closes the final
        channel's message (after an analysis message the model goes on to its answer)."""
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.harmony = harmony
        self._end = harmony.end if harmony is not None and harmony.end not in self.eos else None
        # tokens that end a completion without being part of its text
        self.closers = self.eos | ({self._end} if self._end is not None else set())

    def set_gate(self, seq: Sequence) -> None:
        """Give ``seq`` the quick test the step loop runs before ``check``: token ``index`` can only end it if
        the token is in ``seq.stop_ids`` or ``index >= seq.stop_index`` (``stop_ids`` None: check every token,
        as stop strings need)."""
        params = seq.params
        limit = self.max_model_len - 1
        if params.max_tokens is not None:
            limit = min(limit, seq.num_prompt_tokens + params.max_tokens - 1)
        seq.stop_index = limit
        if params.stop and self.tokenizer is not None:
            seq.stop_ids = None
        else:
            seq.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.closers)

    def check(self, seq: Sequence, index: int) -> bool:
        """Token ``index`` was just sampled: set ``finish_reason`` (and ``stop_reason``) if ``seq`` ends there."""
        token, params = seq.token_ids[index], seq.params
        completion = index + 1 - seq.num_prompt_tokens
        if token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif token in self.eos and not params.ignore_eos:
            seq.finish_reason, seq.stop_reason = "stop", None  # as vLLM: EOS is no stop reason of the request's
        elif token == self._end and not params.ignore_eos and completion >= params.min_tokens \
                and self._closes_final(seq, index):
            seq.finish_reason, seq.stop_reason = "stop", None  # the answer's own end, as an EOS
        elif params.stop and self.tokenizer is not None and self._hit_stop_string(seq, index):
            seq.finish_reason = "stop"
        elif params.max_tokens is not None and completion >= params.max_tokens:
            seq.finish_reason = "length"
        elif index + 1 >= self.max_model_len:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _closes_final(self, seq: Sequence, index: int) -> bool:
        return closes_final(seq.token_ids, index, self.harmony,
                            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))

    def _hit_stop_string(self, seq: Sequence, index: int) -> bool:
        text = self.decode(seq.token_ids[seq.num_prompt_tokens:index + 1], seq)
        # Only text near the end can hold a stop string that was not there a token ago; the small margin
        # covers characters that change when a multi-byte character is completed.
        start = max(0, seq.stop_scan_pos - 4)
        # before min_tokens no stop string ends the completion (as in vLLM), nor is found later
        early = index + 1 - seq.num_prompt_tokens < seq.params.min_tokens
        found = [] if early else [(pos, s) for s in seq.params.stop if (pos := text.find(s, start)) >= 0]
        if not found:
            seq.stop_scan_pos = max(0, len(text) - max(len(s) for s in seq.params.stop) + 1)
            return False
        pos, stop = min(found)
        seq.text = text[: pos + len(stop)] if seq.params.include_stop_str_in_output else text[:pos]
        seq.stop_reason = stop
        return True

    def decode(self, token_ids: list[int], seq: Sequence) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=seq.params.skip_special_tokens)

    def final_text(self, seq: Sequence) -> str:
        if seq.text is not None:  # cut at a stop string already
            return seq.text
        return self.texts_of([(seq.completion_token_ids, seq.finish_reason, seq.stop_reason)],
                             seq.params.skip_special_tokens)[0]

    def texts_of(self, completions: list[tuple[list[int], str | None, str | int | None]],
                 skip_special_tokens: bool) -> list[str]:
        """The texts of completions (token ids, finish reason, stop reason) that did not end at a stop string."""
        if self.tokenizer is None:
            return [""] * len(completions)
        # The EOS / stop token that ended a completion is not part of its text (EOS: stop reason None, as a
        # completed grammar's is, but its last token is an EOS id).
        closers = self.closers
        ids = [c[:-1] if finish == "stop" and (isinstance(reason, int) or (reason is None and c and c[-1] in closers))
               else c for c, finish, reason in completions]
        if len(ids) == 1:
            return [self.tokenizer.decode(ids[0], skip_special_tokens=skip_special_tokens)]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=skip_special_tokens)
