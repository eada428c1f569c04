"""`InputProcessor`: a `GenerationRequest` into a validated, tokenised `Request` (`LLMEngine.make_request`).

Everything a client can get wrong is refused here with an `InvalidRequestError` naming the
parameter (or a `ContextLengthExceededError`), before any block is allocated: exactly one prompt
form, token ids within the vocabulary, the context left for `max_tokens`, the adapter, the
output constraint (compiled, so a bad schema is a 400), and KV compression's requirements.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tandem.engine.io.generation_defaults import GenerationDefaults
from tandem.engine.io.tokenizer import Tokenizer
from tandem.engine.protocol import GenerationRequest
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams, StructuredOutput
from tandem.platform.errors import ContextLengthExceededError, InvalidRequestError


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        generation_defaults: GenerationDefaults,
        *,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        compressed_max_len: int,
        kv_compression_rate: float | None,
        has_compression_pool: bool,
        check_lora: Callable[[str], None],
        compile_grammar: Callable[[StructuredOutput], object] | None,
        whole_prompt_max_tokens: int | None = None,
        embed_only: bool = False,
    ) -> None:
        """`max_model_len` / `compressed_max_len`: the context of a request in the shared cache /
        the compression pool; `kv_compression_rate`: the engine's default; `check_lora` raises
        for an adapter that is not loaded; `compile_grammar` (None: no structured output)
        compiles an output constraint, raising `InvalidRequestError` for a bad one.
        `whole_prompt_max_tokens`: embedding prompts run whole in one step, at most this long (an
        encoder's, or a pooling that reads every row; None: they are chunked). `embed_only`: the
        model does not generate (an encoder)."""
        self.whole_prompt_max_tokens = whole_prompt_max_tokens
        self.embed_only = embed_only
        self.tokenizer = tokenizer
        self.generation_defaults = generation_defaults
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.compressed_max_len = compressed_max_len
        self.kv_compression_rate = kv_compression_rate
        self.has_compression_pool = has_compression_pool
        self.check_lora = check_lora
        self.compile_grammar = compile_grammar

    def make_request(self, gen: GenerationRequest, *, compress: bool = True) -> tuple[Request, str | None]:
        """Validate and tokenise; raises `InvalidRequestError` before anything is allocated.
        `compress=False`: the shared layout whatever the request or engine asks (KV hand-over)."""
        if self.embed_only and not gen.embed:
            raise InvalidRequestError(
                "this model is an encoder: it embeds text (/v1/embeddings) and does not generate",
                param="model",
            )
        token_ids, prompt = self._prompt_token_ids(gen)
        if gen.embed:
            return self._embedding_request(gen, token_ids), prompt
        params = self.generation_defaults.apply(gen.sampling_params)
        vocab = self.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError(
                f"stop_token_ids must be token ids of this model: in [0, {vocab})", param="stop_token_ids"
            )
        rate = (
            params.kv_compression_rate if params.kv_compression_rate is not None else self.kv_compression_rate
        )
        compressed = compress and rate is not None and rate > 1.0
        if compressed:
            params = self._check_compression(params, gen)
        params = self._with_max_tokens(params, gen, len(token_ids), compressed)
        if gen.lora_name is not None:
            self.check_lora(gen.lora_name)
        if params.structured is not None:
            if self.compile_grammar is None:
                raise InvalidRequestError(
                    "this engine has no grammar support for structured output", param=params.structured.param
                )
            self.compile_grammar(params.structured)  # 400 for a bad schema; cached for the runner
        request = Request(
            request_id=gen.request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            priority=gen.priority,
            tenant_id=gen.tenant_id,
            tenant_weight=gen.tenant_weight,
            lora_name=gen.lora_name,
            kv_compression_rate=rate if compressed else None,
        )
        return request, prompt

    def _embedding_request(self, gen: GenerationRequest, token_ids: list[int]) -> Request:
        """An embedding request: its prompt within the context (an encoder's: within one step),
        nothing to generate."""
        limit = self.max_model_len
        if self.whole_prompt_max_tokens is not None:
            limit = min(limit, self.whole_prompt_max_tokens)
        if len(token_ids) > limit:
            raise ContextLengthExceededError(
                f"the input has {len(token_ids)} tokens; this model embeds at most {limit} tokens at once",
                param="input",
            )
        if gen.lora_name is not None:
            self.check_lora(gen.lora_name)
        return Request(
            request_id=gen.request_id,
            prompt_token_ids=token_ids,
            sampling_params=SamplingParams(max_tokens=1, temperature=0.0, speculative=False),
            priority=gen.priority,
            tenant_id=gen.tenant_id,
            tenant_weight=gen.tenant_weight,
            lora_name=gen.lora_name,
            embed=True,
            whole_prompt=self.whole_prompt_max_tokens is not None,
        )

    def _prompt_token_ids(self, gen: GenerationRequest) -> tuple[list[int], str | None]:
        """The prompt's token ids (tokenised from text or messages, or checked as given) and its
        text (None when given as ids)."""
        given = [x is not None for x in (gen.prompt, gen.prompt_token_ids, gen.messages)]
        if sum(given) != 1:
            raise InvalidRequestError(
                "give exactly one of prompt, prompt_token_ids or messages", param="prompt"
            )
        if gen.messages is not None:
            if not gen.messages:
                raise InvalidRequestError("messages must not be empty", param="messages")
            prompt = self.tokenizer.apply_chat_template(gen.messages, add_generation_prompt=True)
            return self.tokenizer.encode(prompt, add_special_tokens=False), prompt
        if gen.prompt is not None:
            if not isinstance(gen.prompt, str) or not gen.prompt:
                raise InvalidRequestError("prompt must be a non-empty string", param="prompt")
            return self.tokenizer.encode(gen.prompt), gen.prompt
        token_ids = list(gen.prompt_token_ids or [])
        if not token_ids:
            raise InvalidRequestError("prompt_token_ids must not be empty", param="prompt")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        return token_ids, None

    def _with_max_tokens(
        self,
        params: SamplingParams,
        gen: GenerationRequest,
        num_prompt_tokens: int,
        compressed: bool,
    ) -> SamplingParams:
        """`params` with `max_tokens` resolved against the context left after the prompt. A
        compressed request must fit the compression pool alone before eviction (so it can always
        run); the others, the shared cache."""
        context = self.compressed_max_len if compressed else self.max_model_len
        if num_prompt_tokens >= context:
            raise ContextLengthExceededError(
                f"the prompt has {num_prompt_tokens} tokens; this model's context is {context} tokens "
                f"{'(the KV compression pool) ' if compressed else ''}and at least one must be left to generate"
            )
        remaining = context - num_prompt_tokens
        if params.max_tokens is None:  # the request's default, the checkpoint's, what the context leaves
            defaults = (gen.default_max_tokens, self.generation_defaults.max_tokens)
            return dataclasses.replace(
                params, max_tokens=min([remaining, *(d for d in defaults if d is not None)])
            )
        if params.max_tokens > remaining:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {context} tokens; the prompt has "
                f"{num_prompt_tokens} and max_tokens asks for {params.max_tokens} more. Reduce the prompt or "
                f"max_tokens (at most {remaining} here), or leave max_tokens out",
                param="max_tokens",
            )
        return params

    def _check_compression(self, params: SamplingParams, gen: GenerationRequest) -> SamplingParams:
        """A compressed request needs the head-block pool and no adapter; it does not speculate
        (its heads keep different tokens)."""
        if not self.has_compression_pool:
            raise InvalidRequestError(
                "this engine has no KV compression pool; start it with kv_compression_rate or "
                "enable_kv_compression=True",
                param="kv_compression_rate",
            )
        if gen.lora_name is not None:
            raise InvalidRequestError(
                "KV compression cannot be combined with a LoRA adapter yet", param="kv_compression_rate"
            )
        return dataclasses.replace(params, speculative=False)
