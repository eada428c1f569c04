"""Multi-head latent attention (DeepSeek-V3's, scaled down): the latent KV cache's bytes against a
per-head cache of the same model (from the allocator), FP8 latents, the prefill/decode hand-over
of latent pages (checked, corrupt pages refused, tokens equal to HF's), and the refusals (per-head
KV compression, LoRA adapters). Parity with HF in a mixed batch with chunked prefill, a prefix hit,
preemption and speculation is in test_model_families.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tandem import LLM, LoRARequest, SamplingParams
from tandem.engine.engine import LLMEngine
from tandem.engine.kv.transfer import KVTransferError
from tandem.engine.protocol import GenerationRequest

from .conftest import make_tiny_model
from .model_families import MOE_FAMILIES, load_hf, save_family_model
from .test_hf_parity import hf_greedy

FAMILY = "deepseek_v3"
PROMPTS = [
    "Once upon a time, in a land far away, there lived a small dragon who loved the sea.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = make_tiny_model(tmp_path_factory.mktemp("mla-tokenizer"), num_layers=1)
    return save_family_model(FAMILY, tmp_path_factory.mktemp(FAMILY), tokenizer)


def test_the_latent_cache_takes_the_latent_and_rotary_key_once_per_token(folder: Path) -> None:
    """From the allocator: one tensor per layer (V is K), (kv_lora_rank + qk_rope_head_dim)
    elements per token and layer, against heads x (qk_head_dim + v_head_dim) for a per-head cache;
    FP8 latents take half of the bfloat16 latent cache's bytes again (plus a float16 scale)."""
    overrides = MOE_FAMILIES[FAMILY][2]
    heads, latent = 4, overrides["kv_lora_rank"] + overrides["qk_rope_head_dim"]  # 32 + 8
    per_head = heads * (
        overrides["qk_nope_head_dim"] + overrides["qk_rope_head_dim"] + overrides["v_head_dim"]
    )
    sizes = {}
    for dtype, kv_dtype in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8_e4m3")):
        llm = LLM(
            str(folder), dtype=dtype, kv_cache_dtype=kv_dtype, kv_cache_memory=1 << 20, speculative=None
        )
        runner = llm.engine.runner  # type: ignore[attr-defined]
        caches = runner.kv_caches
        assert all(k is v for k, v, _, _ in caches), "V is K: the latent is stored once"
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for layer in caches
            for t in layer
            if t is not None
        }
        num_tokens = caches[0][0].shape[0] * runner.block_size  # blocks x tokens a block
        per_token_layer = sum(storages.values()) / (num_tokens * len(caches))
        sizes[(dtype, kv_dtype)] = per_token_layer
        assert per_token_layer == runner.kv_spec.bytes_per_token_vector
    assert sizes[("float32", "auto")] == latent * 4
    assert sizes[("bfloat16", "auto")] == latent * 2
    assert sizes[("float32", "fp8_e4m3")] == latent * 1 + 2  # e4m3 codes and one float16 scale
    print(
        f"\nlatent cache: {latent * 4} bytes a token and layer in float32 against {per_head * 4} for a per-head "
        f"cache ({latent / per_head:.1%}); DeepSeek-V3's own dims: (512 + 64) / (128 x (192 + 128)) = "
        f"{576 / (128 * 320):.2%}; FP8 {latent + 2} bytes against bfloat16's {latent * 2}"
    )
    assert latent / per_head == pytest.approx(40 / 160)


def test_fp8_latents_still_answer(folder: Path) -> None:
    llm = LLM(str(folder), dtype="float32", kv_cache_dtype="fp8_e4m3", kv_cache_memory=1 << 20)
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [8, 8]
    assert llm.stats()["kv_cache_dtype"] == "float8_e4m3fn"


def test_latent_pages_hand_over_between_engines(folder: Path) -> None:
    """Prefill on one engine, decode on another: the latent pages travel checked (a flipped byte
    is refused), and the decoded tokens are HF's."""
    options = {"dtype": "float32", "kv_cache_memory": 1 << 20, "block_size": 4, "speculative": None}
    sender = LLMEngine.from_options(str(folder), **options)
    receiver = LLMEngine.from_options(str(folder), **options)
    hf = load_hf(FAMILY, folder)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for index, text in enumerate(PROMPTS):
        prompt = sender.tokenizer.encode(text)
        gen = GenerationRequest(f"r{index}", prompt_token_ids=prompt, sampling_params=params)
        sender.add_prefill_request(gen)
        while sender.has_unfinished_requests():
            sender.step()
        transfer = sender.handover.export_kv(gen.request_id)
        assert transfer.model_fingerprint.endswith("|latent")
        if index == 0:
            page = transfer.pages[1]
            flipped = dataclasses.replace(page, data=bytes([page.data[0] ^ 1]) + page.data[1:])
            bad = dataclasses.replace(transfer, pages=(transfer.pages[0], flipped, *transfer.pages[2:]))
            with pytest.raises(KVTransferError):
                receiver.handover.add_request_with_kv(gen, bad)
            assert receiver.stats()["kv_blocks_used"] == 0
        receiver.handover.add_request_with_kv(gen, transfer)
        tokens: list[int] = []
        while receiver.has_unfinished_requests():
            for out in receiver.step():
                tokens = list(out.outputs[0].token_ids)
        assert tokens == hf_greedy(hf, prompt, params.max_tokens, None)
    assert sender.stats()["kv_blocks_used"] == 0 and receiver.stats()["kv_blocks_used"] == 0


def test_per_head_compression_and_adapters_are_refused_naming_why(folder: Path, tmp_path: Path) -> None:
    from tandem.engine.lora.manager import AdapterError
    from tandem.platform.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as refused:
        LLM(str(folder), dtype="float32", kv_cache_memory=1 << 20, enable_kv_compression=True)
    assert refused.value.param == "enable_kv_compression" and "latent" in refused.value.message
    import peft

    model = peft.get_peft_model(load_hf(FAMILY, folder), peft.LoraConfig(r=4, target_modules=["o_proj"]))
    model.save_pretrained(str(tmp_path / "o"))
    llm = LLM(str(folder), dtype="float32", enable_lora=True, max_lora_rank=8, kv_cache_memory=1 << 20)
    with pytest.raises(AdapterError) as bad:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora=[LoRARequest("o", str(tmp_path / "o"))])
    assert bad.value.param == "target_modules"


def test_absorbed_attention_equals_hfs_expanded_attention(folder: Path) -> None:
    """Logits of a whole prompt through the engine (latent cache, absorbed queries) against HF's
    expanded per-head keys and values: within 1e-4."""
    from .test_hf_parity import our_prefill_logits

    llm = LLM(str(folder), dtype="float32", kv_cache_memory=1 << 20, speculative=None)
    hf = load_hf(FAMILY, folder)
    ids = llm.tokenizer.encode(PROMPTS[0])
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    got = our_prefill_logits(llm, ids)
    assert (got - want).abs().max().item() < 1e-4
