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
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def observation_scores(
    q_window: torch.Tensor,  # [W, Hq, D] queries of the last W positions
    k: torch.Tensor,  # [T, Hk, D] keys each head holds (after RoPE), padded to T
    scale: float,
    lengths: torch.Tensor | None = None,  # [Hk] tokens head h holds (<= T); None: T in every head
) -> torch.Tensor:  # [Hk, T] float32 (0 at padding)
    """Squared causal attention of the window queries, summed over each KV head's query group.
    Window query j is head h's token `lengths[h] - W + j` and reads that head's tokens up to its
    own. Before any eviction every head holds the T positions in order (`lengths` None); after
    one, a head's tokens are its kept ones in order, so the rule reads indices, not positions."""
    num_window, num_q_heads, head_dim = q_window.shape
    num_tokens, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    if lengths is None:
        lengths = torch.full((num_kv_heads,), num_tokens, dtype=torch.int64, device=k.device)
    q = q_window.float().view(num_window, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hk,G,W,D]
    keys = k.float().permute(1, 0, 2).unsqueeze(1)  # [Hk, 1, T, D]
    logits = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [Hk, G, W, T]
    indices = torch.arange(num_tokens, device=k.device)
    last_read = (
        lengths.to(k.device).view(-1, 1) - num_window + torch.arange(num_window, device=k.device)
    )  # [Hk, W]
    hidden = indices.view(1, 1, -1) > last_read.unsqueeze(-1)  # [Hk, W, T]
    logits = logits.masked_fill(hidden.unsqueeze(1), float("-inf"))
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


def protected_window_for(num_tokens: int, rate: float, window: int, sinks: int) -> int:
    """Recent tokens every head keeps whatever their scores: `window`, unless a head's share of
    the budget (ceil(T / rate)) is too small to hold the window, the sinks and as many tokens
    again chosen by score; then half of what the sinks leave. So a high rate is met (not held up
    by the protected tokens), and some of every head's budget still follows its scores. A context
    of at most `window + sinks` tokens is all protected (nothing to gain from evicting it)."""
    share = math.ceil(num_tokens / rate)
    if share >= 2 * window + sinks or num_tokens <= window + sinks:
        return window
    return max(1, min(window, (share - sinks) // 2))


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
    lengths: Sequence[int] | None = None,  # tokens head h holds (<= T); None: T in every head
) -> list[list[int]]:  # per KV head: kept token indices (< its length), increasing
    """The tokens each head keeps. Protected tokens count against the budget; every head keeps at
    least one token. With `per_head`, the rest of the budget goes to the highest scores over all
    heads together; without it, each head keeps its own top `budget // Hk` (remainder to the
    first heads). Indices at or past a head's length (padding) are never kept."""
    num_kv_heads, num_tokens = scores.shape
    held = torch.full((num_kv_heads,), num_tokens) if lengths is None else torch.tensor(list(lengths))
    if int(held.max()) > num_tokens or int(held.min()) < 1:
        raise ValueError(f"head lengths must be within 1..{num_tokens}, got {held.tolist()}")
    index = torch.arange(num_tokens).view(1, -1)
    valid = index < held.view(-1, 1)  # [Hk, T]
    protected = held.clamp(max=max(protected_window, 1))  # [Hk]
    prefix = held.clamp(max=protected_prefix)
    always = valid & ((index >= (held - protected).view(-1, 1)) | (index < prefix.view(-1, 1)))
    ranked = scores.float().clone()
    ranked[always] = float("inf")
    ranked[~valid] = float("-inf")
    if per_head:
        top = torch.topk(ranked.flatten(), min(budget, int(valid.sum()))).indices
        keep = torch.zeros(num_kv_heads * num_tokens, dtype=torch.bool)
        keep[top] = True
        keep = keep.view(num_kv_heads, num_tokens)
    else:
        keep = torch.zeros(num_kv_heads, num_tokens, dtype=torch.bool)
        base, extra = divmod(budget, num_kv_heads)
        for head in range(num_kv_heads):
            floor = int(protected[head]) + int(prefix[head])
            count = min(int(held[head]), max(floor, base + (1 if head < extra else 0)))
            keep[head, torch.topk(ranked[head], count).indices] = True
    keep |= always  # ties at +inf could leave some out of the top-k
    keep &= valid
    return [torch.nonzero(row).flatten().tolist() for row in keep]


@dataclass(frozen=True)
class EvictionPolicy:
    """How a compressed request's cache is cut down (engine settings): once its context is
    computed, and then every `interval` decode steps (0: never again), each time scored by the
    queries of the last `window` positions."""

    window: int = 16  # observation window: its queries score the cache; its tokens are kept
    sinks: int = 4  # the first tokens, always kept
    pool_kernel: int = 7  # score pooling over neighbours (odd; 1: none)
    per_head: bool = True  # Ada-KV budget over each layer's heads; False: uniform
    interval: int = 64  # decode steps between evictions after the first; 0: evict once

    def __post_init__(self) -> None:
        if self.window < 1 or self.sinks < 0 or self.interval < 0:
            raise ValueError(f"eviction window must be >= 1, sinks and interval >= 0: {self}")


def plan_kept(
    layer_scores: list[torch.Tensor],  # per layer [Hk, T]: `observation_scores` of the window
    rate: float,
    policy: EvictionPolicy,
    head_lens: Sequence[int] | None = None,  # per head (layer * Hk + kv_head): tokens it holds
    num_seen: int | None = None,  # tokens the request has computed (default: T)
) -> list[list[int]]:  # per head (layer * Hk + kv_head): kept token indices, increasing
    """What every head of every layer keeps at compression `rate`: per layer, the
    `num_kept_for_rate` share of the `num_seen` tokens the request has computed (never more than
    the layer's heads hold), chosen by `select_kept` from the pooled scores, the last
    `protected_window_for` tokens and the sinks always among them. The first eviction
    has every head holding all `num_seen` tokens; a later one holds what the last one kept plus
    the tokens computed since, so the request stays at `rate` as it grows."""
    kept: list[list[int]] = []
    for layer, scores in enumerate(layer_scores):
        num_kv_heads, num_tokens = scores.shape
        lengths = (
            None if head_lens is None else list(head_lens[layer * num_kv_heads : (layer + 1) * num_kv_heads])
        )
        held = num_kv_heads * num_tokens if lengths is None else sum(lengths)
        seen = num_tokens if num_seen is None else num_seen
        protected = protected_window_for(seen, rate, policy.window, policy.sinks)
        budget = min(held, num_kept_for_rate(seen, num_kv_heads, rate, protected, policy.sinks))
        kept += select_kept(
            pool_scores(scores, policy.pool_kernel), budget, protected, policy.per_head, policy.sinks, lengths
        )
    return kept
