"""Per-request sampling parameters, validated on construction (no torch)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from tandem.platform.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_N = 128  # choices per request (OpenAI's limit)
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 16, 1000  # stop strings are searched for at every step
# A seed is what `torch.Generator.manual_seed` takes: any signed or unsigned 64-bit integer.
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1
# Integer fields that reach tensors (top_k, token ids) stay in the range of a signed 32-bit int.
MAX_INT32 = (1 << 31) - 1
MAX_REPETITION_PENALTY = 10.0


# JSON under a constraint is written as Python's json.dumps writes it: fixed separators and no
# other whitespace (a small model given free whitespace can spend its whole budget on newlines).
# llguidance's JSON options; also given inline (`x-guidance`) to schemas inside Lark grammars.
JSON_GRAMMAR_OPTIONS: dict[str, object] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

StructuredKind = Literal["json_schema", "regex", "lark", "choice"]


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text, enforced token by token (engine/structured/grammar.py).

    `kind` says what `value` holds: a JSON schema as JSON text (`{"type": "object"}` is any JSON
    object), a regular expression (Rust `regex` syntax), a Lark grammar in llguidance's dialect
    (which can inline JSON schemas with `%json {...}`), or a JSON list of strings to choose from.
    Equal specs share one compiled grammar. `param` names the request field it came from, so a
    grammar that does not compile is a 400 naming that field (it is not part of the identity).
    """

    kind: StructuredKind
    value: str
    param: str = field(default="response_format", compare=False)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    Defaults follow vLLM: temperature 1.0, max_tokens 16. `temperature` below 1e-5 (0 included) means greedy.
    `model_defaults` names the fields a client left unset (the OpenAI mapping sets it): the
    engine fills them from the checkpoint's generation defaults (`GenerationDefaults.apply`), and
    until then they hold the neutral values below.
    A prompt plus an explicit `max_tokens` must fit the model's context (else
    `ContextLengthExceededError`); `max_tokens=None` asks for what the context leaves, capped by the
    request's `default_max_tokens`.
    Invalid values raise `InvalidRequestError` naming the field, before anything is allocated.
    """

    max_tokens: int | None = 16  # None: the request's `default_max_tokens`, within the context
    n: int = 1  # choices to generate for the prompt (parallel_sampling.py), computed once
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (0: only the sampled token's)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF / vLLM: a logit of a token already in the prompt or output is divided by this where
    # positive, multiplied where negative (1: off)
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    speculative: bool = True  # False: never verify draft tokens for this request
    structured: StructuredOutput | None = None  # constrain the output (JSON schema, regex, grammar)
    # Compress this request's KV cache by per-head eviction at this rate (>= 1; 1: no eviction);
    # None: the engine's `kv_compression_rate`. Needs an engine started with KV compression.
    kv_compression_rate: float | None = None
    model_defaults: frozenset[str] = frozenset()  # fields the checkpoint's defaults fill (see above)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {message}", param=param)

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")
        if self.max_tokens is not None and (
            _not_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT32
        ):
            raise bad("max_tokens", f"must be an integer in [1, {MAX_INT32}], got {self.max_tokens!r}")
        if _not_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if _not_int(self.top_k) or not 0 <= self.top_k <= MAX_INT32:
            raise bad("top_k", f"must be 0 or -1 (disabled) or a positive integer, got {self.top_k}")
        if self.seed is not None and (_not_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED):
            raise bad("seed", f"must be an integer in [{MIN_SEED}, {MAX_SEED}], got {self.seed!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise bad(
                "repetition_penalty",
                f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}",
            )
        if self.logprobs is not None and (_not_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        self._validate_stops_and_constraints()

    def _validate_stops_and_constraints(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {message}", param=param)

        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise bad(
                "stop", f"may hold at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters"
            )
        if any(_not_int(t) or not 0 <= t <= MAX_INT32 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be integers in [0, {MAX_INT32}]")
        rate = self.kv_compression_rate
        if rate is not None and (
            isinstance(rate, bool)
            or not isinstance(rate, int | float)
            or not 1.0 <= rate <= MAX_COMPRESSION_RATE
        ):
            raise bad(
                "kv_compression_rate", f"must be a number in [1, {MAX_COMPRESSION_RATE:g}], got {rate!r}"
            )
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise bad("structured", "must be a StructuredOutput")
            if self.ignore_eos:  # a finished grammar allows only EOS: ignoring it cannot end well
                raise InvalidRequestError(
                    "ignore_eos cannot be combined with a structured output constraint",
                    param="ignore_eos",
                )

    @property
    def greedy(self) -> bool:
        """Temperatures below `GREEDY_TEMPERATURE` are greedy: sampling at them is the argmax
        (as vLLM does), and dividing logits by them would overflow to inf."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def with_values(self, values: dict[str, object]) -> SamplingParams:
        """A validated copy with `values` set and nothing left to the model's defaults."""
        return dataclasses.replace(self, **values, model_defaults=frozenset())  # type: ignore[arg-type]


GREEDY_TEMPERATURE = 1e-5
MAX_COMPRESSION_RATE = 1024.0


def _not_int(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)
