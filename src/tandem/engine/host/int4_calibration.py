"""Calibrated INT4 weights for a checkpoint, computed once per checkpoint and machine and cached.

Contract of `calibrated_int4(loaded, group_size, device, cache_dir)`: a dict from each INT4
target's key (`target_key`: its checkpoint names joined by "|") to its `Int4Weight`, quantised
by GPTQ (`kernels.gptq`) with the Hessians of the target's inputs on the bundled calibration text
(`data/int4_calibration.txt`, its own text: the quality probe judges the result on another,
`data/calibration.txt`). Collecting them runs the float32 model over the text as prompt chunks
of `CHUNK_TOKENS`; then each target is quantised (a progress bar on stderr). The result is saved
as safetensors under `$TANDEM_CACHE_DIR/int4/` keyed by the checkpoint's files, the group size,
the calibration text, the method's version, torch's version and the CPU; a second load reads it
(seconds), and engines starting together compute it once (a lock beside the file).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tandem.engine.host.precision_probe import probe_lock
from tandem.engine.host.quality_probe import checkpoint_identity
from tandem.engine.models.interface import Int4Target
from tandem.engine.models.loader import LoadedModel, build_model
from tandem.engine.models.quantized import DEFAULT_INT4_GROUP_SIZE
from tandem.engine.runner import ModelRunner
from tandem.engine.runner.kv_tensors import KVCacheSpec
from tandem.engine.runner.teacher_forcing import teacher_forced_logits
from tandem.kernels.gptq import gptq_quantize
from tandem.kernels.int4 import Int4Weight, fit_group_size
from tandem.platform.cpu import cpu_model_name

logger = logging.getLogger("tandem.engine")

METHOD_VERSION = 1
CALIBRATION_TEXT = Path(__file__).parent.parent / "data" / "int4_calibration.txt"
CHUNK_TOKENS = 512
MAX_TOKENS = 4096


def int4_source(method: str, group_size: int | None, loaded: LoadedModel) -> str:
    """Where a checkpoint's INT4 weights come from, in words (part of the quality probe's cache
    key and verdict): the file's own 4-bit blocks (a GGUF without an explicit group size; its other
    linears round-to-nearest), else the quantiser and its group size."""
    if loaded.path.suffix == ".gguf" and group_size is None:
        return f"the file's 4-bit blocks as stored, others round-to-nearest, group {DEFAULT_INT4_GROUP_SIZE}"
    return (
        f"{'GPTQ' if method == 'gptq' else 'round-to-nearest'}, group {group_size or DEFAULT_INT4_GROUP_SIZE}"
    )


def target_key(target: Int4Target) -> str:
    return "|".join(target.source_names)


def cache_key(loaded: LoadedModel, group_size: int) -> str:
    parts = {
        "version": METHOD_VERSION, "checkpoint": str(loaded.path.resolve()), "files": checkpoint_identity(loaded.path),
        "group_size": group_size, "text": hashlib.sha256(CALIBRATION_TEXT.read_bytes()).hexdigest(),
        "torch": torch.__version__, "cpu": cpu_model_name(),
    }  # fmt: skip
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def calibrated_int4(
    loaded: LoadedModel, group_size: int, kv_spec: KVCacheSpec, device: torch.device, cache_dir: Path
) -> dict[str, Int4Weight]:
    """The checkpoint's GPTQ INT4 weights (module docstring): cached, else computed and cached.
    `kv_spec`: the model's cache shape (its dtype is replaced by float32 here)."""
    path = cache_dir / "int4" / f"gptq-{cache_key(loaded, group_size)}.safetensors"
    with probe_lock(path):
        try:
            return _read(path)
        except (OSError, ValueError, KeyError):
            pass
        started = time.perf_counter()
        weights = _compute(loaded, group_size, kv_spec, device)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        save_file(_as_tensors(weights), str(partial))
        partial.replace(path)
        logger.info(
            "calibrated INT4 weights computed",
            extra={
                "seconds": round(time.perf_counter() - started, 1),
                "path": str(path),
                "targets": len(weights),
            },
        )
        return weights


def _as_tensors(weights: dict[str, Int4Weight]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for key, w in weights.items():
        tensors[f"{key}#q"] = w.q.contiguous()
        tensors[f"{key}#scale"] = w.scale.contiguous()
        tensors[f"{key}#zero"] = w.zero.contiguous()
        tensors[f"{key}#group_size"] = torch.tensor([w.group_size])
    return tensors


def _read(path: Path) -> dict[str, Int4Weight]:
    tensors = load_file(str(path))
    keys = {name.rsplit("#", 1)[0] for name in tensors}
    return {
        key: Int4Weight(
            tensors[f"{key}#q"],
            tensors[f"{key}#scale"],
            tensors[f"{key}#zero"],
            int(tensors[f"{key}#group_size"][0]),
        )
        for key in keys
    }


def _compute(
    loaded: LoadedModel, group_size: int, kv_spec: KVCacheSpec, device: torch.device
) -> dict[str, Int4Weight]:
    token_ids = loaded.tokenizer.encode(CALIBRATION_TEXT.read_text())[:MAX_TOKENS]
    model = build_model(
        loaded, dtype=torch.float32, device=device, max_positions=CHUNK_TOKENS + 1, pack_weights=False
    )
    targets = model.int4_targets()
    hessians: dict[str, torch.Tensor] = {}
    hooks = []
    for target in targets:
        key = target_key(target)
        linear = getattr(target.parent, target.attr)
        hessians[key] = torch.zeros(linear.in_features, linear.in_features, dtype=torch.float64)

        def accumulate(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], key: str = key) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            hessians[key].addmm_(x.T, x)

        hooks.append(linear.register_forward_pre_hook(accumulate))
    spec = dataclasses.replace(kv_spec, dtype=torch.float32)
    runner = ModelRunner(model, spec, -(-CHUNK_TOKENS // spec.block_size) + 1, device, native_decoder=False)
    try:
        with torch.inference_mode():
            for start in range(0, len(token_ids), CHUNK_TOKENS):
                chunk = token_ids[start : start + CHUNK_TOKENS]
                if len(chunk) > 1:
                    teacher_forced_logits(runner, chunk, len(chunk))
    finally:
        for hook in hooks:
            hook.remove()
    out: dict[str, Int4Weight] = {}
    for number, target in enumerate(targets, 1):
        key = target_key(target)
        weight = getattr(target.parent, target.attr).weight.detach()
        out[key] = gptq_quantize(weight, hessians[key], fit_group_size(weight.shape[1], group_size))
        _progress(number, len(targets))
    return out


def _progress(done: int, total: int) -> None:
    """Progress of the first load's quantisation: a bar on a terminal, else a log line per quarter."""
    if sys.stderr.isatty():
        width = 30
        filled = width * done // total
        bar = f"[{'#' * filled}{'.' * (width - filled)}]"
        sys.stderr.write(
            f"\r[tandem] calibrating INT4 (GPTQ) {bar} {done}/{total}" + ("\n" if done == total else "")
        )
        sys.stderr.flush()
    elif done * 4 // total != (done - 1) * 4 // total:
        logger.info("calibrating INT4 (GPTQ)", extra={"done": done, "total": total})
