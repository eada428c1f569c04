"""Mixture-of-experts: top-k routing and the experts' gated MLPs over the tokens routed to them.

Shapes: T tokens, H hidden, E experts, I an expert's intermediate size, k experts per token.
Expert weights are stacked: `w_gate_up` [E, 2I, H] (gate rows first, then up rows, as HF's fused
`experts.gate_up_proj`), `w_down` [E, H, I]. An expert computes `down(act(gate x) * up x)`, and a
token's output is the sum over its k experts of that times the expert's routing weight.

`grouped_experts` is the fast path: the T*k (token, expert) pairs are sorted by expert once, and
each expert that received tokens runs its two matmuls over all of them at once (no per-token
Python loop), through an `ExpertFn`: stacked dense weights (`stacked_experts`) or the model's
per-expert linears (dense or INT4); `experts_reference` is the per-token definition.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu",)


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name != "silu":
        raise ValueError(f"expert activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return F.silu(x)


def softmax_topk_routing(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's and Qwen-MoE's routing: softmax over the experts in float32, the top k, their
    weights renormalised to sum to 1 when `renormalize` (Mixtral always; Qwen `norm_topk_prob`).
    Returns (weights [T, k] in the logits' dtype, expert ids [T, k] int64); ties go to the lower
    expert id, as `torch.topk` orders them."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def sigmoid_group_topk_routing(
    router_logits: torch.Tensor,  # [T, E] float32
    correction_bias: torch.Tensor | None,  # [E] float32: added for the choice only
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's and GLM-4.5's routing: sigmoid scores; the experts are split into
    `num_groups` groups, each scored by the sum of its two best (bias-corrected) scores, and only
    the `topk_groups` best groups are eligible; the top k eligible experts by corrected score are
    chosen, weighted by their uncorrected scores (renormalised to sum to 1 when `renormalize`),
    times `scaling`. Returns (weights [T, k] float32, expert ids [T, k] int64)."""
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1:
        grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        best_groups = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, best_groups, 1.0)
        expert_mask = (
            group_mask.unsqueeze(-1).expand(-1, -1, num_experts // num_groups).reshape(num_tokens, -1)
        )
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def experts_reference(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H]
    w_down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    act: str = "silu",
) -> torch.Tensor:  # [T, H]
    """The definition: each token through each of its experts, one at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate, up = (w_gate_up[e] @ x[t]).chunk(2)
            out[t] += (w_down[e] @ (_act(act, gate) * up)) * topk_weights[t, j]
    return out


ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]  # (expert id, rows [n, H]) -> its output [n, H]


def stacked_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor, act: str = "silu") -> ExpertFn:
    """The experts of stacked dense weights ([E, 2I, H] and [E, H, I]) as an `ExpertFn`."""

    def run(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, w_gate_up[expert]).chunk(2, dim=-1)  # [n, I] each
        return F.linear(_act(act, gate) * up, w_down[expert])

    return run


def grouped_experts(
    x: torch.Tensor,  # [T, H]
    expert: ExpertFn,
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    num_experts: int,
    counts: torch.Tensor | None = None,  # [E] `expert_counts(topk_ids)` when the caller has them
) -> torch.Tensor:  # [T, H]
    """`experts_reference`'s result, each active expert computing all of its tokens at once
    (`expert(e, rows)`: a dense, INT4 or any other kernel); the sum order per token may differ
    from the reference's: equal up to rounding."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert, token order kept
    token_of_pair = order // top_k  # [T*k] the token each sorted pair belongs to
    weight_of_pair = topk_weights.reshape(-1)[order]  # [T*k]
    if counts is None:
        counts = expert_counts(topk_ids, num_experts)
    out = torch.zeros_like(x)
    start = 0
    for expert_id, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        tokens = token_of_pair[start : start + count]  # [n]
        hidden = expert(expert_id, x.index_select(0, tokens))  # [n, H]
        out.index_add_(0, tokens, (hidden * weight_of_pair[start : start + count, None]).to(x.dtype))
        start += count
    return out


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert [E] int64 (a token counts once per expert it chose)."""
    return torch.bincount(topk_ids.reshape(-1), minlength=num_experts)
