"""Batched multi-LoRA: many adapters (and rows with none) in one forward pass.

Adapters sit in `S` slots of stacked weights per fused linear: `lora_a[S, R, in]` and
`lora_b[S, out, R]`, with the LoRA scaling already folded into `lora_b` and smaller ranks
zero-padded to `R` (zero rows/columns add nothing). For a fused linear (q/k/v or gate/up) the
sub-modules' A matrices are stacked along the rank and B is block-diagonal, so one pair of
matmuls covers all of them.

Semantics (BGMV, per token row t with slot s = token_slots[t]; s < 0 means no adapter):

    y[t] += lora_b[s] @ (lora_a[s] @ x[t])

`lora_apply` computes it SGMV-style: rows are grouped by slot once per step (`LoRAGroups`), and
each group does two dense matmuls, so prefill chunks get large matmuls and a decode batch with k
distinct adapters costs k small ones. `lora_apply_reference` is the per-row definition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRAGroups:
    """Rows of a step grouped by adapter slot (built once per step, used by every layer)."""

    slots: list[int]  # distinct slots present (>= 0)
    row_indices: list[torch.Tensor]  # per slot: int64 row indices into the step's token rows
    all_rows: list[bool]  # per slot: True when the group is every row (no gather needed)

    @classmethod
    def from_token_slots(cls, token_slots: torch.Tensor) -> LoRAGroups:  # token_slots: [T] int
        slots = sorted(int(s) for s in torch.unique(token_slots).tolist() if s >= 0)
        num_rows = token_slots.shape[0]
        indices = [torch.nonzero(token_slots == s).flatten() for s in slots]
        return cls(slots, indices, [idx.numel() == num_rows for idx in indices])

    @property
    def is_empty(self) -> bool:
        return not self.slots


def lora_apply(
    y: torch.Tensor,  # [T, out], updated in place and returned
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, R, in]
    lora_b: torch.Tensor,  # [S, out, R]  (scaling folded in)
    groups: LoRAGroups,
) -> torch.Tensor:
    for slot, rows, whole in zip(groups.slots, groups.row_indices, groups.all_rows, strict=True):
        if whole:
            y += (x @ lora_a[slot].T) @ lora_b[slot].T
        else:
            delta = (x.index_select(0, rows) @ lora_a[slot].T) @ lora_b[slot].T  # [n, out]
            y.index_add_(0, rows, delta)
    return y


def lora_apply_reference(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """Row by row, straight from the definition."""
    out = y.clone()
    for t in range(x.shape[0]):
        s = int(token_slots[t])
        if s >= 0:
            out[t] += lora_b[s] @ (lora_a[s] @ x[t])
    return out
