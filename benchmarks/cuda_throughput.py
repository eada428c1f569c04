"""The engine on a CUDA GPU against HF transformers on the same GPU, side by side in one run
(`engine_throughput.py --device cuda` runs this).

A Llama-3-8B-shaped model with random bfloat16 weights (no download: built on the GPU, saved as
an HF folder with a small BPE tokenizer; prompts are random token ids) is served by the engine
with its CUDA defaults (bfloat16, Triton kernels, decode CUDA graphs). For each batch size N: N
prompts of `--prompt-len` tokens, `--new-tokens` generated greedily with EOS ignored, submitted at
once; generated tokens/s over the wall time (prefill included), against HF `generate` on the same
prompts as one batch (bfloat16, SDPA). Then:
- the batch-1 decode step: (wall - TTFT) / (new tokens - 1) of the batch-1 run, against the
  bandwidth limit = weight bytes / the GPU's measured copy bandwidth (read + write bytes of a
  large device-to-device copy, over its time);
- FP8 KV: the tokens the same KV bytes hold in FP8 and in bfloat16 (`KVCacheSpec`), and
  throughput at the middle batch size with `kv_cache_dtype="fp8_e4m3"`;
- INT4 weights (`weight_dtype="int4"`, the Triton W4A16 kernel): throughput at batch 1 and the
  middle batch size.

    python benchmarks/engine_throughput.py --device cuda --output benchmarks/results/cuda.json

`python benchmarks/cuda_throughput.py --smoke` runs the same steps on CPU with a tiny Llama shape
and few tokens: a check of the script itself where no GPU is lent (its figures mean nothing).
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from common import log, write_result

LLAMA3_8B = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}  # fmt: skip
TINY = {**LLAMA3_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512}  # fmt: skip


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_model_folder(folder: Path, shape: dict[str, Any], device: str) -> tuple[Path, int]:
    """A random-weight LlamaForCausalLM of `shape` in bfloat16 saved as an HF folder with a BPE
    tokenizer; returns the folder and the weights' bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["a benchmark needs a tokenizer, nothing more"] * 4, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    config = LlamaConfig(**shape, eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.02)
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(str(folder), safe_serialization=True)
    del model
    free_gpu()
    return folder, num_bytes


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device-to-device copy of 2 GiB, reads plus writes, best of 5."""
    src = torch.empty((1 << 30) if device == "cuda" else (1 << 24), dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / min(times[1:])


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(300, vocab - 100, (n, length), generator=gen).tolist()


def run_engine(llm: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    params = _params(new_tokens)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = statistics.mean(o.metrics.ttft or 0.0 for o in outs)
    return {
        "wall_s": wall, "generated_tokens": generated, "tokens_per_s": generated / wall, "ttft_mean_s": ttft,
        "decode_step_s": (wall - ttft) / max(1, new_tokens - 1),
    }  # fmt: skip


def run_hf(model: Any, prompts: list[list[int]], new_tokens: int, device: str) -> dict[str, float]:
    ids = torch.tensor(prompts, device=device)
    kwargs = {"do_sample": False, "attention_mask": torch.ones_like(ids), "pad_token_id": 0}
    with torch.inference_mode():
        sync(device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        sync(device)
        wall = time.perf_counter() - start
    generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"wall_s": wall, "generated_tokens": generated, "tokens_per_s": generated / wall}


def engine(folder: Path, device: str, max_batch: int, **options: Any) -> Any:
    from tandem import LLM

    started = time.perf_counter()
    llm = LLM(str(folder), device=device, max_num_seqs=max_batch, max_num_batched_tokens=8192,
              enable_prefix_caching=False, speculative=None, **options)  # fmt: skip
    llm.generate([[300] * 8], _params(4))  # warm-up
    log(f"engine {options or 'defaults'} ready in {time.perf_counter() - started:.0f} s")
    return llm


def _params(new_tokens: int) -> Any:
    from tandem import SamplingParams

    return SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)


def measure(
    folder: Path,
    device: str,
    max_batch: int,
    runs: dict[int, list[list[int]]],
    new_tokens: int,
    **options: Any,
) -> tuple[dict[int, dict[str, float]], dict[str, Any]]:
    """An engine with `options` over each batch of `runs`; returns the results and its stats. The
    engine lives only here, so its memory is back once this returns (and `free_gpu` ran)."""
    llm = engine(folder, device, max_batch, **options)
    results = {}
    for n, prompts in runs.items():
        results[n] = run_engine(llm, prompts, new_tokens)
        log(f"batch {n} {options or 'defaults'}: {results[n]['tokens_per_s']:.0f} tok/s")
    return results, llm.stats()


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main_cuda(
    batch_sizes: list[int], prompt_len: int, new_tokens: int, output: Path, workdir: Path, smoke: bool = False
) -> dict:
    """The report (module docstring); `smoke`: on CPU with the tiny shape (a check of this script)."""
    from transformers import AutoModelForCausalLM

    from tandem.engine.runner.kv_tensors import KVCacheSpec

    device, shape = ("cpu", TINY) if smoke else ("cuda", LLAMA3_8B)
    assert smoke or torch.cuda.is_available(), "--device cuda needs a CUDA GPU"
    gpu: dict[str, Any] = {"name": "cpu (smoke run)"}
    if not smoke:
        gpu = {
            "name": torch.cuda.get_device_name(),
            "memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        }
    bandwidth = copy_bandwidth(device)
    log(f"{gpu['name']}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    folder, weight_bytes = build_model_folder(
        workdir / ("tiny" if smoke else "llama3-8b-random"), shape, device
    )
    log(f"model folder ready: {weight_bytes / 1e9:.1f} GB of weights")
    vocab = shape["vocab_size"]
    max_batch = max(batch_sizes)
    middle = sorted(batch_sizes)[len(batch_sizes) // 2]
    rows: dict[int, dict[str, Any]] = {n: {"batch": n} for n in batch_sizes}

    prompts = {n: prompts_for(n, prompt_len, vocab, n) for n in batch_sizes}
    results, stats = measure(folder, device, max_batch, prompts, new_tokens)
    free_gpu()
    for n in batch_sizes:
        rows[n]["tandem"] = results[n]

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16, attn_implementation="sdpa")
    hf = hf.to(device).eval()
    hf.generate(torch.tensor([[300] * 8], device=device), max_new_tokens=4, do_sample=False, pad_token_id=0)
    for n in batch_sizes:
        rows[n]["hf"] = run_hf(hf, prompts[n], new_tokens, device)
        rows[n]["tandem_over_hf"] = rows[n]["tandem"]["tokens_per_s"] / rows[n]["hf"]["tokens_per_s"]
        log(
            f"batch {n}: HF {rows[n]['hf']['tokens_per_s']:.0f} tok/s, tandem {rows[n]['tandem_over_hf']:.2f}x"
        )
    del hf
    free_gpu()

    bound_s = weight_bytes / bandwidth
    step_s = rows[min(batch_sizes)]["tandem"]["decode_step_s"]
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    spec = dict(num_layers=shape["num_hidden_layers"], num_kv_heads=shape["num_key_value_heads"], head_dim=head_dim,
                block_size=16)  # fmt: skip
    bf16_block = KVCacheSpec(**spec, dtype=torch.bfloat16).bytes_per_block
    fp8_block = KVCacheSpec(**spec, dtype=torch.float8_e4m3fn).bytes_per_block

    fp8_runs, fp8_stats = measure(
        folder, device, max_batch, {middle: prompts[middle]}, new_tokens, kv_cache_dtype="fp8_e4m3"
    )
    free_gpu()
    int4_runs, _ = measure(
        folder, device, max_batch, {n: prompts[n] for n in (1, middle)}, new_tokens, weight_dtype="int4"
    )
    free_gpu()

    report = {
        "benchmark": "cuda_throughput",
        "gpu": gpu,
        "model": "tiny Llama shape (smoke run)" if smoke else "Llama-3-8B shape, random bfloat16 weights",
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "engine": {k: stats.get(k) for k in ("dtype", "weight_dtype", "kv_cache_dtype", "kv_capacity_tokens", "kv_blocks_total")},
        "num_graph_steps": stats.get("num_graph_steps"),
        "results": [rows[n] for n in batch_sizes],
        "batch1_decode": {
            "step_s": step_s, "weight_bytes": weight_bytes, "copy_bandwidth_bytes_per_s": bandwidth,
            "bandwidth_limit_s": bound_s, "fraction_of_limit": bound_s / step_s,
        },
        "fp8_kv": {
            "bytes_per_block_bf16": bf16_block, "bytes_per_block_fp8": fp8_block,
            "tokens_ratio_same_bytes": bf16_block / fp8_block, "batch": middle, "run": fp8_runs[middle],
            "kv_capacity_tokens": fp8_stats.get("kv_capacity_tokens"),
            "bf16_kv_capacity_tokens": stats.get("kv_capacity_tokens"),
        },
        "int4_weights": {"runs": {str(n): run for n, run in int4_runs.items()}},
    }  # fmt: skip
    write_result(output, report)
    return report


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shape on CPU: check the script, not the GPU"
    )
    parser.add_argument(
        "--output", type=Path, default=Path(__file__).parent / "results" / "cuda_throughput.json"
    )
    args = parser.parse_args()
    sizes, tokens = ([1, 2, 4], 8) if args.smoke else ([1, 32, 256], 128)
    print(json.dumps(main_cuda(sizes, 16 if args.smoke else 128, tokens, args.output,
                               Path("/tmp/tandem-cuda-bench"), smoke=args.smoke), indent=2))  # fmt: skip
