"""Calibrated INT4 (GPTQ, `kernels/gptq.py`, `engine/host/int4_calibration.py`).

- The maths: on inputs whose channels differ in scale and correlate (as activations do), GPTQ's
  error feedback gives a layer's outputs a smaller error than round-to-nearest at the same group
  size, and its codes are valid INT4 (0..15, float16-exact parameters).
- The engine: `weight_dtype="int4"` on float weights quantises with GPTQ once, caches the result
  per checkpoint, and a second engine reads the cache instead of computing again; `int4_method=
  "rtn"` is the old round-to-nearest.
The quality on real checkpoints is measured by benchmarks/quant_quality.py (docs/performance.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.host import int4_calibration
from tandem.kernels.gptq import gptq_quantize
from tandem.kernels.int4 import dequantize_int4, quantize_int4


def _activations(num_tokens: int, width: int, seed: int) -> torch.Tensor:
    """Tokens from one distribution (fixed channel mixing and scales), `seed` drawing the tokens."""
    structure = torch.Generator().manual_seed(0)
    mixing = torch.randn(width, width, generator=structure) / width**0.5
    channel_scale = torch.logspace(-1, 1, width)[torch.randperm(width, generator=structure)]
    noise = torch.randn(num_tokens, width, generator=torch.Generator().manual_seed(seed))
    return (noise @ mixing + 0.3) * channel_scale


@pytest.mark.parametrize("group_size", [32, 128])
def test_gptq_gives_smaller_output_error_than_round_to_nearest(group_size: int) -> None:
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(3))
    x = _activations(2048, 256, seed=4)
    held_out = _activations(512, 256, seed=5)
    calibrated = gptq_quantize(weight, x.double().T @ x.double(), group_size)
    rounded = quantize_int4(weight, group_size)
    assert calibrated.q.dtype == torch.uint8 and int(calibrated.q.max()) <= 15
    assert torch.equal(calibrated.scale, calibrated.scale.half().float())  # what the kernel stores

    def output_error(w: torch.Tensor) -> float:
        return float(((held_out @ weight.T - held_out @ w.T) ** 2).mean())

    gptq_error, rtn_error = output_error(dequantize_int4(calibrated)), output_error(dequantize_int4(rounded))
    print(f"\ngroup {group_size}: output MSE GPTQ {gptq_error:.4g}, round-to-nearest {rtn_error:.4g}")
    assert gptq_error < 0.75 * rtn_error


def test_int4_engine_quantises_once_and_reads_the_cache_next_time(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    options = {"dtype": "float32", "weight_dtype": "int4", "int4_group_size": 32, "kv_cache_memory": 4 << 20}
    first = LLM(str(tiny_model_dir), **options).generate(["Hello there"], params)[0].outputs[0].token_ids
    cached = list((tmp_path / "int4").glob("gptq-*.safetensors"))
    assert len(cached) == 1

    def refuse(*_: object) -> None:
        raise AssertionError("computed again instead of reading the cache")

    monkeypatch.setattr(int4_calibration, "_compute", refuse)
    second = LLM(str(tiny_model_dir), **options).generate(["Hello there"], params)[0].outputs[0].token_ids
    assert second == first
    rtn = LLM(str(tiny_model_dir), **options, int4_method="rtn")  # never calibrates
    assert rtn.generate(["Hello there"], params)[0].outputs[0].token_ids
