"""Every supported architecture against HF `transformers` (float32), through the whole engine.

Each family's tiny checkpoint is built and saved by `transformers` itself with every parameter
random (biases and norm weights too), with a sliding window of 8 tokens where the family has one
and prompts longer than it (`model_families.py`). Per family:

- last-position logits within 1e-4 of HF's;
- greedy tokens equal to HF's argmax loop (`generate`, KV cache) for every prompt, in one mixed
  batch with chunked prefill (16-token budget), a prefix-cache hit and preemptions (a cache too
  small for the batch): the stats say each happened;
- the same tokens with prompt-lookup speculation on (drafts proposed and verified);
- a PEFT LoRA adapter (every projection by the architecture's own module names, Phi-3's fused
  `qkv_proj` / `gate_up_proj` included; random A and B) equal to PEFT's greedy tokens; an adapter
  naming projections the model does not have is refused naming `target_modules`.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tandem import LLM, LoRARequest, SamplingParams
from tandem.platform.errors import InvalidRequestError

from .conftest import make_tiny_model
from .model_families import COMMON, FAMILIES, MLA_FAMILIES, MOE_FAMILIES, WINDOW, load_hf, save_family_model
from .test_hf_parity import hf_greedy, our_prefill_logits

SHARED_PREFIX = "Once upon a time, in a land far away, there lived a small dragon who "
PROMPTS = [
    SHARED_PREFIX + "loved to read books about the sea.",
    SHARED_PREFIX + "could not fly.",
    "The capital of France is Paris, and the capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]
NEW_TOKENS = 16
LOGIT_ATOL = 1e-4
# 4 layers x K and V x 2 heads x 16 dims x 4 bytes x 4 tokens = 4 KiB a block; a request is up to
# 24 blocks (the byte-level tiny tokenizer makes ~80-token prompts): 28 blocks hold one of them at
# a time, so the batch of four preempts. Where every layer slides (the engine gives back blocks
# that left the window) a request holds at most 3 + 4 (a 16-token chunk) + 2 blocks: 10 blocks
# serve the whole context, one or two requests at a time.
TIGHT = {"kv_cache_memory": 112 << 10, "block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8}
RELEASES_BLOCKS = {"mistral", "phi3"}  # every layer slides: the cache follows the window
WINDOWED_TIGHT = {**TIGHT, "kv_cache_memory": 40 << 10}


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("family-tokenizer"), num_layers=1)


_CHECKPOINTS: dict[str, Path] = {}


def checkpoint(family: str, tokenizer_files: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if family not in _CHECKPOINTS:
        _CHECKPOINTS[family] = save_family_model(family, tmp_path_factory.mktemp(family), tokenizer_files)
    return _CHECKPOINTS[family]


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("family", [*FAMILIES, *MOE_FAMILIES])
def test_family_matches_hf(
    family: str, tokenizer_files: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = checkpoint(family, tokenizer_files, tmp_path_factory)
    hf = load_hf(family, folder)
    roomy = LLM(str(folder), dtype="float32", speculative=None, kv_cache_memory=1 << 20)
    prompt_ids = [roomy.tokenizer.encode(p) for p in PROMPTS]
    assert min(len(ids) for ids in prompt_ids) > 2 * WINDOW  # every prompt slides past the window
    for ids in prompt_ids[:2]:
        with torch.no_grad():
            want_logits = hf(torch.tensor([ids])).logits[0, -1].float()
        got_logits = our_prefill_logits(roomy, ids)[-1]
        assert (got_logits - want_logits).abs().max().item() < LOGIT_ATOL

    tight = WINDOWED_TIGHT if family in RELEASES_BLOCKS else TIGHT
    if family in MLA_FAMILIES:  # a latent block is 40 of the 64 bytes-per-token units: 28 blocks again
        tight = {**TIGHT, "kv_cache_memory": 70 << 10}
    llm = LLM(str(folder), dtype="float32", speculative=None, **tight)
    if family in RELEASES_BLOCKS:  # a cache smaller than one request serves the whole context
        assert (
            llm.engine.kv_manager.capacity_tokens
            < len(prompt_ids[0]) + NEW_TOKENS
            <= llm.engine.max_model_len
        )

    want = [hf_greedy(hf, ids, NEW_TOKENS, None) for ids in prompt_ids]
    assert llm.generate([prompt_ids[0]], greedy())[0].outputs[0].token_ids == want[0]
    outs = llm.generate(prompt_ids, greedy())  # the mixed batch: prefix hit, chunks, preemption
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats

    spec = LLM(
        str(folder), dtype="float32", speculative={"method": "ngram", "num_speculative_tokens": 4}, **tight
    )
    # Drafts verified whatever this machine's step times (the planner's measured cost model can
    # find they do not pay under load): exactness with drafts is what is checked here.
    spec.engine.scheduler.speculation.always_draft()
    outs = spec.generate(prompt_ids, greedy())
    assert [o.outputs[0].token_ids for o in outs] == want
    assert spec.stats()["num_draft_tokens"] > 0


SEPARATE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # Phi-3's module names


def _peft_adapter(family: str, folder: Path, out: Path, targets: list[str] | None = None) -> Path:
    import peft

    base = load_hf(family, folder)
    targets = targets or (FUSED if family == "phi3" else SEPARATE)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    )
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
    model.save_pretrained(str(out))
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_lora_matches_peft(
    family: str, tokenizer_files: Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    import peft

    folder = checkpoint(family, tokenizer_files, tmp_path_factory)
    adapter = _peft_adapter(family, folder, tmp_path / "adapter")
    reference = peft.PeftModel.from_pretrained(load_hf(family, folder), str(adapter)).eval()
    llm = LLM(str(folder), dtype="float32", enable_lora=True, max_lora_rank=8, kv_cache_memory=1 << 20)
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS[1:3]]
    want = [hf_greedy(reference, ids, 8, None) for ids in prompt_ids]
    base = [hf_greedy(load_hf(family, folder), ids, 8, None) for ids in prompt_ids]
    assert want != base  # the adapter changes the answers
    lora = LoRARequest("adapter", str(adapter))
    outs = llm.generate(prompt_ids, greedy(8), lora=[lora, lora])
    assert [o.outputs[0].token_ids for o in outs] == want


def test_an_adapter_for_other_module_names_is_refused(
    tokenizer_files: Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """An adapter naming projections the base model does not have (Llama's q_proj on Phi-3, whose
    checkpoint fuses q/k/v) is a 400 naming `target_modules`, not silently half-applied."""
    from tandem.engine.lora.manager import AdapterError

    folder = checkpoint("phi3", tokenizer_files, tmp_path_factory)
    llama = checkpoint("llama-bias", tokenizer_files, tmp_path_factory)
    adapter = _peft_adapter("llama-bias", llama, tmp_path / "adapter")
    llm = LLM(str(folder), dtype="float32", enable_lora=True, max_lora_rank=8, kv_cache_memory=1 << 20)
    with pytest.raises(AdapterError) as refused:
        llm.generate([[5, 6, 7]], greedy(2), lora=[LoRARequest("llama-names", str(adapter))])
    assert refused.value.param == "target_modules" and "qkv_proj" in refused.value.message


@pytest.mark.parametrize(("family", "released"), [("mistral", True), ("phi3", True), ("gemma2", False)])
def test_sliding_window_memory_is_bounded(
    family: str, released: bool, tokenizer_files: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A model whose every layer slides (window W = 8, blocks of 4) generating 4 W tokens: after
    each step the request holds exactly its table less the blocks wholly before position
    `computed - W + 1`, so never more than W / 4 + 2 blocks, and its tokens are HF's. A model
    with a global layer (Gemma 2) keeps every block (one table serves all its layers)."""
    from tandem.engine.kv.block_pool import FREED_BLOCK
    from tandem.engine.protocol import GenerationRequest

    folder = checkpoint(family, tokenizer_files, tmp_path_factory)
    block_size, new_tokens = 4, 4 * WINDOW
    llm = LLM(str(folder), dtype="float32", speculative=None, kv_cache_memory=1 << 20, block_size=block_size)
    prompt = llm.tokenizer.encode(PROMPTS[2])
    want = hf_greedy(load_hf(family, folder), prompt, new_tokens, None)
    engine, kv = llm.engine, llm.engine.kv_manager
    assert kv.sliding_window == (WINDOW if released else None)
    engine.add_request(GenerationRequest("w", prompt_token_ids=prompt, sampling_params=greedy(new_tokens)))
    held: list[int] = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
        request = engine.scheduler.requests.get("w")
        if request is None:
            break
        table = kv.block_table("w").block_ids
        computed = request.num_computed_tokens
        gone = max(0, computed - WINDOW + 1) // block_size if released else 0
        assert table[:gone] == [FREED_BLOCK] * gone and FREED_BLOCK not in table[gone:]
        assert kv.num_held_blocks("w") == len(table) - gone == kv.pool.num_used_blocks
        held.append(kv.num_held_blocks("w"))
    assert tokens == want
    longest = -(-(len(prompt) + new_tokens) // block_size)
    if released:
        assert max(held[1:]) <= WINDOW // block_size + 2 < longest
        assert kv.num_window_released >= longest - (WINDOW // block_size + 2)
    else:
        assert max(held) == longest - 1 or max(held) == longest
    assert kv.pool.num_used_blocks == 0
    kv.check_integrity()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_int4_decodes_through_the_native_stack(
    family: str, tokenizer_files: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """In INT4, every family's decode steps take the native decoder stack (biases, q/k norms,
    sliding windows with blocks given back past them, Gemma's offset and post norms, GeLU, scaled
    embedding, soft-capping and local RoPE) and give the eager INT4 engine's tokens."""
    from tandem.kernels import int4_native

    if int4_native.load() is None:
        pytest.skip(f"native library unavailable: {int4_native.unavailable_reason()}")
    options = {"dtype": "float32", "weight_dtype": "int4", "speculative": None, "block_size": 4,
               "kv_cache_memory": 1 << 20, "enable_prefix_caching": False}  # fmt: skip
    params = greedy(3 * WINDOW)
    folder = checkpoint(family, tokenizer_files, tmp_path_factory)
    eager = LLM(str(folder), native_decoder=False, **options)
    want = [o.outputs[0].token_ids for o in eager.generate(PROMPTS[2:], params)]
    native = LLM(str(folder), **options)
    got = [o.outputs[0].token_ids for o in native.generate(PROMPTS[2:], params)]
    assert native.stats()["num_native_decoder_steps"] >= params.max_tokens - 1
    assert got == want


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_hand_over_between_engines_of_a_windowed_model(
    family: str, tokenizer_files: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Prefill on one engine, decode on another: the sender keeps a held prefill's blocks whole
    (even where it gives back blocks past the window), the receiver releases them as it decodes;
    the tokens are HF's."""
    from tandem.engine.engine import LLMEngine
    from tandem.engine.protocol import GenerationRequest

    folder = checkpoint(family, tokenizer_files, tmp_path_factory)
    options = {"dtype": "float32", "kv_cache_memory": 1 << 20, "block_size": 4, "speculative": None}
    chunked = {
        "max_num_batched_tokens": 16,
        "max_num_seqs": 8,
    }  # the prompt in chunks: blocks leave the window
    sender = LLMEngine.from_options(str(folder), **options, **chunked)
    receiver = LLMEngine.from_options(str(folder), **options)
    hf = load_hf(family, folder)
    params = greedy(2 * WINDOW)
    for index, text in enumerate(PROMPTS[:2]):
        prompt = sender.tokenizer.encode(text)
        gen = GenerationRequest(f"r{index}", prompt_token_ids=prompt, sampling_params=params)
        sender.add_prefill_request(gen)
        while sender.has_unfinished_requests():
            sender.step()
        receiver.handover.add_request_with_kv(gen, sender.handover.export_kv(gen.request_id))
        tokens: list[int] = []
        while receiver.has_unfinished_requests():
            for out in receiver.step():
                tokens = list(out.outputs[0].token_ids)
        assert tokens == hf_greedy(hf, prompt, params.max_tokens, None)
    assert sender.stats()["kv_blocks_used"] == 0 and receiver.stats()["kv_blocks_used"] == 0
    assert (receiver.stats()["kv_window_released_blocks"] > 0) == (family == "mistral")


def test_longrope_is_served_up_to_its_original_context(
    tokenizer_files: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Beyond `original_max_position_embeddings` HF re-rotates the whole sequence with the long
    factors (which cached keys cannot follow): a LongRoPE model's context is its original one, and
    a longer prompt is refused with a 400 naming the prompt, not answered inexactly."""
    folder = checkpoint("phi3", tokenizer_files, tmp_path_factory)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=1 << 20)
    original = FAMILIES["phi3"][2]["original_max_position_embeddings"]
    assert llm.engine.max_model_len == original < COMMON["max_position_embeddings"]
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate([[5] * (original + 1)], greedy(1))
    assert refused.value.param in ("prompt", "messages", "max_tokens")


def _teacher_forced_nll(llm: LLM, token_ids: list[int], chunk: int = 16) -> float:
    """Mean next-token NLL of `token_ids` through the engine's model and paged cache, in chunks, so
    that attention reads earlier context back from the cache (where FP8 KV acts)."""
    from tandem.kernels.attention_metadata import build_attention_metadata

    engine = llm.engine
    runner, block_size = engine.runner, engine.kv_manager.block_size
    table = list(range(-(-len(token_ids) // block_size)))
    total = 0.0
    with torch.inference_mode():
        for start in range(0, len(token_ids) - 1, chunk):
            end = min(start + chunk, len(token_ids) - 1)
            metadata = build_attention_metadata(
                [table], [end - start], [end], block_size, runner.kv_spec.num_kv_heads, runner.device
            )
            logits = runner.model(
                torch.tensor(token_ids[start:end]), torch.arange(start, end), runner.kv_caches, metadata,
                torch.arange(end - start),
            )  # fmt: skip
            targets = torch.tensor(token_ids[start + 1 : end + 1])
            total -= logits.float().log_softmax(-1).gather(1, targets[:, None]).sum().item()
    return total / (len(token_ids) - 1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp8_kv_perplexity_within_one_percent(
    family: str, tokenizer_files: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """FP8 (e4m3) KV against float32 KV on a fixed text, sliding windows and soft-capping
    included: perplexity within 1% (the bound used for Llama); figures per family and INT4's in
    docs/performance.md (`benchmarks/quant_quality.py --model`)."""
    folder = checkpoint(family, tokenizer_files, tmp_path_factory)
    text = " ".join(PROMPTS * 2)
    options = {"dtype": "float32", "kv_cache_memory": 1 << 20, "block_size": 4, "speculative": None}
    base = LLM(str(folder), **options)
    token_ids = base.tokenizer.encode(text)[:200]
    fp8 = LLM(str(folder), kv_cache_dtype="fp8_e4m3", **options)
    assert fp8.stats()["kv_cache_dtype"] == "float8_e4m3fn"
    ratio = math.exp(_teacher_forced_nll(fp8, token_ids) - _teacher_forced_nll(base, token_ids))
    assert ratio != 1.0 and abs(ratio - 1) < 0.01, ratio  # FP8 moves the figure, within 1%


def test_a_prefix_hit_needs_only_the_blocks_inside_the_window(
    tokenizer_files: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """On a cache smaller than one request, a windowed model's first request gives back (and
    reuses) its early blocks as it goes, so the start of its prompt is no longer cached when the
    same prompt comes again. The second request still skips all but its last tokens: it takes the
    cached blocks inside the window of its first computed position, and its tokens are HF's."""
    from tandem.engine.kv.block_pool import FREED_BLOCK
    from tandem.engine.protocol import GenerationRequest

    folder = checkpoint("mistral", tokenizer_files, tmp_path_factory)
    llm = LLM(str(folder), dtype="float32", speculative=None, **WINDOWED_TIGHT)
    engine, kv = llm.engine, llm.engine.kv_manager
    prompt = llm.tokenizer.encode(PROMPTS[0])
    want = hf_greedy(load_hf("mistral", folder), prompt, NEW_TOKENS, None)
    assert llm.generate([prompt], greedy())[0].outputs[0].token_ids == want
    hits_before = kv.num_prefix_hits
    engine.add_request(GenerationRequest("again", prompt_token_ids=prompt, sampling_params=greedy()))
    engine.step()
    table = kv.block_table("again").block_ids
    assert table[0] == FREED_BLOCK  # block 0 was not cached any more: not needed either
    skipped = kv.num_prefix_hits - hits_before
    assert skipped >= len(prompt) - WINDOW - 2 * TIGHT["block_size"]
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
    assert tokens == want
