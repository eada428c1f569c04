"""Compile every Triton kernel for a GPU that is not there: Triton's compiler and the `ptxas` its
wheel ships turn each kernel, at the configurations the engine launches, into Hopper (sm_90)
machine code on any machine, so a kernel that the interpreter runs but the GPU compiler refuses
fails CI. Run in its own process (`python -m tests.triton_aot`): `TRITON_INTERPRET` must be unset
when the kernel modules are imported. Prints one JSON line: {"name": "ok" | error}.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _configurations() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    import triton.language as tl

    from tandem.kernels import triton_attention, triton_int4

    attention_args = {
        "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "k_scale_ptr": "*fp16", "v_scale_ptr": "*fp16",
        "k_new_ptr": "*bf16", "v_new_ptr": "*bf16", "out_ptr": "*bf16", "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32", "query_start_ptr": "*i32", "tile_request_ptr": "*i32", "tile_row_ptr": "*i32",
        "scale": "fp32", "softcap": "fp32", "window": "i32",
        **{name: "i32" for name in (
            "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_nt", "stride_nh", "stride_vnt",
            "stride_vnh", "stride_kb", "stride_ks", "stride_kh", "stride_sb", "stride_ss", "stride_bt",
        )},
    }  # fmt: skip
    llama8b = {"GROUP": 4, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "BLOCK_N": 64, "BLOCK_SIZE": 16}
    plain = {"FP8": False, "FRESH_KEYS": False, "HAS_WINDOW": False, "HAS_SOFTCAP": False}
    bf16 = {"DOT_DTYPE": tl.bfloat16, "DOT_PRECISION": "tf32"}
    fp8_args = {**attention_args, "k_ptr": "*u8", "v_ptr": "*u8"}
    configs = [
        ("attention-decode-bf16", triton_attention._unified_attention_kernel, attention_args,
         {**llama8b, **plain, **bf16, "BLOCK_Q": 1, "BLOCK_M": 16}),
        ("attention-prefill-bf16", triton_attention._unified_attention_kernel, attention_args,
         {**llama8b, **plain, **bf16, "BLOCK_Q": 16, "BLOCK_M": 64}),
        ("attention-fp8-fresh-window-softcap", triton_attention._unified_attention_kernel, fp8_args,
         {**llama8b, **bf16, "BLOCK_Q": 16, "BLOCK_M": 64, "FP8": True, "FRESH_KEYS": True, "HAS_WINDOW": True,
          "HAS_SOFTCAP": True}),
        ("attention-float32-ieee", triton_attention._unified_attention_kernel,
         {**attention_args, **{k: "*fp32" for k in ("q_ptr", "k_ptr", "v_ptr", "k_new_ptr", "v_new_ptr", "out_ptr")}},
         {**llama8b, **plain, "BLOCK_Q": 16, "BLOCK_M": 64, "DOT_DTYPE": tl.float32, "DOT_PRECISION": "ieee"}),
    ]  # fmt: skip
    write_args = {
        "k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
        "k_scale_ptr": "*fp16", "v_scale_ptr": "*fp16", "slot_ptr": "*i64",
        **{name: "i32" for name in (
            "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cs", "stride_ch", "stride_ss",
        )},
    }  # fmt: skip
    write_shape = {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "HEADS_PAD": 8, "HEAD_DIM_PAD": 128}
    configs += [
        ("kv-write-bf16", triton_attention._write_kv_kernel, write_args, {**write_shape, "FP8": False}),
        ("kv-write-fp8", triton_attention._write_kv_kernel,
         {**write_args, "k_cache_ptr": "*u8", "v_cache_ptr": "*u8"}, {**write_shape, "FP8": True}),
    ]  # fmt: skip
    w4_args = {
        "x_ptr": "*bf16", "packed_ptr": "*u8", "scales_ptr": "*fp16", "zeros_ptr": "*fp16", "out_ptr": "*bf16",
        "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_pk": "i32", "stride_sg": "i32",
        "stride_om": "i32",
    }  # fmt: skip
    for block_m, block_n in ((16, 64), (64, 128)):
        configs.append((
            f"w4a16-bf16-m{block_m}", triton_int4._w4a16_kernel, w4_args,
            {"GROUP_SIZE": 128, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 64, **bf16},
        ))  # fmt: skip
    configs.append((
        "w4a16-double-quant-group32", triton_int4._w4a16_kernel,
        {**w4_args, "scales_ptr": "*fp32", "zeros_ptr": "*fp32"},
        {"GROUP_SIZE": 32, "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 32, **bf16},
    ))  # fmt: skip
    return configs


def compile_all(arch: int = 90) -> dict[str, str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = {}
    for name, kernel, args, constexprs in _configurations():
        signature = {**args, **dict.fromkeys(constexprs, "constexpr")}
        try:
            compiled = triton.compile(
                ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                target=GPUTarget("cuda", arch, 32),
            )
            results[name] = "ok" if compiled.asm.get("cubin") else "no machine code"
        except Exception as exc:  # noqa: BLE001 - report every kernel's error, not the first
            results[name] = f"{type(exc).__name__}: {exc}"[:2000]
    return results


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    print(json.dumps(compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 90)))
