"""The Triton kernels against their torch references, on every machine.

Without CUDA they run in Triton's CPU interpreter (conftest sets `TRITON_INTERPRET=1`), at tiny
shapes; with CUDA (`gpu` marker) the same checks run compiled on the GPU. The last tests force
the CUDA path's selection (`TANDEM_TRITON_ON_CPU=1`) to run whole engines through the kernels on
CPU, and check that nothing selects them on CPU otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from tandem.kernels.attention import reference_attention, write_kv_reference
from tandem.kernels.attention_metadata import build_attention_metadata
from tandem.kernels.fp8 import quantize_fp8
from tandem.kernels.int4 import (  # noqa: E402
    Int4Linear,
    _choose_kernel,
    double_quantize_int4,
    int4_linear_reference,
    quantize_int4,
)
from tandem.kernels.triton_support import TRITON_ON_CPU_ENV, uses_triton  # noqa: E402

pytestmark = pytest.mark.slow  # Triton's CPU interpreter and the Hopper compile (make test runs them)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
    ),
]


def _interpreter_or_cuda(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU runs of Triton kernels need TRITON_INTERPRET=1 (set by conftest without CUDA)")


def _kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str
):  # type: ignore[no-untyped-def]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.zeros(shape, dtype=dtype, device=device)
    v = torch.zeros(shape, dtype=dtype, device=device)
    if dtype != torch.float8_e4m3fn:
        return k, v, None, None
    scales = torch.zeros(shape[:3], dtype=torch.float16, device=device)
    return k, v, scales, torch.zeros_like(scales)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["f32", "bf16", "fp8"]
)
def test_kv_write_matches_reference(device: str, dtype: torch.dtype) -> None:
    """The KV write stores what `write_kv`'s torch body stores, byte for byte (FP8 codes and
    scales included, over magnitudes from subnormal e4m3 codes to large ones and an all-zero
    vector), and skips slots < 0."""
    from tandem.kernels.triton_attention import write_kv_triton

    _interpreter_or_cuda(device)
    torch.manual_seed(0)
    num_tokens, num_kv_heads, head_dim = 10, 3, 24  # head dim and head count not powers of two
    k = torch.randn(num_tokens, num_kv_heads, head_dim) * torch.logspace(-4, 3, num_tokens)[:, None, None]
    v = torch.randn(num_tokens, num_kv_heads, head_dim)
    k[3, 1] = 0.0  # an all-zero vector: a finite scale, zero codes
    v[4, 0, :5] = torch.tensor([1e-3, -2.5e-3, 7e-4, 448.0, -0.1])  # e4m3 subnormals after scaling
    slots = torch.randperm(32)[:num_tokens]
    slots[7] = -1  # a padding row: written nowhere
    expected = _kv_cache(4, 8, num_kv_heads, head_dim, dtype, device)
    actual = _kv_cache(4, 8, num_kv_heads, head_dim, dtype, device)
    keep = slots >= 0
    write_kv_reference(
        k[keep].to(device), v[keep].to(device), *expected[:2], slots[keep].to(device), *expected[2:]
    )
    write_kv_triton(k.to(device), v.to(device), *actual[:2], slots.to(device), *actual[2:])
    for want, got in zip(expected, actual, strict=True):
        if want is not None:
            assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))
    if dtype == torch.float8_e4m3fn:
        assert torch.isfinite(actual[0].float()).all() and torch.isfinite(actual[2].float()).all()


def _requests() -> list[tuple[int, int]]:
    """(context length, rows this step): a whole prompt, a chunk after a cached prefix, a decode,
    a speculative verification (3 rows after a prefix), a longer decode."""
    return [(9, 9), (21, 6), (20, 1), (11, 3), (37, 1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("kv_dtype", "q_dtype", "num_heads", "window", "softcap"),
    [
        (torch.float32, torch.float32, 6, None, None),  # GQA group 3
        (torch.float32, torch.float32, 8, 5, None),  # group 4, sliding window
        (torch.float32, torch.float32, 4, None, 3.0),  # group 2, soft-capping
        (torch.float8_e4m3fn, torch.float32, 6, None, None),
        (torch.float8_e4m3fn, torch.float32, 8, 7, 4.0),
        (torch.bfloat16, torch.bfloat16, 6, None, None),
    ],
    ids=["f32-g3", "f32-g4-window", "f32-g2-softcap", "fp8-g3", "fp8-g4-window-softcap", "bf16-g3"],
)
def test_paged_attention_matches_reference(
    device: str,
    kv_dtype: torch.dtype,
    q_dtype: torch.dtype,
    num_heads: int,
    window: int | None,
    softcap: float | None,
) -> None:
    """Every row of a mixed step (prompt, chunk after a prefix, decodes, a verification) equals
    dense causal attention over the request's keys as the cache holds them (FP8: dequantised;
    a whole prompt under FP8: as computed).
    With a window, the blocks before each request's window are released (-1 in its table) and
    the block those entries once named is poisoned: neither is read."""
    from tandem.kernels.paged_rows import build_query_tiles, query_tile_rows
    from tandem.kernels.triton_attention import paged_attention_triton

    _interpreter_or_cuda(device)
    torch.manual_seed(1)
    num_kv_heads, head_dim, block_size, num_blocks = 2, 16, 4, 40
    caches = _kv_cache(num_blocks, block_size, num_kv_heads, head_dim, kv_dtype, device)
    requests = _requests()
    free = torch.randperm(num_blocks - 1).tolist()  # the last block is the poisoned one
    poisoned = num_blocks - 1
    tables, keys, fresh_k, fresh_v = [], [], [], []
    for ctx, n in requests:
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        tables.append(table)
        k, v = torch.randn(ctx, num_kv_heads, head_dim) * 2, torch.randn(ctx, num_kv_heads, head_dim)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        write_kv_reference(
            k.to(device), v.to(device), caches[0], caches[1], slots.to(device), caches[2], caches[3]
        )
        keys.append(slots)
        fresh_k.append(k[ctx - n :])
        fresh_v.append(v[ctx - n :])
    for cache in caches[:2]:
        cache[poisoned].view(torch.uint8).fill_(0x7F)  # NaN in every dtype
    q = torch.randn(sum(n for _, n in requests), num_heads, head_dim).to(q_dtype)
    table_tensor = torch.full((len(requests), max(len(t) for t in tables)), -1, dtype=torch.int32)
    for i, (table, (ctx, n)) in enumerate(zip(tables, requests, strict=True)):
        table_tensor[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        if window is not None:  # blocks wholly before the first row's window: released
            first_key = max(0, ctx - n - window + 1)
            for b in range(first_key // block_size):
                table_tensor[i, b] = -1 if b % 2 else poisoned
    query_lens = [n for _, n in requests]
    # this step's keys and values as the model hands them over: v a strided view of a fused tensor
    fused = torch.cat([torch.cat(fresh_k), torch.cat(fresh_v)], dim=-1).to(q_dtype)  # [T, Hk, 2D]
    k_step, v_step = fused[..., :head_dim].contiguous(), fused[..., head_dim:]
    query_start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    block_q = query_tile_rows(max(query_lens))
    tile_request, tile_row = build_query_tiles(query_lens, block_q)
    out = paged_attention_triton(
        q.to(device), caches[0], caches[1], table_tensor.to(device),
        torch.tensor([c for c, _ in requests], dtype=torch.int32, device=device), query_start.to(device),
        torch.tensor(tile_request, dtype=torch.int32, device=device),
        torch.tensor(tile_row, dtype=torch.int32, device=device), block_q, 0.3, caches[2], caches[3], window, softcap,
        k_step.to(device), v_step.to(device),
    ).cpu()  # fmt: skip

    def stored(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
        rows = cache.view(-1, num_kv_heads, head_dim)[slots.to(device)].float().cpu()
        return (
            rows
            if scales is None
            else rows * scales.view(-1, num_kv_heads)[slots.to(device)].float().cpu()[..., None]
        )

    row = 0
    tolerance = 2e-2 if q_dtype == torch.bfloat16 else 2e-5
    for (ctx, n), slots, k_new, v_new in zip(requests, keys, fresh_k, fresh_v, strict=True):
        k_ref, v_ref = stored(caches[0], caches[2], slots), stored(caches[1], caches[3], slots)
        if ctx == n and kv_dtype != q_dtype:  # a prompt under a narrower cache: its keys as computed
            k_ref, v_ref = k_new.to(q_dtype).float(), v_new.to(q_dtype).float()
        want = reference_attention(q[row : row + n].float(), k_ref, v_ref, 0.3, window, softcap)
        torch.testing.assert_close(out[row : row + n].float(), want, atol=tolerance, rtol=tolerance)
        row += n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("num_rows", "in_features", "out_features", "group_size", "double_quant"),
    [(1, 64, 48, 32, False), (5, 128, 40, 64, False), (33, 256, 72, 128, False), (3, 192, 64, 32, True)],
)
def test_w4a16_matches_reference(
    device: str, num_rows: int, in_features: int, out_features: int, group_size: int, double_quant: bool
) -> None:
    """`Int4Linear` with the Triton kernel equals `int4_linear_reference` (dequantise, then F.linear),
    for several row counts, ragged N, group sizes and double-quantised parameters, with a bias."""
    from tandem.kernels.triton_int4 import pack_int4_columns, w4a16_matmul

    _interpreter_or_cuda(device)
    torch.manual_seed(2)
    weight = quantize_int4(torch.randn(out_features, in_features), group_size)
    if double_quant:
        weight = double_quantize_int4(weight)
    x = torch.randn(num_rows, in_features)
    want = int4_linear_reference(x, weight)
    got = w4a16_matmul(
        x.to(device), pack_int4_columns(weight.q).to(device), weight.scale.t().contiguous().to(device),
        weight.zero.t().contiguous().to(device), group_size,
    ).cpu()  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if device == "cuda":  # the module: float16 group parameters (float32 when double-quantised)
        linear = Int4Linear(weight, torch.device("cuda"), "auto", bias=torch.randn(out_features))
        assert linear.kernel == "triton"
        if not double_quant:
            weight.scale, weight.zero = weight.scale.half().float(), weight.zero.half().float()
        want = int4_linear_reference(x, weight) + linear.bias.cpu()
        torch.testing.assert_close(linear(x.cuda()).cpu(), want, atol=1e-4, rtol=1e-4)


def test_int4_linear_runs_triton_where_it_is_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU, `Int4Linear` takes the Triton kernel only when forced (and then matches the reference)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter")
    weight = quantize_int4(torch.randn(40, 64), 32)
    weight.scale, weight.zero = weight.scale.half().float(), weight.zero.half().float()  # stored as float16
    cpu = torch.device("cpu")
    assert Int4Linear(weight, cpu, "auto").kernel != "triton"
    with pytest.raises(RuntimeError, match="int4_kernel='triton' cannot be used"):
        Int4Linear(weight, cpu, "triton")
    monkeypatch.setenv(TRITON_ON_CPU_ENV, "1")
    bias = torch.randn(40)
    linear = Int4Linear(weight, cpu, "auto", bias=bias)
    assert linear.kernel == "triton"
    x = torch.randn(3, 64)
    torch.testing.assert_close(linear(x), int4_linear_reference(x, weight) + bias, atol=1e-4, rtol=1e-4)


def test_cuda_paths_are_chosen_only_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device picks the implementation: CUDA gets Triton's attention, KV write and INT4 kernels
    and bfloat16; CPU never does unless a test forces it, and the CPU-only paths refuse CUDA."""
    from tandem.engine.host.precision import choose_precision
    from tandem.kernels.linear import onednn_available

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv(TRITON_ON_CPU_ENV, raising=False)
    assert uses_triton(cuda)
    assert not uses_triton(cpu)
    assert _choose_kernel("auto", cuda, 128) == "triton"
    assert _choose_kernel("torch", cuda, 128) == "torch"
    with pytest.raises(RuntimeError, match="native"):
        _choose_kernel("native", cuda, 32)
    assert _choose_kernel("auto", cpu, 32) in ("native", "torch")
    assert not onednn_available(cuda, torch.float32)
    choice = choose_precision(
        device_type="cuda",
        dtype="auto",
        weight_dtype="auto",
        flags=frozenset({"amx_bf16"}),
        native_int4=False,
    )
    assert (choice.dtype, choice.weight_dtype) == ("bfloat16", "dense")
    from tandem.engine.builder import uses_decode_graphs
    from tandem.platform.config import EngineConfig

    assert uses_decode_graphs(EngineConfig(), cuda) and not uses_decode_graphs(
        EngineConfig(cuda_graphs=False), cuda
    )
    assert not uses_decode_graphs(EngineConfig(), cpu)
    metadata = build_attention_metadata([[3, 1]], [5], [5], 4, 2, cpu)
    assert metadata.paged is None and metadata.prefills  # the torch path's per-segment metadata
    monkeypatch.setenv(TRITON_ON_CPU_ENV, "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert uses_triton(cpu)
        forced = build_attention_metadata([[3, 1]], [5], [5], 4, 2, cpu)
        assert forced.paged is not None and forced.paged.block_tables.tolist() == [[3, 1]]
        assert forced.slot_mapping.tolist() == [12, 13, 14, 15, 4]


def test_triton_kernels_compile_for_hopper() -> None:
    """Every Triton kernel, at the configurations the engine launches (bf16 and float32, FP8 with
    fresh keys, windows and soft-capping, decode and prefill tiles, W4A16 with float16 and float32
    group parameters), compiles to sm_90 machine code with Triton's own compiler and ptxas: no GPU
    needed, so CI catches what only the GPU compiler refuses (tests/triton_aot.py)."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the default; set to silence Triton 3.9's warning
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "tests.triton_aot"], cwd=Path(__file__).resolve().parents[1], env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) >= 9
    assert all(status == "ok" for status in results.values()), results


def test_decode_graphs_serve_only_plain_decode_steps() -> None:
    """`choose_path` sends a step to the captured graphs only when it is decode-only (one row per
    request), LoRA-free, not compressed and within the largest bucket; a runner without graphs
    (every CPU runner) never does."""
    from tandem.engine.runner.forward_path import ForwardPath, RunnerPaths, StepShape, choose_path

    graphs = RunnerPaths(False, False, False, False, 1 << 30, graph_max_batch=8)
    none = RunnerPaths(False, False, False, False, 1 << 30)
    decode = StepShape(num_requests=8, num_rows=8, decoding=True)
    assert choose_path(decode, graphs) is ForwardPath.GRAPH
    assert choose_path(decode, none) is not ForwardPath.GRAPH
    for shape in (
        StepShape(num_requests=9, num_rows=9, decoding=True),
        StepShape(num_requests=2, num_rows=2, decoding=True, has_lora=True),
        StepShape(num_requests=2, num_rows=5, decoding=True, has_multi_row=True),
        StepShape(num_requests=2, num_rows=40, decoding=False, has_multi_row=True),
        StepShape(num_requests=2, num_rows=2, decoding=True, compressed=True),
    ):
        assert choose_path(shape, graphs) is not ForwardPath.GRAPH, shape


def _greedy(model_dir: Path, prompts: list[str], **options: object) -> tuple[list[list[int]], dict]:
    from tandem import LLM, SamplingParams

    llm = LLM(str(model_dir), kv_cache_memory=4 << 20, max_num_batched_tokens=64, **options)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    return [out.outputs[0].token_ids for out in outputs], llm.engine.stats()


PROMPTS = ["The quick brown fox jumps", "Paged attention stores keys and values in fixed-size", "Hello"]


@pytest.mark.parametrize(
    "options",
    # FP8: the CPU path not batch-invariant, whose prompts attend their own unrounded K/V as the
    # Triton kernel does (a batch-invariant CPU prompt attends its keys as cached, FP8)
    [
        {},
        {"kv_cache_dtype": "fp8_e4m3", "batch_invariant": False},
        {"weight_dtype": "int4", "int4_group_size": 32},
    ],
    ids=["f32", "fp8-kv", "int4"],
)
def test_engine_through_triton_kernels_matches_torch_path(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, options: dict
) -> None:
    """A whole engine with the CUDA path's kernels (forced on CPU, interpreted): the same greedy
    tokens as the CPU path for a batch mixing prompt chunks (a 64-token step budget) and decodes,
    with FP8 KV and with INT4 weights too."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter")
    monkeypatch.delenv(TRITON_ON_CPU_ENV, raising=False)
    want, _ = _greedy(tiny_model_dir, PROMPTS, **options)
    monkeypatch.setenv(TRITON_ON_CPU_ENV, "1")
    got, stats = _greedy(tiny_model_dir, PROMPTS, **options)
    assert got == want
    assert not stats["native_decoder"]


def test_engine_through_triton_kernels_matches_hf(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forced CUDA path's greedy tokens equal HF transformers' (float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter")
    monkeypatch.setenv(TRITON_ON_CPU_ENV, "1")
    got, _ = _greedy(tiny_model_dir, PROMPTS[:2])
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for prompt, tokens in zip(PROMPTS[:2], got, strict=True):
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=10,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        assert tokens == out[0, len(ids) :].tolist()


def test_decode_graph_buffers_pad_and_replay(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode-graph path without CUDA (`decode_graphs="eager"`: static buffers, padding rows to
    the bucket, no capture): the same greedy tokens as eager steps, decode steps taken through it
    (3 requests padded to the bucket of 4), the padding row writing nowhere (slot -1)."""
    from tandem import LLM, SamplingParams
    from tandem.engine.runner.decode_graphs import DecodeGraphs, graph_batch_sizes

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter")
    monkeypatch.setenv(TRITON_ON_CPU_ENV, "1")
    want, _ = _greedy(tiny_model_dir, PROMPTS)
    llm = LLM(str(tiny_model_dir), kv_cache_memory=4 << 20, max_num_batched_tokens=64)
    runner = llm.engine.runner
    assert graph_batch_sizes(4) == [1, 2, 4] and graph_batch_sizes(300)[-3:] == [256, 288, 300]
    runner.graphs = DecodeGraphs(
        runner.model.forward, runner.kv_caches, runner.block_size, 512, [1, 2, 4], runner.device
    )
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0))
    assert [out.outputs[0].token_ids for out in outputs] == want
    assert llm.engine.stats()["num_graph_steps"] > 0
    bucket = runner.graphs.graphs[4]  # the last 3-request step's buffers: row 3 is padding
    assert bucket.metadata.slot_mapping[3].item() == -1 and bucket.metadata.paged.seq_lens[3].item() == 0


def test_fp8_quantisation_of_a_zero_vector_is_finite() -> None:
    """An all-zero K/V vector quantises to zero codes with a finite scale (a scale that rounds to
    0 in float16 used to give 0 / 0 = NaN codes)."""
    codes, scale = quantize_fp8(torch.zeros(2, 8))
    assert torch.equal(codes.float(), torch.zeros(2, 8)) and bool((scale > 0).all())


@pytest.mark.parametrize("family", ["mistral", "gemma2", "deepseek_v3"])
def test_windowed_families_through_triton_kernels_match_hf(
    family: str, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sliding windows through the forced CUDA path on prompts longer than the window: Mistral
    (every layer slides, so the engine gives back the blocks that left the window and the block
    tables hold released entries) and Gemma 2 (alternating windows, soft-capped scores); greedy
    tokens equal HF's (float32), with 4-token blocks and 16-token steps. DeepSeek-V3 too: latent
    attention's shared 40-wide vectors (K and V one tensor) through the same kernels."""
    from tokenizers import Tokenizer

    from tandem import LLM, SamplingParams

    from .conftest import make_tiny_model
    from .model_families import load_hf, save_family_model

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter")
    tokenizer_files = make_tiny_model(tmp_path_factory.mktemp("tokenizer"), num_layers=1)
    folder = save_family_model(family, tmp_path_factory.mktemp(family), tokenizer_files)
    monkeypatch.setenv(TRITON_ON_CPU_ENV, "1")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    texts = [
        "Paged attention stores keys and values in fixed-size blocks.",
        "The quick brown fox jumps over it",
    ]
    prompts = [tokenizer.encode(text).ids for text in texts]
    llm = LLM(str(folder), dtype="float32", speculative=None, kv_cache_memory=256 << 10, block_size=4,
              max_num_batched_tokens=16, max_num_seqs=8)  # fmt: skip
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    hf = load_hf(family, folder)
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        assert ids.shape[1] > 8  # longer than the window
        with torch.no_grad():
            want = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, eos_token_id=None,
                pad_token_id=0,
            )  # fmt: skip
        assert out.outputs[0].token_ids == want[0, ids.shape[1] :].tolist(), prompt
    if family == "mistral":
        assert llm.stats()["kv_window_released_blocks"] > 0


def test_gpu_benchmark_script_runs_its_steps_on_cpu(tmp_path: Path) -> None:
    """`benchmarks/cuda_throughput.py --smoke`: the GPU check's benchmark, every step of it (model
    folder, copy bandwidth, engine and HF runs, FP8 KV, INT4) on CPU at a tiny shape, so the script
    a lent GPU runs once is known to run to its JSON."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    output = tmp_path / "cuda_throughput.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "cuda_throughput.py", "--smoke", "--output", str(output)], cwd=root / "benchmarks",
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(output.read_text())
    assert [row["batch"] for row in report["results"]] == [1, 2, 4]
    assert all(row["tandem"]["generated_tokens"] == row["batch"] * 8 for row in report["results"])
    assert all(row["tandem_over_hf"] > 0 for row in report["results"])
    assert report["fp8_kv"]["tokens_ratio_same_bytes"] == pytest.approx(2 * 16 / (16 + 2))  # head dim 16
    assert set(report["int4_weights"]["runs"]) == {"1", "2"}
