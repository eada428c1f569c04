"""`ModelRunner`: turns a `SchedulerOutput` into tensors, runs the model, samples.

Owns everything torch: the models, the paged KV tensors (`kv_tensors`), the head-block pool of
compressed requests (`compressed`), per-request sampling state (`sampler`, `constraints`) and the
draft model's cache. The engine sees only the `Runner` protocol (`step.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from tandem.engine.lora.manager import LoRAManager, LoRAStep
from tandem.engine.models.interface import CausalLM
from tandem.engine.models.moe_layer import routed_tokens
from tandem.engine.models.native import NativeLlama, NativeStep
from tandem.engine.models.pooling import Pooling
from tandem.engine.runner.compiled_decode import CompiledDecode
from tandem.engine.runner.compressed import HeadPool, HeadPoolForward
from tandem.engine.runner.constraints import GrammarMasks
from tandem.engine.runner.decode_graphs import DecodeGraphs, graph_batch_sizes
from tandem.engine.runner.draft import PagedDraftCache
from tandem.engine.runner.draft_steps import DraftSteps
from tandem.engine.runner.embedder import Embedder, step_rows
from tandem.engine.runner.forward_path import ForwardPath, RunnerPaths, StepShape, choose_path
from tandem.engine.runner.kv_tensors import (
    PAGE_DTYPES,
    KVCacheSpec,
    allocate_kv_caches,
    export_pages,
    import_pages,
)
from tandem.engine.runner.sampler import Sampler, failed_alone
from tandem.engine.sched.step import RunnerResult, RunnerStats, ScheduledRequest, SchedulerOutput
from tandem.engine.structured.grammar import GrammarCompiler
from tandem.kernels.attention_metadata import build_attention_metadata
from tandem.kernels.kv_eviction import EvictionPolicy

logger = logging.getLogger("tandem.engine.runner")


class ModelRunner:
    """`decode_model` (optional, e.g. an INT4 copy of `model` sharing nothing but the cache)
    serves decode steps of at most `decode_model_max_batch` requests; `native_decoder` allows
    the native stack over its INT4 linears, `compile_decode` a compiled graph of it
    (`forward_path` says which step takes which). `grammars` compiles requests' output
    constraints (`constraints`). `num_head_blocks` > 0 allocates the head-block pool of
    compressed requests, and `eviction` decides what their heads keep (`compressed`).
    `decode_graphs`: "capture" replays decode steps of up to `graph_max_batch` requests from
    CUDA graphs (`decode_graphs`; captured by `capture_graphs`), "eager" runs the same static
    buffers without capturing (tests), "off" neither. Graphs need the Triton attention path,
    one model (no separate decode model) and no draft. `batch_invariant`: every row of the
    shared layout through one path and row-wise attention (`forward_path`; the model's linears
    are made row-invariant by `batch_invariance.make_batch_invariant` before). `pooling`: how an
    embedding request's hidden states become its embedding (`Embedder`; default: the last token)."""

    def __init__(
        self,
        model: CausalLM,
        kv_spec: KVCacheSpec,
        num_blocks: int,
        device: torch.device,
        seed: int = 0,
        lora: LoRAManager | None = None,
        compile_decode: bool = False,
        decode_model: CausalLM | None = None,
        decode_model_max_batch: int = 0,
        draft: PagedDraftCache | None = None,
        native_decoder: bool = True,
        grammars: GrammarCompiler | None = None,
        num_head_blocks: int = 0,
        eviction: EvictionPolicy | None = None,
        decode_graphs: str = "off",
        graph_max_batch: int = 0,
        max_model_len: int = 0,
        batch_invariant: bool = False,
        pooling: Pooling | None = None,
    ) -> None:
        self.model = model
        self.batch_invariant = batch_invariant
        self.decode_model = decode_model or model
        self.decode_model_max_batch = decode_model_max_batch if decode_model is not None else 1 << 30
        self.compiled = CompiledDecode(self.decode_model.forward, device) if compile_decode else None
        self.num_compiled_steps = self.num_decode_model_steps = self.num_native_steps = 0
        self.lora = lora
        self.kv_spec = kv_spec
        self.device = device
        self.overlappable = device.type == "cuda"  # steps on a device thread (`step_pipeline.py`)
        self.block_size = kv_spec.block_size
        self.kv_caches = allocate_kv_caches(kv_spec, num_blocks, device)
        self.native: NativeLlama | None = None
        self.native_unavailable_reason = "disabled (native_decoder=False)"
        if native_decoder and self.compiled is None:
            self.native_unavailable_reason = NativeLlama.unsupported_reason(self.decode_model, self.kv_caches)
            self.native = NativeLlama.build(self.decode_model, self.kv_caches, self.block_size)
        self.draft = draft
        self.drafting = DraftSteps(draft) if draft is not None else None
        self.vocab_size = model.config.vocab_size
        self.masks = GrammarMasks(grammars)
        self.sampler = Sampler(device, seed, self.masks)
        self.heads = (
            HeadPoolForward.build(
                num_head_blocks, kv_spec, self.model, self.decode_model, self.native, eviction, device
            )
            if num_head_blocks > 0
            else None
        )
        self.graphs: DecodeGraphs | None = None
        if decode_graphs != "off" and graph_max_batch > 0 and decode_model is None and draft is None:
            self.graphs = DecodeGraphs(
                self.model.forward, self.kv_caches, self.block_size, max_model_len,
                graph_batch_sizes(graph_max_batch), device,
            )  # fmt: skip
        self._capture_graphs = decode_graphs == "capture"
        self.embedder = Embedder(model, pooling or Pooling(), device)

    # -- what the engine reads (`Runner` protocol) -------------------------------------------------
    @property
    def has_draft(self) -> bool:
        return self.draft is not None

    def bind_thread(self) -> None:
        """Make the calling thread's current CUDA device the runner's (a device thread's start)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def stats(self) -> RunnerStats:
        return RunnerStats(
            native_decoder=self.native is not None,
            num_native_decoder_steps=self.num_native_steps,
            num_graph_steps=self.graphs.num_replays if self.graphs is not None else 0,
            draft_wall_s=self.drafting.draft_wall_s if self.drafting is not None else 0.0,
            grammar_mask_s=self.masks.mask_s,
            expert_tokens=routed_tokens(self.model),
        )

    @property
    def paths(self) -> RunnerPaths:
        return RunnerPaths(
            native=self.native is not None,
            native_heads=self.heads is not None and self.heads.native_heads is not None,
            compiled=self.compiled is not None,
            separate_decode_model=self.decode_model is not self.model,
            decode_model_max_batch=self.decode_model_max_batch,
            graph_max_batch=self.graphs.max_batch if self.graphs is not None else 0,
            batch_invariant=self.batch_invariant,
        )

    # Views of the head-block pool (tests and the fault hook read them).
    @property
    def head_pool(self) -> HeadPool | None:
        return self.heads.pool if self.heads is not None else None

    @property
    def native_heads(self) -> NativeLlama | None:
        return self.heads.native_heads if self.heads is not None else None

    @property
    def num_native_head_steps(self) -> int:
        return self.heads.num_native_steps if self.heads is not None else 0

    @property
    def compiles_decode(self) -> bool:
        return self.compiled is not None

    # -- KV pages for hand-over (kv_transfer.py) -------------------------------------------------
    def export_pages(self, block_ids: list[int], num_tokens: int, dtype_name: str) -> list[bytes]:
        """The KV of the first `num_tokens` tokens in `block_ids`, a page per block, in `dtype_name`."""
        return export_pages(self.kv_caches, self.block_size, block_ids, num_tokens, PAGE_DTYPES[dtype_name])

    def import_pages(self, block_ids: list[int], pages: list[tuple[int, bytes]]) -> None:
        """Write pages (token count, bytes in this cache's dtype) into `block_ids`, in order."""
        import_pages(self.kv_caches, self.kv_spec, block_ids, pages)

    def imported_prompt(self, request_id: str, first_position: int, num_tokens: int) -> None:
        """A request whose prompt KV (first_position..num_tokens-1) another engine computed: no target
        states exist for it, so a draft head catches up on it from zero states (never on the shared
        prefix blocks before it, whose head KV their filler wrote)."""
        if self.draft is not None and self.draft.wants_hidden and num_tokens > first_position:
            width = self.model.config.hidden_size * max(1, len(self.draft.hidden_layers))
            zeros = torch.zeros(num_tokens - first_position, width, device=self.device)
            self.draft.record(request_id, first_position, self.draft.prepare_states(zeros))

    # -- one step --------------------------------------------------------------------------------
    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.sampler.forget(request_id)
            if self.heads is not None:
                self.heads.forget(request_id)
        if self.draft is not None:
            self.draft.forget(request_ids)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerResult:
        """Run one step. Failure is per request: a request whose rows break the step (its
        sampling parameters, its adapter, its logits) is reported in `RunnerResult.failed` and the
        others are computed. When the batched step raises, each request is rerun alone (its KV
        slots are rewritten with the same values) to find the ones that fail. When the model pass
        raised for every request alone, `forward_failed` says so, and the engine decides whether
        the runner itself is broken. `RunnerResult.wall_s` is the step's wall time."""
        started = time.perf_counter()
        self.forget(sched.finished_request_ids)
        if self.heads is not None:
            if sched.head_move_src_slots:  # evictions, before any write
                self.heads.move(sched.head_move_src_slots, sched.head_move_dst_slots)
            for request_id in sched.preempted_request_ids:  # its head tokens are recomputed anew
                self.heads.forget(request_id)
        if self.draft is not None:  # a preempted request's draft KV went with its blocks
            self.draft.forget(sched.preempted_request_ids)
        result = self._execute_isolated(sched.scheduled)
        result.wall_s = time.perf_counter() - started
        return result

    def _execute_isolated(self, items: list[ScheduledRequest]) -> RunnerResult:
        try:
            return self._execute(items)
        except Exception:
            if len(items) == 1:
                return dataclasses.replace(failed_alone(items[0]), forward_failed=True)
            logger.warning(
                "step failed; rerunning its requests one by one", extra={"num_requests": len(items)}
            )
        result = RunnerResult({})
        num_raised = 0
        for item in items:
            try:
                result.merge(self._execute([item]))
            except Exception:
                result.merge(failed_alone(item))
                num_raised += 1
        result.forward_failed = num_raised == len(items)
        return result

    def _execute(self, items: list[ScheduledRequest]) -> RunnerResult:
        """Embedding requests' rows in a forward of their own (`Embedder`), the others by layout."""
        embeds = [item for item in items if item.embed]
        if not embeds:
            return self._execute_layouts(items)
        _, hidden = self._torch_forward(
            ForwardPath.MODEL, embeds, *self.embedder.rows(embeds), self._lora_step(embeds), True, ()
        )
        result = RunnerResult({}, embeddings=self.embedder.pool(embeds, hidden))
        if len(embeds) < len(items):
            result.merge(self._execute_layouts([item for item in items if not item.embed]))
        return result

    def _execute_layouts(self, items: list[ScheduledRequest]) -> RunnerResult:
        """Shared-layout rows in one forward, compressed requests' rows in another."""
        compressed = [item for item in items if item.is_compressed]
        if not compressed:
            return self._execute_shared(items)
        if self.heads is None:
            raise RuntimeError("a compressed request reached a runner without a head-block pool")
        path = choose_path(self.heads.shape_of(compressed), self.paths)
        result = self.heads.execute(
            compressed, path, self.kv_caches, lambda i, logits: self._finish(i, logits, None, {})
        )
        if len(compressed) < len(items):
            result.merge(self._execute_shared([item for item in items if not item.is_compressed]))
        return result

    def _execute_shared(self, items: list[ScheduledRequest]) -> RunnerResult:
        draft_probs: dict[str, torch.Tensor] = {}
        if self.draft is not None and any(item.num_draft_slots for item in items):
            assert self.drafting is not None
            items, draft_probs = self.drafting.propose(items, self.sampler.generator_for)
        logits, states = self.forward_shared(items)
        return self._finish(items, logits, states, draft_probs)

    def forward_shared(self, items: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of shared-layout rows: the logits of every sampled row (each request's
        last token and its drafts) and, for a draft head, the hidden states."""
        input_ids, positions, logits_rows = step_rows(items)
        lora_step = self._lora_step(items)
        shape = StepShape(
            num_requests=len(items),
            num_rows=len(input_ids),
            decoding=all(item.sample and len(item.token_ids) == 1 + item.num_draft_tokens for item in items),
            has_lora=lora_step is not None,
            has_multi_row=any(len(item.token_ids) > 1 for item in items),
        )
        path = choose_path(shape, self.paths)
        hidden = self.draft.wants_hidden if self.draft is not None else False
        hidden_layers = self.draft.hidden_layers if self.draft is not None else ()
        rows = torch.tensor(logits_rows, dtype=torch.int64, device=self.device)
        self._count(path)
        if path is ForwardPath.GRAPH:
            assert self.graphs is not None
            return self.graphs.run(input_ids, positions, [item.block_ids for item in items]), None
        if path is ForwardPath.NATIVE:
            assert self.native is not None
            step = NativeStep.build(
                [i.token_ids for i in items],
                [i.start_position for i in items],
                [i.block_ids for i in items],
                self.block_size,
            )
            output = self.native.forward(step, rows, return_hidden=hidden, hidden_layers=hidden_layers)
        else:
            output = self._torch_forward(
                path, items, input_ids, positions, rows, lora_step, hidden, hidden_layers
            )
        return output if hidden else (output, None)

    def _torch_forward(
        self,
        path: ForwardPath,
        items: list[ScheduledRequest],
        input_ids: list[int],
        positions: list[int],
        rows: torch.Tensor,
        lora_step: LoRAStep | None,
        hidden: bool,
        hidden_layers: tuple[int, ...],
    ) -> Any:
        """The model's own forward (eager, compiled, or the decode model's) over paged attention."""
        metadata = build_attention_metadata(
            [item.block_ids for item in items],
            [len(item.token_ids) for item in items],
            [item.start_position + len(item.token_ids) for item in items],
            self.block_size,
            self.kv_spec.num_kv_heads,
            self.device,
            every_row_native=self.batch_invariant,
        )
        forward = self.model.forward
        if path is ForwardPath.COMPILED:
            assert self.compiled is not None
            forward = self.compiled.forward
        elif path is ForwardPath.DECODE_MODEL:
            forward = self.decode_model.forward
        output = forward(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self.kv_caches,
            metadata,
            rows,
            lora=lora_step,
            return_hidden=hidden,
            hidden_layers=hidden_layers,
        )
        return output

    def _count(self, path: ForwardPath) -> None:
        if path in (ForwardPath.NATIVE, ForwardPath.COMPILED, ForwardPath.DECODE_MODEL):
            self.num_decode_model_steps += 1
        self.num_native_steps += path is ForwardPath.NATIVE
        self.num_compiled_steps += path is ForwardPath.COMPILED

    def _lora_step(self, items: list[ScheduledRequest]) -> LoRAStep | None:
        """The adapters' per-row slots for this step, or None when no row runs an adapter."""
        lora_names = {item.lora_name for item in items if item.lora_name is not None}
        if self.lora is None or not lora_names:
            return None
        slot_of = self.lora.slots_for_step(lora_names)
        token_slots: list[int] = []
        for item in items:
            token_slots.extend([slot_of[item.lora_name] if item.lora_name else -1] * len(item.token_ids))
        return LoRAStep(self.lora.slots, torch.tensor(token_slots, device=self.device))

    def _finish(
        self,
        items: list[ScheduledRequest],
        logits: torch.Tensor,
        hidden: torch.Tensor | None,
        draft_probs: dict[str, torch.Tensor],
    ) -> RunnerResult:
        """Sample (and verify drafts) from a forward's logits; tell the draft model what was
        accepted and hand a draft head its states."""
        result = self.sampler.sample(logits, [item for item in items if item.sample], draft_probs)
        if self.drafting is not None:
            self.drafting.observe(items, result, hidden)
        return result

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture the decode graphs (with `decode_graphs="capture"`); on failure, decode stays eager."""
        if self.graphs is None or not self._capture_graphs:
            return
        try:
            self.graphs.capture()
        except Exception as exc:  # noqa: BLE001 - any capture failure means: stay eager
            logger.warning(
                "decode graph capture failed; decode steps run eagerly",
                extra={"error": f"{type(exc).__name__}: {exc}"[:500]},
            )
            self.graphs = None

    def warmup_decode(self, batch_sizes: tuple[int, ...] = (1, 2)) -> None:
        """Compile the decode graph before the first request (`CompiledDecode.warm_up`); on any
        compile error, decode stays eager."""
        if self.compiled is not None and not self.compiled.warm_up(
            self.kv_caches, self.kv_spec.num_kv_heads, self.block_size, self.draft, batch_sizes
        ):
            self.compiled = None
