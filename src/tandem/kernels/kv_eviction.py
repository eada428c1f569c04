"""Which KV tokens each head keeps when a request's cache is compressed (plain torch).

Scores (KV-Compress, arXiv 2410.00161; SnapKV's observation window): the last `W` queries of a
prompt predict what later queries will read. For each KV head h and token t,
    score[h, t] = sum over the query heads g of h's GQA group and the W window queries j of
                  softmax(q_j,g . K_h^T * scale, causal)[t] ** 2
Squaring favours tokens that some query reads strongly over tokens every query reads a little.
The window's own tokens (the last `protected_window` positions) are always kept, and so are the
first `protected_prefix` (StreamingLLM's attention sinks: heads park attention there, and
evicting them moves that mass onto whatever is left). `pool_scores`
(SnapKV's clustering) then gives each token the highest score of its neighbours, so a span that
is read (a number, a name) is kept whole rather than one token of it.

Budget (Ada-KV, arXiv 2407.11550): a layer keeping `budget` of its `num_kv_heads * T` vectors
takes the highest scores over all its heads together, so a head whose attention is spread
keeps more tokens than a head that reads few (per-head eviction). Uniform eviction, the
baseline, keeps `budget / num_kv_heads` tokens in every head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def observation_scores(
    q_window: torch.Tensor,  # [W, Hq, D] queries of the last W prompt positions
    k: torch.Tensor,  # [T, Hk, D] keys of all T prompt positions (after RoPE)
    scale: float,
) -> torch.Tensor:  # [Hk, T] float32
    """Squared causal attention of the window queries, summed over each KV head's query group.
    Window query j sits at position T - W + j and reads keys at positions <= its own."""
    num_window, num_q_heads, head_dim = q_window.shape
    num_tokens, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    q = q_window.float().view(num_window, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hk,G,W,D]
    keys = k.float().permute(1, 0, 2).unsqueeze(1)  # [Hk, 1, T, D]
    logits = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [Hk, G, W, T]
    positions = torch.arange(num_tokens, device=k.device)
    query_positions = torch.arange(num_tokens - num_window, num_tokens, device=k.device)
    logits = logits.masked_fill(positions.view(1, -1) > query_positions.view(-1, 1), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return probs.square().sum(dim=(1, 2))  # [Hk, T]


def pool_scores(
    scores: torch.Tensor,  # [Hk, T]
    kernel: int,  # odd; 1 leaves scores as they are
) -> torch.Tensor:  # [Hk, T]: score[h, t] = max of scores[h, t - kernel // 2 : t + kernel // 2 + 1]
    if kernel <= 1:
        return scores
    if kernel % 2 == 0:
        raise ValueError(f"pooling kernel must be odd, got {kernel}")
    pooled = torch.nn.functional.max_pool1d(scores.unsqueeze(0), kernel, stride=1, padding=kernel // 2)
    return pooled.squeeze(0)


def num_kept_for_rate(
    num_tokens: int, num_kv_heads: int, rate: float, protected_window: int, protected_prefix: int = 0
) -> int:
    """Vectors a layer keeps at compression `rate` (>= 1): ceil(Hk * T / rate), but never fewer
    than the protected tokens in every head, nor more than it holds."""
    if rate < 1.0:
        raise ValueError(f"compression rate must be >= 1, got {rate}")
    floor = num_kv_heads * min(protected_window + protected_prefix, num_tokens)
    return min(num_kv_heads * num_tokens, max(floor, math.ceil(num_kv_heads * num_tokens / rate)))


def select_kept(
    scores: torch.Tensor,  # [Hk, T] one layer's scores (see `observation_scores`)
    budget: int,  # vectors to keep in this layer, over all its heads
    protected_window: int,  # the last this-many tokens of every head are always kept
    per_head: bool = True,  # False: uniform, budget // Hk tokens in every head
    protected_prefix: int = 0,  # the first this-many tokens of every head are always kept
) -> list[list[int]]:  # per KV head: kept token indices, increasing
    """The tokens each head keeps. Protected tokens count against the budget; every head keeps at
    least one token. With `per_head`, the rest of the budget goes to the highest scores over all
    heads together; without it, each head keeps its own top `budget // Hk` (remainder to the
    first heads)."""
    num_kv_heads, num_tokens = scores.shape
    protected = min(max(protected_window, 1), num_tokens)
    prefix = min(protected_prefix, num_tokens)
    ranked = scores.float().clone()
    ranked[:, num_tokens - protected :] = float("inf")
    ranked[:, :prefix] = float("inf")
    if per_head:
        top = torch.topk(ranked.flatten(), min(budget, ranked.numel())).indices
        keep = torch.zeros(num_kv_heads * num_tokens, dtype=torch.bool)
        keep[top] = True
        keep = keep.view(num_kv_heads, num_tokens)
    else:
        keep = torch.zeros(num_kv_heads, num_tokens, dtype=torch.bool)
        base, extra = divmod(budget, num_kv_heads)
        for head in range(num_kv_heads):
            count = min(num_tokens, max(protected + prefix, base + (1 if head < extra else 0)))
            keep[head, torch.topk(ranked[head], count).indices] = True
    keep[:, num_tokens - protected :] = True  # ties at +inf could leave some out of the top-k
    keep[:, :prefix] = True
    return [torch.nonzero(row).flatten().tolist() for row in keep]


@dataclass(frozen=True)
class EvictionPolicy:
    """How a compressed request's context is cut down once it is computed (engine settings)."""

    window: int = 16  # observation window: its queries score the context; its tokens are kept
    sinks: int = 4  # the first tokens, always kept
    pool_kernel: int = 7  # score pooling over neighbours (odd; 1: none)
    per_head: bool = True  # Ada-KV budget over each layer's heads; False: uniform


def plan_kept(
    layer_scores: list[torch.Tensor],  # per layer [Hk, T]: `observation_scores` of the window
    rate: float,
    policy: EvictionPolicy,
) -> list[list[int]]:  # per head (layer * Hk + kv_head): kept token indices, increasing
    """What every head of every layer keeps at compression `rate`: per layer,
    `num_kept_for_rate` vectors chosen by `select_kept` from the pooled scores."""
    kept: list[list[int]] = []
    for scores in layer_scores:
        num_kv_heads, num_tokens = scores.shape
        budget = num_kept_for_rate(num_tokens, num_kv_heads, rate, policy.window, policy.sinks)
        kept += select_kept(
            pool_scores(scores, policy.pool_kernel), budget, policy.window, policy.per_head, policy.sinks
        )
    return kept
