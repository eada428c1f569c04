"""A checkpoint's generation defaults fill a request's unset sampling fields (as vLLM's
`--generation-config auto`), can be turned off, and are stated by /v1/models and stats()."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from tandem import LLM, AsyncEngine, SamplingParams
from tandem.deployments.engine_clients import LocalEngineClient
from tandem.deployments.ingress import create_app
from tandem.deployments.openai.server import OpenAIServer
from tandem.engine.io.generation_defaults import GenerationDefaults
from tandem.engine.models.loader import load_model
from tandem.platform.api_keys import parse_keys
from tandem.platform.errors import ModelLoadError
from tandem.platform.tenancy import TenantRegistry

KEY = "sk-acme"
PROMPTS = ["The quick brown fox", "Paged attention stores", "Continuous batching lets", "Hello there"]
# top_k 1 makes every sampled token the most likely one: a request left to these defaults is
# greedy whatever its seed, one that sets its own fields samples.
DEFAULTS = {"temperature": 1.3, "top_k": 1, "repetition_penalty": 1.0, "max_new_tokens": 7, "do_sample": True}


@pytest.fixture(scope="module")
def folder(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    copy = tmp_path_factory.mktemp("gen-defaults") / "tiny-gen"
    shutil.copytree(tiny_model_dir, copy)
    (copy / "generation_config.json").write_text(json.dumps({**DEFAULTS, "eos_token_id": 2}))
    return copy


def _texts(llm: LLM, params: SamplingParams | None) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params)]


def test_read_from_the_folder_and_checked(folder: Path, tmp_path: Path) -> None:
    defaults = load_model(str(folder)).generation_defaults
    assert defaults.as_dict() == {"temperature": 1.3, "top_k": 1, "repetition_penalty": 1.0, "max_tokens": 7}
    assert defaults.to_hf_dict()["max_new_tokens"] == 7
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ModelLoadError, match="top_p"):
        GenerationDefaults.from_hf_folder(tmp_path)
    gguf = GenerationDefaults.from_gguf_fields({"general.sampling.top_k": 40, "general.sampling.temp": 0.6})
    assert gguf.as_dict() == {"top_k": 40, "temperature": 0.6}


def test_unset_fields_take_the_checkpoint_defaults(folder: Path) -> None:
    llm = LLM(str(folder), kv_cache_memory=4 << 20, speculative=None)
    assert llm.stats()["generation_defaults"]["top_k"] == 1
    greedy = _texts(llm, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    left_to_model = SamplingParams(
        max_tokens=7, seed=3, ignore_eos=True, model_defaults=frozenset({"temperature", "top_k"})
    )
    assert _texts(llm, left_to_model) == greedy
    explicit = _texts(llm, SamplingParams(temperature=1.3, max_tokens=7, seed=3, ignore_eos=True))
    assert explicit != greedy  # set fields are the request's own: it samples


def test_generation_config_none_turns_them_off(folder: Path) -> None:
    llm = LLM(str(folder), kv_cache_memory=4 << 20, speculative=None, generation_config="none")
    assert llm.stats()["generation_defaults"] == {}
    greedy = _texts(llm, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    unset = SamplingParams(
        max_tokens=7, seed=3, ignore_eos=True, model_defaults=frozenset({"temperature", "top_k"})
    )
    assert _texts(llm, unset) != greedy  # temperature 1 over the whole vocabulary


@pytest.fixture(scope="module")
def client(folder: Path) -> Iterator[openai.OpenAI]:
    engine = AsyncEngine.from_options(
        str(folder), kv_cache_memory=4 << 20, served_model_name="tiny-gen", speculative=None
    )
    server = OpenAIServer(LocalEngineClient(engine), TenantRegistry(parse_keys(f"{KEY}=acme")))
    with TestClient(create_app(server)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)
    engine.shutdown()


def test_the_api_applies_them_and_says_which(client: openai.OpenAI) -> None:
    card = client.models.retrieve("tiny-gen")
    info = card.model_extra["tandem"]  # type: ignore[index]
    assert info["generation_defaults"] == {
        "temperature": 1.3,
        "top_k": 1,
        "repetition_penalty": 1.0,
        "max_tokens": 7,
    }
    assert info["dtype"] and info["weight_dtype"] and info["precision_reason"]

    def complete(top_k: int | None = None, **kwargs: object) -> tuple[str, int]:
        extra = {"ignore_eos": True, **({} if top_k is None else {"top_k": top_k})}
        out = client.completions.create(model="tiny-gen", prompt=PROMPTS[0], extra_body=extra, **kwargs)  # type: ignore[call-overload]
        return out.choices[0].text, out.usage.completion_tokens

    greedy, num_tokens = complete(temperature=0, max_tokens=7)
    assert complete(seed=11) == (greedy, 7)  # top_k 1 and max_new_tokens 7 from the checkpoint
    sampled = {complete(seed=seed, temperature=1.3, top_k=-1, max_tokens=7)[0] for seed in range(4)}
    assert sampled != {greedy}  # the request's own top_k wins


def test_repetition_penalty_as_transformers(tiny_model_dir: Path) -> None:
    """Greedy with a repetition penalty (over the prompt and the output) equals HF's generate."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from tandem.kernels.sampling import apply_repetition_penalty

    logits = torch.randn(3, 50)
    ids = torch.tensor([[1, 4, 4, 9], [0, 2, 3, 2], [7, 7, 7, 7]])
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter_(1, ids, True)
    want = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits, seen, torch.full((3,), 1.7)), want)

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=4 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.7)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        ids = torch.tensor([out.prompt_token_ids])
        ref = hf.generate(ids, max_new_tokens=12, do_sample=False, repetition_penalty=1.7, min_new_tokens=12)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist(), prompt
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in plain] != [
        o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)
    ]
