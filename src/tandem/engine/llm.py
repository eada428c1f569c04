"""Offline API: `LLM(model=..., **engine_options).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from tandem.engine.engine import LLMEngine
from tandem.engine.io.generation_defaults import DEFAULTABLE
from tandem.engine.protocol import GenerationRequest, LoRARequest, RequestOutput
from tandem.engine.request import Priority
from tandem.engine.sampling_params import SamplingParams
from tandem.platform.errors import InvalidRequestError

Messages = list[dict[str, Any]]


class LLM:
    """Batch generation in-process. Engine options are `EngineConfig` fields
    (`kv_cache_memory`, `block_size`, `max_num_seqs`, `max_num_batched_tokens`, `max_model_len`,
    `dtype`, `seed`, ...). `model=None` loads the bundled default model."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine.from_options(model, **engine_options)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Sequence[str] | Sequence[list[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Priority = Priority.INTERACTIVE,
        on_output: Callable[[RequestOutput], None] | None = None,
        lora: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); results are in input order.

        `lora`: one adapter for every prompt, or one (or None) per prompt; each is loaded from its
        folder the first time its name is seen (needs `LLM(..., enable_lora=True)`). All prompts
        are validated before any is queued, so one bad prompt adds nothing.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        loras = self._loras_per_prompt(lora, len(prompts))
        requests = [
            GenerationRequest(
                request_id=self.engine.new_request_id(),
                prompt=p if isinstance(p, str) else None,
                prompt_token_ids=None if isinstance(p, str) else list(cast(list[int], p)),
                sampling_params=sp,
                priority=priority,
                lora_name=adapter.name if adapter is not None else None,
            )
            for p, sp, adapter in zip(
                prompts, self._params_per_prompt(sampling_params, len(prompts)), loras, strict=True
            )
        ]
        return self._run(requests, on_output)

    def _loras_per_prompt(
        self, lora: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
    ) -> list[LoRARequest | None]:
        loras = [lora] * num_prompts if lora is None or isinstance(lora, LoRARequest) else list(lora)
        if len(loras) != num_prompts:
            raise InvalidRequestError(
                f"got {len(loras)} LoRA requests for {num_prompts} prompts", param="lora"
            )
        loaded = set(self.engine.adapters.names())
        for adapter in loras:
            if adapter is not None and adapter.name not in loaded:
                self.engine.adapters.add(adapter.name, adapter.path)
                loaded.add(adapter.name)
        return loras

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Chat completion for one conversation or a list of them (model's chat template)."""
        conversations: list[Messages] = (
            [messages] if messages and isinstance(messages[0], dict) else list(messages)  # type: ignore[list-item,arg-type]
        )
        requests = [
            GenerationRequest(request_id=self.engine.new_request_id(), messages=conv, sampling_params=sp)
            for conv, sp in zip(
                conversations, self._params_per_prompt(sampling_params, len(conversations)), strict=True
            )
        ]
        return self._run(requests, None)

    def stats(self) -> dict[str, object]:
        return self.engine.stats()

    @staticmethod
    def _params_per_prompt(
        params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None:  # the checkpoint's generation defaults, as vLLM's LLM does
            return [SamplingParams(model_defaults=DEFAULTABLE) for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return list(params)

    def _run(
        self, requests: list[GenerationRequest], on_output: Callable[[RequestOutput], None] | None
    ) -> list[RequestOutput]:
        prepared = [self.engine.make_request(r) for r in requests]  # all validated before any is queued
        order = {r.request_id: i for i, r in enumerate(requests)}
        for request, prompt in prepared:
            streamed = on_output is not None
            self.engine.add_prepared(request, prompt, stream_text=streamed, final_only=not streamed)
        results: list[RequestOutput | None] = [None] * len(requests)
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if on_output is not None:
                        on_output(output)
                    if output.finished:
                        results[order[output.request_id]] = output
        finally:
            for request_id, index in order.items():  # interrupted (e.g. KeyboardInterrupt): free the blocks
                if results[index] is None:
                    self.engine.abort_request(request_id)
        return [r for r in results if r is not None]
