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

from tandem.engine.models.llama import KVLayer, LlamaForCausalLM
from tandem.engine.step import ScheduledRequest
from tandem.kernels.attention import build_attention_metadata
from tandem.kernels.sampling import filter_logits


class DraftProposer:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVLayer],
        num_kv_heads: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.device = device
        self.num_computed: dict[str, int] = {}  # request -> leading positions with valid draft KV

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.num_computed.pop(request_id, None)

    def accepted(self, request_id: str, start_position: int, num_drafts: int, num_accepted: int) -> None:
        """After verification: the draft KV written for rejected drafts is invalid."""
        self.num_computed[request_id] = min(start_position + num_drafts, start_position + 1 + num_accepted)

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
            metadata = build_attention_metadata(
                [item.block_ids for item in active],
                query_lens,
                [item.start_position + depth + 1 for item in active],
                self.block_size,
                self.num_kv_heads,
                self.device,
            )
            logits_rows = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
            logits = self.model(
                torch.tensor(input_ids, dtype=torch.int64, device=self.device),
                torch.tensor(positions, dtype=torch.int64, device=self.device),
                self.kv_caches,
                metadata,
                logits_rows,
            )  # [len(active), V]
            for row, item in enumerate(active):
                params = item.sampling_params
                if params.greedy:
                    drafts[item.request_id].append(int(logits[row].argmax()))
                    continue
                scaled = logits[row : row + 1] / params.temperature
                if params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0:
                    scaled = filter_logits(
                        scaled,
                        torch.tensor([params.top_k], device=self.device),
                        torch.tensor([params.top_p], device=self.device),
                        torch.tensor([params.min_p], device=self.device),
                    )
                q = scaled.softmax(dim=-1)[0]
                probs[item.request_id].append(q)
                drafts[item.request_id].append(int(torch.multinomial(q, 1, generator=generator_for(item))[0]))
        for item in items:
            self.num_computed[item.request_id] = item.start_position + item.num_draft_slots
        return {
            rid: (tokens, torch.stack(probs[rid]) if probs[rid] else None) for rid, tokens in drafts.items()
        }
