"""Batched multi-LoRA: many adapters (and rows with none) in one forward pass.

Adapters sit in `S` slots of stacked weights per fused linear: `lora_a[S, R, in]` and
`lora_b[S, out, R]`, with the LoRA scaling already folded into `lora_b` and smaller ranks
zero-padded to `R` (zero rows/columns add nothing). For a fused linear (q/k/v or gate/up) the
sub-modules' A matrices are stacked along the rank and B is block-diagonal, so one pair of
matmuls covers all of them.

Semantics (BGMV, per token row t with slot s = token_slots[t]; s < 0 means no adapter):

    y[t] += lora_b[s] @ (lora_a[s] @ x[t])

`lora_apply` groups rows by slot once per step (`LoRAGroups`): SGMV-style (per adapter, two dense
matmuls over its rows) for prefill-heavy steps, or one padded pair of `bmm`s over all slots when
each adapter has only a few rows (many-adapter decode), so the op count does not grow with the
number of adapters. `lora_apply_reference` is the per-row definition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRAGroups:
    """Rows of a step grouped by adapter slot (built once per step, used by every layer).

    Two ways to compute a step, chosen here once: `padded` (few rows per adapter, e.g. decode
    batches over many adapters): every slot's rows are gathered into a `[num_slots, G, in]` block
    padded with a zero row, and two `bmm`s over all slots do the work in a fixed number of ops;
    otherwise `grouped`: per present slot, a gather, two matmuls and a scatter (large prefill
    chunks get large matmuls and no padding waste)."""

    slots: list[int]  # distinct slots present (>= 0)
    row_indices: list[torch.Tensor]  # per slot: int64 row indices into the step's token rows
    all_rows: list[bool]  # per slot: True when the group is every row (no gather needed)
    padded_rows: torch.Tensor | None = None  # [num_slots_total, G] rows into x padded with a zero row
    valid_flat: torch.Tensor | None = None  # [n] positions in the flattened [S*G] block that are real
    valid_rows: torch.Tensor | None = None  # [n] the token row each of those positions belongs to

    @classmethod
    def from_token_slots(cls, token_slots: torch.Tensor, num_slots: int | None = None) -> LoRAGroups:
        """`token_slots`: [T] int, -1 for rows without an adapter. `num_slots`: the slot tensors'
        first dimension (enables the padded path when it is cheap)."""
        slots = sorted(int(s) for s in torch.unique(token_slots).tolist() if s >= 0)
        num_rows = token_slots.shape[0]
        indices = [torch.nonzero(token_slots == s).flatten() for s in slots]
        groups = cls(slots, indices, [idx.numel() == num_rows for idx in indices])
        if num_slots is not None and slots and len(slots) > 1:
            widest = max(idx.numel() for idx in indices)
            if num_slots * widest <= 2 * num_rows:  # padding costs at most as much as the real rows
                padded = torch.full(
                    (num_slots, widest), num_rows, dtype=torch.int64, device=token_slots.device
                )
                for slot, idx in zip(slots, indices, strict=True):
                    padded[slot, : idx.numel()] = idx
                flat = padded.flatten()
                valid = torch.nonzero(flat < num_rows).flatten()
                groups.padded_rows, groups.valid_flat, groups.valid_rows = padded, valid, flat[valid]
        return groups

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
    if groups.padded_rows is not None and groups.valid_flat is not None and groups.valid_rows is not None:
        x_padded = torch.cat([x, x.new_zeros(1, x.shape[1])])  # row T is the zero padding row
        h = torch.bmm(x_padded[groups.padded_rows], lora_a.transpose(1, 2))  # [S, G, R]
        delta = torch.bmm(h, lora_b.transpose(1, 2)).flatten(0, 1)  # [S*G, out]
        return y.index_add_(0, groups.valid_rows, delta.index_select(0, groups.valid_flat))
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
