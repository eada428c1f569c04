"""Engine configuration: one pydantic model whose fields are `LLM(...)` keyword arguments.

Names follow what vLLM users expect (`kv_cache_memory`, `block_size`, `max_num_seqs`, ...).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_MODEL = "smollm2-135m-instruct"


class SpeculativeConfig(BaseModel):
    """Speculative decoding (`EngineConfig.speculative`).

    - `ngram`: prompt lookup, proposals from the request's own prompt and output.
    - `draft`: a draft proposes, with its own KV cache beside the target's: `draft_model`, any
      model path the engine loads with the target's vocabulary, or an EAGLE-style head folder
      trained for the target (`scripts/train_draft.py`); without `draft_model`, the head bundled
      for the target, if it has one.
    - `auto` (default): prompt lookup, plus the draft where there is one (`draft_model`, or the
      bundled head of the default model); per request and step, whichever is expected to yield
      more accepted tokens proposes.

    Each step verifies as many drafts as the measured step cost says pay off (none at large
    batch)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    method: Literal["auto", "ngram", "draft"] = Field(
        "ngram",
        description="'ngram': prompt lookup; 'draft': the draft model or head alone; 'auto': both, the "
        "one expected to pay per request and step. Unset: 'auto' when draft_model is given, else "
        "'ngram' (with the native decoder stack a target step is cheap enough that the bundled "
        "head's drafts no longer pay on the measured workloads; docs/performance.md).",
    )
    draft_model: str | None = Field(
        None,
        description="The draft (methods 'draft' and 'auto'): a bundled name, HF folder, GGUF, or an EAGLE head folder.",
    )
    num_speculative_tokens: int = Field(5, ge=1, le=16, description="Most draft tokens per request per step.")
    prompt_lookup_min: int = Field(1, ge=1, description="Shortest n-gram matched against earlier tokens.")
    prompt_lookup_max: int = Field(4, ge=1, description="Longest n-gram matched (tried first).")

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeConfig:
        if "method" not in self.model_fields_set and self.draft_model is not None:
            self.method = "auto"
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        if self.method == "ngram" and self.draft_model is not None:
            raise ValueError("method 'ngram' takes no draft_model; use method 'draft' or 'auto'")
        return self


class EngineConfig(BaseModel):
    """Everything the engine needs to start. Unknown keys are rejected, so typos fail loudly."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(
        DEFAULT_MODEL,
        description="Model name of a bundled model, an HF folder of a supported family, or a .gguf file "
        "(llama, mixtral-style llama, qwen2, qwen3, qwen3moe, phi3, gemma, gemma2, gemma3; other GGUF "
        "architectures and quant types are refused by name).",
    )
    served_model_name: str | None = Field(
        None,
        description="Model id in the API; defaults to the bundled name or the path's last part (a .gguf "
        "file's stem).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Compute dtype of weights and activations. 'auto': bfloat16 on CUDA; on CPU the "
        "fastest the precision probe measured for this model on this machine (precision_probe), or "
        "without it bfloat16 on CPUs with AMX-BF16 and float32 elsewhere (engine/host/precision.py; "
        "stats() and the start-up log say what was chosen and why). An explicit dtype is the whole "
        "unquantised model in that dtype (with weight_dtype 'auto').",
    )
    precision_probe: bool = Field(
        True,
        description="On CPU with dtype 'auto': at the first start on a machine, time the model's GEMM "
        "shapes in each compute dtype and with INT4 weights (a few seconds) and choose the fastest; "
        "the result is cached per machine and model shapes under $TANDEM_CACHE_DIR/precision. "
        "False: choose by CPU flags.",
    )
    device: str = Field("auto", description="'cpu', 'cuda', 'cuda:N' or 'auto'.")
    weight_dtype: Literal["auto", "dense", "int4", "int8", "hybrid", "gguf"] = Field(
        "auto",
        description="'int4': group-wise INT4 linears (two values per byte; a GGUF's Q4_0 / Q4_1 / Q4_K "
        "blocks load as stored, float weights are quantised by int4_method); 'int8': Q8_0 linears "
        "(int8 codes, a float16 scale per 32 inputs); 'gguf': a quantised GGUF's linears as the file "
        "stores them (4-bit blocks as INT4 exactly, Q8_0 / Q5_0 as INT8 exactly, Q5_1 / Q5_K / Q6_K "
        "rounded once to Q8_0); 'dense': the compute dtype; 'auto': one precision for every step, "
        "'gguf' for a GGUF file whose linears are quantised (CPU, native kernel), else 'int4' on a CPU where the precision probe measured INT4 faster than the compute "
        "dtype at one row (a lone request's decode step) and the quality probe measured it within its "
        "bound on this checkpoint, else 'int8' where the same holds for INT8, else "
        "'dense'; 'hybrid' (never chosen by 'auto'): both copies, INT4 for decode steps of at most "
        "hybrid_int4_max_batch requests, the compute dtype for prefill and larger batches: a request's "
        "tokens then depend on the load. Costs the memory of both copies.",
    )
    quality_probe: bool = Field(
        True,
        description="At the first start on a machine, hold a quantised or automatically chosen 16-bit "
        "precision to a bound on this checkpoint: next-token distributions on a bundled calibration text, "
        "decode steps included, against the float32 weights (mean KL <= 0.02 nats, top-1 agreement >= "
        "0.97; engine/host/quality_probe.py). An automatic choice outside it falls back (INT4 to dense, "
        "bfloat16 to float32); an explicit one starts with a warning giving the figures. Cached per "
        "machine and checkpoint under $TANDEM_CACHE_DIR/precision.",
    )
    generation_config: Literal["auto", "none"] = Field(
        "auto",
        description="'auto': a request's unset sampling fields (temperature, top_p, top_k, min_p, "
        "repetition_penalty, and max_tokens from max_new_tokens) take the checkpoint's defaults "
        "(generation_config.json, or a GGUF file's general.sampling.* keys), as vLLM does; 'none': "
        "neutral values (temperature 1, no filters).",
    )
    hybrid_int4_max_batch: int = Field(
        8, ge=1, description="With weight_dtype='hybrid': largest decode batch that uses the INT4 copy."
    )
    int4_group_size: int | None = Field(
        None,
        ge=32,
        le=256,
        description="INT4 group size along the input dim. Unset: a GGUF's Q4_0 / Q4_1 / Q4_K tensors load "
        "as they are (group 32) and other weights are quantised with groups of 32 (the best group size measured: docs/performance.md). Set: every linear is "
        "quantised at this size (from the dequantised file for a GGUF: fewer bytes, a second rounding).",
    )
    int4_method: Literal["gptq", "rtn"] = Field(
        "gptq",
        description="How INT4 weights are made from float weights (a GGUF's own 4-bit blocks load as "
        "they are): 'gptq' quantises each linear with GPTQ's error feedback on the bundled calibration "
        "text, once per checkpoint and machine (cached under TANDEM_CACHE_DIR/int4); 'rtn' rounds each "
        "group to nearest (faster to load, much worse on some checkpoints: docs/performance.md).",
    )
    int4_double_quant: bool = Field(
        False,
        description="Store each INT4 group's scale and zero as int8 codes with a bfloat16 scale per "
        "super-block of up to 8 groups (llama.cpp K-quant / QLoRA style), the 4-bit codes re-rounded "
        "to match: 4.6 bits per weight instead of 5 at group 32 (0.29x of 16-bit instead of 0.31x). "
        "The native CPU kernel reads the codes as they are; torch's kernel (int4_kernel='torch') "
        "needs them multiplied out to bfloat16 at each forward, the Triton kernel (CUDA) once, to float32.",
    )
    int4_kernel: Literal["auto", "native", "triton", "torch"] = Field(
        "auto",
        description="INT4 matmul: 'native' is Tandem's AVX2 CPU kernel (built with the system C compiler on "
        "first use, cached under $TANDEM_CACHE_DIR or ~/.cache/tandem), 'triton' Tandem's W4A16 Triton "
        "kernel (CUDA), 'torch' torch's int4 kernel; 'auto' takes Triton's on CUDA, native on a CPU where "
        "it can be built, and torch's otherwise.",
    )
    role: Literal["colocated", "prefill", "decode"] = Field(
        "colocated",
        description="Quantisation preset: 'decode' defaults to INT4 weights + FP8 KV, 'prefill' to "
        "16-bit weights and KV and no speculation; explicit weight_dtype / kv_cache_dtype / speculative win.",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8_e4m3"] = Field(
        "auto",
        description="KV-cache element type; 'auto' follows dtype. 'fp8_e4m3' stores e4m3 values with a "
        "float16 scale per (token, head): about 2x the tokens of a 16-bit cache in the same memory.",
    )
    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV-cache block.")
    kv_cache_memory: int | None = Field(
        None, gt=0, description="KV-cache budget in bytes (takes precedence over the fraction)."
    )
    kv_cache_memory_fraction: float = Field(
        0.1,
        gt=0.0,
        le=0.95,
        description="KV-cache budget as a fraction of device memory (CPU: of available RAM).",
    )
    max_num_seqs: int = Field(64, ge=1, description="Most requests in one batch.")
    max_num_batched_tokens: int = Field(
        1024, ge=1, description="Token budget of one step, shared by prefill chunks and decodes."
    )
    max_model_len: int | None = Field(
        None, ge=2, description="Context window; defaults to the model's, capped by KV capacity."
    )
    batch_kv_occupancy_limit: float = Field(
        0.8,
        gt=0.0,
        le=1.0,
        description="Batch-priority requests are admitted only while KV occupancy stays under this.",
    )
    batch_max_prefill_tokens: int | None = Field(
        None, ge=1, description="Cap on a batch request's prefill chunk per step; default budget/4."
    )
    batch_tokens_under_load: int = Field(
        4,
        ge=0,
        description="Tokens per step that batch requests share while interactive requests run or wait.",
    )
    batch_tokens_after_interactive: int | None = Field(
        8,
        ge=1,
        description="Tokens per step that batch requests share for interactive_quiet_s after the last "
        "interactive request left: short steps, so that the next one waits little for the step in "
        "flight when it arrives. None: no cap (batch steps as large as the budget at once).",
    )
    interactive_quiet_s: float = Field(
        2.0, ge=0.0, description="How long after interactive traffic batch steps stay short."
    )
    batch_tokens_beside_interactive_prompt: int | None = Field(
        0,
        ge=0,
        description="Tokens batch requests share in a step that computes an interactive prompt "
        "chunk: 0 keeps a prompt's steps, and so its time to first token, as without batch traffic. "
        "None: batch_tokens_under_load.",
    )
    tenant_weights: dict[str, Annotated[float, Field(gt=0.0)]] = Field(
        default_factory=dict,
        description="Fair-share weight per tenant id (default 1 for every tenant): inside a priority "
        "class the scheduler serves tenants tokens, seats and preemption in proportion to these.",
    )
    kv_compression_rate: float | None = Field(
        None,
        ge=1.0,
        le=1024.0,
        description="Compress every request's KV cache by per-head eviction at this rate unless the "
        "request sets its own (implies enable_kv_compression). None: only requests that ask.",
    )
    enable_kv_compression: bool = Field(
        False, description="Keep a KV compression pool (per-(layer, head) blocks) for requests that ask."
    )
    kv_compression_memory_fraction: float = Field(
        0.5, gt=0.0, lt=1.0, description="Share of the KV budget the compression pool takes, when it exists."
    )
    kv_compression_policy: Literal["per_head", "uniform"] = Field(
        "per_head", description="Budget split over each layer's heads by score (Ada-KV), or equal per head."
    )
    kv_compression_interval: int = Field(
        64,
        ge=0,
        description="A compressed request is evicted once its context is computed, then again every this "
        "many decode steps, so it stays at its rate as it generates. 0: only once.",
    )
    enable_lora: bool = Field(False, description="Serve LoRA adapters (reserves max_loras device slots).")
    max_loras: int = Field(4, ge=1, description="Distinct adapters in one batch (device slots).")
    max_lora_rank: int = Field(16, ge=1, le=256, description="Largest adapter rank accepted.")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="Adapters kept loaded in host memory (LRU); default 4 x max_loras."
    )
    enable_prefix_caching: bool = Field(True, description="Reuse cached KV blocks of shared prompt prefixes.")
    share_prefix_cache_across_tenants: bool = Field(
        False, description="Let tenants reuse each other's cached prefixes (off: the tenant salts the key)."
    )
    kv_integrity_check: bool = Field(
        True,
        description="Before each step, abort any scheduled request whose KV blocks were reassigned.",
    )
    compile_decode: bool = Field(
        False,
        description="Run decode-only steps through torch.compile (inductor): one fused graph per step "
        "instead of thousands of small ops. Compiled at start-up (minutes on a small CPU; cached on "
        "disk under TORCHINDUCTOR_CACHE_DIR); falls back to eager if compilation fails.",
    )
    cuda_graphs: bool = Field(
        True,
        description="On CUDA, capture decode steps (one token per request, no LoRA rows) as CUDA graphs "
        "at start, one per batch-size bucket up to cuda_graph_max_batch, and replay them: one launch "
        "instead of hundreds of kernel launches per step. Capture time and memory are logged; other "
        "steps run eagerly. Ignored on CPU, with a draft model, and with weight_dtype 'hybrid'.",
    )
    cuda_graph_max_batch: int = Field(
        256,
        ge=1,
        le=1024,
        description="Largest decode batch captured as a CUDA graph (at most max_num_seqs).",
    )
    batch_invariant: bool = Field(
        True,
        description="Compute every token row in one summation order whatever else runs (batch size, "
        "prompt chunking, prefix-cache hits, speculation, thread count), so that temperature 0 and "
        "seeded sampling give the same tokens alone, in any batch and as a batch line. Its cost is "
        "measured in docs/performance.md; off: small decode steps and large steps take different "
        "kernels, and a request's last bits (sometimes its tokens) depend on the batch.",
    )
    native_decoder: bool = Field(
        True,
        description="Run small decode steps (at most 16 token rows, no LoRA rows) of an INT4 model on "
        "CPU through Tandem's native decoder stack: all layers in one call instead of some 2,000 torch "
        "ops. Off: those steps run eagerly (or compiled, with compile_decode).",
    )
    admission_wait_ms: float = Field(
        5.0,
        ge=0.0,
        description="When a request reaches an idle engine, wait until no other request has arrived "
        "for this long before the first step, so a burst of arrivals is prefilled in one step instead "
        "of queueing behind a step of its first few. 0 starts at once.",
    )
    admission_max_wait_ms: float = Field(
        50.0, ge=0.0, description="Upper bound on that wait, however steadily requests keep arriving."
    )
    speculative: SpeculativeConfig | None = Field(
        default_factory=lambda: SpeculativeConfig.model_validate({}),
        description="Speculative decoding (prompt lookup by default; method 'auto' adds the trained "
        "draft head of the default model; on by default, it verifies drafts only where the measured "
        "step cost says they pay); None: off. Greedy output is identical either way, sampled output "
        "has the same distribution.",
    )
    kv_hold_ttl_s: float = Field(
        30.0,
        gt=0.0,
        description="How long a prefilled request's KV blocks wait to be exported (a hand-over to a "
        "decode engine) before they are freed.",
    )
    seed: int = Field(0, description="Seed of the engine's default random generator.")
    adaptive_threads: bool = Field(
        True,
        description="On CPU: each step size runs with all its threads (num_threads, or the default) or "
        "one, whichever its measured step times say is faster (one wins when other processes share "
        "the cores); off: always all",
    )
    async_scheduling: bool = Field(
        True,
        description="Schedule each step while the device runs the previous one, where the runner's steps "
        "run on a device thread (the CUDA runner's and the null model's; not on a CPU, whose cores the "
        "model and the engine share); such an engine plans no speculative drafts.",
    )
    null_model_step_ms: float | None = Field(
        None,
        ge=0.0,
        description="Benchmarks only: run no model. Each step waits this many milliseconds with the GIL free "
        "(a device's step) and samples a fixed cycle of ordinary tokens; only the model's config and "
        "tokenizer are loaded (`benchmarks/platform_overhead.py`).",
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads on CPU; default: torch's, capped by the CPUs this process may use "
        "(its affinity and its cgroup's CPU quota, as a pod's CPU limit sets it)",
    )

    @property
    def api_model_name(self) -> str:
        """The model id clients send: `served_model_name`, else the bundled name or the path's last
        part (a .gguf file's stem, as Ollama and llama.cpp's server name it)."""
        import os.path

        name = os.path.basename(os.path.normpath(self.model))
        return self.served_model_name or (name.removesuffix(".gguf") if name.endswith(".gguf") else name)

    @model_validator(mode="after")
    def _apply_role(self) -> EngineConfig:
        if self.role == "decode":
            if "weight_dtype" not in self.model_fields_set:
                self.weight_dtype = "int4"
            if "kv_cache_dtype" not in self.model_fields_set:
                self.kv_cache_dtype = "fp8_e4m3"
        if self.role == "prefill" and "speculative" not in self.model_fields_set:
            self.speculative = None  # it samples one token per request: nothing to draft
        return self

    @model_validator(mode="after")
    def _check_budget(self) -> EngineConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running request can decode each step"
            )
        return self
