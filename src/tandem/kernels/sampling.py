"""Sampling from logits: penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs.

All functions take a batch of rows `logits: [B, V]` (float32) and per-row parameter tensors
`[B]`; a disabled filter uses its neutral value (top_k = 0, top_p = 1, min_p = 0).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from tandem.kernels import int4_native


def apply_penalties(
    logits: torch.Tensor,  # [B, V]
    output_counts: torch.Tensor,  # [B, V] how often each token was generated so far
    presence: torch.Tensor,  # [B]
    frequency: torch.Tensor,  # [B]
) -> torch.Tensor:
    """OpenAI semantics: logits -= frequency * count + presence * (count > 0)."""
    counts = output_counts.to(logits.dtype)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


def apply_repetition_penalty(
    logits: torch.Tensor,  # [B, V]
    seen: torch.Tensor,  # [B, V] bool: the token is in the row's prompt or output
    penalty: torch.Tensor,  # [B] > 0
) -> torch.Tensor:
    """HF / vLLM semantics: where `seen`, logits / penalty if positive, logits * penalty otherwise."""
    factor = penalty[:, None].to(logits.dtype)
    penalised = torch.where(logits > 0, logits / factor, logits * factor)
    return torch.where(seen, penalised, logits)


def apply_token_bitmask_(
    logits: torch.Tensor,  # [B, V] float, modified in place
    bitmask: torch.Tensor,  # [B, ceil(V / 32)] int32: bit t % 32 of word t // 32 set = token t allowed
) -> torch.Tensor:  # `logits`
    """Set disallowed tokens to the dtype's lowest finite value (not -inf: penalties and the top-p
    filter then never meet inf - inf), in place. The bit layout is llguidance's (and xgrammar's):
    little-endian int32 words, so the bytes of a row, unpacked little-endian, are the tokens in
    order (on a little-endian host; numpy's unpack is a few times faster than 32 torch shifts)."""
    vocab = logits.shape[-1]
    words = bitmask.cpu().contiguous().numpy()
    if not np.little_endian:  # torch holds native words; the bit order is the little-endian one
        words = words.astype("<i4")
    disallowed = np.unpackbits((~words).view(np.uint8), axis=-1, count=vocab, bitorder="little")  # [B, V]
    drop = torch.from_numpy(disallowed).view(torch.bool).to(logits.device)
    return logits.masked_fill_(drop, torch.finfo(logits.dtype).min)


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Plain torch, out of place: each word shifted by 0..31 and its low bit kept."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    keep = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[-1]].to(logits.device).bool()
    return logits.masked_fill(~keep, torch.finfo(logits.dtype).min)


def filter_logits(
    logits: torch.Tensor,  # [B, V], already divided by temperature
    top_k: torch.Tensor,  # [B] int64, 0 = disabled
    top_p: torch.Tensor,  # [B] float, 1 = disabled
    min_p: torch.Tensor,  # [B] float, 0 = disabled
) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k, outside the top-p nucleus, or below min_p * p_max.

    top-p keeps the smallest set of most likely tokens whose probability sums to >= top_p
    (the token that crosses the threshold is kept, as in HF and vLLM).
    """
    neg_inf = torch.finfo(logits.dtype).min
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    remove = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(remove, neg_inf).softmax(dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    remove |= cum_before >= top_p[:, None]
    remove |= probs < (min_p[:, None] * probs[:, :1])
    remove[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(remove, neg_inf)
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def _native_for(logits: torch.Tensor) -> ctypes.CDLL | None:
    """The native library where it can read these logits (2-D float32 on the CPU), else None."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2:
        return None
    return int4_native.load()


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B] int64
    """`logits.argmax(dim=-1)`, the same answers (the first largest value; a row's first NaN where
    it has one), read on every thread by the native library where it runs (CPU, float32): torch's
    reads a step's logits on one thread."""
    lib = _native_for(logits)
    if lib is None or logits.shape[1] == 0:
        return logits.argmax(dim=-1)
    rows = logits.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    if lib.tandem_argmax_rows(
        rows.data_ptr(), rows.shape[0], rows.shape[1], out.data_ptr(), torch.get_num_threads()
    ):
        raise MemoryError(f"native argmax could not allocate scratch for {rows.shape[0]} rows")
    return out


def finite_rows(logits: torch.Tensor) -> list[bool]:  # [R, V] -> R flags
    """Whether each row's sum is finite (False where the row holds a NaN or an infinity, or its sum
    overflows): `torch.isfinite(logits.sum(dim=-1)).tolist()` up to the order of the sum, read on
    every thread by the native library where it runs (CPU, float32)."""
    lib = _native_for(logits)
    if lib is None:
        return torch.isfinite(logits.sum(dim=-1)).tolist()
    rows = logits.contiguous()
    flags = torch.empty(rows.shape[0], dtype=torch.uint8)
    lib.tandem_finite_rows(
        rows.data_ptr(), rows.shape[0], rows.shape[1], flags.data_ptr(), torch.get_num_threads()
    )
    return [bool(flag) for flag in flags.tolist()]


def sample_rows(
    probs: torch.Tensor,  # [B, V]
    generators: list[torch.Generator | None],  # per row; None uses the default generator
) -> torch.Tensor:  # [B] int64
    """One multinomial draw per row, each from its own generator (per-request seeds)."""
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    for i, generator in enumerate(generators):
        out[i] = torch.multinomial(probs[i], 1, generator=generator)[0]
    return out


def top_logprobs(
    logits: torch.Tensor,  # [B, V] raw model logits (before penalties/temperature)
    chosen: torch.Tensor,  # [B] int64
    num_top: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen_logprob [B], top_ids [B, num_top], top_logprobs [B, num_top])."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen_lp = logprobs.gather(-1, chosen[:, None]).squeeze(-1)
    top_vals, top_ids = (
        logprobs.topk(num_top, dim=-1) if num_top > 0 else (logprobs[:, :0], chosen[:, None][:, :0])
    )
    return chosen_lp, top_ids, top_vals


def verify_drafts(
    probs: torch.Tensor,  # [k + 1, V] the target's distribution at each draft position, then one past
    draft_ids: list[int],  # k proposed tokens
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,  # [k, V] the proposer's distributions; None: one-hot
) -> list[int]:
    """Speculative sampling for one request (Leviathan et al.; Chen et al.): accept draft j with
    probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection, draw from the residual
    max(p_j - q_j, 0) renormalised and stop; if all are accepted, draw one more from p_k. With a
    deterministic proposer (prompt lookup) q_j is one-hot at d_j, so acceptance is p_j(d_j) and the
    residual is p_j without d_j. The tokens returned are distributed exactly as sampling from p one
    token at a time. Returns the accepted drafts followed by one drawn token (1..k+1 tokens)."""
    k = len(draft_ids)
    uniforms = torch.rand(k, generator=generator, device=probs.device).tolist() if k else []
    accepted: list[int] = []
    for j, draft in enumerate(draft_ids):
        p_draft = float(probs[j, draft])
        q_draft = 1.0 if draft_probs is None else float(draft_probs[j, draft])
        if q_draft <= 0.0 or uniforms[j] * q_draft < p_draft:  # u < p/q without dividing
            accepted.append(draft)
            continue
        if draft_probs is None:
            residual = probs[j].clone()
            residual[draft] = 0.0
        else:
            residual = (probs[j] - draft_probs[j]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p_j <= q_j nowhere short: cannot be rejected
            accepted.append(draft)
            continue
        accepted.append(int(torch.multinomial(residual, 1, generator=generator)[0]))
        return accepted
    accepted.append(int(torch.multinomial(probs[k], 1, generator=generator)[0]))
    return accepted
