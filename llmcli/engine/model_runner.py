"""ModelRunner: builds the model on its device, sizes the KV pool, and runs one step at a time."""
from __future__ import annotations

import gc
import logging
import os
from typing import Any, Callable

import numpy as np
import torch

from llmcli.config import Config
from llmcli.parallel import agree_min, tp_rank, tp_size
from llmcli.engine.block_tables import BlockTables
from llmcli.engine.pinned import ReadbackRing
from llmcli.engine.kv_cache import (KVCacheTooSmall, allocate_kv_cache, describe_states, kv_bytes_per_token,
                                   kv_layout, plan_kv_cache)
from llmcli.engine.kv_groups import blocks_needed
from llmcli.layers.attention import Attention
from llmcli.engine.row_table import RowTable
from llmcli.engine.state_pages import StatePages
from llmcli.engine.state_pool import linear_layers, plan_state_pages, state_row_bytes
from llmcli.engine.sampling_extras import StepExtras, StepLogprobs, upload_extras
from llmcli.engine.startup import StartupClock
from llmcli.engine.step_plan import StepPlan
from llmcli.engine.step_timer import StepTimer
from llmcli.engine.warmup import compile_variants, measure_activation_peak
from llmcli.engine.step_inputs import DecodeArrays, StepInputs, decode_arrays, prepare_decode, prepare_prefill
from llmcli.engine.uploader import Uploader
from llmcli.kernels import make_backend
from llmcli.kernels.backend import AttentionMetadata
from llmcli.layers.logit_bias import BiasTables
from llmcli.layers.logprobs import worker_prompt_logits
from llmcli.layers.penalties import PenaltyTables
from llmcli.layers.sampler import Sampler, greedy_tokens
from llmcli.layers.state_segments import LinearStep, linear_step
from llmcli.layers.token_mask import apply_token_bitmask
from llmcli.models import build_model, head_dim_of
from llmcli.layers.moe_mxfp4 import finish_mxfp4
from llmcli.layers.quantization.loading import finish_fp8
from llmcli.models.loader import load_dummy, load_safetensors

log = logging.getLogger("llmcli")
MaskSource = Callable[[], Any]  # returns the int32 token bitmask (host) of the step's sampled rows, or None


class LaunchedStep:
    """A step enqueued on the device: its sampled tokens (one per sampling entry of the plan) once it finishes.

    The step's logprobs (``extras``), if any were asked for, are copied back with the tokens behind the
    same event: reading them costs no extra wait.
    """

    def __init__(self, tokens: torch.Tensor | None, extras: StepExtras | None = None,
                 ring: ReadbackRing | None = None) -> None:
        self.extras = extras
        self._done = None
        self._ring, self._slot = ring, -1
        device = ([tokens] if tokens is not None else []) + (extras.device_tensors() if extras is not None else [])
        if device and device[0].is_cuda:
            host = []
            for t in device:
                if not host and tokens is not None and ring is not None:  # the tokens: a reused buffer
                    self._slot, h, self._done = ring.take(t)
                else:
                    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                host.append(h)
            if self._done is None:
                self._done = torch.cuda.Event()
            self._done.record()
            device = host
        elif tokens is not None:
            device[0] = tokens.clone()  # it may be a view of a buffer the next step overwrites (decode graphs)
        self._host: list[int] | torch.Tensor = device.pop(0) if tokens is not None else []
        self._extra_host = device

    @property
    def read(self) -> bool:
        """The tokens are on the host (``token_ids`` was called; always, where this rank samples nothing)."""
        return isinstance(self._host, list)

    def token_ids(self) -> list[int]:
        if isinstance(self._host, list):
            return self._host
        if self._done is not None:
            self._done.synchronize()
        self._host = self._host.tolist()
        if self._ring is not None:
            self._ring.release(self._slot)  # the buffer may take another step's tokens now
            self._ring = None
        return self._host

    def logprobs(self) -> StepLogprobs | None:
        """The step's logprobs on the host (call after ``token_ids``), or None when none were asked for."""
        if self.extras is None or not self._extra_host:
            return None
        return self.extras.host_results(self._extra_host)


class ModelRunner:
    def __init__(self, config: Config, clock: StartupClock | None = None) -> None:
        self.config = config
        # Seconds per start-up phase (weights, probe, kv_cache, compile, graphs), for --verbose and probe-memory.
        self.clock = clock = clock if clock is not None else StartupClock()
        self.rank, self.world = tp_rank(), tp_size()
        hf = config.hf_config
        self.device = torch.device("cuda", self.rank) if config.device == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.head_dim = head_dim_of(hf)
        if config.tensor_parallel_size != self.world:
            raise RuntimeError(f"this process already belongs to a group of {self.world} tensor-parallel ranks; "
                               f"an engine with tensor_parallel_size={config.tensor_parallel_size} cannot start "
                               "in it (one tensor-parallel engine per process)")
        self.num_kv_heads = hf.num_key_value_heads // self.world  # divisibility is checked before ranks start
        self.backend = make_backend(config.attention_backend, hf.num_attention_heads // self.world,
                                    self.num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                                    config.kvcache_block_size)
        with clock.phase("weights"):
            self.model = self._build_model()
        # layers of a wider head than config.json's head_dim (Gemma 4's global ones) size the decode scratch; the
        # softmax scale stays head_dim ** -0.5 (such layers fold their own into q's norm)
        self.backend.head_dim = max([self.head_dim] + [m.head_dim for m in self.model.modules()
                                                       if isinstance(m, Attention)])
        self.init_host_state(config, self.device, 0)
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # kernels that need no forward compile on worker threads meanwhile (joined before graph capture)
        side = self._start_side_compile()
        try:
            with clock.phase("probe"):
                activation_peak = measure_activation_peak(self)
                per_token = kv_bytes_per_token(hf, self.num_kv_heads, self.head_dim, config.kv_torch_dtype,
                                               self.model, self.kv_layout)
                row_bytes = state_row_bytes(self.model, config.torch_dtype)
                # a hybrid model's states take rows of KV pages (engine/state_pages.py): every rank the most any
                # rank's take
                row_pages = -(-row_bytes // (per_token * config.kvcache_block_size))
                if row_bytes and self.world > 1:
                    row_pages = -agree_min(-row_pages, self.device)
                self.memory_report = plan_kv_cache(config, self.device, per_token, self.weights_bytes,
                                                   activation_peak, row_pages, self.kv_layout)
                self.num_blocks = self._agree_on_blocks(self.memory_report.num_blocks)
                if row_pages:
                    self.state_pages = self._plan_states(row_pages, row_bytes)
            if self.num_blocks == 0:
                raise KVCacheTooSmall("; ".join(self.memory_report.notes), self.memory_report)
            with clock.phase("kv_cache"):
                states = (self.state_pages, config.torch_dtype) if self.state_pages is not None else None
                self.kv_cache = allocate_kv_cache(self.model, self.num_blocks, config.kvcache_block_size,
                                                  self.num_kv_heads, self.head_dim, config.kv_torch_dtype,
                                                  self.device, self.kv_layout, states)
                self.state_pool = [t for m in linear_layers(self.model) for t in (m.conv_state, m.ssm_state)]
            if self.device.type == "cuda":
                with clock.phase("compile"):
                    compile_variants(self)
                    failed = side.join() if side is not None else 0
                log.info("compiled the prefill and sampler variants in %.1f s", clock.seconds["compile"])
                if failed:
                    log.info("%d side compile tasks failed; those kernels compile when first launched", failed)
        finally:
            if side is not None:
                side.join(cancel=True)  # start-up failed on the way: no thread outlives it (no-op after success)
        if self.device.type == "cuda" and not config.enforce_eager and self.backend.name != "torch":
            from llmcli.engine.cuda_graphs import DecodeGraphs

            with clock.phase("graphs"):
                # the one-pass sampler must have passed its start-up check to go inside the graph (the check
                # covers the filtered draw too: the threshold kernel against the sort-based filter)
                in_graph = config.sample_in_graph and self.world == 1 and self.sampler.one_pass
                self.graphs = DecodeGraphs(self.model, self.backend, config, self.device, sample_in_graph=in_graph,
                                           groups=len(self.rows.group_tables))
            self.memory_report.cuda_graph_bytes = self.graphs.pool_bytes
            log.info("captured %d decode CUDA graphs in %.1f s", len(self.graphs.batch_sizes),
                     clock.seconds["graphs"])

    def _start_side_compile(self):
        """Worker threads compiling the sampler, logprobs and attention kernels (llmcli.engine.side_compile);
        None on CPU, with tensor parallelism, or with LLMCLI_SIDE_COMPILE=0."""
        if self.device.type != "cuda" or self.world > 1 or os.environ.get("LLMCLI_SIDE_COMPILE") == "0":
            return None
        from llmcli.engine.cuda_graphs import graph_batch_sizes
        from llmcli.engine.side_compile import SideCompile, attention_tasks, kernel_tasks

        cfg = self.config
        tasks = attention_tasks(self.backend, cfg.torch_dtype, self.device, cfg.max_model_len,
                                cfg.max_num_batched_tokens, [] if cfg.enforce_eager else graph_batch_sizes(cfg.max_num_seqs),
                                kv_dtype=cfg.kv_torch_dtype)
        tasks += kernel_tasks(cfg.hf_config.vocab_size, cfg.torch_dtype, self.device)
        return SideCompile(tasks, self.device)

    @property
    def startup_s(self) -> dict[str, float]:
        return self.clock.rounded()

    def init_host_state(self, config: Config, device: torch.device, num_blocks: int) -> None:
        """What ``launch`` needs besides the model (benchmarks/host_step_cpu.py builds a runner from this alone)."""
        self.config, self.device, self.num_blocks = config, device, num_blocks
        self.rank, self.world = getattr(self, "rank", 0), getattr(self, "world", 1)
        self.sampler = Sampler()
        self.sampler_checked = False  # the one-pass sampler's start-up check (warmup.check_sampler) ran
        self.uploader = Uploader(device)
        self.readback = ReadbackRing() if device.type == "cuda" else None  # the sampled tokens' host buffers
        model = getattr(self, "model", None)
        # the KV groups (engine/kv_groups.py): one block table per group and sequence
        self.kv_layout = kv_layout(model, config.max_model_len) if model is not None else None
        self.rows = RowTable(-(-config.max_model_len // config.kvcache_block_size), config.kvcache_block_size,
                             device, rows=config.max_num_seqs + 1,
                             groups=self.kv_layout.num_groups if self.kv_layout is not None else 1)
        self.last_decode: DecodeArrays | None = None  # the last graph decode step's arrays (a plan may follow)
        self.penalties = PenaltyTables(config.hf_config.vocab_size, device)
        self.bias = BiasTables(config.hf_config.vocab_size, device)
        self.prev_tokens: torch.Tensor | None = None  # the last launch's sampled tokens, on the device
        self.prev_in_graph = False  # they are in the decode graphs' own token buffer already
        self.timer = StepTimer()
        self.graphs = None
        self.state_pool: list[torch.Tensor] = []  # hybrid models' linear-attention states, once allocated
        self.state_pages: StatePages | None = None  # and where they live (engine/state_pages.py)

    @property
    def block_tables(self) -> "BlockTables":
        return self.rows.block_tables

    def _plan_states(self, row_pages: int, row_bytes: int) -> StatePages:
        """A hybrid model's state rows in the agreed pool (max_num_seqs lowered where they would not fit beside
        one sequence of max_model_len): said in the memory report, and in the log when lowered."""
        config, report = self.config, self.memory_report
        shared = not config.num_kvcache_blocks
        kv_min = blocks_needed(config.max_model_len, [g["window"] for g in report.kv_groups] or [None],
                               config.kvcache_block_size, config.kvcache_block_size) if shared \
            else config.num_kvcache_blocks
        pages, lowered = plan_state_pages(config, row_pages, self.num_blocks, kv_min, shared)
        if not shared:  # exactly num_kvcache_blocks beside the rows (the memory may have held fewer rows)
            report.num_blocks = self.num_blocks = min(self.num_blocks, kv_min + pages.rows * row_pages)
        if lowered:
            report.notes.insert(0, lowered)
            if self.rank == 0:
                log.warning(lowered)
        if config.max_num_seqs == 0:
            report.num_blocks = self.num_blocks = 0
            beside = "one sequence of max_model_len" if shared else "num_kvcache_blocks"
            report.notes.append(f"not one sequence's linear-attention states ({row_pages} blocks) fit beside the "
                                f"snapshot rows and {beside}: raise gpu_memory_utilization or kv_cache_memory_gib, "
                                "or lower max_model_len or num_kvcache_blocks")
        describe_states(report, pages, row_bytes)
        return pages

    def _agree_on_blocks(self, num_blocks: int) -> int:
        """Every tensor-parallel rank must use the same pool: take the smallest."""
        if self.world == 1:
            return num_blocks
        self.memory_report.num_blocks = agree_min(num_blocks, self.device)
        self.memory_report.cache_tokens = self.memory_report.num_blocks * self.config.kvcache_block_size
        return self.memory_report.num_blocks

    @torch.inference_mode()
    def _build_model(self) -> torch.nn.Module:
        cfg = self.config
        torch.manual_seed(cfg.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(cfg.torch_dtype)
        try:
            with torch.device(self.device):
                model = build_model(cfg.hf_config, self.backend, cfg.max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        loaded = None
        if cfg.load_format == "dummy":
            load_dummy(model, cfg.seed)
        else:
            loaded = load_safetensors(model, cfg.model_path, cfg.quant_config)
        self.fp8_layers = finish_fp8(model, cfg.quant_config, loaded, self.device)
        if self.fp8_layers:
            log.info("%d linear layers run FP8 GEMMs", self.fp8_layers)
        if finish_mxfp4(model, cfg.torch_dtype):
            log.info("MXFP4 experts in the tensor cores' fragment order (the frag kernel)")
        return model.eval()

    @torch.inference_mode()
    def run(self, plan: StepPlan, before_sample: MaskSource | None = None) -> list[int] | None:
        """Compute one step and wait for it; the sampled token of each sampling entry (rank 0 only)."""
        step = self.launch(plan, before_sample)
        return step.token_ids() if self.rank == 0 else None

    @torch.inference_mode()
    def launch(self, plan: StepPlan, before_sample: MaskSource | None = None) -> LaunchedStep:
        """Enqueue one step on the device and return at once; ``token_ids()`` on the result waits for it.

        An entry whose last token is still in flight (``plan.pending >= 0``) takes it straight from the
        previous launch's sampled tokens on the device, so the host never waits between steps.
        ``before_sample`` (structured outputs) is called once the forward is enqueued: while the device runs
        it, the host may read back the previous step and build this step's token bitmask (a [rows, words]
        int32 tensor in pinned memory on CUDA, or None), which is applied to the logits before sampling.
        """
        if not plan.is_prefill and self.graphs is not None and self.graphs.fits(plan.num_entries) \
                and before_sample is None and (self.rank != 0 or plan.extras is None):
            return self._launch_graph(plan)  # the common decode step: nothing between the logits and the sampler
        self.prev_in_graph = False
        self.last_decode = None
        with self.timer.phase("prepare"):
            self.rows.update(plan, self.uploader)
            prepare = prepare_prefill if plan.is_prefill else prepare_decode
            inputs = prepare(plan, self.uploader, self.rows.group_tables)
            if plan.is_prefill and self.state_pool:  # a hybrid model: decode rows apart, prefix hits, snapshots
                inputs.metadata.linear_step = self._linear_step(plan, inputs.metadata)
            sampling = self.rows.sampling(*self.rows.sampled(plan), self.uploader) \
                if self.rank == 0 and inputs.num_sampled else None
            # penalties, logit biases and logprobs (rank 0 samples alone); None when no request of the step asks
            extras = upload_extras(plan.extras, inputs.num_sampled, self.uploader, self.penalties, self.bias,
                                   self.rows) \
                if self.rank == 0 and plan.extras is not None else None
        with self.timer.phase("forward"):
            if inputs.pending_rows is not None:
                # clamped: a row flagged non-finite (-1) computes one throw-away token before its request fails
                from_device = self.prev_tokens[inputs.pending_rows.clamp(min=0)].clamp(min=0)
                inputs.input_ids = torch.where(inputs.pending_rows >= 0, from_device, inputs.input_ids)
            hidden = self._forward(inputs)
            logits = self._logits(hidden, inputs)
        mask = before_sample() if before_sample is not None and logits is not None else None
        with self.timer.phase("sample"):
            if logits is None:
                token_ids = None
                if extras is not None:  # a prompt chunk that samples nothing may still want prompt logprobs
                    extras.compute_logprobs(None, None, hidden, self.model.compute_logits)
                elif self.rank != 0 and plan.extras is not None:  # rank 0's prompt logits gather from this rank
                    rows = self.uploader.upload(torch.int64, plan.extras.prompt_rows)[0]
                    worker_prompt_logits(hidden[rows], self.model.compute_logits)
            else:
                raw = logits
                if extras is not None:
                    logits = extras.penalize(logits, inputs.input_ids, self.penalties, self.bias)
                if mask is not None:  # after penalties: a disallowed token stays disallowed
                    logits = apply_token_bitmask(logits, self._upload_mask(mask))
                token_ids = greedy_tokens(logits) if sampling is None else self.sampler(logits, sampling)
                if extras is not None:  # (in range: the sampler's -1 flags a row of non-finite logits)
                    extras.compute_logprobs(raw, token_ids.clamp(min=0), hidden, self.model.compute_logits)
            if self.world > 1 and inputs.num_sampled:
                token_ids = self._share_tokens(token_ids, inputs.num_sampled)
            self.prev_tokens = token_ids
            return LaunchedStep(token_ids if self.rank == 0 else None, extras, self.readback)

    def _linear_step(self, plan: StepPlan, meta: AttentionMetadata) -> LinearStep:
        """Snapshot ``i`` is pool slot ``max_num_seqs + 1 + i`` (engine/state_pool.py)."""
        base = self.config.max_num_seqs + 1
        return linear_step(meta, plan.rows, plan.computed, plan.scheduled,
                           [(e, base + s) for e, s in plan.state_reads],
                           [(e, o, base + s) for e, o, s in plan.state_writes], self.uploader)

    def _upload_mask(self, mask: torch.Tensor) -> torch.Tensor:
        return mask.to(self.device, non_blocking=True) if self.device.type == "cuda" else mask

    def _launch_graph(self, plan: StepPlan) -> LaunchedStep:
        """A decode step through its CUDA graphs: staged inputs, the forward's replay, then the sampler's
        (``sample_in_graph``: the plain or the filtered one), or logits and sampling outside the graphs."""
        n = plan.num_entries
        with self.timer.phase("prepare"):
            rows = self.rows
            deltas = rows.update(plan, self.uploader, defer=True)
            if deltas is not None and len(deltas[0]) > self.graphs.max_deltas:  # many new tables at once
                self.block_tables.upload(*deltas, self.uploader)
                deltas = None
            arrays = decode_arrays(plan, self.rows.group_tables, self.last_decode)
            steps = arrays.lens - rows.prompt[arrays.rows]
            in_graph = rows.graph_sampling(arrays.rows, steps) if self.graphs.sample_in_graph and self.rank == 0 \
                else None
            if in_graph is not None:
                f32, seeds, steps, top_ks = in_graph.f32, in_graph.seeds, in_graph.steps, in_graph.top_ks
            else:
                f32, seeds = None, np.zeros(n, np.int64)
                steps = top_ks = seeds
            i64 = np.stack([arrays.ids, arrays.positions, arrays.slots, arrays.pending, seeds, steps, arrays.rows,
                            arrays.order, top_ks, *arrays.group_slots])
            sampling = None if in_graph is not None or self.rank != 0 else \
                rows.sampling(arrays.rows, arrays.lens - rows.prompt[arrays.rows], self.uploader)
        with self.timer.phase("forward"):
            prev = None if self.prev_in_graph else self.prev_tokens
            tokens, hidden = self.graphs.staged_replay(i64, f32, arrays.lens, self.rows.group_tables, prev, deltas,
                                                       filtered=in_graph is not None and in_graph.filtered)
            logits = None if in_graph is not None else self.model.compute_logits(hidden)
        with self.timer.phase("sample"):
            if in_graph is not None:
                token_ids = tokens
            elif logits is None:
                token_ids = None
            else:
                token_ids = greedy_tokens(logits) if sampling is None else self.sampler(logits, sampling)
            if self.world > 1:
                token_ids = self._share_tokens(token_ids, n)
            self.prev_tokens, self.prev_in_graph = token_ids, in_graph is not None
            self.last_decode = arrays
            return LaunchedStep(token_ids if self.rank == 0 else None, ring=self.readback)

    def _share_tokens(self, token_ids: torch.Tensor | None, n: int) -> torch.Tensor:
        """Rank 0's sampled tokens on every rank, device to device, so that the next step's in-flight
        tokens (``pending_rows``) resolve on each rank without a trip through the host."""
        import torch.distributed as dist

        if token_ids is None:
            token_ids = torch.empty(n, dtype=torch.int64, device=self.device)
        dist.broadcast(token_ids, src=0)
        return token_ids

    def shutdown(self) -> None:
        """Give the device memory back now, even if something still holds a reference to this runner."""
        for module in self.model.modules():
            if hasattr(module, "k_cache"):
                module.k_cache = module.v_cache = None
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = None
        self.kv_cache = None
        self.state_pool = None
        for layer in linear_layers(self.model):
            layer.conv_state = layer.ssm_state = None
        for param in self.model.parameters():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        if self.device.type == "cuda":
            # device tensors held only by garbage not yet collected (cycles, a caught exception's frames) would
            # keep their memory from the driver until the next collection
            gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states of every input row."""
        meta = inputs.metadata
        if self.graphs is not None and not meta.is_prefill and self.graphs.fits(meta.batch_size):
            self.prev_in_graph = False  # the replay may leave other tokens in the graphs' token buffer
            return self.graphs.replay(inputs)
        self.backend.prepare(meta)
        return self.model(inputs.input_ids, inputs.positions)

    def _logits(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor | None:
        """Logits of the sampling rows (rank 0; None elsewhere or when no sequence samples)."""
        if not inputs.num_sampled:
            return None
        if inputs.sample_rows is not None:
            hidden = hidden[inputs.sample_rows]
        return self.model.compute_logits(hidden)
