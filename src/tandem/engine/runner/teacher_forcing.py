"""The next-token logits a model gives along a fixed token sequence, computed as the engine computes
a lone request (the quality probe, the quality gate and INT4 calibration measure a precision by them)."""

from __future__ import annotations

import torch

from tandem.engine.runner.model_runner import ModelRunner
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sched.step import ScheduledRequest


@torch.inference_mode()
def teacher_forced_logits(runner: ModelRunner, token_ids: list[int], num_prompt_tokens: int) -> torch.Tensor:
    """[len(token_ids) - num_prompt_tokens + 1, V] float32: the next-token logits after each
    of `token_ids[num_prompt_tokens - 1:]`, computed as a lone request is: the first
    `num_prompt_tokens` as one prompt chunk, then each further token as a one-token decode step
    (through the path `choose_path` picks for it). Writes blocks 0.. of the cache, which hold
    no request's KV before the engine starts: call it only then (the quality probe does)."""
    num_blocks = -(-len(token_ids) // runner.block_size)
    if not 0 < num_prompt_tokens <= len(token_ids) or num_blocks > runner.kv_caches[0][0].shape[0]:
        raise ValueError(
            f"{len(token_ids)} tokens ({num_prompt_tokens} as the prompt) do not fit this runner"
        )
    block_ids = list(range(num_blocks))
    params = SamplingParams(temperature=0.0)

    def step(start: int, end: int) -> torch.Tensor:
        item = ScheduledRequest(
            request_id="teacher-forced", token_ids=token_ids[start:end], start_position=start, block_ids=block_ids,
            sample=True, sampling_params=params, output_token_ids=[], is_new=start == 0,
        )  # fmt: skip
        return runner.forward_shared([item])[0].float()

    rows = [step(0, num_prompt_tokens)]
    rows.extend(step(position, position + 1) for position in range(num_prompt_tokens, len(token_ids)))
    return torch.cat(rows)
