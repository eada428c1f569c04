"""`LLMEngine`: validate and add requests, then `step()` = schedule -> execute -> update -> outputs
(or, with a device runner, the next step scheduled while this one runs: `step_pipeline.py`).
`AsyncEngine` drives it from a background thread; the hand-over is `handover.py`; the runner is
seen only through the `Runner` protocol (`step.py`). A request finishes through one path,
`Scheduler.finish_request` (stop token, length, stop string, abort, error, KV integrity), which
calls `_on_finish` (its adapter is given back); the output processor makes its last output.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import torch

from tandem.engine.builder import EngineParts, build_parts, eviction_policy
from tandem.engine.engine_setup import build_kv_managers, build_scheduler, schedules_ahead
from tandem.engine.host.thread_tuner import ThreadTuner
from tandem.engine.io.input_processor import InputProcessor
from tandem.engine.io.output_processor import OutputProcessor
from tandem.engine.io.stats import CompressionStats, EngineStats, KVStats, SchedulerStats, SpeculationStats
from tandem.engine.kv.handover import KVHandover, kv_fingerprint
from tandem.engine.lora.adapters import EngineAdapters
from tandem.engine.null_setup import build_null_parts
from tandem.engine.protocol import GenerationRequest, RequestOutput
from tandem.engine.request import Request, RequestStatus
from tandem.engine.runner import GRAMMAR_FAILED
from tandem.engine.sched.parallel_sampling import ChoiceFamilies, choice_requests, merge_by_id
from tandem.engine.sched.step import RequestUpdate, RunnerResult, SchedulerOutput
from tandem.engine.step_pipeline import StepPipeline
from tandem.engine.structured.grammar import GrammarCompiler
from tandem.platform.config import EngineConfig
from tandem.platform.errors import InvalidRequestError

__all__ = ["EngineBrokenError", "EngineParts", "LLMEngine"]

logger = logging.getLogger("tandem.engine")

# Single-request steps in a row whose model pass raised before the runner is declared broken
# (one bad request fails alone; the same failure step after step is the runner, not a request).
MAX_CONSECUTIVE_FAILED_STEPS = 3

KV_INTEGRITY_ERROR = "a KV block of this request was reassigned; retry the request"


class EngineBrokenError(RuntimeError):
    """The runner failed in a way no single request explains; the engine must be replaced."""


class LLMEngine:
    def __init__(self, config: EngineConfig, parts: EngineParts) -> None:
        """An engine over `parts` (see `from_config`, which loads them from `config.model`)."""
        self.config = config
        self.model_name = parts.model_name
        self.served_model_name = config.api_model_name
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.max_model_len = parts.max_model_len
        self.max_positions = parts.max_positions or parts.max_model_len  # the model's RoPE tables
        self.runner = parts.runner
        self.adapters = EngineAdapters(parts.lora)  # the LoRA adapters served, by name
        self.kv_cache_dtype = parts.kv_cache_dtype
        self.precision = parts.precision
        self.batch_invariance = parts.batch_invariance
        self.generation_defaults = parts.generation_defaults
        self.quant_types = parts.quant_types
        self.pooling = parts.pooling
        self.encoder = parts.encoder
        self.grammars: GrammarCompiler | None = parts.grammars
        self.kv_manager, self.head_kv = build_kv_managers(config, parts)
        self.num_kv_integrity_aborts = 0
        self.num_failed_requests = 0  # requests the runner could not compute (ended with an error)
        self.num_consecutive_failed_steps = 0  # steps in a row whose model pass raised for every request
        # Steps that ran the model, their wall seconds, and the CPU seconds of the calling thread
        # over them: wall well above CPU means the step waited (other processes on its cores, or
        # other threads holding the GIL), which is how serving overhead shows up inside the engine.
        self.num_steps = 0
        self.step_wall_s = 0.0
        self.step_thread_cpu_s = 0.0
        self.thread_tuner = ThreadTuner(parts.tuned_threads) if parts.tuned_threads else None
        self.scheduler = build_scheduler(
            config,
            self.kv_manager,
            self.head_kv,
            max_model_len=max(self.max_model_len, self.compressed_max_len),
            has_draft=self.runner.has_draft,
            eviction_window=eviction_policy(config).window,
            on_finish=self._on_finish,
            schedule_ahead=(ahead := schedules_ahead(config, self.runner, self.head_kv is not None)),
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.pipeline = StepPipeline(
            self.scheduler, self.runner, end_stale=self._end_stale, fail_requests=self._fail_requests,
            outputs=self.outputs, mark_scheduled=self.output_processor.mark_scheduled,
        ) if ahead else None  # fmt: skip
        self.families = ChoiceFamilies()  # requests with n > 1 choices, by parent id
        self.input_processor = self._input_processor()
        # The prefill/decode hand-over of this engine's KV (`kv/handover.py`).
        self.handover = KVHandover(
            self.scheduler,
            self.kv_manager,
            self.runner,
            make_request=self.make_request,
            fingerprint=kv_fingerprint(self.model_name, self.model_config),
            kv_cache_dtype=self.kv_cache_dtype,
            acquire_lora=self.adapters.acquire,
            add_output=self.output_processor.add,
            outputs=self.outputs,
        )

    def _input_processor(self) -> InputProcessor:
        return InputProcessor(
            self.tokenizer,
            self.generation_defaults,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            compressed_max_len=self.compressed_max_len,
            kv_compression_rate=self.config.kv_compression_rate,
            has_compression_pool=self.head_kv is not None,
            check_lora=self.adapters.check,
            compile_grammar=self.grammars.compile if self.grammars is not None else None,
            whole_prompt_max_tokens=self.config.max_num_batched_tokens
            if self.pooling.whole_prompt or self.encoder
            else None,
            embed_only=self.encoder,
        )

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load `config.model` and build the engine's parts (`builder.build_parts`; with
        `null_model_step_ms`, `null_setup.build_null_parts`: no model runs)."""
        null = config.null_model_step_ms is not None
        return cls(config, build_null_parts(config) if null else build_parts(config))

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> LLMEngine:
        if model is not None:
            options["model"] = model
        return cls.from_config(EngineConfig(**options))

    # -- requests -----------------------------------------------------------------------
    def make_request(self, gen: GenerationRequest, *, compress: bool = True) -> tuple[Request, str | None]:
        """Validate and tokenise (`InputProcessor.make_request`); raises `InvalidRequestError`
        before anything is allocated. `compress=False`: the shared layout whatever the request or
        engine asks (KV hand-over)."""
        return self.input_processor.make_request(gen, compress=compress)

    @property
    def compressed_capacity_tokens(self) -> int:
        """Tokens one compressed request can hold in every head before any eviction."""
        if self.head_kv is None:
            return 0
        return (self.head_kv.pool.num_blocks // self.head_kv.num_heads) * self.head_kv.block_size

    @property
    def compressed_max_len(self) -> int:
        """The context of a compressed request: the compression pool's, within the model's."""
        return min(self.compressed_capacity_tokens, self.max_positions)

    def _on_finish(self, request: Request) -> None:
        """Every finished request passes here once (`Scheduler.finish_request`, whatever ended it)."""
        if request.lora_name is not None:
            self.adapters.release(request.lora_name)

    def model_info(self) -> dict[str, object]:
        """What `/v1/models` says of the served model: the precision it runs (and why) and the
        generation defaults that fill a request's unset sampling fields."""
        precision = self.precision
        return {
            "dtype": precision.dtype if precision else None,
            "weight_dtype": precision.weight_dtype if precision else None,
            "kv_cache_dtype": self.kv_cache_dtype,
            "quant_types": self.quant_types,  # a GGUF file's stored types, most weights first
            "precision_reason": precision.reason if precision else "",
            "quality": [q.as_stats() for q in precision.quality] if precision else [],
            "generation_defaults": self.generation_defaults.as_dict(),
            "max_model_len": self.max_model_len,
            # what the model does: an encoder only embeds; a decoder generates and embeds
            "tasks": ["embed"] if self.encoder else ["generate", "embed"],
            "pooling": self.pooling.mode,
            "embedding_dimensions": self.model_config.hidden_size,
        }

    def add_request(self, gen: GenerationRequest, *, stream_text: bool = False) -> Request:
        request, prompt = self.make_request(gen)
        final_only, cumulative = not gen.stream, gen.cumulative
        return self.add_prepared(
            request, prompt, stream_text=stream_text, final_only=final_only, cumulative=cumulative
        )

    def add_prepared(
        self, request: Request, prompt: str | None, *, stream_text: bool = False, final_only: bool = False,
        cumulative: bool = True,
    ) -> Request:  # fmt: skip
        """Queue a request built by `make_request` (validated and tokenised once, by the caller).
        `stream_text`: decode text at every step; `final_only`: `step()` returns only the request's
        first output and its last (not `GenerationRequest.stream`); `cumulative`: its namesake's."""
        if request.request_id in self.scheduler.requests or request.request_id in self.families:
            raise InvalidRequestError(
                f"request id {request.request_id!r} is already running", param="request_id"
            )
        if request.lora_name is not None:
            self.adapters.check(request.lora_name)
        children = choice_requests(request) if request.sampling_params.n > 1 else [request]
        for child in children:
            if child.lora_name is not None:
                self.adapters.acquire(child.lora_name)  # raises when it was removed meanwhile
            self.scheduler.add_request(child)
            self.output_processor.add(child, prompt, stream_text, final_only, cumulative)
        if len(children) > 1:
            self.families.add(request.request_id, [c.request_id for c in children])
        return request

    # -- KV hand-over (`self.handover`: kv/handover.py) -----------------------------------------
    def add_prefill_request(self, gen: GenerationRequest) -> Request:
        """Queue `gen` as a prefill (`KVHandover.make_prefill_request`)."""
        return self.add_prepared(*self.handover.make_prefill_request(gen))

    def abort_request(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> RequestOutput | None:
        """Finish a request now; its KV blocks are free when this returns."""
        if request_id in self.families:  # every choice of a request with n > 1
            outputs = [self._finish_one(c, status) for c in self.families.unfinished_children(request_id)]
            parents, _ = self.families.to_parents([o for o in outputs if o is not None])
            return parents[0] if parents else None
        output = self._finish_one(request_id, status)
        if output is None:
            return None
        return self._to_parents([output])[0]

    def _finish_one(self, request_id: str, status: RequestStatus) -> RequestOutput | None:
        request = self.scheduler.finish_request(request_id, status)  # releases its adapter (`_on_finish`)
        if request is None:
            return None
        return self.output_processor.finish(request)

    def _to_parents(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Choices' outputs as their parents' (`ChoiceFamilies`); a choice that failed ends its
        siblings, whose last outputs join the parent's."""
        if not self.families.families:
            return outputs
        parents, to_end = self.families.to_parents(outputs)
        while to_end:
            ended = [self._finish_one(c, RequestStatus.FINISHED_ABORTED) for c in to_end]
            more, to_end = self.families.to_parents([o for o in ended if o is not None])
            parents = merge_by_id(parents, more)
        return parents

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @staticmethod
    def new_request_id() -> str:
        return uuid.uuid4().hex

    # -- the loop -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule, execute, update, outputs (choices mapped to their parents); with a
        `pipeline`, the next step is scheduled while the device runs this one (`step_pipeline.py`)."""
        if self.pipeline is not None:
            return self._to_parents(self.pipeline.step())
        scheduled = self.scheduler.schedule()
        ended = self._end_stale(scheduled.stale_request_ids)
        if not scheduled.is_empty:
            ended += self._execute(scheduled)
        return self._to_parents(ended)

    def _execute(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        """Run a scheduled step and apply it: the requests the runner failed end first (none of
        their tokens is kept), then the others' tokens and outputs."""
        self.output_processor.mark_scheduled(
            [s.request_id for s in scheduled.scheduled if s.is_new], time.monotonic()
        )
        threads = caller_threads = None
        size = 0
        if self.thread_tuner is not None:
            # The tuner's step size leaves drafts out: a decode step of one request is one size
            # whatever the planner drafted (its cost is still over every token computed).
            size = scheduled.num_scheduled_tokens - sum(s.num_draft_tokens for s in scheduled.scheduled)
            threads, caller_threads = self.thread_tuner.choose(size), torch.get_num_threads()
            if threads != caller_threads:
                torch.set_num_threads(threads)  # for this step; the calling thread's count comes back after
        started_wall, started_cpu = time.perf_counter(), time.thread_time()
        try:
            result = self.runner.execute(scheduled)
        finally:
            if threads != caller_threads and caller_threads is not None:
                torch.set_num_threads(caller_threads)
        outputs = self._fail_requests(result, len(scheduled.scheduled))
        outputs += self.outputs(self.scheduler.update_from_output(scheduled, result))
        self.num_steps += 1
        wall = time.perf_counter() - started_wall
        self.step_wall_s += wall
        self.step_thread_cpu_s += time.thread_time() - started_cpu
        if self.thread_tuner is not None and threads is not None:
            self.thread_tuner.observe(size, threads, wall, scheduled.num_scheduled_tokens)
        return outputs

    def outputs(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        """Outputs for applied updates; a request whose stop string the output processor found
        is finished (the same path as every other finish)."""
        outputs, stopped_ids = self.output_processor.process(updates)
        for request_id in stopped_ids:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
        return outputs

    def _fail_requests(self, result: RunnerResult, num_scheduled: int) -> list[RequestOutput]:
        """End the requests the runner could not compute, before their step's results are applied
        (none of their tokens is kept). A model pass that raised for every request alone is the
        runner's fault with several requests or `MAX_CONSECUTIVE_FAILED_STEPS` steps in a row
        (`EngineBrokenError`: the caller fails every request in flight and reports unhealthy)."""
        if result.forward_failed:
            self.num_consecutive_failed_steps += 1
            if num_scheduled > 1 or self.num_consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
                raise EngineBrokenError(
                    f"the model pass failed for every request of the step ({num_scheduled}), each run alone; "
                    f"{self.num_consecutive_failed_steps} such steps in a row"
                )
        else:
            self.num_consecutive_failed_steps = 0
        outputs = []
        for request_id, message in result.failed.items():
            # A constraint the model could not continue is the schema's to fix, not a server fault.
            code = "constraint_failed" if message == GRAMMAR_FAILED else "request_failed"
            output = self._end_with_error(request_id, message, code)
            if output is not None:
                self.num_failed_requests += 1
                outputs.append(output)
        return outputs

    def _end_stale(self, request_ids: list[str]) -> list[RequestOutput]:
        """KV-page integrity: a request the scheduler left out because a block of it was reassigned
        (an allocator bug, a late KV transfer) ends alone, before anything is computed or answered
        from someone else's KV."""
        outputs = []
        for request_id in request_ids:
            logger.error("kv integrity violation; aborting request", extra={"request_id": request_id})
            self.num_kv_integrity_aborts += 1
            output = self._end_with_error(request_id, KV_INTEGRITY_ERROR, "kv_integrity")
            if output is not None:
                outputs.append(output)
        return outputs

    def _end_with_error(self, request_id: str, message: str, code: str) -> RequestOutput | None:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return None
        request.error, request.error_code = message, code
        return self._finish_one(request_id, RequestStatus.FINISHED_ERROR)  # step() maps choices

    def stats(self) -> dict[str, object]:
        """The engine's counters and gauges as one flat JSON object (`EngineStats.as_dict`)."""
        return self.typed_stats().as_dict()

    def typed_stats(self) -> EngineStats:
        """Each component's statistics, read from the component that owns them."""
        precision = self.precision
        scheduler = self.scheduler
        loras = self.adapters.names()
        return EngineStats(
            kv=KVStats.of(self.kv_manager, self.kv_cache_dtype),
            scheduler=SchedulerStats.of(scheduler),
            speculation=SpeculationStats.of(scheduler.speculation),
            runner=self.runner.stats(),
            model={
                "loras_loaded": loras,
                "num_loras_loaded": len(loras),
                "dtype": precision.dtype if precision else None,
                "weight_dtype": precision.weight_dtype if precision else self.config.weight_dtype,
                "precision_reason": precision.reason if precision else "",
                "precision_probe": precision.probe.as_stats() if precision and precision.probe else None,
                "quality_probe": [q.as_stats() for q in precision.quality] if precision else [],
                "generation_defaults": self.generation_defaults.as_dict(),
                "batch_invariant": self.batch_invariance.holds,
                "batch_invariance": self.batch_invariance.reason,
                "role": self.config.role,
                "max_model_len": self.max_model_len,
            },
            counters={
                "num_kv_integrity_aborts": self.num_kv_integrity_aborts,
                "num_failed_requests": self.num_failed_requests,
                "num_steps": self.num_steps + (self.pipeline.num_steps if self.pipeline else 0),
                "num_steps_scheduled_ahead": self.pipeline.num_steps_ahead if self.pipeline else 0,
                "num_steps_chained": self.pipeline.num_steps_chained if self.pipeline else 0,
                "step_wall_s": self.step_wall_s,
                "step_thread_cpu_s": self.step_thread_cpu_s,
            },
            compression=CompressionStats.of(
                self.head_kv, scheduler.head_layout, self.compressed_capacity_tokens
            )
            if self.head_kv is not None
            else None,
            extra=dict(self.grammars.stats()) if self.grammars is not None else {},
        )
