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
from llmcli.engine.outputs import RequestOutput
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
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            add_special_tokens = False
        extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **extra)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    # -- the three request kinds -----------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, whether each of its tokens is the greedy one) per request; a
        sequence longer than the context keeps its last tokens, as lm-eval's other models do."""
        limit = self.max_length - 1  # room for the one generated token
        wholes, firsts = [], []
        for _, context, continuation in requests:
            whole = (context + continuation)[-limit:]
            wholes.append(whole)
            firsts.append(max(1, len(whole) - len(continuation)))  # the first scored position
        # repeated sequences run once, scored from the first position any of their requests reads
        starts: dict[tuple[int, ...], int] = {}
        for whole, first in zip(wholes, firsts):
            key = tuple(whole)
            starts[key] = min(first, starts.get(key, first))
        # one SamplingParams per start (most contexts share a length)
        params = {first: SCORE.replace(prompt_logprobs_start=first) for first in set(starts.values())}
        unique = list(starts)
        outs = dict(zip(unique, self._run([list(u) for u in unique], [params[starts[u]] for u in unique])))
        results = []
        for (key, _, _), whole, first in zip(requests, wholes, firsts):
            positions = outs[tuple(whole)].prompt_logprobs
            scored = [positions[j][whole[j]] for j in range(first, len(whole))]
            answer = (sum(lp.logprob for lp in scored), all(lp.rank == 1 for lp in scored))
            results.append(answer)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's total log-likelihood over disjoint windows of at most ``max_length - 1`` scored
        tokens (lm-eval's own window rule), all windows of all texts in one engine run."""
        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
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
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            kwargs.pop("do_sample", None)
            ids = self.tok_encode(context)[-(self.max_length - max_gen):]
            prompts.append(ids)
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
