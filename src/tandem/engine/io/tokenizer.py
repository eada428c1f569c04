"""Tokenizer and chat template (the `tokenizers` library; templates rendered as HF does).

Loaded from an HF folder (`tokenizer.json`, `tokenizer_config.json`) or built from a GGUF file's
`tokenizer.ggml.*` metadata (byte-level BPE vocab + merges, control tokens as special tokens).

Contract: token ids are the checkpoint's own tokenizer's. `encode(text)` equals transformers'
`AutoTokenizer(text)["input_ids"]`: the special tokens (BOS, EOS) come from the post-processor
of `tokenizer.json` (transformers 5 ignores `tokenizer_config.json`'s `add_bos_token` /
`add_eos_token` when that file exists), or, for a GGUF file, its `add_bos_token` /
`add_eos_token` keys.
A chat prompt is the template's text tokenised without added special tokens, as
`apply_chat_template(..., tokenize=True)` does: a template that writes `bos_token` itself gets
exactly one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors
from tokenizers.decoders import DecodeStream

from tandem.engine.io.byte_decoder import ByteLevelStream, ByteLevelTable, BytePieces, byte_level_table
from tandem.engine.io.chat_templates import FAMILY_CHAT_TEMPLATES
from tandem.engine.io.gguf_tokenizer import add_bos_default, gguf_backend
from tandem.platform.errors import InvalidRequestError, ModelLoadError


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        *,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: list[int],
    ) -> None:
        """`backend` tokenises with its own post-processor (the special tokens a plain `encode`
        adds); the loaders set it as the checkpoint's tokenizer would."""
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self._template: jinja2.Template | None = None
        self._token_bytes: list[bytes] | None = None
        self._byte_level_table: ByteLevelTable | None = None  # `byte_level_table`, built once
        self._byte_level_checked = False

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids; with `add_special_tokens`, the post-processor's BOS / EOS too."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self) -> IncrementalDecoder:
        """A decoder that takes one output's tokens as they come (`IncrementalDecoder`)."""
        self.prepare_streaming()
        return IncrementalDecoder(self.backend, self._byte_level_table)

    def prepare_streaming(self) -> None:
        """Build what incremental decoding reads (a byte-level decoder's table of each token's
        bytes, tens of ms for a large vocabulary) now rather than in the first request's step."""
        if not self._byte_level_checked:
            self._byte_level_table, self._byte_level_checked = byte_level_table(self.backend), True

    def token_bytes_table(self) -> list[bytes]:
        """Each token id's raw bytes (OpenAI's logprobs `bytes`; a token can be part of a UTF-8
        character). Byte-level BPE pieces map back through GPT-2's byte-to-unicode table,
        SentencePiece byte pieces (`<0x0A>`) are that byte and its `▁` a space, anything else
        (special tokens) its UTF-8 text. Built once."""
        if self._token_bytes is None:
            decoder = json.loads(self.backend.to_str()).get("decoder")
            byte_level = '"ByteLevel"' in json.dumps(decoder)
            pieces = BytePieces() if byte_level else None
            table = []
            for token_id in range(self.vocab_size):
                piece = self.backend.id_to_token(token_id) or ""
                as_bytes = pieces.bytes_of(piece) if pieces is not None else None
                if as_bytes is not None:
                    table.append(as_bytes)
                elif (byte_piece := _BYTE_PIECE.fullmatch(piece)) is not None:
                    table.append(bytes([int(byte_piece[1], 16)]))
                else:
                    table.append(piece.replace("\u2581", " ").encode("utf-8"))
            self._token_bytes = table
        return self._token_bytes

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """Render messages the way HF `apply_chat_template` does (sandboxed jinja2)."""
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template; use completions", param="messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise InvalidRequestError(f"messages[{i}] must be an object with a role", param="messages")
            if message.get("content") in (None, "") and not message.get("tool_calls"):
                raise InvalidRequestError(f"messages[{i}] has no content", param="messages")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    # -- loaders ------------------------------------------------------------------------
    @classmethod
    def from_hf_folder(cls, folder: Path, eos_token_ids: list[int]) -> Tokenizer:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder}: tokenizer.json not found", param="model")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on bad JSON
            raise ModelLoadError(f"{path}: cannot parse tokenizer ({exc})", param="model") from exc
        config: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text())
        template = config.get("chat_template")
        template_file = folder / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        bos = _token_str(config.get("bos_token"))
        eos = _token_str(config.get("eos_token"))
        eos_ids = list(eos_token_ids)
        eos_id = backend.token_to_id(eos) if eos is not None else None
        if eos_id is not None and eos_id not in eos_ids:
            eos_ids.append(eos_id)
        return cls(backend, chat_template=template, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids)

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        """The file's tokenizer (`gguf_tokenizer.py`), its BOS / EOS added as its flags say."""
        backend = gguf_backend(fields)
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        bos_id = fields.get("tokenizer.ggml.bos_token_id")
        eos_id = fields.get("tokenizer.ggml.eos_token_id")
        bos = tokens[bos_id] if bos_id is not None else None
        eos = tokens[eos_id] if eos_id is not None else None
        _set_special_tokens(
            backend,
            bos if add_bos_default(fields) else None,
            eos if fields.get("tokenizer.ggml.add_eos_token") else None,
        )
        template = fields.get("tokenizer.chat_template") or FAMILY_CHAT_TEMPLATES.get(
            str(fields.get("general.architecture"))
        )
        return cls(
            backend,
            chat_template=template,
            bos_token=bos,
            eos_token=eos,
            eos_token_ids=[eos_id] if eos_id is not None else [],
        )


class IncrementalDecoder:
    """One output's text, token by token (the `tokenizers` library's `DecodeStream`: it decodes a
    window from the last settled token, as `decode(ids)` minus the window's prefix, and waits
    while the text ends in an incomplete UTF-8 sequence). The text so far is what `decode` of the
    tokens fed gives, less any incomplete character at its end; special tokens are skipped. With a
    byte-level table (`byte_decoder.byte_level_table`: a `ByteLevel` decoder) the same text comes
    from the tokens' bytes, without a call into the library per token."""

    def __init__(self, backend: HFTokenizer, byte_table: ByteLevelTable | None = None) -> None:
        self._backend = backend
        self._bytes = ByteLevelStream(byte_table) if byte_table is not None else None
        self._stream = DecodeStream(skip_special_tokens=True) if byte_table is None else None
        self.num_tokens = 0  # tokens fed so far

    def extend(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text they settle (may be empty)."""
        self.num_tokens += len(token_ids)
        if self._bytes is not None:
            if len(token_ids) == 1:  # a decode step's one token
                return self._bytes.step(token_ids[0])
            return "".join([self._bytes.step(token_id) for token_id in token_ids])
        assert self._stream is not None
        if len(token_ids) == 1:
            return self._stream.step(self._backend, token_ids[0]) or ""
        chunks = [self._stream.step(self._backend, token_id) for token_id in token_ids]
        return "".join(chunk for chunk in chunks if chunk)


def _set_special_tokens(backend: HFTokenizer, bos: str | None, eos: str | None) -> None:
    """Make `backend`'s post-processor add `bos` before and `eos` after a text (None: neither),
    the template transformers builds from `add_bos_token` / `add_eos_token`."""
    specials = [(token, backend.token_to_id(token)) for token in (bos, eos) if token is not None]
    if any(token_id is None for _, token_id in specials):
        raise ModelLoadError(
            f"special tokens {[t for t, _ in specials]} are not in the vocabulary", param="model"
        )
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_template_error(message: str) -> None:
    raise InvalidRequestError(f"chat template error: {message}", param="messages")
