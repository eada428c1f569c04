"""The engine on CUDA (`gpu` marker; skipped without CUDA; `scripts/gpu_check.sh` runs them).

References: HF transformers on the same GPU for greedy tokens, and the same engine on CPU (its
torch and native paths) for FP8 KV and INT4 weights.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]

PROMPTS = [
    "The quick brown fox jumps over",
    "Paged attention stores keys and values in fixed-size blocks of",
    "Hello",
    "0123456789 numbers and words, punctuation; and",
]


def _greedy(
    model_dir: Path, device: str, max_tokens: int = 12, **options: object
) -> tuple[list[list[int]], dict]:
    from tandem import LLM, SamplingParams

    llm = LLM(str(model_dir), device=device, kv_cache_memory=16 << 20, max_num_batched_tokens=32, **options)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [out.outputs[0].token_ids for out in outputs], llm.stats()


def test_greedy_tokens_on_cuda_equal_hf_on_cuda(tiny_model_dir: Path) -> None:
    """float32 on CUDA, prompts chunked (32-token steps) and decoded together: HF's greedy tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokens, stats = _greedy(tiny_model_dir, "cuda", dtype="float32")
    assert stats["num_graph_steps"] > 0, "decode steps should replay CUDA graphs"
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for prompt, ours in zip(PROMPTS, tokens, strict=True):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]], device="cuda")
        with torch.no_grad():
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(ours), do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        assert ours == out[0, ids.shape[1] :].tolist(), prompt


def test_decode_graphs_replay_the_eager_tokens(tiny_model_dir: Path) -> None:
    """CUDA graphs on and off give the same tokens, in float32 and in bfloat16 (the CUDA default)."""
    for dtype in ("float32", "bfloat16"):
        graphs, stats = _greedy(tiny_model_dir, "cuda", dtype=dtype)
        eager, eager_stats = _greedy(tiny_model_dir, "cuda", dtype=dtype, cuda_graphs=False)
        assert graphs == eager, dtype
        assert stats["num_graph_steps"] > 0 and eager_stats["num_graph_steps"] == 0


@pytest.mark.parametrize(
    "options",
    [{"kv_cache_dtype": "fp8_e4m3"}, {"weight_dtype": "int4", "int4_group_size": 32}],
    ids=["fp8-kv", "int4"],
)
def test_quantised_engines_on_cuda_match_cpu(tiny_model_dir: Path, options: dict) -> None:
    """FP8 KV and INT4 weights: the CUDA path's greedy tokens equal the CPU path's (float32)."""
    cuda, stats = _greedy(tiny_model_dir, "cuda", dtype="float32", **options)
    cpu, _ = _greedy(tiny_model_dir, "cpu", dtype="float32", **options)
    assert cuda == cpu
    assert stats["weight_dtype"] == options.get("weight_dtype", "dense")


def test_kv_cache_sized_from_free_device_memory(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without kv_cache_memory the cache takes kv_cache_memory_fraction of the device memory free
    once the weights are loaded, and bfloat16 is the default dtype."""
    from tandem import LLM

    monkeypatch.delenv("TANDEM_AUTO_PRECISION", raising=False)  # the suite's float32 pin
    gc.collect()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    llm = LLM(str(tiny_model_dir), device="cuda", kv_cache_memory_fraction=0.02)
    stats = llm.stats()
    spec = llm.engine.runner.kv_spec
    cache_bytes = stats["kv_blocks_total"] * spec.bytes_per_block
    assert stats["dtype"] == "bfloat16"
    assert 0.9 * 0.02 * free <= cache_bytes <= 1.05 * 0.02 * free
