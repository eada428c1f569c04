"""Our GGUF-built tokenizer and chat template rendering against transformers' own."""

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
