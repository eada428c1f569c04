"""The sampler: next tokens from a step's logits (penalties, filters, seeds, logprobs, grammar
masks) and exact verification of speculative drafts.

Failure is per request: a request with a non-finite logit in any of its rows (an adapter's
extreme weights) fails alone; sampling that raises for the batch is redone request by request,
so a request whose parameters break it fails alone.
"""

from __future__ import annotations

import logging

import torch

from tandem.engine.runner.constraints import GRAMMAR_FAILED, GrammarMasks
from tandem.engine.sched.step import RunnerResult, ScheduledRequest
from tandem.kernels.sampling import (
    apply_penalties,
    apply_repetition_penalty,
    filter_logits,
    finite_rows,
    greedy_tokens,
    sample_rows,
    top_logprobs,
    verify_drafts,
)

logger = logging.getLogger("tandem.engine.runner")

__all__ = ["GRAMMAR_FAILED", "NON_FINITE_LOGITS", "REQUEST_FAILED", "Sampler", "failed_alone"]

# What a client is told when its request failed in the runner (details go to the log only).
REQUEST_FAILED = "this request could not be computed by the engine; the server log has the details"
NON_FINITE_LOGITS = "the model produced non-finite logits for this request (an adapter with extreme weights?)"


def failed_alone(item: ScheduledRequest) -> RunnerResult:
    """Called from an `except` block: the step of `item` alone raised."""
    logger.exception("request failed in the model runner", extra={"request_id": item.request_id})
    return RunnerResult({}, failed={item.request_id: REQUEST_FAILED})


def _logprob_entry(
    token_id: int, chosen_lp: float, top_ids: list[int], top_vals: list[float]
) -> dict[int, float]:
    entry = {token_id: chosen_lp}
    for top_id, value in zip(top_ids, top_vals, strict=True):
        entry.setdefault(top_id, value)
    return entry


class Sampler:
    def __init__(self, device: torch.device, seed: int, masks: GrammarMasks) -> None:
        self.device = device
        self.masks = masks
        self._generators: dict[str, torch.Generator] = {}
        self._default_generator = torch.Generator(device=device)
        self._default_generator.manual_seed(seed)

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self.masks.forget(request_id)

    def generator_for(self, item: ScheduledRequest) -> torch.Generator | None:
        """The request's own generator when it has a seed (made on first use), else the shared one."""
        seed = item.sampling_params.seed
        if seed is None:
            return self._default_generator
        generator = self._generators.get(item.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._generators[item.request_id] = generator
        return generator

    def sample(
        self,
        logits: torch.Tensor,
        items: list[ScheduledRequest],
        draft_probs: dict[str, torch.Tensor] | None = None,
    ) -> RunnerResult:
        """logits: [R, V] float32, `1 + num_draft_tokens` rows per item (in order). Items with
        drafts are verified (`verify`) against `draft_probs` [k, V] by request, where given."""
        if not items:
            return RunnerResult({})
        # A row with a NaN or an infinity sums to one (so does one whose sum overflows: logits
        # near 1e34, as broken); one reduction instead of isfinite() over every logit.
        row_is_finite = finite_rows(logits)  # [R]
        starts, failed = [], {}
        row = 0
        for item in items:
            starts.append(row)
            span = 1 + item.num_draft_tokens
            if not all(row_is_finite[row : row + span]):
                failed[item.request_id] = NON_FINITE_LOGITS
            row += span
        if failed:
            logger.error("non-finite logits; failing those requests", extra={"request_ids": sorted(failed)})
        self.masks.check(items, failed)
        alive = [
            (item, start) for item, start in zip(items, starts, strict=True) if item.request_id not in failed
        ]
        result = self._sample_plain(
            logits, [(item, start) for item, start in alive if not item.num_draft_tokens]
        )
        for item, start in alive:
            if not item.num_draft_tokens:
                continue
            try:
                rows = logits[start : start + 1 + item.num_draft_tokens]
                result.merge(self.verify(rows, item, (draft_probs or {}).get(item.request_id)))
            except Exception:
                result.merge(failed_alone(item))
        result.failed.update(failed)
        self.masks.advance(items, result)
        return result

    def _sample_plain(self, logits: torch.Tensor, plain: list[tuple[ScheduledRequest, int]]) -> RunnerResult:
        """One token for each item without drafts, from its row `start` of `logits`; batched, then
        (when the batch raises) item by item."""
        result = RunnerResult({})
        if not plain:
            return result
        rows = torch.tensor([start for _, start in plain], dtype=torch.int64, device=logits.device)
        plain_logits = logits.index_select(0, rows) if len(plain) < logits.shape[0] else logits
        plain_items = [item for item, _ in plain]
        try:
            result.merge(self.sample_rows(plain_logits, plain_items))
        except Exception:
            logger.warning("batched sampling failed; sampling row by row", exc_info=True)
            for index, item in enumerate(plain_items):
                try:
                    result.merge(self.sample_rows(plain_logits[index : index + 1], [item]))
                except Exception:
                    result.merge(failed_alone(item))
        return result

    def verify(
        self, logits: torch.Tensor, item: ScheduledRequest, draft_probs: torch.Tensor | None = None
    ) -> RunnerResult:
        """logits: [k + 1, V] finite float32 at the request's last token and its k drafts. Greedy:
        the drafts the target's argmax agrees with, then the argmax after them (identical to
        decoding one token at a time). Random: rejection sampling (`verify_drafts`) against the
        draft model's distributions `draft_probs` [k, V], or a one-hot proposal when None."""
        params = item.sampling_params
        raw_logits = logits
        logits, drafts, draft_probs = self.masks.constrain_drafts(logits, item, draft_probs)
        if params.greedy:
            targets = greedy_tokens(logits).tolist()  # [k + 1]
            num_accepted = 0
            while num_accepted < len(drafts) and drafts[num_accepted] == targets[num_accepted]:
                num_accepted += 1
            tokens = targets[: num_accepted + 1]
        else:
            scaled = logits / params.temperature
            if params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0:
                num_rows = scaled.shape[0]
                scaled = filter_logits(
                    scaled,
                    torch.full((num_rows,), params.top_k, device=logits.device),
                    torch.full((num_rows,), params.top_p, device=logits.device),
                    torch.full((num_rows,), params.min_p, device=logits.device),
                )
            tokens = verify_drafts(scaled.softmax(dim=-1), drafts, self.generator_for(item), draft_probs)
        result = RunnerResult({item.request_id: tokens})
        if params.logprobs is not None:
            chosen = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
            chosen_lp, top_ids, top_vals = top_logprobs(raw_logits[: len(tokens)], chosen, params.logprobs)
            result.logprobs[item.request_id] = [
                _logprob_entry(token_id, float(chosen_lp[i]), top_ids[i].tolist(), top_vals[i].tolist())
                for i, token_id in enumerate(tokens)
            ]
        return result

    def sample_rows(self, logits: torch.Tensor, items: list[ScheduledRequest]) -> RunnerResult:
        """logits: [B, V] finite float32, one row per item (in order): one token each."""
        if not items:
            return RunnerResult({})
        raw_logits = logits
        logits = self._penalised(self.masks.constrain_rows(logits, items), items)
        params = [item.sampling_params for item in items]
        chosen = greedy_tokens(logits)  # [B]
        random_rows = [row for row, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, dtype=torch.int64, device=logits.device)
            sub = logits.index_select(0, rows) / torch.tensor(
                [params[r].temperature for r in random_rows], device=logits.device
            ).unsqueeze(1)
            if any(
                params[r].top_k > 0 or params[r].top_p < 1.0 or params[r].min_p > 0.0 for r in random_rows
            ):
                sub = filter_logits(
                    sub,
                    torch.tensor([params[r].top_k for r in random_rows], device=logits.device),
                    torch.tensor([params[r].top_p for r in random_rows], device=logits.device),
                    torch.tensor([params[r].min_p for r in random_rows], device=logits.device),
                )
            generators = [self.generator_for(items[r]) for r in random_rows]
            chosen[rows] = sample_rows(sub.softmax(dim=-1), generators)
        chosen_list = chosen.tolist()
        result = RunnerResult({item.request_id: [chosen_list[row]] for row, item in enumerate(items)})
        logprob_rows = [row for row, p in enumerate(params) if p.logprobs is not None]
        if logprob_rows:
            num_top = max(params[r].logprobs or 0 for r in logprob_rows)
            rows = torch.tensor(logprob_rows, dtype=torch.int64, device=logits.device)
            chosen_lp, top_ids, top_vals = top_logprobs(
                raw_logits.index_select(0, rows), chosen[rows], num_top
            )
            for i, row in enumerate(logprob_rows):
                n = params[row].logprobs or 0
                result.logprobs[items[row].request_id] = [
                    _logprob_entry(
                        chosen_list[row],
                        float(chosen_lp[i]),
                        top_ids[i, :n].tolist(),
                        top_vals[i, :n].tolist(),
                    )
                ]
        return result

    @staticmethod
    def _penalised(logits: torch.Tensor, items: list[ScheduledRequest]) -> torch.Tensor:
        """logits [B, V] with presence and frequency penalties over each item's output so far,
        then the repetition penalty over its prompt and output."""
        params = [item.sampling_params for item in items]
        if not any(p.has_penalties for p in params):
            return logits
        counts = torch.zeros_like(logits)  # [B, V]
        for row, item in enumerate(items):
            output_ids = item.known_output_token_ids
            if output_ids and item.sampling_params.has_penalties:
                ids = torch.tensor(output_ids, dtype=torch.int64, device=logits.device)
                counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
        logits = apply_penalties(
            logits,
            counts,
            torch.tensor([p.presence_penalty for p in params], device=logits.device),
            torch.tensor([p.frequency_penalty for p in params], device=logits.device),
        )
        if all(p.repetition_penalty == 1.0 for p in params):
            return logits
        seen = counts > 0  # [B, V]
        for row, item in enumerate(items):
            if item.sampling_params.repetition_penalty != 1.0 and item.prompt_token_ids:
                seen[row, torch.tensor(item.prompt_token_ids, dtype=torch.int64, device=logits.device)] = True
        penalty = torch.tensor([p.repetition_penalty for p in params], device=logits.device)
        return apply_repetition_penalty(logits, seen, penalty)
