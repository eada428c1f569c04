"""GGUF files as people download them (issue 62): every quant type read as stored, bit for bit
the `gguf` package's `dequantize`; the native INT4 kernel on 4-bit blocks as stored; each
family's tiny random checkpoint written by `gguf.GGUFWriter` answering HF float32's greedy tokens;
Google's Gemma 3 270M Q4_K_M file tokenised as transformers tokenises it, read to the same
weights transformers dequantises, and refused types named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.models import gguf_blocks
from tandem.engine.models.gguf_file import GGUFFile, open_gguf
from tandem.engine.models.gguf_header import GGUFHeader
from tandem.platform.errors import ModelLoadError

from .conftest import make_tiny_model
from .gguf_files import GGUF_FAMILIES, write_family_gguf
from .test_hf_parity import hf_greedy

PROMPTS = ["Once upon a time, in a land far away", "The capital of France is", "def fibonacci(n):"]
NEW_TOKENS = 12


def _random_blocks(kind: str, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in `kind`'s block layout, its float16 fields finite random values."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(num_blocks, size), dtype=np.uint8)
    halves = rng.normal(0, 0.05, size=(num_blocks, 2)).astype(np.float16).view(np.uint8)
    offsets = {"Q6_K": [208], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q4_1": [0, 2], "Q5_1": [0, 2]}.get(kind, [0])
    for i, offset in enumerate(offsets):
        raw[:, offset : offset + 2] = halves[:, 2 * i : 2 * i + 2]
    return raw.reshape(-1)


@pytest.mark.parametrize("kind", [t for t in gguf_blocks.SUPPORTED_TYPES if t not in gguf_blocks.FLOAT_TYPES])
def test_every_quant_type_reads_bit_for_bit_as_gguf_dequantizes(kind: str) -> None:
    import gguf

    rng = np.random.default_rng(0)
    raw = _random_blocks(kind, 64, rng)
    qtype = gguf.GGMLQuantizationType[kind]
    want = gguf.quants.dequantize(raw, qtype)
    got = gguf_blocks.dequantize(raw, kind, want.shape)
    assert got.dtype == np.float32
    # equal as floats; to the bit except a zero's sign (Q4_0's code 8 times a negative d: gguf
    # writes -0.0, q * d - 8 * d is +0.0)
    assert np.array_equal(got, want)
    assert np.array_equal(got.view(np.uint32)[got != 0], want.view(np.uint32)[want != 0])


def test_float_types_read_as_stored() -> None:
    import gguf

    values = np.random.default_rng(1).normal(size=(4, 64)).astype(np.float32)
    for kind in gguf_blocks.FLOAT_TYPES:
        qtype = gguf.GGMLQuantizationType[kind]
        stored = values if kind == "F32" else gguf.quants.quantize(values, qtype)
        want = gguf.quants.dequantize(stored, qtype)
        assert np.array_equal(gguf_blocks.dequantize(stored, kind, (4, 64)), want)


@pytest.mark.parametrize("kind", gguf_blocks.FOUR_BIT_TYPES)
def test_native_int4_dequantises_4bit_blocks_exactly(kind: str) -> None:
    """Mode 3 of the native kernel: its dequantised weight is gguf's to the bit, its matmul the
    reference's within the activations' int16 rounding, and a row's result the same bits at any
    call size."""
    import gguf

    from tandem.engine.models.gguf_stored import four_bit_weight
    from tandem.kernels import int4_native
    from tandem.kernels.int4 import Int4Linear, dequantize_int4

    if int4_native.load() is None:
        pytest.skip(int4_native.unavailable_reason())
    rows, cols = 48, 512
    raw = _random_blocks(
        kind,
        rows * cols // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0],
        np.random.default_rng(2),
    )
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(rows, cols)
    weight = four_bit_weight([gguf_blocks.read_four_bit(raw, kind, rows, cols)])
    assert np.array_equal(dequantize_int4(weight).numpy(), want)
    linear = Int4Linear(weight, torch.device("cpu"), "native")
    native = int4_native.int4_dequantize(linear.packed, linear.param_codes, linear.superblock_scales, 32)
    assert np.array_equal(native.numpy(), want)
    x = torch.randn(5, cols)
    reference = x @ torch.from_numpy(want).T
    assert ((linear(x) - reference).norm() / reference.norm()).item() < 1e-4
    linear.compute_every_row_natively()  # a row's bits whatever the call's size (batch invariance)
    many = torch.randn(11, cols)
    together = linear(many)
    assert all(torch.equal(linear(many[i : i + 1]), together[i : i + 1]) for i in range(11))
    assert torch.equal(linear(many[3:8]), together[3:8])


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gguf-tokenizer"), num_layers=1)


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_family_gguf_answers_hf_float32_greedy(
    family: str, tokenizer_files: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"tiny-{family}.gguf"
    hf = write_family_gguf(family, tokenizer_files, path)
    _assert_reads_as_the_package(path)
    hf_names = [t.hf_name for t in open_gguf(path).tensors]
    assert len(hf_names) == len(set(hf_names))  # one file tensor per checkpoint tensor
    llm = LLM(str(path), dtype="float32", speculative=None, kv_cache_memory=1 << 20)
    assert llm.engine.served_model_name == f"tiny-{family}"
    assert llm.engine.model_info()["quant_types"][0] == GGUF_FAMILIES[family][4]
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    want = [hf_greedy(hf, ids, NEW_TOKENS, None) for ids in prompt_ids]
    outs = llm.generate(prompt_ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want


def _assert_reads_as_the_package(path: Path) -> None:
    """`GGUFHeader` gives the `gguf` package's `GGUFReader` values: every metadata value (and
    the keys' order), every tensor's name, type, dims and data (dtype, shape, bytes)."""
    import gguf

    ours, theirs = GGUFHeader(path), gguf.GGUFReader(str(path))
    want = {key: field.contents() for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert list(ours.fields.items()) == list(want.items())
    assert ours.data_offset == theirs.data_offset
    assert len(ours.tensors) == len(theirs.tensors)
    for got, stored in zip(ours.tensors, theirs.tensors, strict=True):
        assert (got.name, got.type_id, got.dims) == (
            stored.name,
            int(stored.tensor_type),
            tuple(stored.shape.tolist()),
        )
        assert (got.data.dtype, got.data.shape) == (stored.data.dtype, stored.data.shape), got.name
        assert got.data.tobytes() == stored.data.tobytes(), got.name
        assert not got.data.flags.writeable


def _write_every_type(path: Path, endianess: str, alignment: int | None) -> None:
    """Metadata of every value type (a nested array too) and a tensor of every GGML type we
    read or refuse by name, random values."""
    import gguf

    rng = np.random.default_rng(7)
    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian[endianess])
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 250)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-6)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁wörld 🙂")
    writer.add_array("t.ints", [3, -1, 2**30])
    writer.add_key_value("t.u64s", [1, 2**64 - 1], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT64)
    writer.add_array("t.floats", [0.5, -2.25, 1e-3])
    writer.add_array("t.strs", ["a", "", "▁b", "<end_of_turn>"])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.empty", [])
    writer.add_key_value("t.nested", [[1, 2], [3]], gguf.GGUFValueType.ARRAY)
    values = rng.normal(size=(4, 256)).astype(np.float32)
    writer.add_tensor("f32", values)
    writer.add_tensor("f16", values.astype(np.float16))
    writer.add_tensor("i32", rng.integers(-9, 9, size=(3, 5), dtype=np.int32))
    writer.add_tensor(
        "bf16",
        gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16),
        raw_dtype=gguf.GGMLQuantizationType.BF16,
    )
    for kind in [t for t in gguf_blocks.SUPPORTED_TYPES if t not in gguf_blocks.FLOAT_TYPES] + ["IQ4_NL"]:
        qtype = gguf.GGMLQuantizationType[kind]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(4, 512 // block * size), dtype=np.uint8)
        writer.add_tensor(f"q.{kind}", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("endianess", "alignment"), [("LITTLE", None), ("LITTLE", 64), ("BIG", None)])
def test_the_header_reads_every_value_and_tensor_type_as_the_gguf_package(
    endianess: str, alignment: int | None, tmp_path: Path
) -> None:
    path = tmp_path / "every-type.gguf"
    _write_every_type(path, endianess, alignment)
    _assert_reads_as_the_package(path)
    header = GGUFHeader(path)
    assert header.fields["t.nested"] == [1, 2, 3]  # flat, as the package gives it
    assert header.data_offset % (alignment or 32) == 0


def test_the_default_models_file_reads_as_the_gguf_package(default_model_path: Path) -> None:
    _assert_reads_as_the_package(default_model_path)


def test_a_corrupt_or_truncated_file_is_refused_naming_what_is_wrong(tmp_path: Path) -> None:
    """Cut anywhere in the header or the data, a bad magic, an unsupported version, an empty
    file: a ValueError from the header, a ModelLoadError naming the file and `model` from
    `GGUFFile`; never a struct or index error."""
    path = tmp_path / "every-type.gguf"
    _write_every_type(path, "LITTLE", None)
    whole = path.read_bytes()
    header = GGUFHeader(path)
    cut = tmp_path / "cut.gguf"
    for end in [0, 3, 10, 30, 100, 400, header.data_offset - 5, header.data_offset + 100, len(whole) - 1]:
        cut.write_bytes(whole[:end])
        with pytest.raises(ValueError, match="GGUF|truncated|past the end|corrupt"):
            GGUFHeader(cut)
        with pytest.raises(ModelLoadError, match="corrupt or unsupported GGUF file") as refused:
            GGUFFile(cut)
        assert refused.value.param == "model"
    cut.write_bytes(whole[: header.data_offset + 100])
    with pytest.raises(ValueError, match=r"tensor \S+'s data runs past the end of the file"):
        GGUFHeader(cut)
    cut.write_bytes(b"GGUX" + whole[4:])
    with pytest.raises(ValueError, match="GGUF magic invalid"):
        GGUFHeader(cut)
    cut.write_bytes(whole[:4] + (1).to_bytes(4, "little") + whole[8:])
    with pytest.raises(ValueError, match="GGUF version 1 is not supported"):
        GGUFHeader(cut)


def test_unsupported_architectures_and_types_are_refused_by_name(tmp_path: Path) -> None:
    import gguf

    from tandem.engine.models.loader import check_model

    odd = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(odd), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'mamba' unsupported"):
        check_model(str(odd))


def test_deepseek_v2_softmax_routing_is_refused_naming_the_key() -> None:
    """A `deepseek2` file without `expert_gating_func` is DeepSeek-V2's (llama.cpp reads it as
    softmax routing), which no architecture here implements: refused by the key, not misread."""
    from tandem.engine.models.gguf_arch import GGUFModel

    fields: dict[str, object] = {
        "general.architecture": "deepseek2",
        "tokenizer.ggml.tokens": ["a", "b"],
        **{f"deepseek2.{key}": 4 for key in ("embedding_length", "block_count", "attention.head_count")},
        **{f"deepseek2.{key}": 8 for key in ("feed_forward_length", "rope.dimension_count")},
        **{f"deepseek2.attention.{key}": 16 for key in ("kv_lora_rank", "key_length", "value_length")},
        **{
            f"deepseek2.{key}": 2
            for key in ("expert_count", "expert_used_count", "expert_feed_forward_length")
        },
    }
    model = GGUFModel(fields, {"token_embd.weight"}, "v2.gguf")
    with pytest.raises(ModelLoadError, match="expert_gating_func=1 is not supported"):
        model.hf_config([1])
    yarn = {
        "deepseek2.rope.scaling.type": "yarn",
        "deepseek2.rope.scaling.factor": 40.0,
        "deepseek2.rope.scaling.original_context_length": 4096,
        "deepseek2.rope.scaling.yarn_log_multiplier": 0.1,  # llama.cpp's 0.1 * mscale_all_dim
    }
    fields = {**fields, **yarn, "deepseek2.expert_gating_func": 2}
    config = GGUFModel(fields, {"token_embd.weight"}, "v3.gguf").hf_config([1])
    assert (config["qk_nope_head_dim"], config["v_head_dim"], config["num_key_value_heads"]) == (8, 16, 4)
    assert config["rope_scaling"] == {
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
    }  # fmt: skip


def test_a_type_not_read_is_refused_naming_the_tensor(tokenizer_files: Path, tmp_path: Path) -> None:
    """An IQ4_NL tensor (an importance-matrix type) in an otherwise readable llama file."""
    import gguf
    import transformers

    from tandem.engine.models.loader import check_model

    from .gguf_files import _write_metadata
    from .model_families import COMMON

    vocab = json.loads((tokenizer_files / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    config = transformers.LlamaConfig(vocab_size=len(tokens), bos_token_id=0, eos_token_id=1, **COMMON)
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_metadata(writer, config, "llama", tokenizer_files, tokens)
    qtype = gguf.GGMLQuantizationType.IQ4_NL
    raw = np.zeros((64, 64 // 32 * gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ModelLoadError, match=r"tensor blk\.0\.attn_q\.weight is IQ4_NL, which is not supported"
    ):
        check_model(str(path))


@pytest.mark.parametrize("family", ["llama", "gemma", "qwen3moe", "qwen2", "glm4moe", "deepseek2-whole-kv-b"])
def test_stored_weights_serve_the_files_values(
    family: str, tokenizer_files: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`weight_dtype="gguf"`: each decoder linear, experts included, holds exactly the file's
    values where the kernels store its type (4-bit blocks as INT4, Q8_0 / Q5_0 as INT8); Q5_1 is
    one Q8_0 rounding away from them; and the engine answers."""
    from tandem.engine.models.loader import load_model
    from tandem.kernels import int4_native
    from tandem.kernels.int4 import Int4Linear
    from tandem.kernels.int8 import Int8Linear, dequantize_int8

    if int4_native.load() is None:
        pytest.skip(int4_native.unavailable_reason())
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"tiny-{family}.gguf"
    write_family_gguf(family, tokenizer_files, path)
    weights = load_model(str(path)).weights  # the file's values, dequantised by gguf
    stored = LLM(str(path), dtype="float32", weight_dtype="gguf", speculative=None, kv_cache_memory=1 << 20)
    assert stored.stats()["weight_dtype"] == "gguf"
    targets = stored.engine.runner.model.int4_targets()
    assert targets
    for target in targets:
        want = torch.cat([weights[f"{name}.weight"] for name in target.source_names])
        linear = getattr(target.parent, target.attr)
        kind = GGUF_FAMILIES[family][4]
        if kind == "Q4_0":
            assert isinstance(linear, Int4Linear) and linear.superblock_scales.dtype == torch.float16
            got = int4_native.int4_dequantize(linear.packed, linear.param_codes, linear.superblock_scales, 32)
            assert torch.equal(got, want)
        else:
            assert isinstance(linear, Int8Linear)
            got = dequantize_int8(linear.int8_weight)
            if kind in ("Q5_0", "Q8_0"):  # as stored
                assert torch.equal(got, want)
            else:  # Q5_1: rounded once to Q8_0
                step = want.abs().reshape(want.shape[0], -1, 32).amax(-1, keepdim=True) / 127
                assert ((got - want).abs().reshape_as(step.expand(-1, -1, 32)) <= step / 2 + 1e-6).all()
    out = stored.generate(
        ["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma3"])
def test_sentencepiece_files_tokenise_as_transformers_does(arch: str, tmp_path: Path) -> None:
    """A SentencePiece (`llama`) vocabulary with byte fallback and no merges in the file: ids and
    decoded text equal transformers' GGUF tokenizer's (Llama's Metaspace, Phi-3's normaliser,
    Gemma's spaces and file-order merges)."""
    import gguf
    from transformers import AutoTokenizer

    from tandem.engine.io.tokenizer import Tokenizer

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = [
        "▁",
        "e",
        "t",
        "a",
        "o",
        "h",
        "n",
        "s",
        "r",
        "i",
        "l",
        "d",
        "c",
        "u",
        "w",
        "T",
        ".",
        ",",
        "th",
        "he",
        "▁t",
        "▁th",
        "▁the",
        "in",
        "er",
        "an",
        "▁a",
        "re",
        "on",
        "▁s",
        "ll",
        "▁w",
        "or",
        "ed",
        "▁The",
        "at",
    ]
    words += [
        "en",
        "▁c",
        "ou",
        "is",
        "▁h",
        "▁d",
        "▁l",
        "lo",
        "▁lo",
        "hel",
        "hell",
        "hello",
        "▁hello",
        "▁hel",
        "  ",
    ]
    tokens = pieces + words
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(pieces) + [-float(i) for i in range(len(words))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(words))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fields = {key: field.contents() for key, field in gguf.GGUFReader(str(path)).fields.items()}
    ours = Tokenizer.from_gguf_fields(fields)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in [
        "hello there",
        "The cat sat.",
        "  the  the",
        "héllo wörld 🙂",
        "the\nthe",
        "Tea, or the tea",
        "x",
    ]:
        ids = theirs(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
