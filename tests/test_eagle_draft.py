"""The EAGLE-style draft head (`models/eagle.py`, `EagleProposer`): its paged and dense forms agree,
its files are validated, it reads the target's state at the right position, and the engine's
greedy output is the target's whatever the head proposes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import SamplingParams
from tandem.engine.llm import LLM
from tandem.engine.models.eagle import EagleConfig, EagleDraft, load_eagle
from tandem.engine.models.loader import load_model
from tandem.kernels.attention_metadata import build_attention_metadata
from tandem.platform.errors import InvalidRequestError

from .conftest import make_tiny_model

OPTIONS: dict[str, Any] = {"kv_cache_memory": 160 << 10, "block_size": 4}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("eagle-target"), max_positions=1024)


@pytest.fixture(scope="module")
def one_layer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("eagle-1layer"), max_positions=1024, num_layers=1)


def make_head(
    target: Path, folder: Path, kind: str, seed: int = 0, feature_layers: list[int] | None = None
) -> Path:
    """A head for `target`: `random` (random weights, half the vocabulary), `mirror` (a
    one-layer target's own layer over the token embedding, ignoring states: it predicts exactly
    what the target will), or `passthrough` (its output is the state it reads)."""
    loaded = load_model(str(target))
    cfg = loaded.config
    vocab = torch.arange(cfg.vocab_size) if kind != "random" else torch.arange(0, cfg.vocab_size, 2)
    head_cfg = EagleConfig.for_target(cfg, len(vocab), name="tiny")
    head_cfg.feature_layers = list(feature_layers or [])
    head = EagleDraft(head_cfg, max_positions=1024)
    head.token_map = vocab
    torch.manual_seed(seed)
    hidden = cfg.hidden_size
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0.0, 0.2) if param.dim() == 2 else param.fill_(1.0)
        head.fc.bias.zero_()
        if kind == "mirror":
            assert cfg.num_hidden_layers == 1
            head.fc.weight.zero_()
            head.fc.weight[:, :hidden].copy_(torch.eye(hidden))
            w = loaded.weights
            p = "model.layers.0."
            head.layer.self_attn.qkv_proj.weight.copy_(
                torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
            )
            head.layer.self_attn.o_proj.weight.copy_(w[p + "self_attn.o_proj.weight"])
            head.layer.mlp.gate_up_proj.weight.copy_(
                torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
            )
            head.layer.mlp.down_proj.weight.copy_(w[p + "mlp.down_proj.weight"])
            head.layer.input_layernorm.copy_(w[p + "input_layernorm.weight"])
            head.layer.post_attention_layernorm.copy_(w[p + "post_attention_layernorm.weight"])
        if kind == "passthrough":
            head.fc.weight.zero_()
            head.fc.weight[:, hidden:].copy_(torch.eye(hidden))
            head.layer.self_attn.o_proj.weight.zero_()
            head.layer.mlp.down_proj.weight.zero_()
    head.save(folder, dtype=torch.float32)
    return folder


def spec_llm(target: Path, head: Path, method: str = "draft", **options: Any) -> LLM:
    llm = LLM(
        str(target),
        speculative={"method": method, "draft_model": str(head), "num_speculative_tokens": 3},
        **{**OPTIONS, **options},
    )
    # Verify drafts whatever this machine's step costs are (the planner would at batch 1 anyway).
    llm.engine.scheduler.speculation.always_draft()
    return llm


def test_paged_forward_equals_dense_forward(target_dir: Path, tmp_path: Path) -> None:
    """A prompt in two chunks then two single positions through the paged cache give the dense
    (training) form's logits and states at every position."""
    head = load_eagle(
        make_head(target_dir, tmp_path / "h", "random"),
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_positions=64,
    )
    torch.manual_seed(1)
    cfg = head.config
    head.attach_target(
        torch.nn.Embedding(cfg.target_vocab_size, cfg.hidden_size),
        torch.rand(cfg.hidden_size) + 0.5,
        torch.randn(cfg.target_vocab_size, cfg.hidden_size),
    )
    length, block_size = 11, 4
    ids = torch.randint(0, cfg.target_vocab_size, (length,))
    states = torch.randn(length, cfg.hidden_size)
    want_logits, want_hidden = head.dense_forward(ids[None], states[None])
    kv = [
        (
            torch.zeros(4, block_size, cfg.num_key_value_heads, cfg.head_dim),
            torch.zeros(4, block_size, cfg.num_key_value_heads, cfg.head_dim),
            None,
            None,
        )
    ]
    table = [2, 0, 3]
    with torch.inference_mode():
        for start, end in ((0, 6), (6, 9), (9, 10), (10, 11)):
            metadata = build_attention_metadata(
                [table], [end - start], [end], block_size, cfg.num_key_value_heads, torch.device("cpu")
            )
            logits, hidden = head(
                ids[start:end],
                states[start:end],
                torch.arange(start, end),
                kv,
                metadata,
                torch.arange(end - start),
            )
            torch.testing.assert_close(logits, want_logits[0, start:end], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(hidden, want_hidden[0, start:end], rtol=1e-4, atol=1e-4)


def test_head_files_are_validated(target_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = make_head(target_dir, tmp_path / "h", "random")
    state = load_file(str(folder / "model.safetensors"))
    bad = dict(state, **{"fc.weight": state["fc.weight"][:, :-1].contiguous()})
    save_file(bad, str(folder / "model.safetensors"))
    with pytest.raises(InvalidRequestError, match="fc.weight has shape") as info:
        LLM(str(target_dir), speculative={"method": "draft", "draft_model": str(folder)}, **OPTIONS)
    assert info.value.param == "speculative.draft_model"
    bad = dict(state, token_map=state["token_map"] + 10_000)
    save_file(bad, str(folder / "model.safetensors"))
    with pytest.raises(InvalidRequestError, match="outside the target vocabulary"):
        LLM(str(target_dir), speculative={"method": "draft", "draft_model": str(folder)}, **OPTIONS)
    other = make_tiny_model(tmp_path / "wide", max_positions=1024)
    with pytest.raises(InvalidRequestError, match="method 'draft' needs draft_model"):
        LLM(str(other), speculative={"method": "draft"}, **OPTIONS)


PROMPTS = [[3, 4, 5, 6] * 6 + [7], [9, 10, 11] * 5, [12, 13] * 8 + [14, 15], [20, 21, 22, 23, 24] * 3]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, speculative=False),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    ]


@pytest.mark.parametrize("kind", ["mirror", "random"])
def test_greedy_output_is_the_targets_with_a_head(one_layer_dir: Path, tmp_path: Path, kind: str) -> None:
    """Mixed batches (speculating or not, a sampled request riding along) in a cache small enough
    to preempt: greedy tokens equal the target's alone. The mirror head predicts the one-layer
    target exactly, so nearly every draft is accepted (the head's KV, catch-up and recompute are
    right); the random one has most rejected (rollback)."""
    head = make_head(one_layer_dir, tmp_path / kind, kind)
    small = {"kv_cache_memory": 56 << 10}  # 28 blocks of 4 tokens (the head's cache shares the budget)
    want = LLM(str(one_layer_dir), speculative=None, **{**OPTIONS, **small}).generate(PROMPTS, _params())
    spec = spec_llm(one_layer_dir, head, **small)
    prompts = [*PROMPTS, [30, 31, 32] * 4]
    params = [*_params(), SamplingParams(max_tokens=40, temperature=0.9, ignore_eos=True)]
    got = spec.generate(prompts, params)
    assert [g.outputs[0].token_ids for g in got[:4]] == [w.outputs[0].token_ids for w in want]
    assert len(got[4].outputs[0].token_ids) == 40
    stats = spec.stats()
    assert stats["num_preemptions"] > 0 and stats["num_draft_tokens"] > 0, stats
    if kind == "mirror":
        assert stats["draft_acceptance_rate"] > 0.95, stats
    else:
        assert stats["draft_acceptance_rate"] < 0.5, stats
    assert stats["kv_blocks_used"] == 0


def test_head_reads_the_targets_state_at_the_previous_position(target_dir: Path, tmp_path: Path) -> None:
    """A head whose output is the state it reads proposes, as its first draft, what the target
    predicted at the position before the last: the last token itself, for greedy requests. That
    holds at every proposal only if each request gets its own states at the right positions:
    through chunked prefill, prefix-cache hits, preemption, accepted and rejected drafts, and
    steps where prompt lookup proposed instead (method auto)."""
    spec = spec_llm(
        target_dir,
        make_head(target_dir, tmp_path / "p", "passthrough"),
        method="auto",
        max_num_batched_tokens=16,
        max_num_seqs=8,
    )
    checked = []
    propose = spec.engine.runner.draft.propose

    def recording(items: list[Any], generator_for: Any) -> Any:
        proposals = propose(items, generator_for)
        for item in items:
            history = item.prompt_token_ids + item.output_token_ids
            checked.append((proposals[item.request_id][0][0], history[item.start_position]))
        return proposals

    spec.engine.runner.draft.propose = recording
    long_prompt = [40 + i % 50 for i in range(37)]
    prompts = [*PROMPTS, long_prompt, long_prompt[:33] + [7, 8]]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True) for _ in prompts]
    spec.generate(prompts, params)
    spec.generate([long_prompt[:36] + [9]], params[:1])  # served mostly from the prefix cache
    stats = spec.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert len(checked) > 50
    assert all(draft == last for draft, last in checked), [c for c in checked if c[0] != c[1]][:5]


def test_a_handed_over_request_drafts_with_the_head(one_layer_dir: Path, tmp_path: Path) -> None:
    """A prompt computed by another engine (no target states here): the head catches up on it
    (from zero states; the mirror head reads none) and drafts; the tokens are the target's."""
    from tandem import GenerationRequest
    from tandem.engine.engine import LLMEngine

    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompt = [5, 6, 7, 8] * 5 + [9]
    want = (
        LLM(str(one_layer_dir), speculative=None, **OPTIONS)
        .generate([prompt], params)[0]
        .outputs[0]
        .token_ids
    )
    head = make_head(one_layer_dir, tmp_path / "m", "mirror")
    sender = LLMEngine.from_options(str(one_layer_dir), role="prefill", **OPTIONS)
    assert sender.config.speculative is None  # a prefill engine drafts nothing
    receiver = spec_llm(one_layer_dir, head).engine
    gen = GenerationRequest("r", prompt_token_ids=prompt, sampling_params=params)
    sender.add_prefill_request(gen)
    while sender.has_unfinished_requests():
        sender.step()
    first = receiver.handover.add_request_with_kv(gen, sender.handover.export_kv("r"))
    tokens = list(first.outputs[0].token_ids)
    while receiver.has_unfinished_requests():
        for out in receiver.step():
            tokens = list(out.outputs[0].token_ids)
    assert tokens == want
    stats = receiver.stats()
    assert stats["num_draft_tokens"] > 10 and stats["draft_acceptance_rate"] > 0.95, stats


def test_a_head_fusing_several_target_layers(target_dir: Path, tmp_path: Path) -> None:
    """EAGLE-3 style: the head reads the outputs of target layers 0 and 2, fused. The target's
    forward returns them side by side; greedy tokens stay the target's, in mixed batches with
    preemption and with a handed-over request."""
    from tandem import GenerationRequest
    from tandem.engine.engine import LLMEngine

    head = make_head(target_dir, tmp_path / "fused", "random", feature_layers=[0, 2])
    want = LLM(str(target_dir), speculative=None, **OPTIONS).generate(PROMPTS, _params())
    spec = spec_llm(target_dir, head)
    assert spec.engine.runner.draft.hidden_layers == (0, 2)
    got = spec.generate(PROMPTS, _params())
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    stats = spec.stats()
    assert stats["num_preemptions"] > 0 and stats["num_draft_tokens"] > 0, stats
    sender = LLMEngine.from_options(str(target_dir), role="prefill", **OPTIONS)
    gen = GenerationRequest("h", prompt_token_ids=PROMPTS[0], sampling_params=_params()[0])
    sender.add_prefill_request(gen)
    while sender.has_unfinished_requests():
        sender.step()
    first = spec.engine.handover.add_request_with_kv(gen, sender.handover.export_kv("h"))
    tokens = list(first.outputs[0].token_ids)
    while spec.engine.has_unfinished_requests():
        for out in spec.engine.step():
            tokens = list(out.outputs[0].token_ids)
    assert tokens == want[0].outputs[0].token_ids
