"""Embeddings: the engine's pooled hidden states against transformers' own (a decoder family,
last-token pooling; an encoder family, BERT, with CLS and mean pooling as sentence-transformers'
module files declare), and `/v1/embeddings` through the unchanged `openai` client, in real time
and as a batch of 1,000 lines. `tests/test_serve.py` calls it on Ray Serve."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tandem import AsyncEngine
from tandem.batch.service import BatchLimits
from tandem.deployments.ingress import create_app
from tandem.deployments.local import local_platform
from tandem.engine.protocol import GenerationRequest, RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.platform.api_keys import parse_keys
from tandem.platform.errors import ContextLengthExceededError, InvalidRequestError
from tandem.platform.object_store import FileObjectStore
from tandem.platform.tenancy import TenantRegistry
from tandem.platform.usage_log import UsageLog
from tests.conftest import make_tiny_model, serve_with_worker
from tests.tiny_encoders import make_tiny_bert

KEY = "sk-embeddings"
TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "paris is in france",
    "embedding model text " * 12,  # longer than a step's token budget below: chunked (decoder)
]


def cosine(a: list[float] | torch.Tensor, b: torch.Tensor) -> float:
    return float(
        torch.nn.functional.cosine_similarity(torch.as_tensor(a, dtype=torch.float32), b.float(), dim=0)
    )


async def embed_all(engine: AsyncEngine, texts: list[str]) -> list[RequestOutput]:
    """Every text's final output, the requests running at once (one engine batch)."""

    async def one(index: int, text: str) -> RequestOutput:
        last = None
        async for out in engine.generate(
            GenerationRequest(f"e{index}", prompt=text, embed=True, stream=False)
        ):
            last = out
        assert last is not None
        return last

    return await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))


def hf_pooled(folder: Path, token_ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' `last_hidden_state` of the same tokens, pooled."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        states = model(torch.tensor([token_ids])).last_hidden_state[0]
    return {"last": states[-1], "cls": states[0], "mean": states.mean(dim=0)}[pooling]


@pytest.fixture(scope="module")
def decoder_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("decoder") / "model")


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_an_encoder_embeds_as_transformers_does(tmp_path: Path, pooling: str) -> None:
    folder = make_tiny_bert(tmp_path / "bert", pooling=pooling)
    engine = AsyncEngine.from_options(
        model=str(folder), kv_cache_memory=4 << 20, max_num_batched_tokens=32, max_num_seqs=8
    )
    try:
        outputs = asyncio.run(embed_all(engine, TEXTS[:3]))
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        for out in outputs:
            assert out.prompt_token_ids == tokenizer(out.prompt)["input_ids"]  # [CLS] ... [SEP]
            assert out.embedding is not None and len(out.embedding) == 32
            assert cosine(out.embedding, hf_pooled(folder, out.prompt_token_ids, pooling)) > 1 - 1e-4
        info = engine.engine.model_info()
        assert info["tasks"] == ["embed"] and info["pooling"] == pooling
        # An encoder does not generate, and its input runs whole in one step.
        with pytest.raises(InvalidRequestError, match="encoder"):
            engine.engine.make_request(GenerationRequest("g", prompt="hello"))
        with pytest.raises(ContextLengthExceededError) as too_long:
            engine.engine.make_request(GenerationRequest("long", prompt="hello " * 40, embed=True))
        assert too_long.value.param == "input"
    finally:
        engine.shutdown()


def test_a_decoder_embeds_its_last_token_within_any_batch(decoder_folder: Path) -> None:
    """Last-token pooling of the final norm's states, equal to transformers' for a prompt chunked
    over several steps, and unchanged while a generation shares the steps."""
    engine = AsyncEngine.from_options(
        model=str(decoder_folder), kv_cache_memory=8 << 20, dtype="float32", weight_dtype="dense",
        max_num_batched_tokens=24, max_num_seqs=8,
    )  # fmt: skip
    try:
        alone = asyncio.run(embed_all(engine, TEXTS))
        assert len(alone[-1].prompt_token_ids) > 24  # chunked
        for out in alone:
            reference = hf_pooled(decoder_folder, out.prompt_token_ids, "last")
            assert out.embedding is not None and cosine(out.embedding, reference) > 1 - 1e-4

        async def beside_a_generation() -> list[RequestOutput]:
            params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
            generation = engine.generate(
                GenerationRequest("gen", prompt="hello there", sampling_params=params)
            )
            first = await anext(generation)
            embedded = await embed_all(engine, TEXTS)
            async for _ in generation:
                pass
            assert first.outputs[0].delta_token_ids
            return embedded

        for mixed, solo in zip(asyncio.run(beside_a_generation()), alone, strict=True):
            assert mixed.embedding is not None and solo.embedding is not None
            assert cosine(mixed.embedding, torch.tensor(solo.embedding)) > 1 - 1e-4
        assert engine.engine.model_info()["tasks"] == ["generate", "embed"]
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def bert_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """`/v1/embeddings` on a tiny BERT (CLS pooling), as `tandem serve` wires it."""
    root = tmp_path_factory.mktemp("embeddings")
    folder = make_tiny_bert(root / "bert", pooling="cls")
    store = FileObjectStore(str(root / "objects"))
    engine = AsyncEngine.from_options(
        model=str(folder), kv_cache_memory=4 << 20, max_num_seqs=64, served_model_name="bert-tiny"
    )
    usage_log = UsageLog(store, commit_interval_s=0.0)
    platform = local_platform(
        engine, store, TenantRegistry(parse_keys(f"{KEY}=acme")), batch_limits=BatchLimits(shard_size=250),
        model="bert-tiny", usage_log=usage_log,
    )  # fmt: skip
    try:
        with serve_with_worker(create_app(platform.server), platform.worker) as base_url:
            yield base_url, folder
    finally:
        usage_log.close()
        engine.shutdown()


def unit(vector: torch.Tensor) -> list[float]:
    return (vector / vector.norm()).tolist()


def test_embeddings_through_the_openai_client(bert_server: tuple[str, Path]) -> None:
    base_url, folder = bert_server
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    token_ids = [tokenizer(text)["input_ids"] for text in TEXTS[:3]]
    references = [hf_pooled(folder, ids, "cls") for ids in token_ids]
    # The SDK asks for base64 unless told otherwise, and decodes it.
    decoded = client.embeddings.create(model="bert-tiny", input=TEXTS[:3])
    floats = client.embeddings.create(model="bert-tiny", input=TEXTS[:3], encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2]
    for got, sent, reference in zip(decoded.data, floats.data, references, strict=True):
        assert math.isclose(sum(x * x for x in sent.embedding), 1.0, rel_tol=1e-5)  # normalised
        assert cosine(sent.embedding, reference) > 1 - 1e-4
        assert got.embedding == pytest.approx(sent.embedding, abs=1e-6)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(len(ids) for ids in token_ids)
    # dimensions: the first values, normalised again; base64 is little-endian float32.
    raw = client.embeddings.create(model="bert-tiny", input=TEXTS[0], dimensions=8, encoding_format="base64")
    packed = base64.b64decode(str(raw.data[0].embedding))
    assert list(struct.unpack("<8f", packed)) == pytest.approx(unit(references[0][:8]), abs=1e-5)
    by_ids = client.embeddings.create(model="bert-tiny", input=token_ids, encoding_format="float")
    assert by_ids.data[1].embedding == pytest.approx(floats.data[1].embedding, abs=1e-6)
    card = client.models.retrieve("bert-tiny").model_dump()
    assert card["tandem"]["tasks"] == ["embed"] and card["tandem"]["embedding_dimensions"] == 32
    for call, param in [
        (lambda: client.embeddings.create(model="bert-tiny", input="hi", dimensions=33), "dimensions"),
        (lambda: client.embeddings.create(model="bert-tiny", input=[]), "input"),
        (lambda: client.embeddings.create(model="bert-tiny", input="word " * 200), "input"),
        (
            lambda: client.chat.completions.create(
                model="bert-tiny", messages=[{"role": "user", "content": "hi"}]
            ),
            "model",
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.param == param


def test_a_batch_of_1000_embedding_lines_is_answered_once_each(bert_server: tuple[str, Path]) -> None:
    base_url, _ = bert_server
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)
    texts = [
        f"{WORD} number {i}"
        for i, WORD in zip(range(1000), ["hello", "paris", "text", "dog"] * 250, strict=True)
    ]
    lines = [
        json.dumps({"custom_id": f"e-{i}", "url": "/v1/embeddings", "method": "POST",
                    "body": {"model": "bert-tiny", "input": text, "encoding_format": "float"}})
        for i, text in enumerate(texts)
    ]  # fmt: skip
    file_id = client.files.create(file=("e.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 600
    while batch.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch.errors
    assert batch.request_counts is not None and batch.request_counts.completed == 1000
    assert batch.output_file_id is not None
    output: list[dict[str, Any]] = [
        json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()
    ]
    assert sorted(o["custom_id"] for o in output) == sorted(f"e-{i}" for i in range(1000))  # each once
    by_id = {o["custom_id"]: o["response"]["body"] for o in output}
    realtime = client.embeddings.create(model="bert-tiny", input=texts[7], encoding_format="float")
    assert by_id["e-7"]["data"][0]["embedding"] == pytest.approx(realtime.data[0].embedding, abs=1e-6)
    assert batch.usage is not None and batch.usage.output_tokens == 0
    assert batch.usage.input_tokens == sum(body["usage"]["prompt_tokens"] for body in by_id.values())
