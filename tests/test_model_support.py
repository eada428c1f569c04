"""Checkpoints the engine would answer inexactly are refused by name, never served.

Tiny random-weight models built by `transformers` itself (the reference nobody here wrote): what
it writes for an unsupported architecture (OLMo), activations a family does not compute, keys
no module implements, partial rotary embeddings, an unsupported rope type, and a checkpoint with a
tensor no module consumes are each refused with a `ModelLoadError` naming the key or the tensor;
`tandem serve --model` exits with that message before starting anything. (What each supported
family computes is checked against HF in `test_model_families.py`.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM
from tandem.engine.models.loader import check_model
from tandem.platform.errors import ModelLoadError

from .conftest import make_tiny_model

SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("plain-llama"), num_layers=2)


def hf_checkpoint(folder: Path, tokenizer_files: Path, config_class: str, **overrides: Any) -> Path:
    """A random-weight checkpoint saved by transformers' own `<Family>ForCausalLM`."""
    import transformers

    config_type = getattr(transformers, config_class)
    model_class = getattr(transformers, config_class.replace("Config", "ForCausalLM"))
    vocab = json.loads((tokenizer_files / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    model = model_class(config_type(vocab_size=vocab, **{**SMALL, **overrides})).float()
    model.save_pretrained(str(folder), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_files / name, folder / name)
    return folder


def refusal(path: Path) -> str:
    """The message `LLM(path)` refuses the checkpoint with (and `check_model` agrees)."""
    with pytest.raises(ModelLoadError) as from_check:
        check_model(str(path))
    with pytest.raises(ModelLoadError) as from_load:
        LLM(str(path), kv_cache_memory=1 << 20)
    assert from_check.value.message == from_load.value.message
    assert from_load.value.param == "model"
    return from_load.value.message


@pytest.mark.parametrize(
    ("config_class", "overrides", "named"),
    [
        ("OlmoConfig", {}, "model_type 'olmo'"),
        ("LlamaConfig", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("Gemma2Config", {"hidden_activation": "relu", "head_dim": 8}, "hidden_activation='relu'"),
        ("Qwen3Config", {"use_qk_norm": True, "head_dim": 8}, "use_qk_norm"),  # not a Qwen3 key: refused
        (
            "Phi3Config",
            {"partial_rotary_factor": 0.5, "pad_token_id": None},
            "partial_rotary_factor",
        ),
    ],
)
def test_inexact_configs_are_refused_by_key(
    tmp_path: Path, tokenizer_files: Path, config_class: str, overrides: dict, named: str
) -> None:
    message = refusal(hf_checkpoint(tmp_path / "m", tokenizer_files, config_class, **overrides))
    assert named in message


@pytest.mark.parametrize("rope_type", ["proportional", "su"])
def test_an_unsupported_rope_type_is_refused_by_key(
    tmp_path: Path, tokenizer_files: Path, rope_type: str
) -> None:
    folder = hf_checkpoint(tmp_path / "m", tokenizer_files, "LlamaConfig")
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(config))
    message = refusal(folder)
    assert f"rope_parameters.rope_type={rope_type!r}" in message


def test_a_tensor_no_module_consumes_is_refused_by_name(tmp_path: Path, tokenizer_files: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = hf_checkpoint(tmp_path / "m", tokenizer_files, "LlamaConfig")
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.layers.1.self_attn.q_norm.weight"] = torch.ones(8)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert "model.layers.1.self_attn.q_norm.weight" in refusal(folder)


def test_plain_llama_and_mistral_without_window_still_load(tmp_path: Path, tokenizer_files: Path) -> None:
    """The refusals are not blanket: a Llama checkpoint and a Mistral one whose window covers the
    whole context load and give HF's greedy tokens."""
    check_model(str(tokenizer_files))
    check_model("smollm2-135m-instruct")
    import transformers

    folder = hf_checkpoint(tmp_path / "mistral", tokenizer_files, "MistralConfig", sliding_window=None)
    hf = transformers.MistralForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    llm = LLM(str(folder), kv_cache_memory=1 << 20)
    ids = llm.tokenizer.encode("The quick brown fox jumps over")
    ours = llm.generate([ids], _greedy(12))[0].outputs[0].token_ids
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert list(ours) == theirs[0, len(ids) :].tolist()


def _greedy(num: int):  # type: ignore[no-untyped-def]
    from tandem import SamplingParams

    return SamplingParams(max_tokens=num, temperature=0.0, ignore_eos=True)


def test_tandem_serve_exits_with_the_refusal(tmp_path: Path, tokenizer_files: Path) -> None:
    folder = hf_checkpoint(tmp_path / "m", tokenizer_files, "OlmoConfig")
    env = {**os.environ, "TANDEM_API_KEYS": "k=t"}
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "serve", "--model", str(folder), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 2, result.stderr
    error = json.loads(result.stderr.strip().splitlines()[-1])["error"]
    assert "model_type 'olmo'" in error["message"] and error["type"] == "model_load_error"
