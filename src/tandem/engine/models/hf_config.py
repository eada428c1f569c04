"""`HFConfig`: a checkpoint's `config.json` as the family parsers read it.

It is the JSON object as stored (or as a GGUF file's metadata maps to it, `gguf_names.py`): the
families' `check` and `parse` (`registry.Architecture`) turn it into a typed `DecoderConfig`,
refusing what they cannot compute exactly. A nominal type, so that only a loaded checkpoint's
config (not any dict) reaches them; its values stay the JSON values they were.
"""

from __future__ import annotations

from typing import Any


class HFConfig(dict[str, Any]):
    """A checkpoint's config.json object (keys as the checkpoint spells them)."""
