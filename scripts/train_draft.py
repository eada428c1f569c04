"""Train the EAGLE-style draft head for the default model (SmolLM2-135M-Instruct) on this machine.

Stages (each writes into --work and is skipped when its output exists, so a run can resume):

1. `generate`: chat prompts built from templates x topics (none of them the benchmark's), answered
   by the target itself (bfloat16, batched, half greedy, half sampled at temperature 0.7), so the
   head learns to predict what the target says, not what a corpus says.
2. `features`: the target (float32, the engine's compute dtype) over every prompt + answer: the
   last decoder layer's state at each position and the target's top-8 next-token distribution.
3. `vocab`: the draft vocabulary, the K target ids most frequent in the answers (FR-Spec), always
   with the end-of-turn tokens.
4. `train`: the head (a linear fusion of target layers 2, 14 and 29, fc, one decoder layer: about
   5M parameters; the target's embedding, final norm and LM-head rows frozen) on cross-entropy to
   the target's top-8 distribution at answer positions, with uniform noise on the input states
   and training-time test (EAGLE-3: passes 2..`--ttt-depth` read the head's own predicted states
   and attend as drafting at that depth does), AdamW, cosine schedule. `--feature-layers ""
   --regression-weight 1` trains the EAGLE-1 form (the top layer alone, plus smooth-L1 to the
   target's next state).
5. `export`: bfloat16 safetensors into --out (default: the folder the engine loads for the default
   model) and the held-out greedy acceptance of the first draft token.

    python scripts/train_draft.py                       # all stages, about 45 minutes on 2 cores
    python scripts/train_draft.py --num-prompts 200 --epochs 1 --work /tmp/d   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from tandem.engine.models.eagle import EagleConfig, EagleDraft  # noqa: E402
from tandem.engine.models.llama import rms_norm  # noqa: E402
from tandem.engine.models.loader import build_model, load_model  # noqa: E402
from tandem.kernels.attention_metadata import build_attention_metadata  # noqa: E402
from tandem.kernels.rotary import apply_rope  # noqa: E402

DEFAULT_OUT = REPO / "src/tandem/engine/drafts/smollm2-135m-instruct-eagle"
TOP_K = 8  # target distribution kept per position

TOPICS = [
    "the moon",
    "volcanoes",
    "bread baking",
    "the French Revolution",
    "photosynthesis",
    "chess",
    "electric cars",
    "honeybees",
    "the stock market",
    "learning a new language",
    "rainforests",
    "the human heart",
    "jazz music",
    "recycling",
    "the Roman Empire",
    "black holes",
    "gardening",
    "social media",
    "marathon training",
    "ancient Egypt",
    "climate change",
    "vaccines",
    "robots",
    "the internet",
    "coral reefs",
    "time management",
    "meditation",
    "pirates",
    "dinosaurs",
    "the water cycle",
    "friendship",
    "public speaking",
    "the solar system",
    "birds migrating",
    "a rainy day",
    "mountains",
    "teamwork",
    "video games",
    "cooking pasta",
    "saving money",
    "the printing press",
    "earthquakes",
    "cats",
    "dogs",
    "coffee",
    "tea",
    "winter",
    "summer holidays",
    "a job interview",
    "renewable energy",
    "the piano",
    "football",
    "libraries",
    "trains",
    "the Great Wall of China",
    "penguins",
    "writing a novel",
    "machine learning",
    "the brain",
    "kindness",
    "a small town",
    "the desert",
    "submarines",
    "volunteering",
    "healthy breakfast",
    "Python programming",
    "databases",
    "the history of writing",
    "bicycles",
    "owls",
    "the Olympics",
]

TEMPLATES = [
    "Tell me about {t}.",
    "Explain {t} to a ten-year-old.",
    "Write a haiku about {t}.",
    "Give me three interesting facts about {t}.",
    "Write a short story involving {t}.",
    "What are the pros and cons of {t}?",
    "Summarize the main ideas of {t} in one paragraph.",
    "Write a limerick about {t}.",
    "How would you teach someone about {t}?",
    "List five questions a student might ask about {t}.",
    "Describe {t} in exactly two sentences.",
    "Why is {t} important?",
    "Write a tweet about {t}.",
    "What is a common misconception about {t}?",
    "Compose a short speech about {t}.",
    "Give me a step-by-step guide related to {t}.",
    "Write a dialogue between two friends about {t}.",
    "What would the world be like without {t}?",
    "Write a product description inspired by {t}.",
    "Can you give me advice about {t}?",
]


def log(stage: str, **fields: Any) -> None:
    print(json.dumps({"stage": stage, **fields}), flush=True)


def build_prompts(num_prompts: int, seed: int) -> list[str]:
    pairs = [template.format(t=topic) for topic in TOPICS for template in TEMPLATES]
    random.Random(seed).shuffle(pairs)
    return pairs[:num_prompts]


def stage_generate(work: Path, args: argparse.Namespace) -> None:
    out = work / "sequences.json"
    if out.exists():
        return
    from tandem import LLM, SamplingParams

    llm = LLM(args.model, dtype="bfloat16", speculative=None, max_num_seqs=args.gen_batch)
    tokenizer = llm.engine.tokenizer
    prompts = build_prompts(args.num_prompts, args.seed)
    sequences: list[dict[str, Any]] = []
    started = time.perf_counter()
    for index in range(0, len(prompts), args.gen_batch):
        chunk = prompts[index : index + args.gen_batch]
        token_prompts = [
            tokenizer.encode(
                tokenizer.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False
            )
            for p in chunk
        ]
        greedy = (index // args.gen_batch) % 2 == 0
        params = SamplingParams(
            max_tokens=args.max_new_tokens,
            temperature=0.0 if greedy else 0.7,
            top_p=1.0 if greedy else 0.9,
            seed=None,
        )
        outputs = llm.generate(token_prompts, params)
        for ids, output in zip(token_prompts, outputs, strict=True):
            sequences.append({"prompt": ids, "answer": list(output.outputs[0].token_ids)})
        num_tokens = sum(len(s["answer"]) for s in sequences)
        log(
            "generate",
            prompts=len(sequences),
            of=len(prompts),
            answer_tokens=num_tokens,
            tokens_per_s=round(num_tokens / (time.perf_counter() - started), 1),
        )
    out.write_text(json.dumps(sequences))


@torch.inference_mode()
def stage_features(work: Path, args: argparse.Namespace) -> None:
    out = features_path(work, args)
    if out.exists():
        return
    sequences = json.loads((work / "sequences.json").read_text())
    loaded = load_model(args.model)
    cfg = loaded.config
    device = torch.device("cpu")
    model = build_model(loaded, dtype=torch.float32, device=device, max_positions=2048)
    block_size = 16
    max_len = max(len(s["prompt"]) + len(s["answer"]) for s in sequences)
    num_blocks = -(-max_len // block_size) * 8 + 1
    kv = [
        (
            torch.zeros(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim),
            torch.zeros(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim),
            None,
            None,
        )
        for _ in range(cfg.num_hidden_layers)
    ]
    token_ids, states, top_ids, top_probs, offsets = [], [], [], [], [0]
    started = time.perf_counter()
    for index in range(0, len(sequences), 8):
        batch = [s["prompt"] + s["answer"] for s in sequences[index : index + 8]]
        blocks_each = -(-max_len // block_size)
        tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(batch))]
        lens = [len(ids) for ids in batch]
        metadata = build_attention_metadata(tables, lens, lens, block_size, cfg.num_key_value_heads, device)
        flat = torch.tensor([t for ids in batch for t in ids], dtype=torch.int64)
        positions = torch.tensor([p for n in lens for p in range(n)], dtype=torch.int64)
        logits, hidden = model(
            flat,
            positions,
            kv,
            metadata,
            torch.arange(len(flat)),
            return_hidden=True,
            hidden_layers=feature_layers(args),
        )
        probs, ids = logits.softmax(dim=-1).topk(TOP_K, dim=-1)  # [T, 8]
        token_ids.append(flat.to(torch.int32))
        states.append(hidden.to(torch.bfloat16))
        top_ids.append(ids.to(torch.int32))
        top_probs.append(probs.to(torch.float16))
        for n in lens:
            offsets.append(offsets[-1] + n)
        log(
            "features",
            sequences=min(index + 8, len(sequences)),
            of=len(sequences),
            tokens_per_s=round(offsets[-1] / (time.perf_counter() - started), 1),
        )
    torch.save(
        {
            "token_ids": torch.cat(token_ids),
            "states": torch.cat(states),
            "top_ids": torch.cat(top_ids),
            "top_probs": torch.cat(top_probs),
            "offsets": torch.tensor(offsets, dtype=torch.int64),
            "prompt_lens": torch.tensor([len(s["prompt"]) for s in sequences], dtype=torch.int64),
            "hidden_size": cfg.hidden_size,
        },
        out,
    )


def feature_layers(args: argparse.Namespace) -> tuple[int, ...]:
    return tuple(sorted(int(x) for x in args.feature_layers.split(",") if x.strip()))


def features_path(work: Path, args: argparse.Namespace) -> Path:
    layers = feature_layers(args)
    return work / ("features.pt" if not layers else f"features_layers_{'-'.join(map(str, layers))}.pt")


def stage_vocab(work: Path, args: argparse.Namespace) -> torch.Tensor:
    out = work / "token_map.pt"
    if out.exists():
        return torch.load(out)
    sequences = json.loads((work / "sequences.json").read_text())
    loaded = load_model(args.model)
    counts = np.zeros(loaded.config.vocab_size, dtype=np.int64)
    for s in sequences:
        np.add.at(counts, np.array(s["answer"], dtype=np.int64), 1)
    always = set(loaded.config.eos_token_ids) | set(loaded.tokenizer.eos_token_ids)
    order = [int(t) for t in np.argsort(-counts, kind="stable") if t not in always]
    token_map = torch.tensor(sorted(always) + order[: args.draft_vocab - len(always)], dtype=torch.int64)
    covered = counts[token_map.numpy()].sum() / max(1, counts.sum())
    log("vocab", draft_vocab=len(token_map), answer_token_coverage=round(float(covered), 4))
    torch.save(token_map, out)
    return token_map


def make_head(args: argparse.Namespace, token_map: torch.Tensor) -> tuple[EagleDraft, Any]:
    loaded = load_model(args.model)
    cfg = EagleConfig.for_target(loaded.config, len(token_map), name="SmolLM2-135M-Instruct")
    cfg.feature_layers = list(feature_layers(args))
    head = EagleDraft(cfg, max_positions=2048)
    head.token_map = token_map
    head.init_rope()
    embed = torch.nn.Embedding.from_pretrained(
        loaded.weights["model.embed_tokens.weight"].float(), freeze=True
    )
    lm_head = loaded.weights.get("lm_head.weight", loaded.weights["model.embed_tokens.weight"])
    head.attach_target(embed, loaded.weights["model.norm.weight"], lm_head.float())
    # Start the layer from the target's last layer (closest to the states it must predict).
    layer_prefix = f"model.layers.{loaded.config.num_hidden_layers - 1}."
    w = loaded.weights
    with torch.no_grad():
        layer = head.layer
        layer.self_attn.qkv_proj.weight.copy_(
            torch.cat([w[layer_prefix + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        )
        layer.self_attn.o_proj.weight.copy_(w[layer_prefix + "self_attn.o_proj.weight"])
        layer.mlp.gate_up_proj.weight.copy_(
            torch.cat([w[layer_prefix + "mlp.gate_proj.weight"], w[layer_prefix + "mlp.up_proj.weight"]])
        )
        layer.mlp.down_proj.weight.copy_(w[layer_prefix + "mlp.down_proj.weight"])
        layer.input_layernorm.copy_(w[layer_prefix + "input_layernorm.weight"])
        layer.post_attention_layernorm.copy_(w[layer_prefix + "post_attention_layernorm.weight"])
        hidden = cfg.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, hidden:].copy_(torch.eye(hidden))  # start as: pass the target's state through
        head.fc.weight[:, :hidden].normal_(0.0, 0.02)
        head.fc.bias.zero_()
        if head.fuse is not None:  # start from the top layer's state alone
            head.fuse.weight.zero_()
            head.fuse.weight[:, -hidden:].copy_(torch.eye(hidden))
    return head, loaded


def batches(data: dict[str, torch.Tensor], indices: list[int], max_tokens: int) -> list[list[int]]:
    offsets = data["offsets"]
    out, current, longest = [], [], 0
    for i in indices:
        n = int(offsets[i + 1] - offsets[i])
        if current and max(longest, n) * (len(current) + 1) > max_tokens:
            out.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        out.append(current)
    return out


def collate(
    data: dict[str, torch.Tensor],
    seq_ids: list[int],
    remap: torch.Tensor,
    noise: float,
    answers_only: bool = True,
):
    offsets = data["offsets"]
    lengths = [int(offsets[i + 1] - offsets[i]) for i in seq_ids]
    length = max(lengths)
    width = data["states"].shape[1]  # len(feature_layers) * hidden, the top one last
    hidden = int(data.get("hidden_size", width))
    input_ids = torch.zeros(len(seq_ids), length, dtype=torch.int64)
    features = torch.zeros(len(seq_ids), length, width)
    target_states = torch.zeros(len(seq_ids), length, hidden)
    target_ids = torch.zeros(len(seq_ids), length, TOP_K, dtype=torch.int64)
    target_probs = torch.zeros(len(seq_ids), length, TOP_K)
    mask = torch.zeros(len(seq_ids), length)
    prompt_lens = data["prompt_lens"]
    for row, (i, n) in enumerate(zip(seq_ids, lengths, strict=True)):
        start = int(offsets[i])
        states = data["states"][start : start + n].float()
        input_ids[row, :n] = data["token_ids"][start : start + n].long()
        features[row, 1:n] = states[: n - 1]  # position p reads the target's state at p - 1
        target_states[row, :n] = states[:, -hidden:]
        target_ids[row, :n] = remap[data["top_ids"][start : start + n].long()]
        target_probs[row, :n] = data["top_probs"][start : start + n].float()
        # Loss where the head will draft: at answer positions (position p predicts token p + 1;
        # the first answer token is the target's own, so drafting starts at the prompt's length).
        mask[row, int(prompt_lens[i]) if answers_only else 0 : n] = 1.0
    if noise > 0:
        features = features + (torch.rand_like(features) * 2 - 1) * noise
    return input_ids, features, target_states, target_ids, target_probs, mask


def ttt_mask(length: int, depth: int) -> torch.Tensor:
    """[T, depth * T] bool: which keys the pass-`depth` query at position p reads, as at
    inference: the keys of pass 1 (computed from the target's states) up to p - depth + 1, then
    the key of pass m at position p - (depth - m) for m = 2..depth (the head's own drafts)."""
    p = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    blocks = [j <= p - (depth - 1)] + [j == p - (depth - m) for m in range(2, depth + 1)]
    return torch.cat(blocks, dim=1)


def ttt_forward(
    head: EagleDraft, input_ids: torch.Tensor, features: torch.Tensor, depth: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Training-time test (EAGLE-3): pass 1 reads the target's states; pass d reads the states
    the head predicted in pass d - 1 at the position before, and attends as drafting depth d does.
    Per pass: logits [N, T, K] and predicted states [N, T, H]."""
    layer, attn = head.layer, head.layer.self_attn
    num_seqs, length = input_ids.shape
    embedded = head._embed(input_ids)
    cos = head.rope_cos[:length].unsqueeze(1)
    sin = head.rope_sin[:length].unsqueeze(1)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outputs = []
    states = head.fuse_states(features)  # [N, T, H]
    for d in range(1, depth + 1):
        x = head.fc(torch.cat([embedded, states], dim=-1))  # [N, T, H]
        normed = rms_norm(x, layer.input_layernorm, layer.eps)
        q, k, v = attn.qkv_proj(normed).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = apply_rope(q.view(num_seqs, length, attn.num_heads, attn.head_dim), cos, sin).transpose(1, 2)
        keys.append(
            apply_rope(k.view(num_seqs, length, attn.num_kv_heads, attn.head_dim), cos, sin).transpose(1, 2)
        )
        values.append(v.view(num_seqs, length, attn.num_kv_heads, attn.head_dim).transpose(1, 2))
        out = F.scaled_dot_product_attention(
            q,
            torch.cat(keys, dim=2),
            torch.cat(values, dim=2),
            attn_mask=ttt_mask(length, d),
            scale=attn.scale,
            enable_gqa=True,
        )  # [N, Hq, T, D]
        h = x + attn.o_proj(out.transpose(1, 2).reshape(num_seqs, length, attn.q_size))
        hidden = h + layer.mlp(rms_norm(h, layer.post_attention_layernorm, layer.eps))
        logits = head.lm_head(rms_norm(hidden, head.norm, head.config.rms_norm_eps)).float()
        outputs.append((logits, hidden))
        states = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1].detach()], dim=1)
    return outputs


def losses(
    head: EagleDraft, batch: tuple[torch.Tensor, ...], feature_scale: float, depth: int
) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """Regression and cross-entropy summed over passes (weight 0.8^(d-1)), and top-1 agreement
    with the target per pass."""
    input_ids, features, target_states, target_ids, target_probs, mask = batch
    valid = target_ids >= 0
    weights = target_probs * valid
    regression = torch.zeros(())
    ce = torch.zeros(())
    accuracies = []
    for d, (logits, predicted) in enumerate(ttt_forward(head, input_ids, features, depth)):
        # Pass d + 1's first d positions have no counterpart at inference (no earlier draft).
        pass_mask = mask.clone()
        pass_mask[:, :d] = 0
        scale = 0.8**d
        per_position = F.smooth_l1_loss(
            predicted.float() / feature_scale, target_states / feature_scale, reduction="none"
        ).mean(-1)
        regression = regression + scale * (per_position * pass_mask).sum() / pass_mask.sum()
        picked = logits.log_softmax(dim=-1).gather(-1, target_ids.clamp(min=0)) * valid  # [N, T, 8]
        per_position = -(picked * weights).sum(-1) / weights.sum(-1).clamp(min=1e-6)
        ce = ce + scale * (per_position * pass_mask).sum() / pass_mask.sum()
        top1 = (logits.argmax(-1) == target_ids[..., 0]) & valid[..., 0]
        accuracies.append(float((top1.float() * pass_mask).sum() / pass_mask.sum()))
    return regression, ce, accuracies


def stage_train(work: Path, args: argparse.Namespace, token_map: torch.Tensor) -> EagleDraft:
    head, loaded = make_head(args, token_map)
    checkpoint = features_path(work, args).with_name(
        features_path(work, args).stem.replace("features", "head") + ".pt"
    )
    data = torch.load(features_path(work, args))
    remap = torch.full((loaded.config.vocab_size,), -1, dtype=torch.int64)
    remap[token_map] = torch.arange(len(token_map))
    num_seqs = len(data["offsets"]) - 1
    order = list(range(num_seqs))
    random.Random(args.seed).shuffle(order)
    num_heldout = max(8, num_seqs // 20)
    heldout, train = order[:num_heldout], order[num_heldout:]
    feature_scale = float(data["states"][:100_000].float().abs().mean())
    if checkpoint.exists():
        head.load_state_dict(torch.load(checkpoint), strict=False)
        log("train", resumed=str(checkpoint))
        return head
    params = [p for name, p in head.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    train_batches = batches(data, train, args.batch_tokens)
    total_steps = args.epochs * len(train_batches)
    step, started = 0, time.perf_counter()
    for epoch in range(args.epochs):
        random.Random(args.seed + epoch).shuffle(train_batches)
        for seq_ids in train_batches:
            lr = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / total_steps))
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = collate(data, seq_ids, remap, args.noise * feature_scale)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                regression, ce, accuracy = losses(head, batch, feature_scale, args.ttt_depth)
            loss = args.regression_weight * regression + args.ce_weight * ce
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            optimizer.step()
            step += 1
            if step % 20 == 0 or step == total_steps:
                log(
                    "train",
                    epoch=epoch,
                    step=step,
                    of=total_steps,
                    regression=round(float(regression), 4),
                    ce=round(float(ce), 4),
                    top1_by_depth=[round(a, 3) for a in accuracy],
                    lr=round(lr, 6),
                    elapsed_s=round(time.perf_counter() - started, 1),
                )
        evaluate(head, data, heldout, remap, feature_scale, epoch, max(3, args.ttt_depth))
    torch.save(
        {k: v for k, v in head.state_dict().items() if not k.startswith(("norm", "lm_head"))}, checkpoint
    )
    return head


@torch.no_grad()
def evaluate(
    head: EagleDraft,
    data: dict[str, torch.Tensor],
    heldout: list[int],
    remap: torch.Tensor,
    feature_scale: float,
    epoch: int,
    depth: int,
) -> list[float]:
    """Held-out top-1 agreement with the target per drafting depth (teacher-forced tokens)."""
    sums = [0.0] * depth
    for seq_ids in batches(data, heldout, 8192):
        _, _, accuracies = losses(head, collate(data, seq_ids, remap, 0.0), feature_scale, depth)
        for d, value in enumerate(accuracies):
            sums[d] += value * len(seq_ids)
    result = [round(value / len(heldout), 4) for value in sums]
    log("heldout", epoch=epoch, top1_by_depth=result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--work", type=Path, default=REPO / ".cache/train_draft")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--num-prompts", type=int, default=1400)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--gen-batch", type=int, default=64)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--noise",
        type=float,
        default=0.1,
        help="uniform noise on the input states, in units of their mean magnitude",
    )
    parser.add_argument("--ce-weight", type=float, default=0.5)
    parser.add_argument(
        "--feature-layers",
        default="2,14,29",
        help="target layers whose outputs the head reads, "
        "fused (EAGLE-3: low, middle, top); empty: the last layer's alone",
    )
    parser.add_argument(
        "--regression-weight",
        type=float,
        default=0.0,
        help="weight of smooth-L1 to the target's top state (EAGLE-1; EAGLE-3 drops it)",
    )
    parser.add_argument(
        "--ttt-depth", type=int, default=3, help="drafting depths trained (training-time test)"
    )
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stages", default="generate,features,vocab,train,export")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    stages = set(args.stages.split(","))
    torch.manual_seed(args.seed)
    if "generate" in stages:
        stage_generate(args.work, args)
    if "features" in stages:
        stage_features(args.work, args)
    token_map = stage_vocab(args.work, args)
    if "train" in stages or "export" in stages:
        head = stage_train(args.work, args, token_map)
        if "export" in stages:
            head.save(args.out)
            size = (args.out / "model.safetensors").stat().st_size
            log("export", out=str(args.out), bytes=size)


if __name__ == "__main__":
    main()
