"""Incremental text of byte-level BPE tokens without a call into the tokenizer library per token.

When a tokenizer's decoder is `ByteLevel` alone, `decode(ids, skip_special_tokens=True)` is the
UTF-8 text of the tokens' bytes concatenated (special tokens skipped; invalid sequences replaced,
as Rust's `from_utf8_lossy` and Python's `errors="replace"` both do, per maximal invalid part):
each token's bytes are its piece's characters through GPT-2's byte-to-unicode table, or the piece's
own UTF-8 when a character is outside that table (the library's `ByteLevel.decode_chain`). So a
table of each token's bytes (`byte_level_table`) decodes a stream exactly as the library's
`DecodeStream` does: bytes wait while their text would end in a replacement character (an
incomplete character), and are emitted once it does not.
"""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from tandem.engine.io.gguf_tokenizer import bytes_to_unicode

_REPLACEMENT = "\ufffd"


class BytePieces:
    """GPT-2's byte-level pieces back to their bytes: each character of a piece written in
    `bytes_to_unicode`'s table is one byte."""

    __slots__ = ("byte_chars", "to_latin1")

    def __init__(self) -> None:
        unicode_to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
        self.byte_chars = frozenset(unicode_to_byte)
        self.to_latin1 = str.maketrans({char: chr(byte) for char, byte in unicode_to_byte.items()})

    def bytes_of(self, piece: str) -> bytes | None:
        """The piece's bytes; None when a character is outside the table."""
        if not self.byte_chars.issuperset(piece):
            return None
        return piece.translate(self.to_latin1).encode("latin-1")


class ByteLevelTable:
    """Each token id's bytes in `decode(..., skip_special_tokens=True)` (`token_bytes`, b"" for
    special tokens), and the text of each token that settles on its own (`token_texts`: its bytes
    are whole characters, none a replacement character; None for the others)."""

    __slots__ = ("token_bytes", "token_texts")

    def __init__(self, token_bytes: list[bytes]) -> None:
        self.token_bytes = token_bytes
        self.token_texts: list[str | None] = [_settled_alone(data) for data in token_bytes]


def _settled_alone(data: bytes) -> str | None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if _REPLACEMENT in text else text


def byte_level_table(backend: HFTokenizer) -> ByteLevelTable | None:
    """The table of a tokenizer whose decoder is `ByteLevel` alone; None for any other."""
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    pieces = BytePieces()
    special_ids = {
        token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
    }
    table = [b""] * backend.get_vocab_size(with_added_tokens=True)
    for piece, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token_id in special_ids or token_id >= len(table):
            continue
        # a piece outside the table is its own text (`ByteLevel.decode_chain`)
        table[token_id] = pieces.bytes_of(piece) or piece.encode("utf-8")
    return ByteLevelTable(table)


class ByteLevelStream:
    """One output's text from a `byte_level_table`, token by token (`DecodeStream`'s contract)."""

    __slots__ = ("token_bytes", "token_texts", "pending")

    def __init__(self, table: ByteLevelTable) -> None:
        self.token_bytes = table.token_bytes
        self.token_texts = table.token_texts
        self.pending = b""  # bytes whose text ends in an incomplete character so far

    def step(self, token_id: int) -> str:
        """The text this token settles ("" while it waits)."""
        if not self.pending:
            text = self.token_texts[token_id]
            if text is not None:  # whole characters: what decoding its bytes gives
                return text
            data = self.token_bytes[token_id]
        else:
            data = self.pending + self.token_bytes[token_id]
        if not data:
            return ""
        text = data.decode("utf-8", "replace")
        if text.endswith(_REPLACEMENT):
            self.pending = data
            return ""
        self.pending = b""
        return text
