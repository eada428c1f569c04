"""`DraftProposer`: a draft model that proposes tokens for speculative decoding.

Its paged KV cache lives beside the target's: the same block ids and slots (a position's draft KV
is where the target's KV for that position is), in tensors of its own shape. So it needs no
allocator of its own: the scheduler's block tables cover the drafts' slots already.

Per request it remembers how many leading positions hold valid draft KV (`num_computed`). A
proposal first catches up on the request's tokens past that point (the whole prompt the first
time; afterwards the tokens the target accepted or added), then runs one position per further
draft. After verification, positions past the accepted drafts are invalid again; the next
proposal rewrites them. A request that comes back from preemption starts from zero.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.engine.models.eagle import EagleDraft
from tandem.engine.models.interface import CausalLM, KVLayer
from tandem.engine.sched.step import ScheduledRequest
from tandem.kernels.attention_metadata import AttentionMetadata, build_attention_metadata
from tandem.kernels.sampling import filter_logits


def draw_draft(
    logits: torch.Tensor,  # [V] one request's next-draft logits (float32)
    item: ScheduledRequest,
    generator: torch.Generator | None,
) -> tuple[int, torch.Tensor | None]:
    """The request's next draft: the argmax for greedy requests; else a draw from the draft's
    distribution under the request's temperature and filters, returned with it ([V]) for
    rejection sampling."""
    params = item.sampling_params
    if params.greedy:
        return int(logits.argmax()), None
    scaled = logits.unsqueeze(0) / params.temperature
    if params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0:
        device = logits.device
        scaled = filter_logits(
            scaled,
            torch.tensor([params.top_k], device=device),
            torch.tensor([params.top_p], device=device),
            torch.tensor([params.min_p], device=device),
        )
    q = scaled.softmax(dim=-1)[0]
    return int(torch.multinomial(q, 1, generator=generator)[0]), q


def draft_step_metadata(
    active: list[ScheduledRequest],
    query_lens: list[int],
    depth: int,
    block_size: int,
    num_kv_heads: int,
    device: torch.device,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Attention metadata of one drafting pass (request i computes `query_lens[i]` positions
    ending at its last token + `depth`) and the rows [len(active)] whose logits are wanted."""
    metadata = build_attention_metadata(
        [item.block_ids for item in active],
        query_lens,
        [item.start_position + depth + 1 for item in active],
        block_size,
        num_kv_heads,
        device,
    )
    return metadata, torch.tensor(query_lens, device=device).cumsum(0) - 1


class PagedDraftCache:
    """What both proposers keep: a paged KV cache beside the target's (same blocks) and, per
    request, how many leading positions hold valid draft KV."""

    wants_hidden = False  # whether the runner hands over the target's states (`EagleProposer`)
    hidden_layers: tuple[int, ...] = ()  # which target layers' outputs it wants

    def __init__(
        self, kv_caches: list[KVLayer], num_kv_heads: int, block_size: int, device: torch.device
    ) -> None:
        self.kv_caches = kv_caches
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.device = device
        self.num_computed: dict[str, int] = {}  # request -> leading positions with valid draft KV

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.num_computed.pop(request_id, None)

    def prepare_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """A step's target states, as kept by `record` (once per step, for all its rows)."""
        return hidden

    def record(self, request_id: str, start_position: int, hidden: torch.Tensor) -> None:
        """Target states are of no use to a draft model."""

    def accepted(self, request_id: str, start_position: int, num_drafts: int, num_accepted: int) -> None:
        raise NotImplementedError

    def propose(
        self,
        items: list[ScheduledRequest],
        generator_for: Callable[[ScheduledRequest], torch.Generator | None],
    ) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        raise NotImplementedError


class DraftProposer(PagedDraftCache):
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[KVLayer],
        num_kv_heads: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        super().__init__(kv_caches, num_kv_heads, block_size, device)
        self.model = model

    def accepted(self, request_id: str, start_position: int, num_drafts: int, num_accepted: int) -> None:
        """After verification: the draft KV written for rejected drafts is invalid."""
        self.num_computed[request_id] = min(
            self.num_computed.get(request_id, 0), start_position + 1 + num_accepted
        )

    @torch.inference_mode()
    def propose(
        self,
        items: list[ScheduledRequest],
        generator_for: Callable[[ScheduledRequest], torch.Generator | None],
    ) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """For each item (decoding, `num_draft_slots` > 0): its drafts and, for sampled requests,
        the draft distributions they were drawn from ([k, V]; None for greedy ones)."""
        drafts: dict[str, list[int]] = {item.request_id: [] for item in items}
        probs: dict[str, list[torch.Tensor]] = {item.request_id: [] for item in items}
        # Pass 0 catches up on the request's own tokens through its last one; pass j feeds draft j.
        for depth in range(max(item.num_draft_slots for item in items)):
            active = [item for item in items if item.num_draft_slots > depth]
            input_ids: list[int] = []
            positions: list[int] = []
            query_lens: list[int] = []
            for item in active:
                last = item.start_position  # the request's last token (its KV is not computed yet)
                if depth == 0:
                    done = 0 if item.is_new else self.num_computed.get(item.request_id, 0)
                    done = min(done, last)
                    history = item.prompt_token_ids + item.output_token_ids  # [0, last] inclusive
                    tokens = history[done : last + 1]
                    start = done
                else:
                    tokens, start = [drafts[item.request_id][-1]], last + depth
                input_ids.extend(tokens)
                positions.extend(range(start, start + len(tokens)))
                query_lens.append(len(tokens))
            metadata, logits_rows = draft_step_metadata(
                active, query_lens, depth, self.block_size, self.num_kv_heads, self.device
            )
            logits = self.model.forward(
                torch.tensor(input_ids, dtype=torch.int64, device=self.device),
                torch.tensor(positions, dtype=torch.int64, device=self.device),
                self.kv_caches,
                metadata,
                logits_rows,
            )  # [len(active), V]
            for row, item in enumerate(active):
                token, q = draw_draft(logits[row], item, generator_for(item))
                drafts[item.request_id].append(token)
                if q is not None:
                    probs[item.request_id].append(q)
        for item in items:
            self.num_computed[item.request_id] = item.start_position + item.num_draft_slots
        return {
            rid: (tokens, torch.stack(probs[rid]) if probs[rid] else None) for rid, tokens in drafts.items()
        }


class EagleProposer(PagedDraftCache):
    """Drafts from an EAGLE-style head (`models/eagle.py`) that reads the target's hidden states.

    The head's one-layer KV cache lives beside the target's in the same blocks, like
    `DraftProposer`'s. Its KV at position p depends on token p and the target's state at p - 1,
    so the runner hands over the target's states of every position it computed and kept
    (`record`: prefill chunks, plain decode steps, accepted drafts), and a proposal first catches
    up on the positions past `num_computed` from those states. Positions the head drafted from its
    own predicted states are recomputed from the target's once verified (`accepted` keeps only
    the first). States wait in a per-request buffer (the head's dtype) until a proposal consumes them;
    a buffer past `max_buffered` positions (a request that has not drafted for long) is dropped
    and the head's KV for those positions is used as found. Where a position's state is missing
    (a prompt prefix served from the prefix cache: the target computed nothing there), the
    head's KV in those blocks is used as found, which was written by the request that
    filled them when it drafted. Either way only acceptance can suffer: verification keeps the
    output the target's."""

    wants_hidden = True

    def __init__(
        self,
        model: EagleDraft,
        kv_caches: list[KVLayer],
        num_kv_heads: int,
        block_size: int,
        device: torch.device,
        max_buffered: int = 4096,
    ) -> None:
        super().__init__(kv_caches, num_kv_heads, block_size, device)
        self.model = model
        self.max_buffered = max_buffered
        self.token_map = model.token_map  # [K] draft row -> target token id
        self.state_dtype = model.fc.weight.dtype
        self.hidden_layers = model.hidden_layers  # what the runner asks the target for
        # request -> contiguous chunks (first position, states [n, hidden]), joined only when a
        # proposal reads them: a request that does not draft for a while (a large batch) appends
        # a row per step without copying what it holds.
        self.states: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def forget(self, request_ids: list[str]) -> None:
        super().forget(request_ids)
        for request_id in request_ids:
            self.states.pop(request_id, None)

    @torch.inference_mode()
    def prepare_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, *] as the target returned them for `hidden_layers` -> fused [T, hidden]."""
        return self.model.fuse_states(hidden.detach()).to(self.state_dtype)

    def _buffered(self, request_id: str) -> tuple[int, torch.Tensor] | None:
        """The request's buffered states as one tensor (first position, [n, hidden])."""
        chunks = self.states.get(request_id)
        if not chunks:
            return None
        if len(chunks) > 1:
            chunks[:] = [(chunks[0][0], torch.cat([states for _, states in chunks]))]
        return chunks[0]

    def record(self, request_id: str, start_position: int, hidden: torch.Tensor) -> None:
        """The target's states [n, hidden] (from `prepare_states`) at positions start_position..
        (all kept)."""
        chunks = self.states.get(request_id)
        if chunks:
            first = chunks[0][0]
            end = chunks[-1][0] + chunks[-1][1].shape[0]
            if start_position == end:
                chunks.append((start_position, hidden))
            elif first <= start_position < end:  # rewritten positions: keep what lies before them
                _, states = self._buffered(request_id) or (first, hidden)
                chunks[:] = [(first, states[: start_position - first]), (start_position, hidden)]
            else:
                chunks[:] = [(start_position, hidden)]
        else:
            chunks = self.states[request_id] = [(start_position, hidden)]
        num_buffered = chunks[-1][0] + chunks[-1][1].shape[0] - chunks[0][0]
        if num_buffered > self.max_buffered:
            self.states.pop(request_id, None)
            self.num_computed[request_id] = start_position + hidden.shape[0]  # used as found

    def accepted(self, request_id: str, start_position: int, num_drafts: int, num_accepted: int) -> None:
        """After verification: only position `start_position` had the head's KV from a target
        state; the drafted positions are recomputed from the target's states next time."""
        self.num_computed[request_id] = min(self.num_computed.get(request_id, 0), start_position + 1)

    def _catch_up_states(self, request_id: str, done: int, last: int) -> tuple[int, torch.Tensor]:
        """The first position to compute (positions before the buffered states are used as
        found) and the states [last + 1 - start, hidden] feeding positions start..last: each
        position's row is the target's state at the position before it, zeros where unknown."""
        hidden = self.model.config.hidden_size
        buffered = self._buffered(request_id)
        first, states = (
            buffered
            if buffered is not None
            else (last, torch.empty(0, hidden, dtype=self.state_dtype, device=self.device))
        )
        start = min(max(done, first), last)
        rows = torch.zeros(last + 1 - start, hidden, dtype=states.dtype, device=states.device)
        lo, hi = max(start - 1, first), min(last - 1, first + states.shape[0] - 1)  # state positions used
        if hi >= lo:
            rows[lo + 1 - start : hi + 2 - start] = states[lo - first : hi + 1 - first]
        return start, rows

    def _consumed(self, items: list[ScheduledRequest]) -> None:
        """After proposing: the head's KV covers each request's drafts; the states before its last
        token's position are consumed."""
        for item in items:
            self.num_computed[item.request_id] = item.start_position + item.num_draft_slots
            buffered = self._buffered(item.request_id)
            if buffered is not None:
                first, states = buffered
                keep_from = max(first, item.start_position)
                self.states[item.request_id] = [(keep_from, states[keep_from - first :])]

    @torch.inference_mode()
    def propose(
        self,
        items: list[ScheduledRequest],
        generator_for: Callable[[ScheduledRequest], torch.Generator | None],
    ) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """As `DraftProposer.propose` (draft distributions [k, V] over the target's vocabulary,
        zero outside the head's)."""
        drafts: dict[str, list[int]] = {item.request_id: [] for item in items}
        probs: dict[str, list[torch.Tensor]] = {item.request_id: [] for item in items}
        predicted: dict[str, torch.Tensor] = {}
        vocab_size = self.model.config.target_vocab_size
        for depth in range(max(item.num_draft_slots for item in items)):
            active = [item for item in items if item.num_draft_slots > depth]
            input_ids: list[int] = []
            positions: list[int] = []
            query_lens: list[int] = []
            features: list[torch.Tensor] = []
            for item in active:
                last = item.start_position  # the request's last token (the target computes it now)
                if depth == 0:
                    done = min(self.num_computed.get(item.request_id, 0), last)
                    start, states = self._catch_up_states(item.request_id, done, last)
                    history = item.prompt_token_ids + item.output_token_ids  # [0, last] inclusive
                    tokens = history[start : last + 1]
                    features.append(states.to(self.device))
                else:
                    tokens, start = [drafts[item.request_id][-1]], last + depth
                    features.append(predicted[item.request_id].unsqueeze(0))
                input_ids.extend(tokens)
                positions.extend(range(start, start + len(tokens)))
                query_lens.append(len(tokens))
            metadata, logits_rows = draft_step_metadata(
                active, query_lens, depth, self.block_size, self.num_kv_heads, self.device
            )
            logits, hidden = self.model(
                torch.tensor(input_ids, dtype=torch.int64, device=self.device),
                torch.cat(features),
                torch.tensor(positions, dtype=torch.int64, device=self.device),
                self.kv_caches,
                metadata,
                logits_rows,
            )  # [len(active), K], [len(active), hidden]
            for row, item in enumerate(active):
                predicted[item.request_id] = hidden[row]
                if item.sampling_params.greedy:  # argmax within the head's vocabulary
                    drafts[item.request_id].append(int(self.token_map[logits[row].argmax()]))
                    continue
                full = torch.full((vocab_size,), float("-inf"), device=self.device)  # [V]
                full[self.token_map] = logits[row]
                token, q = draw_draft(full, item, generator_for(item))
                drafts[item.request_id].append(token)
                assert q is not None
                probs[item.request_id].append(q)
        self._consumed(items)
        return {
            rid: (tokens, torch.stack(probs[rid]) if probs[rid] else None) for rid, tokens in drafts.items()
        }
