"""A Llama decoder stack with INT4 linears in one native call (`csrc/decoder_cpu.c`).

Semantics: for T token rows, every decoder layer as `LlamaDecoderLayer.forward` computes it with
`Int4Linear` layers and the paged KV cache (RMSNorm, q/k/v, RoPE, KV write at `slot_mapping`,
attention of row t over its request's keys at positions 0..positions[t], o, RMSNorm, gate/up,
SiLU, down, residuals), in float32 activations. That eager model is the reference; the two differ
only by float32 summation order (the INT4 matmuls are the same kernel).

Why: at small batch the eager step is dominated by per-op overhead (thousands of small torch ops
per step; docs/performance.md, "Design measurements"); here
a layer is four INT4 matmuls and one parallel attention loop.

Inputs (CPU, contiguous): x [T, H] float32 is updated in place to the last layer's output;
positions, slot_mapping, row_tables [T] int64; block_tables [B, max_blocks] int64 (row_tables[t]
names row t's request); capture_layers ascending layer indices whose outputs are returned side by
side ([T, len * H]). KV caches: float32, bfloat16, float16, or float8_e4m3fn with float16 scales.

`DecoderWeights` holds the C structs built once from a model's tensors; it keeps references to
those tensors, so they must not be replaced while it is in use (the pointers are to their storage).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.kernels import int4_native

_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float16: 3}


class _Int4Weight(ctypes.Structure):
    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("params", ctypes.c_void_p),
        ("superblock_scales", ctypes.c_void_p),
        ("groups_per_superblock", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64),
        ("group_size", ctypes.c_int64),
        ("mode", ctypes.c_int64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Int4Weight),
        ("o", _Int4Weight),
        ("gate_up", _Int4Weight),
        ("down", _Int4Weight),
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("k_scale", ctypes.c_void_p),
        ("v_scale", ctypes.c_void_p),
        ("qkv_bias", ctypes.c_void_p),
        ("o_bias", ctypes.c_void_p),
        ("gate_up_bias", ctypes.c_void_p),
        ("down_bias", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("window", ctypes.c_int64),  # > 0: the layer attends only its last `window` positions
        ("softcap", ctypes.c_float),  # > 0: attention scores soft-capped
        ("post_attn_norm", ctypes.c_void_p),
        ("post_ffn_norm", ctypes.c_void_p),
        ("rope_cos", ctypes.c_void_p),
        ("rope_sin", ctypes.c_void_p),
    ]


class _Dims(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("kv_dtype", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("rope_cos", ctypes.c_void_p),
        ("rope_sin", ctypes.c_void_p),
        ("activation", ctypes.c_int64),
    ]


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}  # the gated MLP's, as the stack numbers them


@dataclass(frozen=True)
class QuantizedTensors:
    """One quantised linear as the kernel reads it: INT4 (`Int4Linear` with the native kernel), or
    with `int8` Q8_0 (`Int8Linear` in `tandem_q8_mm`'s layout: `packed` its codes [Np / 16, K / 2,
    16, 2], `params` its float32 scales [Np / 16, K / 32, 16], `rows` its N)."""

    packed: torch.Tensor  # [N, K/2] uint8, or [N / 16, 16, K / 2] in tile order (`int4_native.tile_blocks`)
    params: torch.Tensor  # [N, G, 2] float16 (scale, zero) or int8 codes
    superblock_scales: torch.Tensor | None  # [N, S, 2] bfloat16 with int8 codes
    group_size: int
    int8: bool = False
    rows: int = 0  # int8 only: the output rows (the layout pads them to a multiple of 16)


@dataclass(frozen=True)
class LayerTensors:
    qkv: QuantizedTensors
    o: QuantizedTensors
    gate_up: QuantizedTensors
    down: QuantizedTensors
    input_norm: torch.Tensor  # [H] float32
    post_norm: torch.Tensor  # [H] float32
    kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
    qkv_bias: torch.Tensor | None = None  # [(Hq + 2 Hk) * D] float32 (Qwen2)
    o_bias: torch.Tensor | None = None  # [H]
    gate_up_bias: torch.Tensor | None = None  # [2 I]
    down_bias: torch.Tensor | None = None  # [H]
    q_norm: torch.Tensor | None = None  # [D] float32, per-head RMSNorm of q before RoPE (Qwen3)
    k_norm: torch.Tensor | None = None
    window: int | None = None  # the layer's sliding window (None: its whole context)
    softcap: float | None = None  # attention scores -> softcap * tanh(score / softcap)
    post_attn_norm: torch.Tensor | None = None  # [H]: norm of the attention output (Gemma 2/3)
    post_ffn_norm: torch.Tensor | None = None  # [H]: norm of the MLP output (Gemma 2/3)
    rope_cos: torch.Tensor | None = None  # [max_positions, D]: the layer's own RoPE (Gemma 3's local)
    rope_sin: torch.Tensor | None = None


def unsupported_reason(kv_dtype: torch.dtype) -> str:
    """Why the native decoder cannot run here ("" when it can)."""
    if kv_dtype not in _KV_DTYPES:
        return f"KV cache dtype {kv_dtype} is not float32, bfloat16, float8_e4m3fn or float16"
    if int4_native.load() is None:
        return f"the native library could not be built or loaded ({int4_native.unavailable_reason()})"
    return ""


class DecoderWeights:
    """The C view of a decoder stack: dimensions, and per layer the INT4 weights, norms and KV
    cache pointers."""

    def __init__(
        self,
        layers: Sequence[LayerTensors],
        *,
        hidden: int,
        intermediate: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        eps: float,
        rope_cos: torch.Tensor,  # [max_positions, D] float32
        rope_sin: torch.Tensor,
        scale: float | None = None,  # attention scale (default head_dim ** -0.5)
        activation: str = "silu",  # the gated MLP's: one of ACTIVATIONS
    ) -> None:
        kv_dtype = layers[0].kv_cache[0].dtype
        reason = unsupported_reason(kv_dtype)
        if reason:
            raise RuntimeError(f"native decoder unavailable: {reason}")
        self._keep: list[torch.Tensor] = []  # every tensor a pointer refers to

        self.num_layers = len(layers)
        self.hidden = hidden
        self._dims = _Dims(
            len(layers), hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size,
            _KV_DTYPES[kv_dtype], eps, head_dim**-0.5 if scale is None else scale, self._ptr(rope_cos.float().contiguous()),
            self._ptr(rope_sin.float().contiguous()), ACTIVATIONS[activation],
        )  # fmt: skip
        self._layers = (_Layer * len(layers))()
        for index, layer in enumerate(layers):
            k_cache, v_cache, k_scale, v_scale = layer.kv_cache
            self._layers[index] = _Layer(
                self._weight(layer.qkv), self._weight(layer.o), self._weight(layer.gate_up), self._weight(layer.down),
                self._ptr(layer.input_norm.float().contiguous()), self._ptr(layer.post_norm.float().contiguous()),
                self._ptr(k_cache), self._ptr(v_cache), self._ptr(k_scale), self._ptr(v_scale),
                *(None if t is None else self._ptr(t.detach().float().contiguous()) for t in (
                    layer.qkv_bias, layer.o_bias, layer.gate_up_bias, layer.down_bias, layer.q_norm, layer.k_norm
                )),
                layer.window or 0, layer.softcap or 0.0,
                *(None if t is None else self._ptr(t.detach().float().contiguous()) for t in (
                    layer.post_attn_norm, layer.post_ffn_norm, layer.rope_cos, layer.rope_sin
                )),
            )  # fmt: skip

    def _ptr(self, t: torch.Tensor | None) -> int | None:
        """`t`'s address, `t` kept alive as long as this object (the C side holds the pointer)."""
        if t is None:
            return None
        assert t.device.type == "cpu" and t.is_contiguous(), "native decoder: CPU, contiguous tensors"
        self._keep.append(t)
        return t.data_ptr()

    def _weight(self, w: QuantizedTensors) -> _Int4Weight:
        """A quantised linear's C view: INT8 (Q8_0) rows, or INT4 codes with their parameters."""
        if w.int8:
            return _Int4Weight(
                self._ptr(w.packed), self._ptr(w.params), None, 1, w.rows, 2 * w.packed.shape[1], 32, 2
            )
        rows, half = int4_native.packed_shape(w.packed)
        mode, per_block = int4_native.weight_mode(w.packed, w.params, w.superblock_scales)
        return _Int4Weight(
            self._ptr(w.packed), self._ptr(w.params), self._ptr(w.superblock_scales), per_block, rows, 2 * half,
            w.group_size, mode,
        )  # fmt: skip

    def run(
        self,
        x: torch.Tensor,  # [T, H] float32, updated in place
        positions: torch.Tensor,  # [T] int64
        slot_mapping: torch.Tensor,  # [T] int64
        block_tables: torch.Tensor,  # [B, max_blocks] int64
        row_tables: torch.Tensor,  # [T] int64
        capture_layers: Sequence[int] = (),
    ) -> torch.Tensor | None:  # [T, len(capture_layers) * H] float32, or None without captures
        num_rows = x.shape[0]
        assert x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] == self.hidden
        for t in (positions, slot_mapping, block_tables, row_tables):
            assert t.dtype == torch.int64 and t.is_contiguous()
        captures = torch.tensor(list(capture_layers), dtype=torch.int64)
        captured = torch.empty(num_rows, len(capture_layers) * self.hidden) if len(capture_layers) else None
        status = int4_native.load().tandem_decoder_layers(  # type: ignore[union-attr]
            ctypes.byref(self._dims), self._layers, x.data_ptr(), num_rows, positions.data_ptr(),
            slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], row_tables.data_ptr(),
            captures.data_ptr(), len(capture_layers), None if captured is None else captured.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        _check(status, num_rows)
        return captured

    def run_heads(
        self,
        x: torch.Tensor,  # [T, H] float32, updated in place: one decode row per request
        positions: torch.Tensor,  # [T] int64
        head_slots: torch.Tensor,  # [L, T, Hk] int64: flat head slot of each row's K/V
        head_tables: torch.Tensor,  # [L, T, Hk, max_blocks] int64 head block tables (padded)
        head_lens: torch.Tensor,  # [L, T, Hk] int64 tokens each head holds, this row included
    ) -> None:
        """The stack over a head-block pool (compressed requests' decode rows; the layers' caches
        this was built with must be that pool): as `head_attention.head_paged_attention` for one
        row per request, K/V written to `head_slots` first."""
        num_rows = x.shape[0]
        assert x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] == self.hidden
        for t in (positions, head_slots, head_tables, head_lens):
            assert t.dtype == torch.int64 and t.is_contiguous()
        assert (
            head_slots.shape[:2]
            == head_lens.shape[:2]
            == head_tables.shape[:2]
            == (self.num_layers, num_rows)
        )
        status = int4_native.load().tandem_decoder_layers_heads(  # type: ignore[union-attr]
            ctypes.byref(self._dims), self._layers, x.data_ptr(), num_rows, positions.data_ptr(),
            head_slots.data_ptr(), head_tables.data_ptr(), head_tables.shape[-1], head_lens.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        _check(status, num_rows)


def _check(status: int, num_rows: int) -> None:
    if status == -1:
        raise MemoryError(f"native decoder could not allocate scratch for {num_rows} rows")
    if status != 0:
        raise ValueError(f"native decoder failed with status {status} (unsupported INT4 group size)")
