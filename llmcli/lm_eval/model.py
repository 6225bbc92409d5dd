"""lm-evaluation-harness's model ``llmcli``: log-likelihoods from the engine's prompt logprobs, greedy or
sampled generation, every request of a call submitted to the engine at once (it batches them itself)."""
from __future__ import annotations

import logging
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, \
    postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from llmcli.config import Config, ConfigError
from llmcli.engine.llm_engine import LLMEngine
from llmcli.engine.logprob_outputs import LazyLogprobs
from llmcli.engine.outputs import RequestOutput
from llmcli.engine.prompt_encoding import encode_texts
from llmcli.sampling_params import SamplingParams
from llmcli.vllm_args import config_kwargs

log = logging.getLogger("llmcli")

# A log-likelihood request: the whole token sequence runs as a prompt and its own prompt logprobs are read
# (rank 1: the greedy token); one token is generated because a request must generate something. Each request
# asks only for the continuation's (prompt_logprobs_start), so the prefix cache may serve the context that a
# question's choices share.
SCORE = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, detokenize=False)


def _device(device: str | None) -> dict[str, Any]:
    """lm-eval's ``device`` ("cuda:0", "cpu", ...) as the engine's (which GPUs: CUDA_VISIBLE_DEVICES). lm-eval's
    command line says "cuda" unless told otherwise, so on a machine without CUDA that means the CPU."""
    if device is None:
        return {}
    kind = device.split(":")[0]
    if kind not in ("cuda", "cpu", "auto"):
        raise ConfigError(f"device={device!r}: llmcli runs on 'cuda' or 'cpu'")
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            log.warning("device=%r: no CUDA device is visible, so llmcli runs on the CPU", device)
            return {"device": "cpu"}
    return {"device": kind}


def _chosen(positions: Any, whole: tuple[int, ...], first: int) -> list[tuple[float, int]]:
    """(logprob, rank) of ``whole[first:]``: from the engine's entries, or (a data-parallel replica's output
    arrives as a plain list) from each position's dict."""
    if isinstance(positions, LazyLogprobs):
        return positions.chosen(first)
    return [(lp.logprob, lp.rank) for lp in (positions[j][whole[j]] for j in range(first, len(whole)))]


@register_model("llmcli")
class LLMCLIModel(TemplateLM):
    """``--model llmcli --model_args pretrained=DIR,tensor_parallel_size=2,data_parallel_size=4,...``: any
    engine setting (llmcli's or vLLM's name, as ``LLM`` takes them); ``batch_size`` is accepted and unused,
    since the engine forms its own batches."""

    def __init__(self, pretrained: str, *, max_gen_toks: int = 256, max_length: int | None = None,
                 add_bos_token: bool | None = None, prefix_token_id: int | None = None,
                 data_parallel_size: int = 1, distributed_backend: str = "local", device: str | None = None,
                 batch_size: Any = None, max_batch_size: Any = None, **engine: Any) -> None:
        super().__init__()
        kwargs = {"model": pretrained, **config_kwargs({**engine, **_device(device)})}
        if int(data_parallel_size) > 1:
            from llmcli.scaleout.data_parallel import DataParallelEngine, ScaleOut, driver_config

            scale = ScaleOut(int(data_parallel_size), distributed_backend)
            self.engine: Any = DataParallelEngine(driver_config(kwargs, scale), scale, engine_kwargs=kwargs)
        else:
            self.engine = LLMEngine(Config(**kwargs))
        self.tokenizer = self.engine.tokenizer
        self._max_length = max_length
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id

    # -- what lm-eval reads ----------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length or self.engine.config.max_model_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Tokens of ``string``: the tokenizer's special tokens unless told otherwise (``add_bos_token``), and
        none when the text already starts with the prefix token (a chat render)."""
        flag = self._special_tokens([string], add_special_tokens)[0]
        return self.tokenizer.encode(string, **({} if flag is None else {"add_special_tokens": flag}))

    def tok_encode_many(self, strings: list[str], add_special_tokens: bool | None = None) -> list[list[int]]:
        """``tok_encode`` of each string, in one batch per ``add_special_tokens`` value (a fast tokenizer's own
        batch encoding, on its threads: a ``tokenizer.encode`` call per string costs ~0.1 ms of Python)."""
        flags = [flag is not False for flag in self._special_tokens(strings, add_special_tokens)]
        out: list[list[int]] = [[]] * len(strings)
        for special in set(flags):
            which = [i for i, f in enumerate(flags) if f is special]
            for i, ids in zip(which, encode_texts(self.tokenizer, [strings[i] for i in which], chat=not special)):
                out[i] = ids
        return out

    def _special_tokens(self, strings: list[str], add_special_tokens: bool | None) -> list[bool | None]:
        """Per string, the tokenizer's ``add_special_tokens`` (None: its default)."""
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
        if add_special_tokens is not None:
            return [add_special_tokens] * len(strings)
        bos = self.tokenizer.decode(self.prefix_token_id)
        return [False if has_bos_prefix(s, bos) else None for s in strings]

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    # -- the three request kinds -----------------------------------------------------------------
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """lm-eval's ``TemplateLM.loglikelihood`` (its ``_encode_pair`` for a causal model: the context's trailing
        whitespace moved to the continuation, the continuation's tokens those of the whole text past the
        context's; an empty context is the prefix token), with every distinct string encoded in one batch
        instead of two ``tok_encode`` calls per request. tests/test_lm_eval.py checks the tokens equal lm-eval's."""
        pairs = [req.args for req in requests]
        texts: dict[tuple[str, bool | None], int] = {}  # (string, add_special_tokens) -> its slot
        plan = []
        for context, continuation in pairs:
            if context == "":
                plan.append((None, texts.setdefault((continuation, False), len(texts))))
                continue
            n_spaces = len(context) - len(context.rstrip())
            if n_spaces > 0:
                context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
            plan.append((texts.setdefault((context + continuation, None), len(texts)),
                         texts.setdefault((context, None), len(texts))))
        encoded: list[list[int]] = [[]] * len(texts)
        for flag in (None, False):
            which = [(slot, string) for (string, f), slot in texts.items() if f is flag]
            for (slot, _), ids in zip(which, self.tok_encode_many([s for _, s in which], flag)):
                encoded[slot] = ids
        new_reqs = []
        for pair, (whole, context) in zip(pairs, plan):
            if whole is None:  # empty context: the prefix token, unless the continuation starts with it
                continuation_enc = encoded[context]
                context_enc, continuation_enc = (([self.prefix_token_id], continuation_enc)
                                                 if self.prefix_token_id != continuation_enc[0]
                                                 else (continuation_enc[:1], continuation_enc[1:]))
            else:
                context_enc = encoded[context]
                continuation_enc = encoded[whole][len(context_enc):]
            new_reqs.append((pair, context_enc, continuation_enc))
        return self._loglikelihood_tokens(new_reqs, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, whether each of its tokens is the greedy one) per request; a
        sequence longer than the context keeps its last tokens, as lm-eval's other models do."""
        limit = self.max_length - 1  # room for the one generated token
        wholes, firsts = [], []
        # repeated sequences run once, scored from the first position any of their requests reads
        starts: dict[tuple[int, ...], int] = {}
        for _, context, continuation in requests:
            whole = tuple((context + continuation)[-limit:])
            first = max(1, len(whole) - len(continuation))  # the first scored position
            wholes.append(whole)
            firsts.append(first)
            starts[whole] = min(first, starts.get(whole, first))
        # one SamplingParams per start (most contexts share a length), with the model's defaults already in (what
        # add_request would otherwise resolve into a new object for each request)
        defaults = self.engine.config.sampling_defaults
        params = {first: SCORE.replace(prompt_logprobs_start=first).with_defaults(defaults)
                  for first in set(starts.values())}
        unique = list(starts)
        outs = dict(zip(unique, self._run([list(u) for u in unique], [params[starts[u]] for u in unique])))
        results = []
        for (key, _, _), whole, first in zip(requests, wholes, firsts):
            scored = _chosen(outs[whole].prompt_logprobs, whole, first)
            answer = (sum(logprob for logprob, _ in scored), all(rank == 1 for _, rank in scored))
            results.append(answer)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's total log-likelihood over disjoint windows of at most ``max_length - 1`` scored
        tokens (lm-eval's own window rule), all windows of all texts in one engine run."""
        windows, owners = [], []
        for i, tokens in enumerate(self.tok_encode_many([req.args[0] for req in requests])):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length - 2, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Completions cut at each request's ``until`` strings (and EOS), in one engine run."""
        eos = self.tokenizer.decode([self.eot_token_id])
        prompts, params, stops = [], [], []
        encoded = self.tok_encode_many([req.args[0] for req in requests])
        for (_, gen_kwargs), tokens in zip((req.args for req in requests), encoded):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            kwargs.pop("do_sample", None)
            prompts.append(tokens[-(self.max_length - max_gen):])
            params.append(SamplingParams(max_tokens=max_gen, stop=[s for s in until if s] or None, **kwargs))
            stops.append(until)
        texts = [postprocess_generated_text(out.outputs[0].text, until, None)
                 for out, until in zip(self._run(prompts, params), stops)]
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    # -- the engine ------------------------------------------------------------------------------
    def _run(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        """Every request added at once, the engine stepped until all are done; outputs in request order."""
        for ids, p in zip(prompts, params):
            self.engine.check_fits(ids, p)
        for i, (ids, p) in enumerate(zip(prompts, params)):
            self.engine.add_request(ids, p, request_id=i)
        done: dict[int, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                done[out.request_id] = out
        return [done[i] for i in range(len(prompts))]
