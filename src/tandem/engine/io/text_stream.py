"""`TextStream`: one request's streamed text, in time proportional to what is new each step.

While a request runs its tokens are decoded incrementally (`Tokenizer.incremental_decoder`: the
tokenizer library's `DecodeStream`, which waits while the text ends in an incomplete UTF-8
sequence). What may still become a stop string (a suffix that is a proper prefix of one) and any
trailing replacement character are held back (`pending`). A stop string is searched for only where
it can end: in the emitted text's last `max_stop_len` characters (`tail`), what is pending and what
is new. No step touches the text emitted before that, so a long answer costs linear time.
The final text is one decode of the whole output (`finish`).
"""

from __future__ import annotations

from tandem.engine.io.tokenizer import IncrementalDecoder, Tokenizer

_REPLACEMENT = "\ufffd"


class TextStream:
    __slots__ = (
        "tokenizer",
        "stops",
        "include_stop",
        "max_stop_len",
        "decoder",
        "parts",
        "num_chars",
        "pending",
        "tail",
        "stop",
    )

    def __init__(self, tokenizer: Tokenizer, stops: list[str], include_stop: bool) -> None:
        self.tokenizer = tokenizer
        self.stops = stops  # non-empty (`SamplingParams` refuses an empty stop string)
        self.include_stop = include_stop  # a stop string found is part of the text
        self.max_stop_len = max((len(s) for s in self.stops), default=0)
        self.decoder: IncrementalDecoder | None = None  # made when the text is first decoded
        self.parts: list[str] = []  # the emitted text, in the pieces emitted (joined when read)
        self.num_chars = 0  # characters emitted
        self.pending = ""  # decoded, not emitted yet: held back
        self.tail = ""  # the emitted text's last `max_stop_len` characters
        self.stop: str | None = None  # the stop string that ended the text

    @property
    def text(self) -> str:
        """The text emitted so far."""
        if len(self.parts) > 1:
            self.parts = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""

    @property
    def num_decoded_tokens(self) -> int:
        return self.decoder.num_tokens if self.decoder is not None else 0

    def step(self, new_token_ids: list[int]) -> str:
        """Decode the output's next tokens (those after `num_decoded_tokens`); returns the text to
        emit now. A stop string found sets `stop` and the text ends there."""
        if self.decoder is None:
            self.decoder = self.tokenizer.incremental_decoder()
        new = self.decoder.extend(new_token_ids) if new_token_ids else ""
        if not self.stops:
            text = self.pending + new if self.pending else new
            self.pending = ""
            if text.endswith(_REPLACEMENT):  # an incomplete character the decoder let through
                kept = text.rstrip(_REPLACEMENT)
                text, self.pending = kept, text[len(kept) :]
            return self._emit(text)
        num_tail = len(self.tail)
        window = self.tail + self.pending + new
        hit = self._find_stop(window, 0)
        if hit is not None:
            position, self.stop = hit
            end = position + len(self.stop) if self.include_stop else position
            self.pending = ""
            return self._emit(window[num_tail:end]) if end > num_tail else ""
        keep = max(num_tail, self._held_back_from(window))
        self.pending = window[keep:]
        return self._emit(window[num_tail:keep])

    def finish(self, token_ids: list[int]) -> str:
        """The final text: one decode of the whole output (`token_ids`), cut at a stop string
        (`stop`) beginning no earlier than the emitted text's tail; returns what it adds to the
        emitted text."""
        full = self.tokenizer.decode(token_ids)
        if self.stops:
            hit = self._find_stop(full, max(0, self.num_chars - self.max_stop_len))
            if hit is not None:
                position, self.stop = hit
                full = full[: position + len(self.stop) if self.include_stop else position]
        emitted = self.text
        if not full.startswith(emitted):  # cannot happen with hold-back; kept as a guard
            full = emitted
        return self._emit(full[self.num_chars :])

    def flush(self) -> str:
        """The text held back, emitted (a request ended from outside: abort, error)."""
        text, self.pending = self.pending, ""
        return self._emit(text)

    def _emit(self, text: str) -> str:
        if text:
            self.parts.append(text)
            self.num_chars += len(text)
            if self.max_stop_len:
                self.tail = (self.tail + text)[-self.max_stop_len :]
        return text

    def _find_stop(self, text: str, start: int) -> tuple[int, str] | None:
        """The earliest stop string in `text` from `start` (ties: the least string)."""
        hits = [(text.find(s, start), s) for s in self.stops]
        found = [(position, s) for position, s in hits if position >= 0]
        return min(found) if found else None

    def _held_back_from(self, text: str) -> int:
        """Where the part of `text` that must wait begins: trailing replacement characters, and
        the longest suffix that is a proper prefix of some stop string."""
        end = keep = len(text.rstrip(_REPLACEMENT))
        for stop in self.stops:
            for n in range(min(len(stop) - 1, end), 0, -1):
                if text.endswith(stop[:n], 0, end):
                    keep = min(keep, end - n)
                    break
        return keep
