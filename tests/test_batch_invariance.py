"""Batch invariance by default (issue: temperature 0 depended on what else ran).

With the defaults (no precision pin: this machine's own choice, INT4 for the default model here),
a temperature-0 request's tokens *and* its logprobs, to the bit, are the same alone, alone again
(a prefix-cache hit), inside a batch of 16 other requests, with speculation off for it, with its
prompt chunked differently, and on one thread instead of two. Compared bitwise, so a difference
in the last bit of any step (which flips tokens sooner or later) fails the test; with
`batch_invariant=False` the batch case differs here. Real checkpoints: the default model, and
Gemma 3 270M (float32 dense by default here) in the slow suite. The kernel part: a dense linear
padded to its measured floor gives each row the same bits at every call size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.host.precision import PIN_ENV
from tandem.kernels.linear import INVARIANCE_ROWS, PackedLinear, make_rows_invariant, onednn_available

TOPICS = ["the moon", "bread", "rivers", "chess", "volcanoes", "the ocean", "bees", "trains", "glass", "clouds",
          "copper", "owls", "jazz", "deserts", "maps", "tea", "salt", "kites", "caves", "wind"]  # fmt: skip
PREAMBLE = (
    "The following is a conversation with a careful writer who answers every question in plain words, "
    "briefly, and without lists.\n\n"
)  # long enough that a prompt fills whole KV blocks, which the prefix cache then holds
PROMPTS = [f"{PREAMBLE}Question: Write two sentences about {topic}.\nAnswer:" for topic in TOPICS]
NUM_CHECKED = 4


def _tokens_and_logprobs(llm: LLM, prompts: list[str], **params: Any) -> list[tuple[list[int], list[float]]]:
    sampling = SamplingParams(temperature=0.0, max_tokens=40, logprobs=0, **params)
    outputs = [o.outputs[0] for o in llm.generate(prompts, sampling)]
    return [
        (o.token_ids, [step[t] for step, t in zip(o.logprobs or [], o.token_ids, strict=True)])
        for o in outputs
    ]


def _check_everywhere(model: str | None, num_checked: int = NUM_CHECKED, **options: Any) -> None:
    llm = LLM(model, kv_cache_memory=96 << 20, max_num_seqs=32, **options)
    stats = llm.stats()
    print(f"\n{stats['dtype']} / {stats['weight_dtype']}; batch invariance: {stats['batch_invariance']}")
    assert stats["batch_invariant"], stats["batch_invariance"]
    checked = PROMPTS[:num_checked]
    alone = [_tokens_and_logprobs(llm, [p])[0] for p in checked]
    drafts_before = llm.stats()["num_draft_tokens"]
    again = [_tokens_and_logprobs(llm, [p])[0] for p in checked]  # prefix-cache hits now
    assert llm.stats()["prefix_cache_hits"] > 0
    in_batch = _tokens_and_logprobs(llm, checked + PROMPTS[NUM_CHECKED : NUM_CHECKED + 16])[:num_checked]
    no_speculation = [_tokens_and_logprobs(llm, [p], speculative=False)[0] for p in checked]
    print(f"draft tokens verified alone: {llm.stats()['num_draft_tokens'] - drafts_before}")
    assert llm.stats()["num_draft_tokens"] > 0  # speculation did run in the cases that allow it
    assert again == alone
    assert in_batch == alone
    assert no_speculation == alone
    # another engine: prompts chunked by 8 tokens, one thread
    torch_threads = torch.get_num_threads()
    try:
        other = LLM(
            model,
            kv_cache_memory=96 << 20,
            max_num_batched_tokens=8,
            max_num_seqs=8,
            num_threads=1,
            **options,
        )
        assert [_tokens_and_logprobs(other, [p])[0] for p in checked] == alone
    finally:
        torch.set_num_threads(torch_threads)


@pytest.mark.slow  # the real default model
def test_default_model_same_bits_alone_in_a_batch_chunked_and_without_speculation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(PIN_ENV, raising=False)
    _check_everywhere(None)


@pytest.mark.slow  # the real default model
def test_pinned_float32_dense_is_batch_invariant_too() -> None:
    """The test suite's own pin (float32 dense): the oneDNN linears at their measured floors and
    native attention for every row."""
    _check_everywhere(None)


@pytest.mark.slow
def test_gemma3_same_bits_alone_in_a_batch_chunked_and_without_speculation(
    gemma3_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(PIN_ENV, raising=False)
    _check_everywhere(str(gemma3_folder), num_checked=2)


@pytest.mark.skipif(
    not onednn_available(torch.device("cpu"), torch.float32), reason="oneDNN's packed linear only"
)
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (2048, 640)])
def test_a_packed_linear_at_its_floor_gives_a_row_the_same_bits_at_every_call_size(
    shape: tuple[int, int],
) -> None:
    in_features, out_features = shape
    linear = PackedLinear(torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(1)))
    assert make_rows_invariant(linear, (torch.get_num_threads(),)) == [], "no floor holds on this CPU"
    x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([linear(x[i : i + 1]) for i in range(300)])
    for rows in (*INVARIANCE_ROWS, 7, 300):
        assert torch.equal(linear(x[:rows]), alone[:rows]), rows
