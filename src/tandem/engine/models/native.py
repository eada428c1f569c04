"""`DecoderLM.forward` for small steps through the native decoder stack: every `DecoderConfig`
(Llama's layers with biases, q/k norms, sliding windows, soft-capping, Gemma's norms, GeLU and
local RoPE; the embedding scale and the final norm and soft-capping stay in torch, `DecoderLM.embed`
and `final_logits`).

`NativeLlama.forward` returns what the INT4 model's eager forward returns for the same step
(logits at `logits_indices`, and the captured layer outputs an EAGLE head reads), with the decoder
layers in one native call (`tandem.kernels.native_decoder`) instead of some 2,000 torch ops. It
takes the step as block tables rather than `AttentionMetadata`, whose gather indices it does not
need. It serves rows without LoRA only, on CPU, when every decoder linear is an INT4 linear with
the native kernel; `NativeLlama.build` returns None, with the reason, otherwise (`unsupported_reason`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.engine.models.decoder import DecoderAttention, DecoderLayer, DecoderLM, DecoderMLP
from tandem.engine.models.interface import CausalLM, KVLayer
from tandem.kernels.int4 import Int4Linear
from tandem.kernels.int8 import Int8Linear
from tandem.kernels.native_decoder import DecoderWeights, LayerTensors, QuantizedTensors, unsupported_reason


def _decoder_layers(model: DecoderLM) -> list[DecoderLayer]:
    return list(model.layers)  # type: ignore[arg-type]


def _computes_the_shared_decoder(model: DecoderLM) -> bool:
    """The model runs `DecoderLM.forward` over unmodified decoder layers (a subclass may change
    how it loads, as Phi-3's does, but not what it computes)."""
    if type(model).forward is not DecoderLM.forward:
        return False
    return all(
        type(layer) is DecoderLayer
        and type(layer.self_attn) is DecoderAttention
        and type(layer.mlp) is DecoderMLP
        for layer in model.layers
    )


def _native_linear(linear: object) -> bool:
    """An INT4 linear with the native kernel, or a Q8_0 INT8 one where the native library runs."""
    return (isinstance(linear, Int4Linear) and linear.kernel == "native") or (
        isinstance(linear, Int8Linear) and linear.native
    )


@dataclass
class NativeStep:
    """One step's rows as the native decoder reads them."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64
    row_tables: torch.Tensor  # [T] int64: the block_tables row of each token row

    @classmethod
    def build(
        cls,
        token_ids: Sequence[Sequence[int]],  # per request, its rows this step
        start_positions: Sequence[int],  # per request, the position of its first row
        block_tables: Sequence[Sequence[int]],  # per request
        block_size: int,
    ) -> NativeStep:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        row_tables: list[int] = []
        width = max(len(table) for table in block_tables)
        tables = torch.zeros(len(block_tables), width, dtype=torch.int64)
        for index, (tokens, start, table) in enumerate(
            zip(token_ids, start_positions, block_tables, strict=True)
        ):
            tables[index, : len(table)] = torch.tensor(table, dtype=torch.int64)
            for position in range(start, start + len(tokens)):
                positions.append(position)
                slots.append(table[position // block_size] * block_size + position % block_size)
            input_ids.extend(tokens)
            row_tables.extend([index] * len(tokens))
        return cls(
            torch.tensor(input_ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            torch.tensor(slots, dtype=torch.int64),
            tables,
            torch.tensor(row_tables, dtype=torch.int64),
        )


class NativeLlama:
    """The native decoder bound to one model and one KV cache (their storage must not move)."""

    def __init__(self, model: DecoderLM, weights: DecoderWeights) -> None:
        self.model = model
        self.weights = weights

    @staticmethod
    def unsupported_reason(model: CausalLM, kv_caches: list[KVLayer]) -> str:
        """Why `build` would return None ("" if it would not)."""
        if not isinstance(model, DecoderLM) or not _computes_the_shared_decoder(model):
            return f"it computes the shared decoder's layers only, not {type(model).__name__}'s"
        if model.norm.device.type != "cpu":
            return f"it runs on CPU only (the model is on {model.norm.device})"
        if model.config.rotary_dim is not None:
            return "it rotates whole heads only, not a partial rotary dimension"
        for layer in _decoder_layers(model):
            assert isinstance(layer.mlp, DecoderMLP), "_computes_the_shared_decoder refuses sparse layers"
            assert isinstance(layer.self_attn, DecoderAttention), "and latent attention"
            linears = (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
            if not all(_native_linear(linear) for linear in linears):
                return "its decoder linears are not INT4 or INT8 with the native kernel"
        return unsupported_reason(kv_caches[0][0].dtype)

    @classmethod
    def build(cls, model: CausalLM, kv_caches: list[KVLayer], block_size: int) -> NativeLlama | None:
        if cls.unsupported_reason(model, kv_caches) or not isinstance(model, DecoderLM):
            return None
        cfg = model.config

        def quantized(linear: Any) -> QuantizedTensors:
            if isinstance(linear, Int8Linear):
                return QuantizedTensors(
                    linear.codes, linear.scales, None, 32, int8=True, rows=linear.out_features
                )
            params = linear.scales_and_zeros if linear.param_codes is None else linear.param_codes
            return QuantizedTensors(linear.packed, params, linear.superblock_scales, linear.group_size)

        def norm(weight: torch.Tensor | None) -> torch.Tensor | None:  # Gemma's (1 + w) as one weight
            return None if weight is None else cfg.norm_offset + weight.detach().float()

        def layer_tensors(index: int, layer: DecoderLayer, kv_cache: KVLayer) -> LayerTensors:
            attn, mlp, sandwich = layer.self_attn, layer.mlp, layer.pre_feedforward_layernorm is not None
            assert isinstance(mlp, DecoderMLP), "unsupported_reason refuses sparse layers"
            assert isinstance(attn, DecoderAttention), "unsupported_reason refuses latent attention"
            local = index in model.local_rope_layers
            mlp_input_norm = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
            return LayerTensors(
                quantized(attn.qkv_proj), quantized(attn.o_proj), quantized(mlp.gate_up_proj), quantized(mlp.down_proj),
                norm(layer.input_layernorm), norm(mlp_input_norm), kv_cache,  # type: ignore[arg-type]
                qkv_bias=attn.qkv_proj.bias, o_bias=attn.o_proj.bias,
                gate_up_bias=mlp.gate_up_proj.bias, down_bias=mlp.down_proj.bias,
                q_norm=norm(attn.q_norm), k_norm=norm(attn.k_norm), window=attn.window, softcap=attn.softcap,
                post_attn_norm=norm(layer.post_attention_layernorm) if sandwich else None,
                post_ffn_norm=norm(layer.post_feedforward_layernorm),
                rope_cos=model.local_rope_cos if local else None, rope_sin=model.local_rope_sin if local else None,
            )  # fmt: skip

        layers = [
            layer_tensors(index, layer, kv_cache)
            for index, (layer, kv_cache) in enumerate(zip(_decoder_layers(model), kv_caches, strict=True))
        ]
        weights = DecoderWeights(
            layers,
            hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            block_size=block_size,
            eps=cfg.rms_norm_eps,
            rope_cos=model.rope_cos,
            rope_sin=model.rope_sin,
            scale=cfg.attention_scale,
            activation=cfg.hidden_act,
        )
        return cls(model, weights)

    def forward(
        self,
        step: NativeStep,
        logits_indices: torch.Tensor,  # [R] rows whose next-token logits are wanted
        return_hidden: bool = False,
        hidden_layers: tuple[int, ...] = (),
    ) -> Any:
        """As `DecoderLM.forward` (float32 logits [R, vocab]; with `return_hidden`, also
        the captured states [T, ...])."""
        model = self.model
        x = model.embed(step.input_ids, torch.float32).contiguous()  # [T, H]
        captured = self.weights.run(
            x,
            step.positions,
            step.slot_mapping,
            step.block_tables,
            step.row_tables,
            hidden_layers if return_hidden else (),
        )
        dtype = model.norm.dtype
        logits = model.final_logits(x.index_select(0, logits_indices).to(dtype))
        if not return_hidden:
            return logits
        states = captured if captured is not None else x
        return logits, states.to(dtype)

    def forward_heads(
        self,
        input_ids: torch.Tensor,  # [T] int64: one decode row per compressed request
        positions: torch.Tensor,  # [T] int64
        head_slots: torch.Tensor,  # [L, T, Hk] int64
        head_tables: torch.Tensor,  # [L, T, Hk, max_blocks] int64
        head_lens: torch.Tensor,  # [L, T, Hk] int64
    ) -> torch.Tensor:  # [T, vocab] float32 logits
        """Decode rows of compressed requests over the head-block pool this stack was built on
        (`DecoderWeights.run_heads`); the same logits as the model's forward with
        `HeadAttentionMetadata` for those rows, up to float32 summation order."""
        model = self.model
        x = model.embed(input_ids, torch.float32).contiguous()  # [T, H]
        self.weights.run_heads(x, positions, head_slots, head_tables, head_lens)
        return model.final_logits(x.to(model.norm.dtype))
