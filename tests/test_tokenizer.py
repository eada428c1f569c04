"""Our tokenizers (GGUF-built and HF folders) and chat templates against transformers' own: the
prompt token ids of completions (`AutoTokenizer(text)`) and of chat
(`apply_chat_template(..., tokenize=True)`), special tokens included."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.engine.models.loader import load_model

TEXTS = [
    "Hello world 123 <|im_start|>",
    "  leading spaces and\ttabs\nnewlines\n\n",
    "Ünïcödé — emojis 🙂🚀 and CJK 你好世界",
    "def f(x):\n    return x**2  # 12345678901234567890",
    "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|endoftext|>",
    "don't won't I'll we've they're",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why is the sky blue?"},
        {"role": "assistant", "content": "Rayleigh scattering."},
        {"role": "user", "content": "More?"},
    ],
]


@pytest.fixture(scope="module")
def ours():  # type: ignore[no-untyped-def]
    return load_model("smollm2-135m-instruct").tokenizer


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers(ours, default_model_path: Path) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)


def test_chat_template_renders_like_transformers(ours) -> None:  # type: ignore[no-untyped-def]
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(
        tokenizer_object=ours.backend, eos_token=ours.eos_token, bos_token=ours.bos_token
    )
    ref.chat_template = ours.chat_template
    for conv in CONVERSATIONS:
        for add in (True, False):
            want = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=add)
            assert ours.apply_chat_template(conv, add_generation_prompt=add) == want


def _chat_ids(ref, conversation) -> list[int]:  # type: ignore[no-untyped-def]
    out = ref.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _ours_chat_ids(ours, conversation) -> list[int]:  # type: ignore[no-untyped-def]
    return ours.encode(
        ours.apply_chat_template(conversation, add_generation_prompt=True), add_special_tokens=False
    )


@pytest.mark.slow
def test_gguf_prompt_ids_match_transformers(ours, default_model_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Completions and chat prompts of the default model, special tokens as its tokenizer adds them."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)
    for text in TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"], text
    for conversation in CONVERSATIONS:
        assert _ours_chat_ids(ours, conversation) == _chat_ids(ref, conversation)


GEMMA_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Colour of the sky?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And grass?"},
    ],
]


@pytest.mark.slow
def test_gemma3_prompt_ids_match_its_tokenizer(gemma3_folder: Path) -> None:
    """Gemma 3's tokenizer starts every text with <bos> (its post-processor) and its chat template
    writes <bos> itself: one <bos> either way, as transformers tokenises them."""
    from transformers import AutoTokenizer

    ours = load_model(str(gemma3_folder)).tokenizer
    ref = AutoTokenizer.from_pretrained(str(gemma3_folder))
    bos = ref.bos_token_id
    for text in [*TEXTS, "The capital of France is", "<bos>already there"]:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ids[0] == bos
    for conversation in GEMMA_CONVERSATIONS:
        ids = _ours_chat_ids(ours, conversation)
        assert ids == _chat_ids(ref, conversation)
        assert ids[0] == bos and ids[1] != bos


@pytest.mark.parametrize(("add_bos", "add_eos"), [(True, False), (False, True), (False, False)])
def test_post_processor_special_tokens_as_transformers(tmp_path: Path, add_bos: bool, add_eos: bool) -> None:
    """The special tokens a plain encode adds are tokenizer.json's post-processor's, as in
    transformers (which ignores tokenizer_config.json's add_bos_token once tokenizer.json exists)."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors
    from transformers import AutoTokenizer

    from tandem.engine.io.tokenizer import Tokenizer
    from tests.conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "tok", num_layers=1)
    backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    single = " ".join([*(["<|endoftext|>"] if add_bos else []), "$A", *(["<|im_end|>"] if add_eos else [])])
    specials = [
        (t, backend.token_to_id(t)) for t, on in (("<|endoftext|>", add_bos), ("<|im_end|>", add_eos)) if on
    ]
    backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    backend.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": not add_bos}))
    ours = Tokenizer.from_hf_folder(folder, [])
    ref = AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"], text
    ids = ours.encode("Hello there")
    assert (ids[0] == ours.bos_token_id) == add_bos
    assert (ids[-1] == ref.eos_token_id) == add_eos


def test_byte_level_stream_settles_what_the_library_stream_does(ours) -> None:  # type: ignore[no-untyped-def]
    """The byte-level table's stream (`IncrementalDecoder` on a `ByteLevel` decoder) gives, token
    by token, exactly the text the tokenizer library's `DecodeStream` settles: on real text
    (multi-byte characters split across tokens), with special tokens inside, and on random ids
    (pieces of characters in any order, invalid sequences), and joins to `decode`."""
    import random

    from tokenizers.decoders import DecodeStream

    from tandem.engine.io.byte_decoder import byte_level_table
    from tandem.engine.io.tokenizer import IncrementalDecoder

    backend = ours.backend
    table = byte_level_table(backend)
    assert table is not None, "the default model's decoder is ByteLevel"
    rng = random.Random(0)
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    sequences = [ours.encode(text, add_special_tokens=False) for text in TEXTS]
    sequences += [[rng.randrange(vocab_size) for _ in range(200)] for _ in range(20)]
    token_bytes = table.token_bytes
    multibyte = [i for i in range(vocab_size) if token_bytes[i] and any(b >= 0x80 for b in token_bytes[i])]
    sequences += [[rng.choice(multibyte) for _ in range(100)] for _ in range(20)]
    for token_ids in sequences:
        ours_stream, library = IncrementalDecoder(backend, table), DecodeStream(skip_special_tokens=True)
        settled = [ours_stream.extend([token_id]) for token_id in token_ids]
        assert settled == [library.step(backend, token_id) or "" for token_id in token_ids]
        text = "".join(settled)
        full = backend.decode(token_ids, skip_special_tokens=True)
        assert full.startswith(text) and not full[len(text) :].strip("\ufffd"), (text, full)
