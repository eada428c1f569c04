"""A new architecture is one module registered with `models.registry`: nothing in the runner,
scheduler or engine changes, and every engine feature applies to it.

The toy here is Llama with a GELU MLP (what HF's `LlamaForCausalLM` computes with
`hidden_act="gelu"`, which the Llama module itself refuses): the test registers it under its own
`model_type` and checks it against HF greedy tokens, with prefix caching and prompt-lookup
speculation on. Unregistered, the same checkpoint is refused by its model type.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tandem import LLM, SamplingParams
from tandem.engine.models.interface import LoRAContext
from tandem.engine.models.llama import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaMLP,
    llama_kv_layers,
    llama_tensor_names,
)
from tandem.engine.models.registry import Architecture, register, unregister
from tandem.engine.models.support import check_config
from tandem.platform.errors import ModelLoadError

from .conftest import make_tiny_model


# -- the whole toy architecture --------------------------------------------------------------
class GeluMLP(LlamaMLP):
    def forward(self, x: torch.Tensor, lora: LoRAContext | None = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.gelu(gate) * up)


class GeluLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: LlamaConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        for index, layer in enumerate(self.layers):
            layer.mlp = GeluMLP(cfg, index)


TOY = Architecture(
    name="toy_gelu_llama",
    model_types=("toy_gelu_llama",),
    hf_classes=(),
    check_config=lambda cfg: check_config({**cfg, "hidden_act": "silu"}),  # Llama's rules but the activation
    parse_config=LlamaConfig.from_hf_dict,
    model_class=GeluLlamaForCausalLM,
    tensor_names=llama_tensor_names,
    kv_layers=llama_kv_layers,
)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def toy_registered() -> Iterator[None]:
    register(TOY)
    try:
        yield
    finally:
        unregister(TOY.name)


@pytest.fixture(scope="module")
def gelu_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """An HF Llama with `hidden_act="gelu"`, its config relabelled as the toy's model type."""
    import transformers

    folder = make_tiny_model(tmp_path_factory.mktemp("toy"), num_layers=2)
    config = transformers.LlamaConfig.from_pretrained(str(folder))
    config.hidden_act = "gelu"
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(config).float().eval()
    hf.save_pretrained(str(folder), safe_serialization=True)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(model_type="toy_gelu_llama", architectures=["GeluLlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(raw))
    return folder, hf


def test_an_unregistered_architecture_is_refused_by_its_model_type(gelu_checkpoint: tuple[Path, Any]) -> None:
    folder, _ = gelu_checkpoint
    with pytest.raises(ModelLoadError, match="model_type 'toy_gelu_llama' is not supported"):
        LLM(str(folder), kv_cache_memory=1 << 20)


def test_a_registered_architecture_runs_with_prefix_caching_and_speculation(
    toy_registered: None, gelu_checkpoint: tuple[Path, Any]
) -> None:
    folder, hf = gelu_checkpoint
    llm = LLM(
        str(folder), dtype="float32", weight_dtype="dense", kv_cache_memory=4 << 20, block_size=4,
        enable_prefix_caching=True, speculative={"method": "ngram", "num_speculative_tokens": 4},
    )  # fmt: skip
    llm.engine.scheduler.speculation.always_draft()  # verify drafts whatever they cost here
    assert type(llm.engine.runner.model) is GeluLlamaForCausalLM
    shared = llm.tokenizer.encode("the cat sat on the mat and the cat sat on the")
    prompts = [shared + llm.tokenizer.encode(tail) for tail in (" mat", " hat and the cat")]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]  # prompts from the cache
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_draft_tokens"] > 0
    with torch.no_grad():
        for ids, ours, cached in zip(prompts, first, again, strict=True):
            theirs = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None)
            assert list(ours) == theirs[0, len(ids) :].tolist()
            assert list(cached) == list(ours)


def test_the_llama_module_still_refuses_gelu(toy_registered: None, gelu_checkpoint: tuple[Path, Any]) -> None:
    """Registering the toy does not widen Llama: the same weights labelled `llama` are refused."""
    folder, _ = gelu_checkpoint
    raw = json.loads((folder / "config.json").read_text())
    relabelled = folder.parent / "as-llama"
    relabelled.mkdir(exist_ok=True)
    for item in folder.iterdir():
        if item.is_file() and item.name != "config.json":
            (relabelled / item.name).write_bytes(item.read_bytes())
    (relabelled / "config.json").write_text(json.dumps({**raw, "model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="hidden_act='gelu'"):
        LLM(str(relabelled), kv_cache_memory=1 << 20)
