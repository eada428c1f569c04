"""A tokenizer built from a GGUF file's `tokenizer.ggml.*` metadata, token for token the one
transformers builds from the same file (`AutoTokenizer.from_pretrained(..., gguf_file=...)`).

- `gpt2` (byte-level BPE): the file's vocabulary and merges; text split by the regex its
  `tokenizer.ggml.pre` names (llama.cpp's pre-tokenizer types), else GPT-2's.
- `llama` (SentencePiece BPE with byte fallback): merges are not in the file; they are recovered
  from the vocabulary: every split of a token into two tokens, ranked by the token's score (Gemma:
  by its position in the file, which is Gemma's merge order; Gemma files also spell tokens of
  several spaces with spaces, looked up as `▁`s). Gemma's, Llama's and Phi-3's normalisation and
  decoding as transformers' `GemmaTokenizer` / `LlamaTokenizer` / its Phi-3 variant set them.

Tokens of type control (3) become special tokens; user-defined (4) plain added tokens, matched
whole. Any other tokenizer model is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tandem.platform.errors import ModelLoadError

_CONTROL, _USER_DEFINED = 3, 4

# llama.cpp pre-tokenizer types -> the split regex their merges were learned on
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_GEMMA_ARCHES = ("gemma", "gemma2", "gemma3")


def gguf_backend(fields: Mapping[str, object]) -> HFTokenizer:
    """The file's tokenizer, without a post-processor (the caller adds BOS / EOS as the file's
    `add_bos_token` / `add_eos_token` say)."""
    kind = fields.get("tokenizer.ggml.model")
    tokens = list(cast(list[str], fields["tokenizer.ggml.tokens"]))
    arch = fields.get("general.architecture")
    if kind == "gpt2":
        backend = _byte_level(fields, tokens)
    elif kind == "llama":
        backend = _sentencepiece(fields, tokens, str(arch))
    else:
        raise ModelLoadError(
            f"GGUF tokenizer model {kind!r} unsupported (byte-level BPE 'gpt2', SentencePiece 'llama')",
            param="model",
        )
    _add_file_tokens(backend, fields, byte_level=kind == "gpt2")
    return backend


def add_bos_default(fields: Mapping[str, object]) -> bool:
    """Whether a plain encode adds BOS: the file's flag; a SentencePiece file without one does
    (llama.cpp's and transformers' default)."""
    flag = fields.get("tokenizer.ggml.add_bos_token")
    return bool(flag) if flag is not None else fields.get("tokenizer.ggml.model") == "llama"


def _byte_level(fields: Mapping[str, object], tokens: list[str]) -> HFTokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = [_pair(m) for m in cast(list[str], fields["tokenizer.ggml.merges"])]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in ("smollm", "starcoder", "refact", "codeshell"):  # llama.cpp: digits one by one
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def recovered_merges(tokens: list[str], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a token into two vocabulary tokens, best first: by the
    token's `rank` (higher first), then the longer left and right pieces; splits of one token by
    the pieces' ids (transformers' `generate_merges`)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    found: list[tuple[str, str, float]] = []
    for token, score in rank.items():
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _sentencepiece(fields: Mapping[str, object], tokens: list[str], arch: str) -> HFTokenizer:
    gemma = arch in _GEMMA_ARCHES
    if gemma:
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        rank: dict[str, float] = {token: -index for index, token in enumerate(tokens)}
    else:
        rank = dict(zip(tokens, cast(list[float], fields["tokenizer.ggml.scores"]), strict=True))
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = recovered_merges(tokens, rank)
    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[cast(int, unk_id)] if gemma and unk_id is not None else None
    backend = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, unk_token=unk)
    )
    steps: list[Any] = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", "\u2581")
        backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous")
    elif arch == "phi3":  # the prefix space from a normaliser, not Metaspace
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend(prepend="\u2581"), normalizers.Replace(pattern=" ", content="\u2581")]
        )
        steps.append(decoders.Strip(content=" ", left=1))
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first", split=False
        )
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_file_tokens(backend: HFTokenizer, fields: Mapping[str, object], *, byte_level: bool) -> None:
    tokens = cast(list[str], fields["tokenizer.ggml.tokens"])
    types = cast(list[int], fields.get("tokenizer.ggml.token_type") or [])
    if byte_level:  # a "control" token outside the byte alphabet is a converter mislabel
        alphabet = set(bytes_to_unicode().values())
        control = [t for t, k in zip(tokens, types, strict=False) if k == _CONTROL and set(t) <= alphabet]
    else:
        control = [t for t, k in zip(tokens, types, strict=False) if k == _CONTROL]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user = [
        t
        for t, k in zip(tokens, types, strict=False)
        if k == _USER_DEFINED and backend.token_to_id(t) is not None
    ]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are written in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}
