"""The model runner: everything torch between a `SchedulerOutput` and a `RunnerResult`.

`model_runner` (the step), `forward_path` (which forward computes a step), `sampler` and
`constraints` (tokens from logits), `kv_tensors` (the paged cache's tensors and pages),
`compressed` (the per-head layout's pool and forward).
"""

from tandem.engine.runner.constraints import GRAMMAR_FAILED
from tandem.engine.runner.forward_path import NATIVE_MAX_ROWS
from tandem.engine.runner.kv_tensors import KVCacheSpec, allocate_kv_caches
from tandem.engine.runner.model_runner import ModelRunner
from tandem.engine.runner.sampler import NON_FINITE_LOGITS, REQUEST_FAILED

__all__ = [
    "GRAMMAR_FAILED",
    "NATIVE_MAX_ROWS",
    "NON_FINITE_LOGITS",
    "REQUEST_FAILED",
    "KVCacheSpec",
    "ModelRunner",
    "allocate_kv_caches",
]
