"""Embedding throughput against sentence-transformers on the same model, and what an embedding
batch costs real-time chat's time to first token, in one run.

Throughput: `--num-texts` texts of about `--words` words each, embedded by Tandem's engine (every
text an embedding request, submitted at once: the engine batches them) and by
sentence-transformers' `encode` (`--st-batch-size`), on the same weights and thread count;
input tokens per second of wall time, and the cosine between the two embeddings of each text
(quality beside speed). Two models: an encoder the shape of bge-small (BERT, 12 layers, hidden
384; random weights: speed does not depend on them) with CLS pooling, and the default model
(SmolLM2-135M-Instruct, the real checkpoint) as a decoder embedder with last-token pooling.

The decoder runs twice: at the engine's defaults (whatever precision "auto" chose: an INT4 copy
prefills slower than float32 on a CPU) and at float32 dense.

Interference: chat requests (interactive, `--chat-requests` one after another, 32 new tokens)
on the default model, alone and while `--batch-texts` embedding requests at batch priority wait
and run; their time to first token, p50 and p95, and the ratio.

    pip install sentence-transformers   # the reference (not a test dependency)
    python benchmarks/embeddings.py      # -> benchmarks/results/embeddings.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import string
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from common import log, percentile, write_result
from tandem import AsyncEngine
from tandem.engine.models.loader import default_cache_dir, gguf_to_hf_folder, resolve_model_path
from tandem.engine.protocol import GenerationRequest, RequestOutput
from tandem.engine.request import Priority
from tandem.engine.sampling_params import SamplingParams

WORDS = [
    "the",
    "model",
    "reads",
    "every",
    "word",
    "of",
    "a",
    "document",
    "and",
    "writes",
    "one",
    "vector",
    "for",
    "it",
    "so",
    "that",
    "documents",
    "about",
    "the",
    "same",
    "thing",
    "lie",
    "close",
    "together",
    "search",
    "ranks",
    "them",
    "by",
    "that",
    "distance",
    "retrieval",
    "augmented",
    "generation",
    "feeds",
    "the",
    "nearest",
    "passages",
    "to",
    "a",
    "chat",
    "model",
    "which",
    "answers",
    "from",
    "them",
]


def make_texts(num_texts: int, num_words: int, seed: int) -> list[str]:
    """Texts of a quarter to twice `num_words` words (a corpus's lengths vary)."""
    rng = random.Random(seed)
    lengths = [rng.randint(max(1, num_words // 4), 2 * num_words) for _ in range(num_texts)]
    return [" ".join(rng.choice(WORDS) for _ in range(length)) for length in lengths]


def make_bge_small_shape(folder: Path) -> Path:
    """A random BERT of bge-small's shape with a WordPiece vocabulary over `WORDS`, saved by
    transformers, declaring CLS pooling as sentence-transformers' module files."""
    import json

    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(WORDS)), *string.ascii_lowercase]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(str(folder))
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=384, intermediate_size=1536, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=512,
    )  # fmt: skip
    BertModel(config).eval().save_pretrained(str(folder), safe_serialization=True)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 384, "pooling_mode_cls_token": True})
    )
    return folder


async def embed(
    engine: AsyncEngine, texts: list[str], priority: Priority, prefix: str
) -> list[RequestOutput]:
    async def one(index: int, text: str) -> RequestOutput:
        request = GenerationRequest(
            f"{prefix}{index}", prompt=text, embed=True, stream=False, priority=priority
        )
        last = None
        async for out in engine.generate(request):
            last = out
        assert last is not None and last.embedding is not None
        return last

    return await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))


def tandem_throughput(engine: AsyncEngine, texts: list[str]) -> tuple[dict[str, float], list[list[float]]]:
    asyncio.run(embed(engine, texts[:8], Priority.INTERACTIVE, "warm"))
    started = time.perf_counter()
    outputs = asyncio.run(embed(engine, texts, Priority.INTERACTIVE, "e"))
    wall = time.perf_counter() - started
    num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return {"wall_s": wall, "input_tokens": num_tokens, "tokens_per_s": num_tokens / wall}, [
        out.embedding or [] for out in outputs
    ]


def st_throughput(
    model: Any, texts: list[str], batch_size: int, num_tokens: int
) -> tuple[dict[str, float], Any]:
    model.encode(texts[:8], batch_size=batch_size)
    started = time.perf_counter()
    vectors = model.encode(texts, batch_size=batch_size, convert_to_tensor=True)
    wall = time.perf_counter() - started
    return {"wall_s": wall, "input_tokens": num_tokens, "tokens_per_s": num_tokens / wall}, vectors


def compare(
    name: str, folder: Path, pooling: str, texts: list[str], args: argparse.Namespace, **engine_options: Any
) -> dict[str, Any]:
    """Tandem (`engine_options` over its defaults) and sentence-transformers on `folder`,
    alternately for `args.rounds` rounds."""
    from sentence_transformers import SentenceTransformer, models

    engine = AsyncEngine.from_options(
        model=str(folder), kv_cache_memory=256 << 20, max_num_seqs=64, **engine_options
    )
    if (folder / "modules.json").is_file():
        reference = SentenceTransformer(str(folder), device="cpu")
    else:
        # The text modality only: sentence-transformers would otherwise wrap a text in the chat
        # template of a model that has one (its system prompt included); both read the text as is.
        transformer = models.Transformer(
            str(folder),
            modality_config={"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
            module_output_name="token_embeddings",
        )
        if transformer.tokenizer.pad_token is None:  # a decoder's tokenizer: pad with its EOS (masked out)
            transformer.tokenizer.pad_token = transformer.tokenizer.eos_token
        reference = SentenceTransformer(
            modules=[transformer, models.Pooling(transformer.get_embedding_dimension(), pooling)],
            device="cpu",
        )
    ours: list[dict[str, float]] = []
    theirs: list[dict[str, float]] = []
    try:
        for _ in range(args.rounds):
            figures, vectors = tandem_throughput(engine, texts)
            ours.append(figures)
            st_figures, st_vectors = st_throughput(
                reference, texts, args.st_batch_size, int(figures["input_tokens"])
            )
            theirs.append(st_figures)
        cosines = torch.nn.functional.cosine_similarity(
            torch.tensor(vectors), st_vectors.float().cpu(), dim=1
        )
    finally:
        engine.shutdown()
    ratio = statistics.median(
        o["tokens_per_s"] / t["tokens_per_s"] for o, t in zip(ours, theirs, strict=True)
    )
    result = {
        "model": name,
        "pooling": pooling,
        "precision": f"{engine.engine.model_info()['dtype']}/{engine.engine.model_info()['weight_dtype']}",
        "tandem": ours,
        "sentence_transformers": theirs,
        "tandem_over_st": ratio,
        "cosine_min": float(cosines.min()),
        "cosine_mean": float(cosines.mean()),
    }
    log(f"{name}: tandem / sentence-transformers {ratio:.2f}x, cosine min {result['cosine_min']:.6f}")
    return result


def chat_ttfts(engine: AsyncEngine, num_requests: int, batch_texts: list[str] | None) -> list[float]:
    """TTFT of `num_requests` chat requests one after another, with `batch_texts` embedding
    requests at batch priority submitted first (running beside them)."""

    async def run() -> list[float]:
        background = None
        if batch_texts:
            background = asyncio.ensure_future(embed(engine, batch_texts, Priority.BATCH, "b"))
            await asyncio.sleep(0.2)  # the batch is queued and running before the first chat request
        ttfts = []
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        for index in range(num_requests):
            request = GenerationRequest(
                f"chat{index}-{bool(batch_texts)}",
                messages=[{"role": "user", "content": f"Tell me about item number {index}"}],
                sampling_params=params,
            )
            started = time.perf_counter()
            first = None
            async for _ in engine.generate(request):
                first = first or time.perf_counter()
            ttfts.append((first or started) - started)
        if background is not None:
            await background
        return ttfts

    return asyncio.run(run())


def interference(args: argparse.Namespace) -> dict[str, Any]:
    engine = AsyncEngine.from_options(kv_cache_memory=256 << 20, max_num_seqs=64)
    try:
        chat_ttfts(engine, 2, None)  # warm-up
        alone = chat_ttfts(engine, args.chat_requests, None)
        loaded = chat_ttfts(engine, args.chat_requests, make_texts(args.batch_texts, args.words, seed=7))
    finally:
        engine.shutdown()
    result = {
        "chat_ttft_alone_s": {"p50": percentile(alone, 0.5), "p95": percentile(alone, 0.95)},
        "chat_ttft_with_embedding_batch_s": {"p50": percentile(loaded, 0.5), "p95": percentile(loaded, 0.95)},
        "num_batch_texts": args.batch_texts,
    }
    result["ttft_p50_ratio"] = (
        result["chat_ttft_with_embedding_batch_s"]["p50"] / result["chat_ttft_alone_s"]["p50"]
    )
    log(f"chat TTFT p50 alone {result['chat_ttft_alone_s']['p50']*1000:.0f} ms, "
        f"beside an embedding batch {result['chat_ttft_with_embedding_batch_s']['p50']*1000:.0f} ms")  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-texts", type=int, default=256)
    parser.add_argument("--words", type=int, default=64)
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chat-requests", type=int, default=8)
    parser.add_argument("--batch-texts", type=int, default=512)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "embeddings.json"))
    args = parser.parse_args()
    texts = make_texts(args.num_texts, args.words, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        encoder = compare(
            "bge-small shape (BERT, random)", make_bge_small_shape(Path(tmp) / "bge"), "cls", texts, args
        )
    # The default model's GGUF as the HF folder the engine dequantises it into (both read it).
    folder = gguf_to_hf_folder(resolve_model_path("smollm2-135m-instruct"), default_cache_dir())
    decoder = compare("SmolLM2-135M-Instruct (decoder), its defaults", folder, "lasttoken", texts, args)
    decoder_dense = compare(
        "SmolLM2-135M-Instruct (decoder), float32 dense", folder, "lasttoken", texts, args,
        dtype="float32", weight_dtype="dense",
    )  # fmt: skip
    result = {
        "threads": torch.get_num_threads(),
        "num_texts": args.num_texts,
        "words_per_text": args.words,
        "encoder": encoder,
        "decoder": decoder,
        "decoder_dense": decoder_dense,
        "interference": interference(args),
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
