"""Grammar-constrained decoding: compiled grammars cached by spec, one matcher per request.

A request whose `SamplingParams.structured` is set gets a `GrammarMatcher`: before each of its
tokens is sampled, the matcher gives the set of tokens the grammar allows next (a bitmask over the
vocabulary), the runner sets every other logit to the lowest value, and the sampled tokens are fed
back to the matcher. A finished grammar allows only the end-of-sequence tokens, so the request
stops there. Rows without a constraint are untouched.

The library is llguidance (Microsoft, MIT): a small abi3 CPU wheel with no dependencies, fast
masks for JSON schemas (figures: docs/performance.md), JSON schema, regex
and Lark grammars (which can inline JSON schemas, used for tool calls). Against it: xgrammar
0.2.9's wheel requires triton and apache-tvm-ffi (hundreds of MB, for a CPU host), and
outlines-core compiles each schema to a regex index up front (seconds for large schemas) and has
no context-free grammars.

Contracts:
- `GrammarCompiler.compile` validates a spec and caches its compiled matcher (an LRU of
  `cache_size` specs); it raises `InvalidRequestError` naming the spec's request field for a
  schema or grammar the library refuses. It is thread-safe: the async engine compiles new specs
  in a worker thread, never on the engine's loop, and the runner only deep-copies cached ones.
- A `GrammarMatcher` changes state only in `accept`; the draft masks roll back what they consume.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Any, cast

import llguidance as llg
import torch

from tandem.engine.io.tokenizer import Tokenizer
from tandem.engine.sampling_params import JSON_GRAMMAR_OPTIONS, StructuredOutput
from tandem.engine.structured.schema_check import finite_value_problem
from tandem.platform.errors import InvalidRequestError


def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for `spec` (not validated yet); `InvalidRequestError` for a value that
    is not of its kind."""
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.value)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(
                f"{spec.param}: the schema is not valid JSON ({exc})", param=spec.param
            ) from exc
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{spec.param}: the schema must be a JSON object", param=spec.param)
        problem = finite_value_problem(schema)
        if problem is not None:
            raise InvalidRequestError(f"{spec.param}: {problem}", param=spec.param)
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=cast(Any, JSON_GRAMMAR_OPTIONS))
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "lark":
        return llg.LLMatcher.grammar_from_lark(spec.value)
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError(
                f"{spec.param}: choices must be a non-empty list of non-empty strings", param=spec.param
            )
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    raise InvalidRequestError(f"{spec.param}: unknown constraint kind {spec.kind!r}", param=spec.param)


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: llg.LLMatcher, num_words: int, eos_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.num_words = num_words  # int32 words per bitmask row: ceil(vocab / 32)
        self.eos_token_ids = eos_token_ids

    @property
    def error(self) -> str | None:
        """Why the matcher cannot go on (a token it refused, a parser limit), or None."""
        return self.matcher.get_error() or None if self.matcher.is_error() else None

    def accept(self, token_ids: list[int]) -> bool:
        """Advance past `token_ids` (sampled under this matcher's masks); False when refused.
        A finished grammar (stopped) allows only an end-of-sequence token, which ends the request
        and is not fed to the library (it refuses any token once stopped)."""
        for token_id in token_ids:
            if self.matcher.is_stopped():
                return token_id in self.eos_token_ids
            if not self.matcher.consume_token(token_id):
                return False
        return True

    def fill_bitmask(self, out: torch.Tensor) -> None:
        """out: [num_words] int32, contiguous, on the CPU: the tokens allowed next."""
        self.matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)

    def draft_bitmasks(self, draft_token_ids: list[int]) -> tuple[torch.Tensor, int]:
        """Masks for a step that verifies drafts: row 0 allows the next token now, row i + 1 the
        one after drafts[: i + 1]. Drafts stop at the first the grammar refuses (nothing after it
        can be accepted), and before the first end-of-sequence draft (the library does not count
        a consumed EOS in its rollback; the last row allows EOS where the grammar can end, so the
        target still may end there), so the result is [num_valid + 1, num_words] and num_valid. The
        state is the same afterwards."""
        limit = next(
            (i for i, t in enumerate(draft_token_ids) if t in self.eos_token_ids), len(draft_token_ids)
        )
        num_valid = self.matcher.validate_tokens(draft_token_ids[:limit]) if limit else 0
        masks = torch.empty(num_valid + 1, self.num_words, dtype=torch.int32)
        self.fill_bitmask(masks[0])
        for index, token_id in enumerate(draft_token_ids[:num_valid]):
            if not self.matcher.consume_token(token_id):  # validated above: a library fault
                raise RuntimeError(f"grammar refused a validated draft token ({self.matcher.get_error()})")
            self.fill_bitmask(masks[index + 1])
        if num_valid:
            self.matcher.rollback(num_valid)
        return masks, num_valid


class GrammarCompiler:
    """Compiles `StructuredOutput` specs for one tokenizer, caches them, hands out matchers."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        cache_size: int = 256,
    ) -> None:
        """`vocab_size` is the model's (the logits' width; tokens past the tokenizer's are never
        allowed). The library's tokenizer is built on first use."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.num_words = (vocab_size + 31) // 32
        self.cache_size = cache_size
        self._llg_tokenizer: llg.LLTokenizer | None = None
        self._executor: llg.LLExecutor | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, llg.LLMatcher] = OrderedDict()
        self.num_compiled = 0
        self.num_cache_hits = 0
        self.compile_s = 0.0

    @property
    def llg_tokenizer(self) -> llg.LLTokenizer:
        with self._lock:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = llg.LLTokenizer(
                    self.tokenizer.backend.to_str(),
                    n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids or None,
                )
            return self._llg_tokenizer

    def is_cached(self, spec: StructuredOutput) -> bool:
        with self._lock:
            return spec in self._cache

    def compile(self, spec: StructuredOutput) -> llg.LLMatcher:
        """The compiled matcher of `spec` in its start state (cached; do not advance it)."""
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
                self.num_cache_hits += 1
                return template
        started = time.perf_counter()
        tokenizer = self.llg_tokenizer
        try:
            grammar = grammar_text(spec)
        except InvalidRequestError:  # named the field already
            raise
        except ValueError as exc:  # the library's refusal of the value itself
            raise InvalidRequestError(f"{spec.param}: {exc}", param=spec.param) from exc
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise InvalidRequestError(f"{spec.param}: {_first_line(messages)}", param=spec.param)
        template = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidRequestError(
                f"{spec.param}: {_first_line([template.get_error()])}", param=spec.param
            )
        with self._lock:
            self.compile_s += time.perf_counter() - started
            self.num_compiled += 1
            self._cache[spec] = template
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return template

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for one request (a copy of the compiled one)."""
        return GrammarMatcher(self.compile(spec).deep_copy(), self.num_words, frozenset(self.eos_token_ids))

    def fill_bitmasks(self, matchers: list[GrammarMatcher]) -> torch.Tensor:
        """[len(matchers), num_words] int32: each matcher's next-token mask, computed in parallel
        by the library's thread pool."""
        masks = torch.empty(len(matchers), self.num_words, dtype=torch.int32)
        if len(matchers) == 1:
            matchers[0].fill_bitmask(masks[0])
            return masks
        if self._executor is None:
            self._executor = llg.LLExecutor()
        self._executor.unsafe_compute_mask_ptr(
            [(m.matcher, row) for row, m in enumerate(matchers)],
            masks.data_ptr(),
            self.num_words * 4,
            len(matchers),
        )
        return masks

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {
                "num_grammars_compiled": self.num_compiled,
                "num_grammar_cache_hits": self.num_cache_hits,
                "grammar_compile_s": round(self.compile_s, 4),
                "num_grammars_cached": len(self._cache),
            }


def _first_line(messages: list[str]) -> str:
    """The library's message without its parser-state dump (kept short for a 400)."""
    text = (messages[0] if messages else "the grammar is invalid").strip()
    return text.splitlines()[0][:500] if text else "the grammar is invalid"
