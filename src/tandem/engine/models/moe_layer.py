"""The sparse mixture-of-experts block that replaces a decoder layer's MLP (`DecoderConfig.moe`).

A router (`gate`, a linear to one logit per expert) picks each token's top-k experts
(`kernels.moe.softmax_topk_routing`); the experts' gated MLPs run grouped by expert
(`kernels.moe.grouped_experts`). Weights are stacked per layer, [E, 2I, H] for gate and up (fused
as the dense MLP fuses them) and [E, H, I] for down, loaded from HF's per-expert tensors under
`MoEConfig.checkpoint_prefix` with the family's expert names (Mixtral's w1/w3/w2, Qwen's
gate/up/down_proj).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tandem.kernels.moe import expert_counts, grouped_experts, softmax_topk_routing


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's
    renormalize: bool  # the top-k weights rescaled to sum to 1
    sparse_layers: frozenset[int] | None = None  # the layers with experts (None: every layer)
    checkpoint_prefix: str = "mlp"  # the block's module name in HF's checkpoint
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # HF's gate, up, down
    hidden_act: str = "silu"

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers is None or layer in self.sparse_layers

    def layer_tensor_names(self) -> list[str]:
        """The block's checkpoint tensors in one layer (after `layers.<i>.`)."""
        p = self.checkpoint_prefix
        names = [f"{p}.gate.weight"]
        for expert in range(self.num_experts):
            names += [f"{p}.experts.{expert}.{name}.weight" for name in self.expert_names]
        return names


def routed_tokens(model: object) -> list[int]:
    """Tokens routed to each expert so far, summed over `model`'s sparse layers ([] for a dense
    model, or before its first step)."""
    modules = model.modules() if isinstance(model, nn.Module) else ()
    counts = [m.expert_tokens for m in modules if isinstance(m, SparseMoE) and m.expert_tokens is not None]
    return torch.stack(counts).sum(0).tolist() if counts else []


Take = Callable[[str], torch.Tensor]
Put = Callable[[torch.Tensor, torch.Tensor, str], None]


class SparseMoE(nn.Module):
    def __init__(self, moe: MoEConfig, hidden_size: int, layer_idx: int = 0) -> None:
        super().__init__()
        self.moe = moe
        self.layer_idx = layer_idx
        experts, inter = moe.num_experts, moe.intermediate_size
        self.gate = nn.Linear(hidden_size, experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden_size))
        self.w_down = nn.Parameter(torch.empty(experts, hidden_size, inter))
        self.expert_tokens: torch.Tensor | None = None  # [E] int64: tokens routed to each expert so far

    def forward(self, x: torch.Tensor, lora: object = None) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        """Adapters never reach the experts (MoE architectures refuse MLP targets), so `lora` is
        accepted for the layer's call signature and unused."""
        weights, ids = softmax_topk_routing(self.gate(x), self.moe.top_k, self.moe.renormalize)
        counts = expert_counts(ids, self.moe.num_experts)
        if self.expert_tokens is None:
            self.expert_tokens = torch.zeros_like(counts)
        self.expert_tokens += counts
        return grouped_experts(x, self.w_gate_up, self.w_down, weights, ids, self.moe.hidden_act, counts)

    def load_hf(self, take: Take, put: Put, layer_prefix: str) -> None:
        """Copy the router and stack the experts' HF tensors (`layers.<i>.` in `layer_prefix`)."""
        p = layer_prefix + self.moe.checkpoint_prefix
        gate_name, up_name, down_name = self.moe.expert_names
        put(self.gate.weight, take(f"{p}.gate.weight"), f"{p}.gate.weight")
        experts = range(self.moe.num_experts)
        gate_up = torch.stack(
            [
                torch.cat(
                    [take(f"{p}.experts.{e}.{gate_name}.weight"), take(f"{p}.experts.{e}.{up_name}.weight")]
                )
                for e in experts
            ]
        )
        put(self.w_gate_up, gate_up, f"{p}.experts.*.{gate_name}+{up_name}")
        down = torch.stack([take(f"{p}.experts.{e}.{down_name}.weight") for e in experts])
        put(self.w_down, down, f"{p}.experts.*.{down_name}")
