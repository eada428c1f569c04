"""`EngineParts`: what an engine runs on (`builder.build_parts` and `encoder_setup` build them)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.engine.host.batch_invariance import DISABLED, BatchInvariance
from tandem.engine.host.precision import PrecisionChoice
from tandem.engine.io.generation_defaults import GenerationDefaults
from tandem.engine.io.tokenizer import Tokenizer
from tandem.engine.lora.manager import LoRAManager
from tandem.engine.models.pooling import Pooling
from tandem.engine.sched.step import Runner
from tandem.engine.structured.grammar import GrammarCompiler


@dataclasses.dataclass
class EngineParts:
    """What an engine runs on. `build_parts` loads the model and builds them; a test may pass its
    own (a fake runner, a small tokenizer)."""

    model_name: str
    model_config: Any  # the model's config (`models.interface.ModelConfig`)
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    runner: Runner
    num_blocks: int  # KV blocks the runner's cache holds
    max_model_len: int
    kv_cache_dtype: str  # what the cache stores, for stats ("float32", "float8_e4m3fn", ...)
    lora: LoRAManager | None = None
    precision: PrecisionChoice | None = None  # what dtype / weight_dtype "auto" resolved to, and why
    grammars: GrammarCompiler | None = None  # output constraints (the runner's); None: refused
    num_head_blocks: int = 0  # head blocks of the KV compression pool (0: no compressed requests)
    max_positions: int | None = None  # positions the model's RoPE tables cover (None: max_model_len)
    kv_window: int | None = None  # blocks before a request's last kv_window positions are given back
    tuned_threads: int | None = None  # most intra-op threads the engine's `ThreadTuner` may use (None: fixed)
    batch_invariance: BatchInvariance = DISABLED  # whether rows are computed alike in any batch, and why
    # what a request's unset sampling fields become (the checkpoint's, with generation_config "auto")
    generation_defaults: GenerationDefaults = dataclasses.field(default_factory=GenerationDefaults)
    pooling: Pooling = dataclasses.field(default_factory=Pooling)  # how an embedding pools (`models.pooling`)
    encoder: bool = False  # a bidirectional encoder: it embeds and does not generate
    quant_types: list[str] = dataclasses.field(default_factory=list)  # a GGUF file's stored types
