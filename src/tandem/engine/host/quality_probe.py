"""The quality probe: how far a precision's next-token distributions are from the checkpoint's
own float32 weights, measured on this checkpoint at first load (`builder.build_parts`).

A quantisation or a 16-bit compute dtype is a default only within a measured bound on the actual
checkpoint: random weights hide quantisation error, and one trained model's INT4 copy can keep
its answers while another's doubles its perplexity. So the probe runs the bundled calibration
text (`data/calibration.txt`, tokenised by the checkpoint's tokenizer) through two runners built
like the engine's, the float32 dense reference and the candidate, as a lone request runs: the
first `NUM_PROMPT_TOKENS` tokens as one prompt chunk, then every further token as a one-token
decode step (the decode path included: the native INT4 stack where it runs). At each of those
positions it compares the next-token distributions:

- `mean_kl`: the mean of KL(P_float32 || P_candidate), in nats;
- `top1_agreement`: the fraction of positions whose most likely token is the same.

Contract: a candidate is within the bound when `mean_kl <= MAX_MEAN_KL` and `top1_agreement >=
MIN_TOP1_AGREEMENT`. Results are cached per machine, checkpoint and candidate as JSON under
`$TANDEM_CACHE_DIR/precision/` (the key: the checkpoint's files' names, sizes and mtimes, the
candidate, the CPU, torch's version, the native library's sources (`int4_native.build_key`) and
the probe's version); a second start reads them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tandem.engine.host.precision_probe import probe_lock, write_atomically
from tandem.kernels.int4_native import build_key
from tandem.platform.cpu import cpu_flags, cpu_model_name

logger = logging.getLogger("tandem.engine")

QUALITY_PROBE_VERSION = 2  # 2: candidates name their INT4 source (GPTQ or the file's codes)
MAX_MEAN_KL = 0.02  # nats
MIN_TOP1_AGREEMENT = 0.97
NUM_PROMPT_TOKENS = 96
NUM_DECODE_TOKENS = 128
CALIBRATION_TEXT = Path(__file__).parent.parent / "data" / "calibration.txt"

# (token_ids, num_prompt_tokens) -> the teacher-forced logits [positions, V] of a runner of one
# precision (`runner.teacher_forcing.teacher_forced_logits`).
Scorer = Callable[[list[int], int], torch.Tensor]


@dataclass(frozen=True)
class QualityResult:
    """How a candidate precision compares with float32 dense on this checkpoint (module docstring)."""

    candidate: str  # "<dtype>/<weight_dtype>", e.g. "bfloat16/dense"
    mean_kl: float
    top1_agreement: float
    num_positions: int
    seconds: float  # how long the measurement took when it ran
    source: str = "measured"  # "measured" | "cache"

    @property
    def within_bound(self) -> bool:
        return self.mean_kl <= MAX_MEAN_KL and self.top1_agreement >= MIN_TOP1_AGREEMENT

    def describe(self) -> str:
        verdict = "within" if self.within_bound else "outside"
        return (
            f"{self.candidate}: mean KL {self.mean_kl:.4f} nats, top-1 agreement {self.top1_agreement:.3f} with "
            f"float32 over {self.num_positions} positions, {verdict} the bound (KL <= {MAX_MEAN_KL}, "
            f"agreement >= {MIN_TOP1_AGREEMENT}; quality probe, {self.source})"
        )

    def as_stats(self) -> dict[str, object]:
        return {**asdict(self), "within_bound": self.within_bound}


def compare(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[float, float]:
    """(mean KL(P_reference || P_candidate), top-1 agreement) of two [N, V] logit tensors."""
    ref_logprobs = torch.log_softmax(reference.float(), dim=-1)
    cand_logprobs = torch.log_softmax(candidate.float(), dim=-1)
    kl = (ref_logprobs.exp() * (ref_logprobs - cand_logprobs)).sum(dim=-1)  # [N]
    agreement = (reference.argmax(dim=-1) == candidate.argmax(dim=-1)).float().mean()
    return float(kl.mean()), float(agreement)


def calibration_token_ids(encode: Callable[[str], list[int]]) -> list[int]:
    """The calibration text's first `NUM_PROMPT_TOKENS + NUM_DECODE_TOKENS` tokens (fewer for a
    tokenizer that packs it tighter)."""
    return encode(CALIBRATION_TEXT.read_text())[: NUM_PROMPT_TOKENS + NUM_DECODE_TOKENS]


def measure(candidate: str, token_ids: list[int], reference: Scorer, scorer: Scorer) -> QualityResult:
    """Score `token_ids` with the float32 `reference` and the `candidate`'s `scorer`, and compare."""
    started = time.perf_counter()
    num_prompt = min(NUM_PROMPT_TOKENS, len(token_ids) // 2)
    expected = reference(token_ids, num_prompt)
    mean_kl, top1 = compare(expected, scorer(token_ids, num_prompt))
    return QualityResult(candidate, mean_kl, top1, expected.shape[0], time.perf_counter() - started)


def checkpoint_identity(path: Path) -> list[list[str | int]]:
    """The checkpoint's files (a GGUF file, or a folder's files) by name, size and mtime."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def quality_key(checkpoint: Path, candidate: str) -> str:
    parts = {
        "version": QUALITY_PROBE_VERSION, "checkpoint": str(checkpoint.resolve()),
        "files": checkpoint_identity(checkpoint), "candidate": candidate, "cpu": cpu_model_name(),
        "flags": sorted(cpu_flags()), "torch": torch.__version__, "kernels": build_key(cpu_flags()),
        "bound": [MAX_MEAN_KL, MIN_TOP1_AGREEMENT, NUM_PROMPT_TOKENS, NUM_DECODE_TOKENS],
    }  # fmt: skip
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def probe_quality(
    checkpoint: Path, candidate: str, token_ids: list[int], reference: Scorer, scorer: Scorer, cache_dir: Path
) -> QualityResult:
    """The candidate's quality on this checkpoint: cached, else measured and cached. Engines
    starting together measure once (a lock beside the cache entry)."""
    path = cache_dir / "precision" / f"quality-{quality_key(checkpoint, candidate)}.json"
    with probe_lock(path):
        try:
            cached = json.loads(path.read_text())
            cached.pop("within_bound", None)
            result = QualityResult(**{**cached, "source": "cache"})
        except (OSError, ValueError, TypeError):
            result = measure(candidate, token_ids, reference, scorer)
            try:
                write_atomically(path, json.dumps(result.as_stats(), indent=1))
            except OSError as exc:
                logger.warning("quality probe not cached", extra={"path": str(path), "error": repr(exc)})
    logger.info("quality probe", extra=result.as_stats())
    return result
