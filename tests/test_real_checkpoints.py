"""Real trained checkpoints nobody here wrote, as a user brings them (issue: the first real
checkpoint answered wrong by default): Google's Gemma 3 270M (converted by transformers from the
GGUF the package index ships; scripts/real_checkpoints.py) and the default model.

- In float32: completions and chat at temperature 0 equal HF float32's greedy text, with HF's
  prompt token counts: the GGUF file through `tandem serve` on Ray at `--dtype float32`; the folder
  through `tandem serve` where the defaults resolve to float32, else in this process (its
  defaults server checks the prompt token counts either way).
- With the defaults (no precision pin), each greedy step picks HF float32's token from the same
  prefix on at least 97% of positions, alone and in a batch of 16.
- Through `tandem serve` with the defaults (batch-invariant): a temperature-0 request gives the
  same tokens alone, streamed and not, again, inside 16 concurrent requests, with speculation off
  for it, and as a line of a batch job (`_same_tokens_everywhere`).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.host.precision import PIN_ENV

from .test_batch import wait_for
from .test_cli_serve import ServeProcess
from .test_serve import KEY

COMPLETION_PROMPTS = [
    "The capital of France is",
    "The quick brown fox",
    "Water boils at",
    "My favourite food is",
    "In 1969, the first person to walk on the moon was",
    "def fibonacci(n):",
    "The three primary colours are",
    "Once upon a time, in a small village,",
]
CHAT_PROMPTS = [
    "What is the capital of Italy?",
    "Name three fruits.",
    "Write one sentence about the sea.",
    "How many legs does a spider have?",
    "What colour is the sky on a clear day?",
    "Say hello in French.",
    "What is two plus two?",
    "Give me a word that rhymes with cat.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hf_gemma(gemma3_folder: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gemma3_folder), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(gemma3_folder))


# HF float32's greedy text and prompt length per prompt: the serve tests ask for the same prompts,
# and each answer costs seconds here (a 262k-row float32 head per token)
_HF_GREEDY: dict[tuple[int, ...], tuple[str, int]] = {}


def _hf_greedy(hf: tuple[Any, Any], input_ids: list[int]) -> tuple[str, int]:
    _hf_greedy_all(hf, [input_ids])
    return _HF_GREEDY[tuple(input_ids)]


def _hf_greedy_all(hf: tuple[Any, Any], prompts: list[list[int]]) -> None:
    """HF's greedy answers to the prompts not asked yet, in one batch padded on the left (HF's own
    batched generation, with its attention mask): each step reads the 262k-row head once for all."""
    model, tokenizer = hf
    new = [list(key) for key in dict.fromkeys(tuple(p) for p in prompts) if key not in _HF_GREEDY]
    if not new:
        return
    width = max(len(p) for p in new)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in new])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in new])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_TOKENS, do_sample=False)
    for prompt, row in zip(new, out, strict=True):
        _HF_GREEDY[tuple(prompt)] = tokenizer.decode(row[width:], skip_special_tokens=True), len(prompt)


def _chat_ids(tokenizer: Any, content: str) -> list[int]:
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=True, add_generation_prompt=True
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _prompt_ids(tokenizer: Any, chat_prompts: list[str]) -> list[list[int]]:
    """The completion prompts' token ids, then the chat prompts' (with Gemma's template)."""
    return [tokenizer(prompt)["input_ids"] for prompt in COMPLETION_PROMPTS] + [
        _chat_ids(tokenizer, content) for content in chat_prompts
    ]


def _check_hf_greedy(
    base_url: str, hf_gemma: tuple[Any, Any], model: str = "gemma3", chat_prompts: list[str] = CHAT_PROMPTS
) -> None:
    """Completions and chat at temperature 0 equal HF float32's greedy text, with HF's prompt token counts."""
    tokenizer = hf_gemma[1]
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)
    _hf_greedy_all(hf_gemma, _prompt_ids(tokenizer, chat_prompts))
    for prompt in COMPLETION_PROMPTS:
        want, num_prompt_tokens = _hf_greedy(hf_gemma, tokenizer(prompt)["input_ids"])
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert reply.choices[0].text == want, prompt
        assert reply.usage is not None and reply.usage.prompt_tokens == num_prompt_tokens
    for content in chat_prompts:
        want, num_prompt_tokens = _hf_greedy(hf_gemma, _chat_ids(tokenizer, content))
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert chat.choices[0].message.content == want, content
        assert chat.usage is not None and chat.usage.prompt_tokens == num_prompt_tokens


def _card(base_url: str, model: str) -> dict[str, Any]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)
    return dict(client.models.retrieve(model).model_extra["tandem"])  # type: ignore[index]


def _check_prompt_token_counts(base_url: str, hf_gemma: tuple[Any, Any], model: str) -> None:
    """Completions' and chat's `usage.prompt_tokens` equal HF's tokenizer's counts (with Gemma's
    chat template for chat): what the server tokenised, whatever precision it computes in."""
    tokenizer = hf_gemma[1]
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)
    for prompt in COMPLETION_PROMPTS:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
        assert reply.usage is not None and reply.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    for content in CHAT_PROMPTS:
        messages: Any = [{"role": "user", "content": content}]
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0)
        assert chat.usage is not None and chat.usage.prompt_tokens == len(_chat_ids(tokenizer, content))


def _check_hf_greedy_in_process(folder: Path, hf_gemma: tuple[Any, Any]) -> None:
    """The folder loaded in float32 with dense weights: greedy text equals HF float32's for the
    completion and chat prompts' token ids."""
    prompts = _prompt_ids(hf_gemma[1], CHAT_PROMPTS)
    _hf_greedy_all(hf_gemma, prompts)
    llm = LLM(str(folder), dtype="float32", weight_dtype="dense", kv_cache_memory=64 << 20, max_num_seqs=16)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for ids, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].text == _hf_greedy(hf_gemma, ids)[0], hf_gemma[1].decode(ids)


@pytest.mark.ray
@pytest.mark.slow
def test_gemma3_served_with_defaults_and_in_float32(
    gemma3_folder: Path, hf_gemma: tuple[Any, Any], tmp_path: Path
) -> None:
    """Through `tandem serve` with the defaults: the checkpoint's generation defaults on its card;
    alone, streamed or not, the same tokens, and again; HF's prompt token counts. In float32 (the
    served defaults where they resolve to it, else the folder loaded in float32 in this process:
    the served float32 path is test_gemma3_gguf_served_as_downloaded's, on the file this folder
    was converted from): HF float32's greedy text."""
    server = ServeProcess(
        tmp_path, "--kv-cache-memory", str(64 << 20), model=str(gemma3_folder), served_name="gemma3",
        pinned_precision=False,
    )  # fmt: skip
    try:
        server.wait_for(r"serving .* at http://")
        why = server.wait_for(r"\[tandem\] why: ").string
        print(f"\n{why.strip()}")
        assert PIN_ENV not in why  # the defaults, not the test suite's pin
        base_url = f"http://127.0.0.1:{server.port}"
        info = _card(base_url, "gemma3")
        assert info["generation_defaults"] == {"top_p": 0.95, "top_k": 64}  # the checkpoint's own
        _same_tokens_everywhere(base_url, "gemma3", CHAT_PROMPTS[:2])
        served_in_float32 = (info["dtype"], info["weight_dtype"]) == ("float32", "dense")
        if served_in_float32:
            _check_hf_greedy(base_url, hf_gemma)  # the text and the prompt token counts
        else:
            _check_prompt_token_counts(base_url, hf_gemma, "gemma3")
    finally:
        server.stop()
    if not served_in_float32:
        _check_hf_greedy_in_process(gemma3_folder, hf_gemma)


@pytest.mark.ray
@pytest.mark.slow
def test_gemma3_gguf_served_as_downloaded(
    gemma3_gguf: Path, hf_gemma: tuple[Any, Any], tmp_path: Path
) -> None:
    """The Q4_K_M file itself through `tandem serve` (issue 62): its card lists the stored types;
    at float32 compute, completions' greedy text is HF float32's on the folder transformers
    dequantises from the same file, with transformers' GGUF tokenizer's prompt token counts; chat
    too (the file has no template: Gemma's, which Google publishes, as the folder has)."""
    name = gemma3_gguf.stem
    server = ServeProcess(
        tmp_path, "--dtype", "float32", "--weight-dtype", "dense", "--kv-cache-memory", str(64 << 20),
        model=str(gemma3_gguf), served_name=name,
    )  # fmt: skip
    try:
        server.wait_for(r"serving .* at http://")
        base_url = f"http://127.0.0.1:{server.port}"
        info = _card(base_url, name)
        assert info["quant_types"] == ["Q8_0", "Q5_0", "Q4_K", "Q6_K", "F32"]  # most weights first
        _check_hf_greedy(base_url, hf_gemma, name, CHAT_PROMPTS[:2])
    finally:
        server.stop()


def test_gemma3_gguf_tokenizer_is_transformers(gemma3_gguf: Path, hf_gemma: tuple[Any, Any]) -> None:
    """Token ids from the file's own metadata equal transformers' GGUF tokenizer's (the folder's
    tokenizer is the one transformers built from this file, saved)."""
    from tandem.engine.models.gguf_file import GGUFFile

    ours, theirs = GGUFFile(gemma3_gguf).tokenizer, hf_gemma[1]
    texts = [
        *COMPLETION_PROMPTS,
        *CHAT_PROMPTS,
        "  two  spaces\n\n\tand tabs",
        "naïve café 日本語 🙂",
        "x<end_of_turn>y",
    ]
    for text in texts:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == theirs.decode(
            theirs(text)["input_ids"], skip_special_tokens=True
        )


def _agreement(hf_model: Any, prompt_ids: list[int], output_ids: list[int]) -> tuple[int, int]:
    """(positions where `output_ids` is HF float32's argmax after the same prefix, positions)."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.inference_mode():
        logits = hf_model(ids).logits[0, len(prompt_ids) - 1 : -1]  # the prediction of each output token
    return int((logits.argmax(dim=-1) == torch.tensor(output_ids)).sum()), len(output_ids)


@pytest.mark.slow
def test_gemma3_defaults_pick_hf_float32_tokens(
    gemma3_folder: Path, hf_gemma: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The defaults (this machine's precision, held to the quality bound): each greedy step's token
    is HF float32's after the same prefix on >= 97% of positions, alone and in a batch of 16."""
    monkeypatch.delenv(PIN_ENV, raising=False)
    llm = LLM(str(gemma3_folder), kv_cache_memory=128 << 20, max_num_seqs=16)
    print(
        f"\ndefaults: {llm.stats()['dtype']} / {llm.stats()['weight_dtype']}: {llm.stats()['precision_reason']}"
    )
    tokenizer = hf_gemma[1]
    prompts = _prompt_ids(tokenizer, CHAT_PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    alone = [llm.generate([ids], params)[0] for ids in prompts]
    batch = llm.generate(prompts, params)
    for name, outputs in (("alone", alone), ("batch of 16", batch)):
        counts = [_agreement(hf_gemma[0], o.prompt_token_ids, o.outputs[0].token_ids) for o in outputs]
        agreed, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
        print(f"{name}: {agreed}/{total} = {agreed / total:.3f} of steps pick HF float32's token")
        assert agreed / total >= 0.97, name


def _same_tokens_everywhere(base_url: str, model: str, prompts: list[str]) -> None:
    """Each prompt's chat completion at temperature 0 (its token ids, as logprobs name them): alone,
    streamed, alone again, inside 16 other concurrent requests, with speculation off, and as a line
    of a batch job: all equal."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=300)

    def body(content: str, **extra: Any) -> dict[str, Any]:
        return {
            "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 32, "temperature": 0,
            "logprobs": True, **extra,
        }  # fmt: skip

    def tokens(reply: Any) -> list[str]:
        return [item.token for item in reply.choices[0].logprobs.content]

    def ask(content: str, **extra: Any) -> list[str]:
        return tokens(client.chat.completions.create(**body(content), extra_body=extra or None))

    def streamed(content: str) -> list[str]:
        out: list[str] = []
        for chunk in client.chat.completions.create(**body(content), stream=True):
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                out.extend(item.token for item in chunk.choices[0].logprobs.content)
        return out

    others = [f"Write two sentences about {topic}." for topic in OTHER_TOPICS]
    alone = {p: ask(p) for p in prompts}
    for p in prompts:
        assert streamed(p) == alone[p], p
        assert ask(p) == alone[p], p
        assert ask(p, speculative=False) == alone[p], p
    together = [*others[:8], *prompts, *others[8:16]]  # the prompts inside 16 others, sent at once
    with ThreadPoolExecutor(len(together)) as pool:
        answers = list(pool.map(ask, together))
    assert answers[8 : 8 + len(prompts)] == [alone[p] for p in prompts]
    lines = [
        json.dumps(
            {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body(p)}
        )
        for i, p in enumerate([*prompts, *others[:6]])
    ]
    file_id = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_for(client, batch.id, {"completed", "failed", "expired", "cancelled"}, timeout=600)
    assert done.status == "completed" and done.output_file_id is not None
    by_id = {
        (line := json.loads(raw))["custom_id"]: line["response"]["body"]
        for raw in client.files.content(done.output_file_id).text.splitlines()
    }
    for i, p in enumerate(prompts):
        assert [item["token"] for item in by_id[f"line-{i}"]["choices"][0]["logprobs"]["content"]] == alone[
            p
        ], p


OTHER_TOPICS = [
    "the moon", "bread", "rivers", "chess", "volcanoes", "the ocean", "bees", "trains", "glass", "clouds", "copper",
    "owls", "jazz", "deserts", "maps", "tea",
]  # fmt: skip


@pytest.mark.ray
@pytest.mark.slow
def test_default_model_served_with_defaults_answers_the_same_alone(tmp_path: Path) -> None:
    server = ServeProcess(
        tmp_path, "--kv-cache-memory", str(128 << 20), model="smollm2-135m-instruct", served_name="default",
        pinned_precision=False,
    )  # fmt: skip
    try:
        server.wait_for(r"serving .* at http://")
        why = server.wait_for(r"\[tandem\] why: ").string
        print(f"\n{why.strip()}")
        assert PIN_ENV not in why  # the defaults, not the test suite's pin
        _same_tokens_everywhere(f"http://127.0.0.1:{server.port}", "default", CHAT_PROMPTS[:3])
    finally:
        server.stop()
