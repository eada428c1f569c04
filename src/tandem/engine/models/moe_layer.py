"""The sparse mixture-of-experts block that replaces a decoder layer's MLP (`DecoderConfig.moe`).

A router (HF's `gate`: one logit per expert, a linear map) picks each token's top-k experts:
softmax top-k (Mixtral, Qwen3-MoE; `kernels.moe.softmax_topk_routing`) or sigmoid scores with
groups, a correction bias and a scale (DeepSeek-V3, GLM-4.5; `sigmoid_group_topk_routing`). The
experts run grouped by expert (`kernels.moe.grouped_experts`), each a `GatedMLP` whose fused
gate/up and down linears are what the INT4 path quantises (`expert_int4_targets`); a shared
expert, where the family has one, is another `GatedMLP` every token takes. Weights load from HF's
per-expert tensors under `MoEConfig.checkpoint_prefix` with the family's expert names (Mixtral's
w1/w3/w2, the others' gate/up/down_proj).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.models.interface import Int4Target
from tandem.kernels.moe import (
    expert_counts,
    grouped_experts,
    sigmoid_group_topk_routing,
    softmax_topk_routing,
)


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
    # DeepSeek-V3 / GLM-4.5 routing (`scoring="sigmoid"`): groups, a score correction bias, a scale
    scoring: str = "softmax"  # "softmax" (Mixtral, Qwen) or "sigmoid"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    correction_bias: bool = False  # the router has `e_score_correction_bias`
    shared_intermediate_size: int = 0  # a shared expert (an MLP every token takes) of this size

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers is None or layer in self.sparse_layers

    def layer_tensor_names(self) -> list[str]:
        """The block's checkpoint tensors in one layer (after `layers.<i>.`)."""
        p = self.checkpoint_prefix
        names = [f"{p}.gate.weight"]
        if self.correction_bias:
            names.append(f"{p}.gate.e_score_correction_bias")
        for expert in range(self.num_experts):
            names += [f"{p}.experts.{expert}.{name}.weight" for name in self.expert_names]
        if self.shared_intermediate_size:
            names += [f"{p}.shared_experts.{name}.weight" for name in self.expert_names]
        return names


class GatedMLP(nn.Module):
    """down(silu(gate x) * up x), no biases: one expert, or a shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


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
        # The router: a plain parameter (no prepacked linear), read in float32 by sigmoid routing.
        self.router = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.correction_bias = (
            nn.Parameter(torch.empty(moe.num_experts), requires_grad=False) if moe.correction_bias else None
        )
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, moe.intermediate_size) for _ in range(moe.num_experts)
        )
        self.shared = (
            GatedMLP(hidden_size, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
        )
        self.expert_tokens: torch.Tensor | None = None  # [E] int64: tokens routed to each expert so far

    def forward(self, x: torch.Tensor, lora: object = None) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        """Adapters never reach the experts (MoE architectures refuse MLP targets), so `lora` is
        accepted for the layer's call signature and unused."""
        moe = self.moe
        if moe.scoring == "sigmoid":  # the router in float32, as DeepSeek-V3 and GLM-4.5 define it
            logits = F.linear(x.float(), self.router.float())
            weights, ids = sigmoid_group_topk_routing(
                logits, self.correction_bias, moe.top_k, moe.num_groups, moe.topk_groups, moe.renormalize,
                moe.routed_scaling,
            )  # fmt: skip
        else:
            weights, ids = softmax_topk_routing(F.linear(x, self.router), moe.top_k, moe.renormalize)
        counts = expert_counts(ids, moe.num_experts)
        if self.expert_tokens is None:
            self.expert_tokens = torch.zeros_like(counts)
        self.expert_tokens += counts
        experts = self.experts
        out = grouped_experts(x, lambda e, rows: experts[e](rows), weights, ids, moe.num_experts, counts)
        return out if self.shared is None else out + self.shared(x)

    def _mlps(self, layer_prefix: str) -> list[tuple[str, GatedMLP]]:
        """Every expert and the shared expert, each with its HF name prefix."""
        p = layer_prefix + self.moe.checkpoint_prefix
        mlps = [(f"{p}.experts.{e}.", expert) for e, expert in enumerate(self.experts)]
        if self.shared is not None:
            mlps.append((f"{p}.shared_experts.", self.shared))
        return [(prefix, mlp) for prefix, mlp in mlps if isinstance(mlp, GatedMLP)]

    def load_hf(self, take: Take, put: Put, layer_prefix: str) -> None:
        """Copy the router and every expert's HF tensors (`layers.<i>.` in `layer_prefix`)."""
        p = layer_prefix + self.moe.checkpoint_prefix
        put(self.router, take(f"{p}.gate.weight"), f"{p}.gate.weight")
        if self.correction_bias is not None:
            put(
                self.correction_bias,
                take(f"{p}.gate.e_score_correction_bias"),
                f"{p}.gate.e_score_correction_bias",
            )
        gate, up, down = self.moe.expert_names
        for prefix, mlp in self._mlps(layer_prefix):
            gate_up = torch.cat([take(f"{prefix}{gate}.weight"), take(f"{prefix}{up}.weight")])
            put(mlp.gate_up_proj.weight, gate_up, f"{prefix}{gate}+{up}")
            put(mlp.down_proj.weight, take(f"{prefix}{down}.weight"), f"{prefix}{down}")

    def int4_targets(self, layer_prefix: str) -> list[Int4Target]:
        """Every expert's (and the shared expert's) fused gate/up and down linears, by their HF
        names (`model.layers.<i>.` in `layer_prefix`); the router stays in the compute dtype."""
        gate, up, down = self.moe.expert_names
        targets = []
        for prefix, mlp in self._mlps(layer_prefix):
            targets += [
                Int4Target(mlp, "gate_up_proj", (prefix + gate, prefix + up)),
                Int4Target(mlp, "down_proj", (prefix + down,)),
            ]
        return targets
