"""One GGUF file opened as a checkpoint: its tokenizer, its HF config parsed by the registered
architecture, and every tensor under the HF name that architecture consumes.

Contract: opening checks everything without reading a tensor (cheap enough for `tandem serve`'s
pre-flight): the architecture (`gguf_arch.FAMILIES`, else refused by name), the config (the
architecture's own checks), every tensor's name (one the architecture does not consume is refused
by name, e.g. `rope_freqs`, which carries scaling the metadata does not state) and type
(`gguf_blocks.SUPPORTED_TYPES`, else refused naming the tensor and its type). `dequantized(t)`
is the tensor as float32 in the HF checkpoint's layout and values: its bytes decoded
(`gguf_blocks`, equal to the `gguf` package's `dequantize`), then the converter's transforms undone.
`open_gguf` keeps the last few opened files (keyed by path, size and mtime): loading, building
each precision's model and the pre-flight check read a file's metadata once.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tandem.engine.io.generation_defaults import GenerationDefaults
from tandem.engine.io.tokenizer import Tokenizer
from tandem.engine.models.gguf_arch import GGUFModel
from tandem.engine.models.gguf_blocks import SUPPORTED_TYPES, dequantize, type_name
from tandem.engine.models.gguf_header import GGUFHeader
from tandem.engine.models.hf_config import HFConfig
from tandem.engine.models.registry import Architecture, architecture_for
from tandem.engine.models.support import check_tensor_names
from tandem.platform.errors import ModelLoadError

# llama.cpp's end-of-generation tokens by text (`llama-vocab.cpp`): a file states one EOS id, but
# chat turns end with these, which llama.cpp stops on too.
END_OF_GENERATION_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<EOT>",
    "<|end_of_text|>",
    "<｜end▁of▁sentence｜>",
)


_KV_B_HALVES = ("attn_k_b.weight", "attn_v_b.weight")


@dataclass(frozen=True)
class GGUFTensor:
    name: str  # the file's name
    hf_name: str
    type_name: str  # "Q4_K", "F32", ...
    shape: tuple[int, ...]  # numpy's order: (rows, cols) for a matrix, (n,) for a vector
    raw: Any  # the stored bytes / values: a lazy view of the mapped file (`StoredTensor.data`)

    @property
    def num_elements(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True)
class MergedKVB:
    """DeepSeek's `kv_b_proj` from the halves llama.cpp's converter splits it into for absorbed
    MLA: `attn_k_b` [heads, kv_lora, nope] (transposed) and `attn_v_b` [heads, v, kv_lora];
    HF's rows are per head the nope rows then the v rows. Decoded when read (`np.asarray`), so
    opening the file still reads no tensor."""

    k_b: GGUFTensor
    v_b: GGUFTensor

    @property
    def shape(self) -> tuple[int, int]:
        heads, kv_lora, nope = self.k_b.shape
        return heads * (nope + self.v_b.shape[1]), kv_lora

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        k_b = dequantize(np.asarray(self.k_b.raw), self.k_b.type_name, self.k_b.shape)
        v_b = dequantize(np.asarray(self.v_b.raw), self.v_b.type_name, self.v_b.shape)
        merged = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(self.shape)
        return np.ascontiguousarray(merged, dtype=np.float32)


class GGUFFile:
    """An opened, checked GGUF checkpoint (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._header = GGUFHeader(path)
        except (ValueError, OSError) as exc:
            raise ModelLoadError(f"{path}: corrupt or unsupported GGUF file ({exc})", param="model") from exc
        self.fields: dict[str, Any] = self._header.fields
        names = {t.name for t in self._header.tensors}
        self.model = GGUFModel(self.fields, names, str(path))
        self.eos_token_ids = self._end_of_generation_ids()
        self.hf_config = self.model.hf_config(self.eos_token_ids)
        try:
            raw = HFConfig(self.hf_config)
            self.architecture: Architecture = architecture_for(raw)
            self.architecture.check_config(raw)
            self.config = self.architecture.parse_config(raw)
        except (KeyError, ValueError, TypeError) as exc:
            raise ModelLoadError(f"{path}: GGUF metadata: {exc}", param="model") from exc
        self.model.bind(self.architecture.tensor_names(self.config, "model."))
        self.tensors = self._check_tensors()

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """Built on first use (recovering a SentencePiece file's merges is costly: not done for a pre-flight check)."""
        return Tokenizer.from_gguf_fields(self.fields)

    def _end_of_generation_ids(self) -> list[int]:
        """The file's EOS, EOT and EOM ids, then the tokens llama.cpp also ends a turn on."""
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        ids = [int(self.fields[key]) for key in keys if self.fields.get(key) is not None]
        tokens: list[str] = self.fields["tokenizer.ggml.tokens"]
        texts = set(END_OF_GENERATION_TEXTS)
        ids += [index for index, token in enumerate(tokens) if token in texts]
        return list(dict.fromkeys(ids))

    def _check_tensors(self) -> list[GGUFTensor]:
        tensors, unknown = [], []
        halves: dict[str, GGUFTensor] = {}  # DeepSeek's split kv_b (`MergedKVB`), by file name
        for tensor in self._header.tensors:
            if self.model.skipped(tensor.name):
                continue
            hf_name = self.model.hf_name(tensor.name)
            kind = type_name(tensor.type_id)
            if kind not in SUPPORTED_TYPES:
                raise ModelLoadError(
                    f"{self.path}: tensor {tensor.name} is {kind}, which is not supported "
                    f"(supported: {', '.join(SUPPORTED_TYPES)})",
                    param="model",
                )
            shape = tuple(reversed(tensor.dims))
            experts = self.model.expert_names(tensor.name)
            if experts is not None and len(shape) == 3 and shape[0] == len(experts):
                # [experts, rows, cols]: each expert's rows are contiguous blocks of the stored bytes
                tensors += [
                    GGUFTensor(tensor.name, name, kind, shape[1:], tensor.data[index])
                    for index, name in enumerate(experts)
                ]
                continue
            if hf_name is None and tensor.name.endswith(_KV_B_HALVES):
                halves[tensor.name] = GGUFTensor(tensor.name, "", kind, shape, tensor.data)
                continue
            if hf_name is None:
                unknown.append(tensor.name)
                continue
            tensors.append(GGUFTensor(tensor.name, hf_name, kind, shape, tensor.data))
        tensors += self._merged_kv_b(halves, unknown)
        check_tensor_names(
            [t.hf_name for t in tensors] + unknown,
            lambda prefix: self.architecture.tensor_names(self.config, prefix),
            source=str(self.path),
        )
        return tensors

    def _merged_kv_b(self, halves: dict[str, GGUFTensor], unknown: list[str]) -> list[GGUFTensor]:
        """Each layer's `attn_k_b` + `attn_v_b` as the `kv_b_proj` the architecture consumes (a
        half without its pair, or where no `kv_b_proj` is consumed, is refused as unknown). Files
        that carry the whole `attn_kv_b` too (some converters kept it) are read from it."""
        merged = []
        for name, k_b in list(halves.items()):
            if not name.endswith(_KV_B_HALVES[0]):
                continue
            prefix = name[: -len(_KV_B_HALVES[0])]
            if prefix + "attn_kv_b.weight" in self.model.meta.tensor_names:  # the halves repeat it
                halves.pop(name)
                halves.pop(prefix + _KV_B_HALVES[1], None)
                continue
            v_b = halves.get(prefix + _KV_B_HALVES[1])
            hf_name = self.model.hf_name(prefix + "attn_kv_b.weight")
            if v_b is None or hf_name is None or len(k_b.shape) != 3 or len(v_b.shape) != 3:
                continue
            whole = MergedKVB(k_b, v_b)
            merged.append(GGUFTensor(prefix + "attn_kv_b.weight", hf_name, "F32", whole.shape, whole))
        used = {t.name[: -len("attn_kv_b.weight")] for t in merged}
        unknown += [name for name in halves if name[: name.rindex(".attn_") + 1] not in used]
        return merged

    @property
    def generation_defaults(self) -> GenerationDefaults:
        return GenerationDefaults.from_gguf_fields(self.fields)

    def quant_types(self) -> list[str]:
        """The stored types of its tensors, most weights first ("Q8_0", "Q5_0", ..., "F32")."""
        sizes: dict[str, int] = {}
        for tensor in self.tensors:
            sizes[tensor.type_name] = sizes.get(tensor.type_name, 0) + tensor.num_elements
        return sorted(sizes, key=lambda kind: -sizes[kind])

    def dequantized(self, tensor: GGUFTensor) -> np.ndarray:
        """Float32 in `tensor.shape`, as the HF checkpoint holds it (`gguf_blocks.dequantize`:
        the gguf package's values)."""
        array = dequantize(np.asarray(tensor.raw), tensor.type_name, tensor.shape)
        return np.array(self.model.to_hf(tensor.hf_name, array), dtype=np.float32, order="C")

    def dequantized_weights(self) -> Iterator[tuple[str, np.ndarray]]:
        for tensor in self.tensors:
            yield tensor.hf_name, self.dequantized(tensor)


@functools.lru_cache(maxsize=4)
def _open(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(Path(path))


def open_gguf(path: Path) -> GGUFFile:
    """`GGUFFile(path)`, shared while the file is unchanged (see the module docstring)."""
    stat = path.stat()
    return _open(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
