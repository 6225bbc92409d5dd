"""LLMEngine: requests in, one scheduler step at a time, finished outputs out."""
from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from llmcli.config import Config
from llmcli.engine.model_runner import ModelRunner
from llmcli.engine.logprob_outputs import BlockEntries, LazyLogprobs, TokenText
from llmcli.engine.outputs import CompletionOutput, EngineStats, ModelFailure, RequestMetrics, RequestOutput
from llmcli.engine.cpu_threads import cpu_threads
from llmcli.engine.harmony import BUDGET_NEEDS_HARMONY, HarmonyTokens, prompt_state
from llmcli.engine.memory_check import check_host_memory
from llmcli.engine.kv_groups import kv_windows_of
from llmcli.engine.state_pages import kv_room_of, state_pages_of
from llmcli.engine.admission import bad_word_ids, check_request_fits, encode_prompt, truncate_prompt
from llmcli.engine.scheduler import ScheduledBatch, Scheduler
from llmcli.engine.sequence import RequestRejected, Sequence, SequenceStatus
from llmcli.engine.startup import StartupClock, use_persistent_compile_cache
from llmcli.engine.step_plan import StepPlan
from llmcli.engine.step_timer import StepTimer
from llmcli.engine.stopping import StopChecker
from llmcli.layers.sampler import NONFINITE
from llmcli.models.hub import load_tokenizer
from llmcli.sampling_params import SamplingParams


class StepRunner(Protocol):
    """What the engine uses of its model runner: a ``ModelRunner``, or with tensor parallelism a
    ``TensorParallelRunner`` (rank 0's runner plus the control plane). Both take the step plan alone."""

    num_blocks: int
    memory_report: Any
    timer: StepTimer
    startup_s: dict[str, float]

    def launch(self, plan: StepPlan, before_sample: Callable[[], Any] | None = None) -> Any: ...

    def shutdown(self) -> None: ...


@dataclass
class InflightStep:
    """A launched step whose sampled tokens have not been read back yet."""

    seqs: list[Sequence]
    sampled: list[Sequence]
    indices: list[int]  # where each sampled token goes in its sequence's token_ids
    launched: Any  # the model runner's LaunchedStep: token_ids(), logprobs()


class LLMEngine:
    """One engine on one device (or one tensor-parallel group); the command line sees it as an ``EngineAPI``."""

    def __init__(self, config: Config, tokenizer: Any = None, cancelled: Callable[[], bool] | None = None) -> None:
        """``cancelled``: asked between start-up phases; when it says True, start-up raises StartupCancelled."""
        self.config = config
        self.clock = StartupClock(cancelled)
        use_persistent_compile_cache()
        with self.clock.phase("tokenizer"):
            self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model_path,
                                                                                    config.tokenizer)
        self.eos_token_ids = list(config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None \
                and self.tokenizer.eos_token_id not in self.eos_token_ids:
            self.eos_token_ids.append(self.tokenizer.eos_token_id)
        # A Harmony model (gpt-oss) ends its answer with <|return|> and a tool call with <|call|>, whatever its
        # generation_config.json lists; its <|end|> closes any message, so it ends only the final one (stopping).
        # Some conversions list <|end|> as an EOS id (or make it the tokenizer's EOS), which would end every
        # generation after its analysis: it is dropped from the set here and the stop checker's rule applies.
        self.harmony = HarmonyTokens.of(self.tokenizer)
        if self.harmony is not None:
            self.eos_token_ids = [t for t in self.eos_token_ids if t != self.harmony.end]
            self.eos_token_ids += [t for t in (self.harmony.ret, self.harmony.call) if t not in self.eos_token_ids]
        self.model_runner = self._start_runner(config)
        self.clock.check()
        report = getattr(self.model_runner, "memory_report", None)  # none from a stand-in runner (benchmarks)
        self.stats = EngineStats(kv_blocks_total=self.model_runner.num_blocks,
                                 state_snapshot_bytes=getattr(report, "state_snapshot_bytes", 0))
        self.kv_windows = kv_windows_of(report)
        self.scheduler = Scheduler(config, self.model_runner.num_blocks, self.stats, self.kv_windows,
                                   state_pages_of(report))
        self.stats.kv_blocks_total = self.scheduler.block_manager.num_blocks  # a hybrid's: KV and state pages
        self.stopper = StopChecker(self.tokenizer, self.eos_token_ids, config.max_model_len, self.harmony)
        self._rng = random.Random(config.seed)
        self.step_timer: StepTimer = self.model_runner.timer
        # Off: finished outputs carry text=None (unless cut at a stop string) and the caller decodes them
        # with ``fill_texts`` where the step loop does not wait for it (the CLI's writer thread).
        self.detokenize = True
        # Host work of step N+1 overlaps the device's step N (tests turn it off to compare with the plain loop).
        self.overlap = True
        self.inflight: InflightStep | None = None
        self._token_text = TokenText(self.tokenizer)  # decodes logprob tokens, once per id
        self.structured: Any = None  # StructuredRequests, made at the first constrained request
        self._finished_early: list[RequestOutput] = []  # the previous step, read back before this step's sampling

    def _start_runner(self, config: Config) -> StepRunner:
        if config.device == "cpu":  # rank 0's share; the other ranks take the same (parallel/tp_runner.py)
            import torch

            check_host_memory(config)  # before any weight is allocated: one line, not an OOM kill

            torch.set_num_threads(cpu_threads(config.hf_config.hidden_size, config.tensor_parallel_size))
        if config.tensor_parallel_size > 1:
            from llmcli.parallel.tp_runner import start_tensor_parallel

            with self.clock.phase("tensor_parallel"):
                return start_tensor_parallel(config)
        return ModelRunner(config, self.clock)

    @property
    def model_config(self) -> Config:
        """The engine's settings under vLLM's name (``model_config.max_model_len``, ``.model``, ``.hf_config``)."""
        return self.config

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def startup_s(self) -> dict[str, float]:
        """Seconds per start-up phase: tokenizer, weights, probe, kv_cache, compile, graphs (rank 0's, with
        tensor parallelism, after the whole group's ``tensor_parallel``)."""
        runner = self.model_runner.startup_s
        return {**self.clock.rounded(), **{k: v for k, v in runner.items() if k not in self.clock.seconds}}

    def fill_texts(self, outs: list[RequestOutput]) -> None:
        """Decode the text of outputs made with ``detokenize`` off, in one batch (safe in another thread:
        it touches only ``outs`` and the tokenizer, whose batch decoding runs outside the GIL)."""
        todo = [c for o in outs for c in o.outputs if c.text is None]
        for skip in {o.skip_special_tokens for o in todo}:
            group = [o for o in todo if o.skip_special_tokens == skip]
            texts = self.stopper.texts_of([(o.token_ids, o.finish_reason, o.stop_reason) for o in group], skip)
            for out, text in zip(group, texts):
                out.text = text

    # -- requests ---------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.config.model)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: Any = None) -> Sequence:
        token_ids = truncate_prompt(self.encode(prompt), params, self.config.max_model_len)
        params = params.with_defaults(self.config.sampling_defaults)
        self.check_fits(token_ids, params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(token_ids, params, self.config.kvcache_block_size, request_id, seed)
        if params.bad_words:
            seq.banned_token_ids = bad_word_ids(self.tokenizer, params.bad_words)
        if params.min_tokens:
            seq.hold_ids = sorted(set(params.stop_token_ids) | set([] if params.ignore_eos else self.eos_token_ids))
        self.stopper.set_gate(seq)
        frame = self._harmony_frame(token_ids, params)
        if params.structured_outputs is not None or frame is not None:
            self._structured().add(seq, frame)  # joins the scheduler once its grammar is compiled
        else:
            self.scheduler.add(seq)
        self.stats.prompt_tokens += len(token_ids)
        return seq

    def check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejected if this request can never run on this engine."""
        check_request_fits(token_ids, params, self.config,
                           kv_room_of(getattr(self.model_runner, "memory_report", None), self.model_runner.num_blocks),
                           self.kv_windows)
        bad_word_ids(self.tokenizer, params.bad_words)  # RequestRejected for a word it cannot ban
        if params.structured_outputs is not None:
            from llmcli.engine.structured import check_constraint

            check_constraint(params.structured_outputs)  # GrammarError

    def _harmony_frame(self, token_ids: list[int], params: SamplingParams) -> Any:
        """On a Harmony model, a constraint shapes the final answer only (after the analysis), and a thinking
        budget bounds the analysis: the frame their grammar runs in, or None (no constraint and no budget, or
        a prompt that leaves no assistant message open: the constraint then shapes the whole completion)."""
        budget = params.thinking_token_budget
        if self.harmony is None:
            if budget is not None:
                raise RequestRejected(f"thinking_token_budget {BUDGET_NEEDS_HARMONY}")
            return None
        if params.structured_outputs is None and budget is None:
            return None
        state = prompt_state(token_ids, self.harmony, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
        if state not in ("header", "analysis"):
            if budget is not None and state is None:
                raise RequestRejected("thinking_token_budget needs a prompt that ends at the assistant's turn "
                                      "(a chat record, or a prompt ending with <|start|>assistant)")
            return None
        from llmcli.engine.structured.harmony_grammar import HarmonyFrame

        return HarmonyFrame(state, budget)

    def _structured(self) -> Any:
        if self.structured is None:
            from llmcli.engine.structured.requests import StructuredRequests

            self.structured = StructuredRequests(self.tokenizer, self.eos_token_ids,
                                                 self.config.hf_config.vocab_size)
        return self.structured

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.inflight is not None or \
            (self.structured is not None and self.structured.num_compiling > 0)

    # -- the step ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step, then finish the previous one while the device computes.

        The host never waits between steps: the tokens of step N are read back (and
        stop conditions checked) after step N+1 is already on the device. A sequence that stopped at
        step N may thus compute one extra token in step N+1, which is dropped.
        """
        timer = self.step_timer
        start = time.perf_counter()
        if self.structured is not None and self.structured.num_compiling:
            idle = not self.scheduler.has_unfinished() and self.inflight is None
            ready, failed = self.structured.ready(block=idle)
            for seq in ready:
                self.scheduler.add(seq)
            for seq, error in failed:  # never scheduled: it holds no blocks
                seq.finish_reason = "error"
                self._finished_early.append(dataclasses.replace(self._output(seq), error=error))
        batch = self.scheduler.schedule()
        launched = None
        if batch is not None:
            timer.kind = "mixed" if batch.num_decode else "prefill" if batch.is_prefill else "decode"
            timer.seconds[(timer.kind, "schedule")] += time.perf_counter() - start
            timer.steps[timer.kind] += 1
            timer.tokens[timer.kind] += batch.num_tokens
            launched = self._launch(batch)
        finished, self._finished_early = self._finished_early, []
        finished += self._finish(self.inflight) if self.inflight is not None else []
        self.inflight = launched
        if launched is not None and not self.overlap:
            finished += self._finish(launched)
            self.inflight = None
        self.stats.num_finished += len(finished)
        self._refresh_queue_stats()
        return finished

    def _launch(self, batch: ScheduledBatch) -> InflightStep:
        sampled = batch.sampled
        constrained = self.structured is not None and any(seq.matcher is not None for seq in sampled)
        masks = self._mask_source(sampled) if constrained else None  # (no scan of the batch without structured)
        launched = self.model_runner.launch(batch.plan, masks)
        if not self.overlap:
            launched.token_ids()  # the plain loop: wait for the step before anything else
        if batch.is_prefill:
            self.stats.prefill_tokens_computed += batch.num_tokens - batch.num_decode
        with self.step_timer.phase("schedule"):  # the scheduler's bookkeeping after the launch
            indices = self.scheduler.launched(batch.seqs, sampled)
        self.stats.num_steps += 1
        return InflightStep(batch.seqs, sampled, indices, launched)

    def _mask_source(self, sampled: list[Sequence]) -> Callable[[], Any]:
        """This step's token bitmask, built while the device runs its forward: the mask depends on the
        previous step's tokens, so that step is read back and finished first (its outputs are returned by
        this ``step()``), then every matcher is current. The forward itself stays overlapped."""
        def fill() -> Any:
            if self.inflight is not None:
                self._finished_early += self._finish(self.inflight)
                self.inflight = None
            with self.step_timer.phase("mask"):
                return self.structured.fill(sampled, pinned=self.config.device == "cuda")
        return fill

    def _finish(self, step: InflightStep) -> list[RequestOutput]:
        with self.step_timer.phase("wait"):
            tokens = step.launched.token_ids()
        with self.step_timer.phase("postprocess"):
            logprobs = step.launched.logprobs()
            if logprobs is not None:
                for entry, first, entries in logprobs.prompt:
                    seq = step.seqs[entry]
                    # a recomputed prompt (after preemption) replaces
                    del seq.prompt_logprob_entries[first - seq.prompt_logprobs_from:]
                    seq.prompt_logprob_entries.extend(entries)
            now = time.perf_counter()
            # a row flagged by the sampler (its logits were not finite) ends its request alone, first
            finished = self._fail_nonfinite(step, tokens, now) if NONFINITE in tokens else []
            ends = self.structured.accept(step.sampled, tokens) if self.structured is not None else {}
            generated, check, finished_status = 0, self.stopper.check, SequenceStatus.FINISHED
            block = logprobs.block if logprobs is not None else None
            block_rows = logprobs.block_rows if block is not None else None
            # once per sequence per step: Sequence.resolve inlined, and StopChecker.check only behind its gate
            for row, (seq, index, token) in enumerate(zip(step.sampled, step.indices, tokens)):
                if seq.status is finished_status:
                    continue  # it stopped a step earlier; this token was computed speculatively
                ids = seq.token_ids
                ids[index] = token
                seq.num_pending -= 1
                if index == len(ids) - 1:
                    seq.pending_row = -1
                if block is not None:
                    at = row if block_rows is None else (block_rows[row] if row < len(block_rows) else -1)
                    if at >= 0:
                        seq.logprob_blocks.append(block)
                        seq.logprob_rows.append(at)
                generated += 1
                if seq.first_token_time is None:
                    seq.first_token_time = now
                gate = seq.stop_ids
                done = check(seq, index) if gate is None or token in gate or index >= seq.stop_index else False
                keep = index + 1
                end = ends.get(seq.seq_id) if ends else None
                if end == "abort":
                    # the grammar matcher failed at this token: the output is what it accepted, never a "stop"
                    seq.finish_reason, seq.stop_reason, seq.text = "abort", None, None
                    done, keep = True, index
                elif end == "stop" and seq.finish_reason != "stop":
                    # a grammar completed by the last token allowed by max_tokens still counts as a stop
                    seq.finish_reason, done = "stop", True
                if done:
                    seq.truncate(keep)
                    seq.finish_time = now
                    self.scheduler.finish(seq)
                    finished.append(self._output(seq))
            self.stats.generated_tokens += generated
            manager = self.scheduler.block_manager
            if manager.enable_prefix_caching:
                # blocks whose last token was in flight at launch can be published now (one check per sequence)
                block_size = manager.block_size
                for seq in step.seqs:
                    if seq.num_computed_tokens // block_size > seq.num_hashed_blocks and not seq.is_finished:
                        manager.register_computed(seq)
            return finished

    def _fail_nonfinite(self, step: InflightStep, tokens: list[int], now: float) -> list[RequestOutput]:
        """An error output for each request whose token of this step is the sampler's non-finite flag."""
        failed = []
        for seq, index, token in zip(step.sampled, step.indices, tokens):
            if token != NONFINITE or seq.status is SequenceStatus.FINISHED:
                continue
            error = ModelFailure(f"the model produced non-finite logits at token {index - seq.num_prompt_tokens}")
            seq.truncate(index)
            seq.finish_reason, seq.finish_time = "error", now
            self.scheduler.finish(seq)
            failed.append(dataclasses.replace(self._output(seq), error=error))
        return failed

    def _refresh_queue_stats(self) -> None:
        self.stats.num_running = len(self.scheduler.running)
        self.stats.num_waiting = len(self.scheduler.waiting) + (self.structured.num_compiling if self.structured else 0)
        self.stats.kv_blocks_used = self.scheduler.block_manager.num_used_blocks
        snapshots = self.scheduler.snapshots
        if snapshots is not None:
            self.stats.state_snapshot_slots = snapshots.num_slots
            self.stats.state_snapshots_taken, self.stats.state_snapshot_hits = snapshots.taken, snapshots.hits

    def _output(self, seq: Sequence) -> RequestOutput:
        completion = CompletionOutput(
            index=0, text=("" if not seq.params.detokenize else self.stopper.final_text(seq)
                           if self.detokenize or seq.text is not None else None),
            token_ids=seq.completion_token_ids, finish_reason=seq.finish_reason or "length",
            stop_reason=seq.stop_reason, skip_special_tokens=seq.params.skip_special_tokens)
        if seq.params.logprobs is not None:
            n, k = len(completion.token_ids), seq.params.logprobs
            blocks, rows = seq.logprob_blocks[:n], seq.logprob_rows[:n]
            completion.logprobs = LazyLogprobs(completion.token_ids, BlockEntries(blocks, rows, k), self._token_text)
            completion.cumulative_logprob = sum(b.logprobs[r] for b, r in zip(blocks, rows))
        prompt_ids = seq.token_ids[: seq.num_prompt_tokens]
        prompt_logprobs = None
        if seq.params.prompt_logprobs is not None:
            skipped = seq.prompt_logprobs_from  # positions whose next token's logprob was not asked for
            prompt_logprobs = LazyLogprobs(prompt_ids[skipped + 1:], seq.prompt_logprob_entries, self._token_text,
                                           leading_nones=skipped + 1)
        metrics = RequestMetrics(arrival_time=seq.arrival_time, first_token_time=seq.first_token_time,
                                 finish_time=seq.finish_time, num_cached_prompt_tokens=seq.num_cached_tokens)
        return RequestOutput(request_id=seq.request_id, prompt=None, prompt_token_ids=prompt_ids,
                             outputs=[completion], prompt_logprobs=prompt_logprobs, metrics=metrics)

    def shutdown(self) -> None:
        if self.structured is not None:
            self.structured.shutdown()
        self.model_runner.shutdown()
