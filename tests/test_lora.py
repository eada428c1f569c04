"""LoRA: batched multi-adapter kernel vs its definition, PEFT parity in one mixed batch, slot
eviction, and validation of bad adapters (never unpickled)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from tandem import LLM, LoRARequest, SamplingParams
from tandem.engine.lora.manager import AdapterError, LoRALimits, LoRAModelShape, parse_peft_adapter
from tandem.kernels.lora import LoRAGroups, lora_apply, lora_apply_reference

from .conftest import ADAPTERS

PROMPTS = [
    "The quick brown fox",
    "Paged attention stores keys",
    "Continuous batching lets new requests",
    "0123456789 numbers and words",
]


def test_lora_apply_matches_per_row_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 12, generator=gen)
    y = torch.randn(9, 20, generator=gen)
    lora_a = torch.randn(3, 4, 12, generator=gen)
    lora_b = torch.randn(3, 20, 4, generator=gen)
    token_slots = torch.tensor([2, 2, -1, 0, 0, 0, 2, -1, 1])
    got = lora_apply(y.clone(), x, lora_a, lora_b, LoRAGroups.from_token_slots(token_slots))
    torch.testing.assert_close(got, lora_apply_reference(y, x, lora_a, lora_b, token_slots))
    padded = LoRAGroups.from_token_slots(token_slots, num_slots=3)  # few rows per adapter: bmm path
    assert padded.padded_rows is not None
    got = lora_apply(y.clone(), x, lora_a, lora_b, padded)
    torch.testing.assert_close(got, lora_apply_reference(y, x, lora_a, lora_b, token_slots))
    everyone = torch.zeros(9, dtype=torch.int64)  # one adapter for every row: no gather path
    got = lora_apply(y.clone(), x, lora_a, lora_b, LoRAGroups.from_token_slots(everyone))
    torch.testing.assert_close(got, lora_apply_reference(y, x, lora_a, lora_b, everyone))


def _peft_reference(
    tiny_model_dir: Path, adapter: Path | None, new_tokens: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens and first-token log-probs from transformers (+ peft) for every prompt."""
    from transformers import LlamaForCausalLM

    from tandem.engine.io.tokenizer import Tokenizer

    model = LlamaForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    tokenizer = Tokenizer.from_hf_folder(tiny_model_dir, [])
    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer.encode(prompt)])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            tokens.append(out[0, ids.shape[1] :].tolist())
            logprobs.append(torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1))
    return tokens, logprobs


@pytest.mark.parametrize("max_loras", [3, 2])
def test_mixed_adapter_batch_matches_peft(
    tiny_model_dir: Path, peft_adapters: dict[str, Path], max_loras: int
) -> None:
    """Every prompt with each of 3 PEFT adapters and with none, all in one generate call: greedy
    tokens identical to PEFT's and first-token log-probs close. With max_loras=2 the scheduler
    must rotate adapters through the slots and the answers must not change."""
    new_tokens = 8
    llm = LLM(
        str(tiny_model_dir), kv_cache_memory=8 << 20, enable_lora=True, max_loras=max_loras, max_lora_rank=16
    )
    names: list[str | None] = [*ADAPTERS, None]
    prompts = [p for _ in names for p in PROMPTS]
    loras = [LoRARequest(n, str(peft_adapters[n])) if n else None for n in names for _ in PROMPTS]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, lora=loras)
    got = {(lora.name if lora else None, p): o for lora, p, o in zip(loras, prompts, outs, strict=True)}
    base_tokens = None
    for name in names:
        want_tokens, want_logprobs = _peft_reference(
            tiny_model_dir, peft_adapters[name] if name else None, new_tokens
        )
        for prompt, tokens, logprobs in zip(PROMPTS, want_tokens, want_logprobs, strict=True):
            out = got[(name, prompt)].outputs[0]
            assert out.token_ids == tokens, (name, prompt)
            first = out.logprobs[0]
            for token_id, value in first.items():
                assert abs(value - float(logprobs[token_id])) < 1e-3, (name, prompt, token_id)
        if name is None:
            base_tokens = want_tokens
    for name in ADAPTERS:  # the adapters really change the model
        assert [got[(name, p)].outputs[0].token_ids for p in PROMPTS] != base_tokens, name
    manager = llm.engine.adapters.manager
    assert manager is not None and manager.num_slot_loads >= len(ADAPTERS)
    if max_loras == 2:  # three adapters went through two slots, so one slot was reloaded
        assert len(set(manager.slot_of.values())) <= 2


def test_bad_adapters_are_refused_with_a_reason(peft_adapters: dict[str, Path]) -> None:
    shape = LoRAModelShape(num_layers=3, hidden_size=64, intermediate_size=128, q_size=64, kv_size=32)
    folder = peft_adapters["all-r8"]
    config = json.loads((folder / "adapter_config.json").read_text())
    weights = (folder / "adapter_model.safetensors").read_bytes()
    adapter = parse_peft_adapter("ok", config, weights, shape)
    assert adapter.rank == 8 and len(adapter.weights) == 3 * 4

    def refused(cfg: dict, data: bytes = weights, shp: LoRAModelShape = shape, **limits: int) -> str:
        with pytest.raises(AdapterError) as info:
            parse_peft_adapter("bad", cfg, data, shp, LoRALimits(**limits))
        return info.value.message

    assert "max_lora_rank" in refused(config, max_lora_rank=4)
    assert "use_dora" in refused({**config, "use_dora": True})
    assert "not supported" in refused({**config, "target_modules": ["q_proj", "lm_head"]})
    assert "safetensors" in refused(config, b"\x80\x04pickle-bytes")  # never unpickled
    assert "shape" in refused(config, shp=LoRAModelShape(3, 96, 128, 96, 32))  # another base model
    assert "layers" in refused(config, shp=LoRAModelShape(2, 64, 128, 64, 32))
    assert "limit" in refused(config, max_adapter_bytes=100)
    # Numbers: non-finite or extreme weights and scalings never reach a step.
    tensors = load_safetensors(weights)
    first = next(iter(tensors))

    def with_first(value: torch.Tensor) -> bytes:
        return save_safetensors({**tensors, first: value})

    assert "NaN or infinite" in refused(config, with_first(torch.full_like(tensors[first], float("nan"))))
    assert "NaN or infinite" in refused(config, with_first(torch.full_like(tensors[first], float("-inf"))))
    assert "magnitude" in refused(config, with_first(tensors[first] * 1e4))
    assert "norm" in refused(config, with_first(tensors[first] * 100), max_weight_abs=1e9)
    assert "scales updates" in refused({**config, "lora_alpha": 1e308})
    assert "finite positive" in refused({**config, "lora_alpha": float("nan")})
    assert "finite positive" in refused({**config, "lora_alpha": True})
    at_limit = {**config, "lora_alpha": 64 * config["r"]}
    assert parse_peft_adapter("edge", at_limit, weights, shape, LoRALimits(max_update_norm=1e9)).scaling == 64


def test_half_precision_checkpoints_read_as_the_float32_one(peft_adapters: dict[str, Path]) -> None:
    """BF16 and F16 checkpoints (numpy has no bfloat16: the reader widens the bits itself) give the
    weights torch gives for the same tensors; an integer tensor is refused."""
    import torch
    from safetensors.torch import load, save

    from tandem.engine.lora.checkpoint import read_safetensors

    stored = load((peft_adapters["all-r8"] / "adapter_model.safetensors").read_bytes())
    for dtype in (torch.bfloat16, torch.float16):
        read = read_safetensors(save({k: v.to(dtype) for k, v in stored.items()}))
        for key, tensor in stored.items():
            assert torch.equal(torch.from_numpy(read[key]), tensor.to(dtype).float()), (dtype, key)
    with pytest.raises(AdapterError, match="I32"):
        read_safetensors(save({"x": torch.ones(2, dtype=torch.int32)}))


def test_api_processes_do_not_import_torch() -> None:
    """The ingress and batch-worker code (adapter validation included) runs without torch: only
    the LLM replicas load it."""
    import subprocess
    import sys

    code = (
        "import sys, tandem.deployments.app, tandem.deployments.batch_worker; "
        "assert 'torch' not in sys.modules, [m for m in sys.modules if m.startswith('torch')][:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
