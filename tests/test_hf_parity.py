"""Greedy tokens and logits against HF transformers' LlamaForCausalLM (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.kernels.attention_metadata import build_attention_metadata

from .conftest import make_tiny_model

LOGPROB_ATOL = 2e-3  # our vs HF log-probabilities of the top tokens, fp32

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a",
    "List three primary colours:",
    "1, 2, 3, 4, 5,",
    "Paged attention stores keys and values in",
    "<|im_start|>user\nWhat is 17 times 3?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
]


def hf_greedy(model, prompt_ids: list[int], max_new: int, eos: int | list[int] | None) -> list[int]:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0] if isinstance(eos, list) else eos,
        )
    return out[0, len(prompt_ids) :].tolist()


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def our_prefill_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """All-position logits of one prompt through our model, paged KV and all."""
    engine = llm.engine
    rid = "parity-probe"
    assert engine.kv_manager.allocate_slots(rid, len(token_ids))
    try:
        table = engine.kv_manager.block_table(rid).block_ids
        meta = build_attention_metadata(
            [table],
            [len(token_ids)],
            [len(token_ids)],
            engine.kv_manager.block_size,
            engine.runner.kv_spec.num_kv_heads,
            engine.runner.device,
        )
        with torch.inference_mode():
            return engine.runner.model(
                torch.tensor(token_ids),
                torch.arange(len(token_ids)),
                engine.runner.kv_caches,
                meta,
                torch.arange(len(token_ids)),
            )
    finally:
        engine.kv_manager.free(rid)


def check_parity(  # type: ignore[no-untyped-def]
    llm: LLM, hf_model, prompts: list[str], max_new: int, *, one_at_a_time: bool = True
) -> None:
    """Greedy tokens equal HF's for each prompt in one batch (and, `one_at_a_time`, alone), and
    the top log-probabilities HF's at every generated position."""
    eos = sorted(llm.engine.eos_token_ids)  # every id that ends a reply (a GGUF's end-of-turn tokens too)
    prompt_ids = [llm.tokenizer.encode(p) for p in prompts]
    expected = [hf_greedy(hf_model, ids, max_new, eos) for ids in prompt_ids]
    params = SamplingParams(max_tokens=max_new, temperature=0.0, logprobs=5)

    together = llm.generate(prompt_ids, params)
    for i, (want, batched) in enumerate(zip(expected, together, strict=True)):
        assert batched.outputs[0].token_ids == want, f"prompt {i} in a batch of {len(prompts)}"
    if one_at_a_time:
        for i, (want, ids) in enumerate(zip(expected, prompt_ids, strict=True)):
            assert llm.generate([ids], params)[0].outputs[0].token_ids == want, f"prompt {i} one at a time"

    # Log-probabilities of the top tokens at every generated position (teacher forcing).
    for ids, out in zip(prompt_ids, together, strict=True):
        ref = hf_logprobs(hf_model, ids + out.outputs[0].token_ids)
        for step, entry in enumerate(out.outputs[0].logprobs or []):
            for token_id, value in entry.items():
                assert abs(ref[len(ids) - 1 + step, token_id].item() - value) < LOGPROB_ATOL


def test_tiny_gqa_model_matches_hf(tiny_model_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    hf_model = LlamaForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    llm = LLM(
        str(tiny_model_dir), kv_cache_memory=4 << 20, block_size=4, max_num_batched_tokens=64, max_num_seqs=8
    )
    prompts = [p for p in PROMPTS if len(llm.tokenizer.encode(p)) > 1]
    check_parity(llm, hf_model, prompts, max_new=24)
    ids = llm.tokenizer.encode(PROMPTS[2])
    ours = our_prefill_logits(llm, ids)
    ref = hf_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_compiled_decode_matches_hf(tiny_model_dir: Path) -> None:
    """`compile_decode=True` runs decode-only steps through torch.compile; answers stay HF's."""
    from transformers import LlamaForCausalLM

    hf_model = LlamaForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    llm = LLM(
        str(tiny_model_dir),
        kv_cache_memory=4 << 20,
        block_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        compile_decode=True,
    )
    assert llm.engine.runner.compiles_decode, "compilation failed and fell back to eager"
    prompts = [p for p in PROMPTS if len(llm.tokenizer.encode(p)) > 1]
    check_parity(llm, hf_model, prompts, max_new=24)
    assert llm.engine.runner.num_compiled_steps > 0


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {  # DeepSeek-style: mscale / mscale_all_dim, untruncated ramp, other betas
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16,
            "beta_slow": 2,
            "truncate": False,
        },
    ],
)
def test_rope_scaling_and_tied_embeddings_match_hf(tmp_path: Path, scaling: dict) -> None:
    from transformers import LlamaForCausalLM

    folder = make_tiny_model(tmp_path / "m", num_kv_heads=1, tie=True, seed=3, rope_scaling=scaling)
    hf_model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    llm = LLM(str(folder), kv_cache_memory=2 << 20, block_size=8)
    ids = llm.tokenizer.encode(" ".join(PROMPTS))[:200]
    torch.testing.assert_close(
        our_prefill_logits(llm, ids), hf_model(torch.tensor([ids])).logits[0], atol=1e-4, rtol=1e-4
    )


@pytest.mark.slow
def test_default_model_matches_hf(default_llm: LLM, hf_default_model) -> None:  # type: ignore[no-untyped-def]
    # In a batch only: that each request's tokens and log-probabilities are the same bits alone
    # as in a batch is test_batch_invariance's (this pin, float32 dense, and the defaults); one at
    # a time here cost 22 s of float32 decode at batch 1.
    check_parity(default_llm, hf_default_model, PROMPTS, max_new=64, one_at_a_time=False)


@pytest.mark.slow
def test_default_model_prefill_logits_match_hf(default_llm: LLM, hf_default_model) -> None:  # type: ignore[no-untyped-def]
    ids = default_llm.tokenizer.encode(PROMPTS[2] + " " + PROMPTS[5])
    ours = our_prefill_logits(default_llm, ids)
    ref = hf_default_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-3)
