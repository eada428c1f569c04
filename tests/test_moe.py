"""Mixture-of-experts layers: the grouped expert computation against its per-token definition and
against HF's own sparse blocks, LoRA on a MoE model's attention against PEFT, and the refusals
(adapters on experts, configs we would compute inexactly). Whole-model parity with HF (a mixed
batch with chunked prefill, a prefix hit and a preemption) is in test_model_families.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM, LoRARequest, SamplingParams
from tandem.engine.models.moe_layer import MoEConfig, SparseMoE
from tandem.kernels.moe import experts_reference, grouped_experts, softmax_topk_routing, stacked_experts
from tandem.platform.errors import ModelLoadError

from .conftest import make_tiny_model
from .model_families import MOE_FAMILIES, load_hf, save_family_model
from .test_hf_parity import hf_greedy


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("moe-tokenizer"), num_layers=1)


@pytest.fixture(scope="module")
def checkpoints(tokenizer_files: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {f: save_family_model(f, tmp_path_factory.mktemp(f), tokenizer_files) for f in MOE_FAMILIES}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_the_per_token_definition(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, experts, inter, top_k = 37, 32, 16, 24, 4
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    w_down = (torch.randn(experts, hidden, inter, generator=gen) * 0.2).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen).to(dtype)
    weights, ids = softmax_topk_routing(logits, top_k, renormalize=True)
    assert ids.shape == (tokens, top_k) and torch.allclose(
        weights.float().sum(-1), torch.ones(tokens), atol=1e-2
    )
    want = experts_reference(x.float(), w_gate_up.float(), w_down.float(), weights.float(), ids)
    got = grouped_experts(x, stacked_experts(w_gate_up, w_down), weights, ids, experts)
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    assert (got.float() - want).abs().max().item() < tolerance * max(1.0, want.abs().max().item())
    assert len(set(ids.reshape(-1).tolist())) > top_k  # the tokens spread over many experts


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_sparse_block_equals_hfs(family: str, checkpoints: dict[str, Path]) -> None:
    """One layer's block with the checkpoint's weights: the same output as HF's sparse MoE block
    on the same input (routing, renormalisation and the weighted sum of experts)."""
    from tandem.engine.models.registry import architecture_for

    folder = checkpoints[family]
    hf = load_hf(family, folder)
    import json

    config = architecture_for(json.loads((folder / "config.json").read_text()))
    cfg = config.parse_config(json.loads((folder / "config.json").read_text()))
    assert cfg.moe is not None
    layer = min(i for i in range(cfg.num_hidden_layers) if cfg.moe.is_sparse(i))
    hf_block = hf.model.layers[layer].mlp
    ours = SparseMoE(cfg.moe, cfg.hidden_size, layer)
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))

    def take(name: str) -> torch.Tensor:
        return weights["model." + name]

    def put(param: torch.Tensor, value: torch.Tensor, _: str) -> None:
        with torch.no_grad():
            param.copy_(value)

    ours.load_hf(take, put, f"layers.{layer}.")
    x = torch.randn(23, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf_block(x[None])
        want = want[0] if isinstance(want, tuple) else want
        got = ours(x)
    assert (got - want.reshape(got.shape)).abs().max().item() < 1e-5


def test_lora_on_a_moe_models_attention_matches_peft(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import peft

    family = "qwen3_moe"
    folder = checkpoints[family]
    base = load_hf(family, folder)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
    model.save_pretrained(str(tmp_path / "attn"))
    reference = peft.PeftModel.from_pretrained(load_hf(family, folder), str(tmp_path / "attn")).eval()
    llm = LLM(str(folder), dtype="float32", enable_lora=True, max_lora_rank=8, kv_cache_memory=1 << 20)
    prompts = [llm.tokenizer.encode(p) for p in ("The sea is", "def add(a, b):\n    return")]
    want = [hf_greedy(reference, ids, 8, None) for ids in prompts]
    assert want != [hf_greedy(load_hf(family, folder), ids, 8, None) for ids in prompts]
    lora = LoRARequest("attn", str(tmp_path / "attn"))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora=[lora, lora])] == want


def test_an_adapter_on_expert_modules_is_refused_naming_them(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    import peft

    from tandem.engine.lora.manager import AdapterError

    folder = checkpoints["qwen3_moe"]  # layer 1 is dense: PEFT finds gate/up/down_proj there
    llm = LLM(str(folder), dtype="float32", enable_lora=True, max_lora_rank=8, kv_cache_memory=1 << 20)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    # PEFT turns MLP module names on a MoE model into `target_parameters` (the stacked experts)
    for name, targets, param, named in (
        ("experts", ["q_proj", "gate_proj", "up_proj"], "target_parameters", "gate_up_proj"),
        ("experts-down", ["down_proj"], "target_parameters", "down_proj"),
    ):
        model = peft.get_peft_model(
            load_hf("qwen3_moe", folder), peft.LoraConfig(r=4, target_modules=targets)
        )
        model.save_pretrained(str(tmp_path / name))
        with pytest.raises(AdapterError) as refused:
            llm.generate([[5, 6, 7]], params, lora=[LoRARequest(name, str(tmp_path / name))])
        assert refused.value.param == param and named in refused.value.message, refused.value.message


@pytest.mark.parametrize(
    ("family", "change", "named"),
    [
        ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
        ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_moe_configs_computed_inexactly_are_refused(
    family: str, change: dict[str, Any], named: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    import json
    import shutil

    folder = tmp_path / family
    shutil.copytree(checkpoints[family], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ModelLoadError) as refused:
        LLM(str(folder), dtype="float32", kv_cache_memory=1 << 20)
    assert named in str(refused.value)


def test_moe_config_marks_sparse_layers() -> None:
    moe = MoEConfig(
        num_experts=8, top_k=2, intermediate_size=16, renormalize=True, sparse_layers=frozenset({0, 2})
    )
    assert [moe.is_sparse(i) for i in range(4)] == [True, False, True, False]
    assert len(moe.layer_tensor_names()) == 1 + 8 * 3


def test_routing_stats_count_every_routed_token(checkpoints: dict[str, Path]) -> None:
    """`stats()` reports tokens per expert over the sparse layers: each computed token routed to
    top_k experts in each sparse layer (Qwen3-MoE here: 3 of its 4 layers), and the imbalance."""
    from tandem.engine.builder import graph_capturable

    llm = LLM(str(checkpoints["qwen3_moe"]), dtype="float32", kv_cache_memory=1 << 20, speculative=None,
              enable_prefix_caching=False)  # fmt: skip
    assert "moe_expert_tokens" not in llm.stats()
    prompt = llm.tokenizer.encode("Routing counts every token that passes a sparse layer")
    llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    stats = llm.stats()
    num_computed = len(prompt) + 5 - 1  # the last sampled token is never fed back
    assert sum(stats["moe_expert_tokens"]) == num_computed * 2 * 3
    assert len(stats["moe_expert_tokens"]) == 8 and stats["moe_expert_imbalance"] >= 1.0
    assert not graph_capturable(llm.engine.runner.model)  # type: ignore[attr-defined]  # eager on CUDA


def test_group_limited_sigmoid_routing_picks_only_from_the_best_groups() -> None:
    """8 experts in 4 groups, 2 groups eligible: every choice lies in the two groups whose best
    two corrected scores sum highest; the weights are the uncorrected scores, renormalised and
    scaled; the correction bias moves the choice, not the weights."""
    from tandem.kernels.moe import sigmoid_group_topk_routing

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 8, generator=gen)
    bias = torch.randn(8, generator=gen) * 0.5
    weights, ids = sigmoid_group_topk_routing(logits, bias, 3, 4, 2, True, 2.5)
    choice = logits.sigmoid() + bias
    group_scores = choice.view(64, 4, 2).sum(-1)  # a group of 2: its best two are all of it
    best = group_scores.topk(2, dim=-1).indices
    assert all(set((ids[t] // 2).tolist()) <= set(best[t].tolist()) for t in range(64))
    assert torch.allclose(weights.sum(-1), torch.full((64,), 2.5), atol=1e-5)
    picked = logits.sigmoid().gather(1, ids)
    assert torch.allclose(weights, picked / picked.sum(-1, keepdim=True) * 2.5, atol=1e-6)
    _, unbiased = sigmoid_group_topk_routing(logits, None, 3, 4, 2, True, 2.5)
    assert not torch.equal(unbiased.sort(-1).values, ids.sort(-1).values)


def test_int4_experts_compute_their_dequantised_weights_in_under_a_third_of_the_bytes(
    checkpoints: dict[str, Path],
) -> None:
    """`weight_dtype="int4"` quantises every expert (and the shared expert) through the INT4
    kernels: a sparse block's output equals the float block's with each expert's weight replaced
    by its dequantised INT4 weight, in under 0.3x the bytes of 16-bit experts; the router stays
    float. Perplexity on the fixed text moves by the figures in docs/performance.md (asserted
    within 15% here: random N(0, 0.12) weights quantise far worse than trained ones)."""
    import dataclasses
    import math

    from safetensors.torch import load_file

    from tandem.kernels.int4 import Int4Linear, dequantize_int4, quantize_int4

    from .test_model_families import PROMPTS, _teacher_forced_nll

    folder = checkpoints["glm4_moe"]
    options = {"dtype": "float32", "kv_cache_memory": 1 << 20, "block_size": 4, "speculative": None}
    dense = LLM(str(folder), **options)
    int4 = LLM(str(folder), weight_dtype="int4", int4_method="rtn", native_decoder=False, **options)
    int4_block = int4.engine.runner.model.layers[1].mlp  # type: ignore[attr-defined]
    assert isinstance(int4_block, SparseMoE)
    linears = [m for m in int4_block.modules() if isinstance(m, Int4Linear)]
    assert len(linears) == 2 * (8 + 1)  # every expert's gate/up and down, and the shared expert's
    assert not isinstance(int4_block.router, Int4Linear)
    bf16_bytes = sum(2 * m.in_features * m.out_features for m in linears)
    assert (
        sum(m.num_weight_bytes for m in linears) < bf16_bytes / 3
    )  # group 32: 4 bits + 32 bits of scale and zero per 32 = 5 / 16 of bfloat16

    rounded = SparseMoE(int4_block.moe, 64, 1)
    weights = load_file(str(folder / "model.safetensors"))

    def put(param: torch.Tensor, value: torch.Tensor, _: str) -> None:
        with torch.no_grad():
            param.copy_(value)

    rounded.load_hf(lambda name: weights["model." + name], put, "layers.1.")
    with torch.no_grad():
        for name, module in rounded.named_modules():
            if isinstance(module, torch.nn.Linear):
                group = dict(int4_block.named_modules())[name].group_size
                w = quantize_int4(
                    module.weight, group
                )  # the native kernel stores group parameters in float16
                w = dataclasses.replace(w, scale=w.scale.half().float(), zero=w.zero.half().float())
                module.weight.copy_(dequantize_int4(w))
    x = torch.randn(19, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = rounded(x), int4_block(x)
    # float16 group parameters on the native kernel; torch's kernel also rounds activations to bfloat16
    tolerance = 1e-3 if all(m.kernel == "native" for m in linears) else 1e-2
    assert (got - want).abs().max().item() < tolerance * max(1.0, want.abs().max().item())

    token_ids = dense.tokenizer.encode(" ".join(PROMPTS * 2))[:200]
    ratio = math.exp(_teacher_forced_nll(int4, token_ids) - _teacher_forced_nll(dense, token_ids))
    assert ratio != 1.0 and abs(ratio - 1) < 0.15, ratio


def test_multi_token_prediction_layers_are_left_unread_and_nothing_else(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A GLM-4.5 checkpoint as published carries `num_nextn_predict_layers` extra layers (for
    speculation, outside the forward pass, skipped by HF too): they load and change nothing; a
    tensor of any other extra layer is still refused by name."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    base = LLM(str(checkpoints["glm4_moe"]), dtype="float32", kv_cache_memory=1 << 20)
    want = base.generate(["Multi-token prediction"], params)[0].outputs[0].token_ids
    for extra_layer, accepted in ((4, True), (5, False)):
        folder = tmp_path / f"mtp{extra_layer}"
        shutil.copytree(checkpoints["glm4_moe"], folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
        weights = load_file(str(folder / "model.safetensors"))
        weights.update({
            name.replace("model.layers.1.", f"model.layers.{extra_layer}."): tensor.clone()
            for name, tensor in weights.items() if name.startswith("model.layers.1.")
        })  # fmt: skip
        weights[f"model.layers.{extra_layer}.eh_proj.weight"] = torch.zeros(64, 128)
        save_file(weights, str(folder / "model.safetensors"))
        if accepted:
            llm = LLM(str(folder), dtype="float32", kv_cache_memory=1 << 20)
            assert llm.generate(["Multi-token prediction"], params)[0].outputs[0].token_ids == want
        else:
            with pytest.raises(ModelLoadError) as refused:
                LLM(str(folder), dtype="float32", kv_cache_memory=1 << 20)
            assert "model.layers.5." in str(refused.value)
