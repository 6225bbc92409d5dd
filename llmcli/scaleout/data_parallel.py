"""Data parallelism: one input fed to many engine replicas, answers merged back, each request answered once.

``DataParallelEngine`` is an ``engine.engine_api.EngineAPI``, as ``LLMEngine``
is (and has ``config`` and ``model_runner.memory_report`` as it does), so the
CLI drives either one: ordering, ``--resume`` and error records work unchanged,
as they go by request id.
Behind it sits a pool of replicas, each a complete engine with its own
``tensor_parallel_size`` ranks: processes on this machine (``local_pool``) or
actors on a Ray cluster (``ray_pool``).

* **Routing.** Each request goes to the replica with the fewest outstanding
  tokens (``balancer``). Requests are buffered per replica and sent in one
  batch at the next ``step``.
* **Seeds.** A request without a seed gets one here, drawn from
  ``random.Random(config.seed)`` in the order requests are added, exactly as
  one ``LLMEngine`` draws them. So sampled output does not depend on the number
  of replicas or on which replica runs a request (also after a failover).
* **Answers.** ``step`` returns the answers that arrived, waiting up to
  ``WAIT_S`` for the first one so the caller's loop does not spin. An answer
  for a request that is not outstanding any more is dropped (never answered
  twice).
* **Failures.** A replica that dies (process exit, Ray actor death, an error
  in its loop) or stops responding (no heartbeat) is reported as a warning,
  and its unanswered requests are sent again to the others (nothing lost).
  When no replica is left, ``DataParallelError`` names every loss.
* **Poison requests.** A request that may have killed its replica is not
  carried from replica to replica: one that was running on two replicas that
  failed (or was the only request running when its replica's engine failed)
  comes back as an error output instead of being sent again. A replica that
  failed with an error names what it was running; one that died without a
  word (a signal) counts against all its unfinished requests; one that was
  stopped (silent) against none.
"""
from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Hashable

from llmcli.config import Config, ConfigError
from llmcli.engine.admission import check_request_fits, encode_prompt
from llmcli.engine.state_pages import kv_room_of
from llmcli.engine.kv_groups import kv_windows_of
from llmcli.engine.outputs import EngineStats, RequestOutput
from llmcli.sampling_params import SamplingParams
from llmcli.scaleout.balancer import OutstandingTokenBalancer, request_cost
from llmcli.scaleout.errors import DataParallelError, ReplicaFailure
from llmcli.scaleout.replica import ReplicaInfo

log = logging.getLogger("llmcli")

BACKENDS = ("local", "ray")
WAIT_S = 0.1
FORCE_POOL_ENV = "LLMCLI_DP_FORCE_POOL"  # testing: "1" runs even one replica as a replica (process or actor)
MAX_LOSSES = 2  # a request running on this many replicas that failed is failed itself, not sent on
# Counters of EngineStats that describe the present (what runs now), not the past: a lost replica's are zeroed.
CURRENT_STATE = ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total")


@dataclass
class ScaleOut:
    """How many replicas, and where: ``local`` processes or a ``ray`` cluster (``ray_address`` None: a new local one)."""

    data_parallel_size: int = 1
    backend: str = "local"
    ray_address: str | None = None

    def __post_init__(self) -> None:
        if self.ray_address:
            self.backend = "ray"
        n = self.data_parallel_size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"data_parallel_size={n!r}: must be a positive integer")
        if self.backend not in BACKENDS:
            raise ConfigError(f"distributed backend {self.backend!r}: must be one of {', '.join(BACKENDS)}")

    @property
    def enabled(self) -> bool:
        """Whether a DataParallelEngine is needed: several replicas, or any on Ray, or FORCE_POOL_ENV=1
        (one replica through the same pool, so that the data-parallel path runs on a machine with one GPU)."""
        return self.data_parallel_size > 1 or self.backend == "ray" or os.environ.get(FORCE_POOL_ENV) == "1"


def start_timeout_s() -> float:
    from llmcli.config import env_number

    return float(env_number("LLMCLI_DP_START_TIMEOUT_S", 900.0))


def driver_config(engine_kwargs: dict[str, Any], scale: ScaleOut) -> Config:
    """The driver's Config: for the tokenizer, the admission rule and the model's limits.

    With Ray and no CUDA device on this machine (a CPU-only head node), the
    driver plans on CPU; each replica validates the device-specific knobs on its
    own node when it starts.
    """
    if scale.backend == "ray" and engine_kwargs.get("device", "auto") != "cpu":
        import torch

        if not torch.cuda.is_available():
            planning = dict(engine_kwargs, device="cpu", dtype="auto", attention_backend="auto",
                            tensor_parallel_size=1)
            return Config(**planning)
    return Config(**engine_kwargs)


def _one_line(loss: str) -> str:
    """A replica's loss for an error record: its first line, with the last line of its traceback if any."""
    lines = [line.strip() for line in loss.splitlines() if line.strip()]
    head = lines[0].removesuffix("its error:").rstrip(" ;:")
    return f"{head} ({lines[-1]})" if len(lines) > 1 else head


@dataclass
class ReplicaRunners:
    """What callers read from ``engine.model_runner``: the smallest KV pool, and replica 0's memory plan."""

    replicas: list[ReplicaInfo]

    @property
    def num_blocks(self) -> int:
        return min(r.num_blocks for r in self.replicas)

    @property
    def memory_report(self) -> Any:
        return self.replicas[0].memory_report


class DataParallelEngine:
    """Many engine replicas behind the interface of one ``LLMEngine`` (``EngineAPI``)."""

    def __init__(self, config: Config, scale: ScaleOut, *, engine_kwargs: dict[str, Any] | None = None,
                 tokenizer: Any = None, pool: Any = None) -> None:
        """``engine_kwargs``: the knobs each replica builds its Config from (default: ``config``'s);
        ``pool``: a replica pool to use instead of starting one (tests)."""
        self.config = config
        self.scale = scale
        if tokenizer is None:
            from llmcli.engine.llm_engine import load_tokenizer

            tokenizer = load_tokenizer(config.model_path, config.tokenizer)
        self.tokenizer = tokenizer
        kwargs = dict(engine_kwargs) if engine_kwargs is not None else {
            name: getattr(config, name) for name in Config.knob_names()}
        kwargs.setdefault("model", config.model)
        self.pool = pool if pool is not None else self._make_pool(kwargs)
        try:
            infos = self.pool.start(start_timeout_s())
        except BaseException:
            self.pool.shutdown()
            raise
        self.model_runner = ReplicaRunners(infos)
        for info in infos:
            log.info("data-parallel replica %d: pid %d on %s, %s%s, %d KV blocks", info.index, info.pid, info.host,
                     info.device, f" (GPUs {info.gpus})" if info.gpus is not None else "", info.num_blocks)
        self.num_replicas = scale.data_parallel_size
        self.balancer = OutstandingTokenBalancer(self.num_replicas)
        self._outstanding: dict[Hashable, tuple[list[int], SamplingParams, int]] = {}
        self._unsent: dict[int, list[tuple]] = {r: [] for r in range(self.num_replicas)}
        self._stats: dict[int, EngineStats] = {
            r: EngineStats(kv_blocks_total=info.num_blocks) for r, info in enumerate(infos)}
        self._losses: list[str] = []
        self._blamed: dict[Hashable, int] = {}  # request -> replicas that failed while running it
        self._failed: list[RequestOutput] = []  # requests given up on, returned by the next step
        self._rng = random.Random(config.seed)
        self._closed = False

    def _make_pool(self, kwargs: dict[str, Any]) -> Any:
        scale, config = self.scale, self.config
        tp = kwargs.get("tensor_parallel_size", 1)
        if scale.backend == "ray":
            from llmcli.scaleout.ray_pool import RayReplicaPool

            for name in ("model", "tokenizer"):  # a local folder by absolute path: actors start in other folders
                value = kwargs.get(name)
                if value and Path(value).expanduser().is_dir():
                    kwargs[name] = str(Path(value).expanduser().resolve())
            device = kwargs.get("device", "auto")
            use_gpu = None if device == "auto" else device == "cuda"
            return RayReplicaPool(kwargs, scale.data_parallel_size, use_gpu=use_gpu, tensor_parallel_size=tp,
                                  address=scale.ray_address)
        from llmcli.scaleout.local_pool import LocalReplicaPool

        # Every replica reads the folder the driver resolved (a hub id is downloaded once, here).
        kwargs = dict(kwargs, model=str(config.model_path), device=config.device)
        return LocalReplicaPool(kwargs, scale.data_parallel_size, device=config.device, tensor_parallel_size=tp)

    @property
    def startup_s(self) -> dict[str, float]:
        """None of its own: each replica's engine times its phases in its own process and hands the driver only
        what it sized (``ReplicaInfo``)."""
        return {}

    @property
    def detokenize(self) -> bool:
        """Always on: each replica's engine decodes its outputs before they cross, with its own tokenizer."""
        return True

    def fill_texts(self, outs: list[RequestOutput]) -> None:
        """Nothing to decode: outputs arrive with their texts (``detokenize``)."""

    # -- requests -----------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.config.model)

    def check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejected unless the request fits every replica (it may have to move after a failure)."""
        report = self.model_runner.memory_report
        check_request_fits(token_ids, params, self.config, kv_room_of(report, self.model_runner.num_blocks),
                           kv_windows_of(report))

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: Any = None) -> None:
        token_ids = self.encode(prompt)
        self.check_fits(token_ids, params)
        if request_id in self._outstanding:
            raise ValueError(f"request id {request_id!r} is already running")
        if params.seed is None:  # the draw one LLMEngine would make, in the same order
            params = params.replace(seed=self._rng.getrandbits(63))
        cost = request_cost(len(token_ids), params, self.config.max_model_len)
        self._outstanding[request_id] = (token_ids, params, cost)
        self._route(request_id)

    def _route(self, request_id: Hashable) -> None:
        token_ids, params, cost = self._outstanding[request_id]
        replica = self.balancer.assign(request_id, cost)
        self._unsent[replica].append((request_id, token_ids, params))

    def _flush(self) -> None:
        for replica, batch in self._unsent.items():
            if batch:
                self._unsent[replica] = []
                self.pool.submit(replica, batch)

    def has_unfinished(self) -> bool:
        return bool(self._outstanding)

    # -- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Send what was added, then return the answers that arrived (waiting up to WAIT_S for the first)."""
        if self._closed:
            raise DataParallelError("the data-parallel engine has been shut down")
        self._flush()
        finished: list[RequestOutput] = []
        for event in self.pool.wait(WAIT_S if self._outstanding else 0.0):
            if event[0] == "out":
                _, replica, outputs, stats = event
                if stats is not None and replica not in self._lost_replicas:
                    self._stats[replica] = stats
                for out in outputs:
                    if out.request_id in self._outstanding:  # the first answer wins; a late duplicate is dropped
                        del self._outstanding[out.request_id]
                        self.balancer.done(out.request_id)
                        finished.append(out)
            else:
                self._replica_lost(event[1], event[2], event[3] if len(event) > 3 else None)
        self._flush()
        finished += self._failed
        self._failed = []
        return finished

    @property
    def _lost_replicas(self) -> set[int]:
        return {r for r, ok in enumerate(self.balancer.alive) if not ok}

    def _replica_lost(self, replica: int, why: str, suspects: list[Any] | None = None) -> None:
        """``suspects``: what the replica was running when it failed (None: unknown, so all it held)."""
        if not self.balancer.alive[replica]:
            return
        self.pool.kill(replica)
        self._unsent[replica] = []
        orphans = self.balancer.remove(replica)
        stats = self._stats[replica]
        for name in CURRENT_STATE:
            setattr(stats, name, 0)
        message = f"data-parallel replica {replica} {why}"
        self._losses.append(message)
        resend = self._give_up_on_poison(orphans, suspects, message)
        live = self.balancer.live
        if not live:
            raise DataParallelError("every data-parallel replica has been lost:\n" + "\n".join(self._losses))
        failed = len(orphans) - len(resend)
        log.warning("llmcli: %s; sending its %d unfinished request(s) to the %d remaining replica(s)%s",
                    message, len(resend), len(live),
                    f" ({failed} given up on, as suspected of killing replicas: see their error records)"
                    if failed else "")
        for request_id in resend:
            self._route(request_id)

    def _give_up_on_poison(self, orphans: list[Any], suspects: list[Any] | None, message: str) -> list[Any]:
        """The orphans to send again; the ones that may be killing replicas become error outputs instead."""
        blamed = set(orphans) if suspects is None else set(suspects).intersection(orphans)
        alone = suspects is not None and len(blamed) == 1  # the only request its engine ran when it failed
        resend = []
        for request_id in orphans:
            if request_id in blamed:
                count = self._blamed[request_id] = self._blamed.get(request_id, 0) + 1
                if alone or count >= MAX_LOSSES:
                    token_ids, _, _ = self._outstanding.pop(request_id)
                    reason = ("it was the only request that replica was running" if alone else
                              f"it was running on {count} data-parallel replicas that failed")
                    self._failed.append(RequestOutput(request_id, None, list(token_ids), [], error=ReplicaFailure(
                        f"{_one_line(message)}; {reason}, so it is not sent to another")))
                    continue
            resend.append(request_id)
        return resend

    # -- statistics -------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        """Counters summed over the replicas (a lost replica's work included); current state of the live ones."""
        total = EngineStats()
        for stats in self._stats.values():
            for f in fields(EngineStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(stats, f.name))
        return total

    @property
    def replicas(self) -> list[ReplicaInfo]:
        return self.model_runner.replicas

    def kill_replica(self, replica: int) -> None:
        """Kill one replica outright (for tests and drills); the next ``step`` notices and fails over."""
        self.pool.kill(replica)

    def shutdown(self) -> None:
        if not self._closed:
            for replica, s in self._stats.items():  # the balance of the work, for reports and benchmarks
                log.info("data-parallel replica %d%s: %d requests answered, %d prompt + %d generated tokens, "
                         "%d steps, %d preemptions", replica, "" if self.balancer.alive[replica] else " (lost)",
                         s.num_finished, s.prompt_tokens, s.generated_tokens, s.num_steps, s.num_preemptions)
        self._closed = True
        self.pool.shutdown()

    def __enter__(self) -> "DataParallelEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
