"""Grammar masks for constrained requests (`SamplingParams.structured`): one matcher per request.

A request's matcher is made at its first sampled row and fed the tokens the request already has
(a request whose first token another engine sampled, or one whose runner state is new). Rows are
masked to what the grammar allows before sampling and verification; the matcher then advances on
the tokens the request was given. A matcher that refuses or errs fails its request alone.
"""

from __future__ import annotations

import logging
import time

import torch

from tandem.engine.sched.step import RunnerResult, ScheduledRequest
from tandem.engine.structured.grammar import GrammarCompiler, GrammarMatcher
from tandem.kernels.sampling import apply_token_bitmask_

logger = logging.getLogger("tandem.engine.runner")

GRAMMAR_FAILED = "the output constraint (response_format or tools) could not be continued"


class GrammarMasks:
    def __init__(self, grammars: GrammarCompiler | None) -> None:
        self.grammars = grammars
        self._matchers: dict[str, GrammarMatcher] = {}
        self.mask_s = 0.0  # wall seconds computing and applying grammar masks

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def matcher_for(self, item: ScheduledRequest) -> GrammarMatcher | None:
        """The request's matcher (made on first use), or None without a constraint. Raises when
        the grammar refuses the request's earlier tokens."""
        spec = item.sampling_params.structured
        if spec is None or self.grammars is None:
            return None
        matcher = self._matchers.get(item.request_id)
        if matcher is None:
            matcher = self.grammars.matcher(spec)
            output_ids = item.known_output_token_ids
            if output_ids and not matcher.accept(list(output_ids)):
                raise RuntimeError(f"the grammar refused the request's earlier tokens ({matcher.error})")
            self._matchers[item.request_id] = matcher
        return matcher

    def check(self, items: list[ScheduledRequest], failed: dict[str, str]) -> None:
        """Add to `failed` the constrained requests whose matcher cannot be made or is in error."""
        for item in items:
            if item.sampling_params.structured is None or item.request_id in failed:
                continue
            try:
                matcher = self.matcher_for(item)
            except Exception:
                logger.exception("grammar matcher failed", extra={"request_id": item.request_id})
                failed[item.request_id] = GRAMMAR_FAILED
                continue
            if matcher is not None and matcher.error is not None:
                logger.error(
                    "grammar matcher in error", extra={"request_id": item.request_id, "error": matcher.error}
                )
                failed[item.request_id] = GRAMMAR_FAILED

    def advance(self, items: list[ScheduledRequest], result: RunnerResult) -> None:
        """Feed each constrained request's new tokens to its matcher; a refusal (a library fault:
        they were sampled under its masks) fails the request."""
        for item in items:
            matcher = self._matchers.get(item.request_id)
            tokens = result.sampled_token_ids.get(item.request_id)
            if matcher is None or not tokens or matcher.accept(tokens):
                continue
            logger.error(
                "grammar refused a sampled token",
                extra={"request_id": item.request_id, "error": matcher.error},
            )
            del result.sampled_token_ids[item.request_id]
            result.logprobs.pop(item.request_id, None)
            result.failed[item.request_id] = GRAMMAR_FAILED

    def constrain_rows(self, logits: torch.Tensor, items: list[ScheduledRequest]) -> torch.Tensor:
        """logits: [B, V], one row per item; the rows of constrained items masked to what their
        grammars allow next (in place, or in a copy when one of them also wants logprobs, which are
        the model's own)."""
        if self.grammars is None:
            return logits
        pairs = [(row, self.matcher_for(item)) for row, item in enumerate(items)]
        constrained = [(row, matcher) for row, matcher in pairs if matcher is not None]
        if not constrained:
            return logits
        rows = [row for row, _ in constrained]
        started = time.perf_counter()
        if any(items[row].sampling_params.logprobs is not None for row in rows):
            logits = logits.clone()
        bitmask = self.grammars.fill_bitmasks([matcher for _, matcher in constrained])  # [n, W]
        if len(rows) == logits.shape[0]:
            apply_token_bitmask_(logits, bitmask)
        else:
            index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            logits.index_copy_(0, index, apply_token_bitmask_(logits.index_select(0, index), bitmask))
        self.mask_s += time.perf_counter() - started
        return logits

    def constrain_drafts(
        self, logits: torch.Tensor, item: ScheduledRequest, draft_probs: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """logits: [k + 1, V] at a request's last token and its k drafts. For a constrained
        request: the drafts up to the first one its grammar refuses (those cannot be accepted),
        their rows masked (a copy), and their draft distributions; else all unchanged."""
        drafts = item.draft_token_ids
        matcher = self.matcher_for(item)
        if matcher is None:
            return logits, drafts, draft_probs
        started = time.perf_counter()
        bitmask, num_valid = matcher.draft_bitmasks(drafts)
        masked = apply_token_bitmask_(logits[: num_valid + 1].clone(), bitmask)
        self.mask_s += time.perf_counter() - started
        return masked, drafts[:num_valid], None if draft_probs is None else draft_probs[:num_valid]
