"""The native CPU INT4 matmul (`csrc/int4_cpu.c`) and decoder stack (`csrc/decoder_cpu.c`, see
`native_decoder.py`): one library, built on first use, called through ctypes.

Why: torch's `_weight_int4pack_mm_for_cpu` takes each group's (scale, zero) as a bfloat16 tensor,
so double-quantised parameters had to be multiplied out before every call, and at batch 1 the
kernel itself moves weights well below memory bandwidth (docs/performance.md). This kernel reads the packed nibbles and the int8
parameter codes directly (exact integer dot products on int16-scaled activations, AVX2), and for
large M dequantises the weight once and leaves the GEMM to torch.

Build: `cc -O3 -march=native -fopenmp -shared` (`TANDEM_NATIVE_MARCH` names another target, e.g.
`haswell` for the AVX2 code paths on an AVX-512 machine) into `$TANDEM_CACHE_DIR/kernels` (default
`~/.cache/tandem/kernels`), keyed by the source's hash and the CPU's flags, written to a temporary
name and renamed so that concurrent replicas never load a half-written file. `load()` returns
None, once logged, when the CPU is not x86-64 with AVX2, FMA and F16C, `TANDEM_NATIVE_INT4=0`,
there is no compiler or the build fails (`unavailable_reason()` says which): callers then use
torch's kernel. The library needs `libgomp.so.1`; torch's CPU build bundles a libgomp with that
soname and loads it first, so the dynamic loader binds both to one OpenMP runtime and one thread
pool (a torch linked to another OpenMP would mean two pools on the same cores).

GGUF 4-bit blocks as stored (mode 3): every call takes `csrc/vnni_cpu.c`'s arithmetic (16 outputs
in a register's lanes, exact integer dot products, each weight block's codes regrouped once a call
and read by every row; the float32 steps fixed per (row, output)): with vpdpbusd where the build
target has AVX512-VNNI (Ice Lake and later Xeons, AMD Zen 4 and later), on the AMX tile unit for
16-row blocks from 12 real rows where it runs, and with vpmaddubsw on AVX2 (`csrc/blocks_avx2.c`):
the same bits on every CPU, and batch invariant (a row's result never depends on its call).
Where the build has AVX512-VNNI (`block_tiles_available`) `Int4Linear` holds such a weight in tile
order (mode 4, `tile_blocks`): each block of 16 rows reordered so that a decode step reads a run of
its 16 rows with one 64-byte load instead of a gather across rows K / 2 bytes apart.

AMX (`csrc/amx_cpu.c`): built where the build target has AMX-INT8 and used where Linux grants the
tile state; `TANDEM_NATIVE_AMX=0` or `use_amx(False)` turns it off. Q8_0 calls put their whole
16-row tiles, and a padded last one from 10 rows (from 1 behind whole tiles where the weight passes
4 MB), on the tile unit with the vector kernel's exact bits; other rows go to the vector kernel.

`int4_mm` / `int4_dequantize` call the library directly (eager); `torch.ops.tandem.int4_mm` /
`torch.ops.tandem.int4_dequantize` are the same functions registered as custom ops, so that
`torch.compile` keeps them as opaque calls inside one graph. Inputs: CPU tensors, contiguous.
"""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tandem.platform.cpu import cpu_flags

log = logging.getLogger(__name__)

GROUP_SIZES = (32, 64, 128, 256)  # what the kernel is specialised for

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "decoder_cpu.c"  # includes int4_cpu.c: one library with both
SOURCES = (
    CSRC / "int4_cpu.c",
    CSRC / "vnni_cpu.c",
    CSRC / "blocks_avx2.c",
    CSRC / "amx_cpu.c",
    CSRC / "logits_cpu.c",
    SOURCE,
)  # what the build's cache key covers
MODE_F16_PARAMS = 0  # params: float16 [N, G, 2] (scale, zero)
MODE_INT8_PARAMS = 1  # params: int8 codes [N, G, 2], with bfloat16 super-block scales [N, S, 2]
MODE_BLOCK_PARAMS = 3  # GGUF 4-bit as stored: int8 codes [N, G, 2], float16 block scales [N, S, 2]
MODE_BLOCK_TILES = 4  # mode 3's bytes in tile order (`tile_blocks`): packed [N / 16, 16, K / 2]


def _cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem") / "kernels"


def _march() -> str:
    """The compiler's target: `TANDEM_NATIVE_MARCH`, else this machine's CPU."""
    return os.environ.get("TANDEM_NATIVE_MARCH", "native")


def build_key(flags: frozenset[str]) -> str:
    """What the library built for these CPU flags is made of: its C sources, the flags and the
    target (`_march`), hashed. Also part of the precision and quality probes' cache keys: a
    measurement of one build's speed or arithmetic says nothing about another's."""
    source = b"".join(path.read_bytes() for path in SOURCES)
    return hashlib.sha256(source + " ".join(sorted(flags)).encode() + _march().encode()).hexdigest()[:16]


def _build(flags: frozenset[str]) -> Path:
    key = build_key(flags)
    target = _cache_dir() / f"int4_cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        command = [
            compiler,
            "-O3",
            f"-march={_march()}",
            "-fopenmp",
            "-shared",
            "-fPIC",
            "-o",
            tmp,
            str(SOURCE),
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_unavailable: list[str] = []


def unavailable_reason() -> str:
    """Why `load()` returned None ("" if it did not, or was not called yet)."""
    return _unavailable[0] if _unavailable else ""


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built library, or None (logged once) when it cannot be used here."""
    reason = None
    if os.environ.get("TANDEM_NATIVE_INT4", "1") == "0":
        reason = "disabled by TANDEM_NATIVE_INT4=0"
    elif platform.machine() not in ("x86_64", "AMD64"):
        reason = f"it is x86-64 only (this is {platform.machine()})"
    elif not {"avx2", "fma", "f16c"} <= cpu_flags():
        reason = "the CPU lacks AVX2, FMA or F16C"
    if reason is not None:
        _unavailable.append(reason)
        log.info("native INT4 kernel not used: %s", reason)
        return None
    try:
        lib = ctypes.CDLL(str(_build(cpu_flags())))
    except (OSError, RuntimeError) as error:
        _unavailable.append(str(error))
        log.warning("native INT4 kernel unavailable, using torch's int4 kernel: %s", error)
        return None
    _declare(lib)
    if os.environ.get("TANDEM_NATIVE_AMX", "1") == "0":
        lib.tandem_set_amx(0)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    """The exported functions' C signatures, for ctypes."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.tandem_int4_mm.argtypes = [p, p, i32, p, p, i64, i64, i64, i64, i64, p, i32]
    lib.tandem_int4_mm.restype = i32
    lib.tandem_int4_dequantize.argtypes = [p, i32, p, p, i64, i64, i64, i64, p, i32]
    lib.tandem_int4_dequantize.restype = None
    lib.tandem_decoder_layers.argtypes = [p, p, p, i64, p, p, p, i64, p, p, i64, p, i32]
    lib.tandem_decoder_layers.restype = i32
    lib.tandem_decoder_layers_heads.argtypes = [p, p, p, i64, p, p, p, i64, p, i32]
    lib.tandem_decoder_layers_heads.restype = i32
    lib.tandem_q8_mm.argtypes = [p, p, p, i64, i64, i64, p, i32]
    lib.tandem_q8_mm.restype = i32
    lib.tandem_argmax_rows.argtypes = [p, i64, i64, p, i32]
    lib.tandem_argmax_rows.restype = i32
    lib.tandem_finite_rows.argtypes = [p, i64, i64, p, i32]
    lib.tandem_finite_rows.restype = None
    lib.tandem_block_tiles.argtypes = []
    lib.tandem_block_tiles.restype = i32
    lib.tandem_set_amx.argtypes = [i32]
    lib.tandem_set_amx.restype = i32
    lib.tandem_amx_tile_calls.argtypes = []
    lib.tandem_amx_tile_calls.restype = i64
    f32 = ctypes.c_float
    lib.tandem_paged_attention.argtypes = [
        p,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        f32,
        p,
        p,
        p,
        p,
        p,
        p,
        i64,
        i64,
        f32,
        p,
        i32,
    ]
    lib.tandem_paged_attention.restype = None


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] uint8 in 0..15 (K % 32 == 0) -> [N, K / 2] uint8 in the kernel's row-chunked
    layout: in each run of 32 values, byte i = q[i] | q[i + 16] << 4."""
    rows, cols = q.shape
    chunks = q.reshape(rows, cols // 32, 2, 16)
    return (chunks[:, :, 0] | chunks[:, :, 1] << 4).reshape(rows, cols // 2).contiguous()


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:  # inverse of pack_rows
    rows, half = packed.shape
    chunks = packed.reshape(rows, half // 16, 1, 16)
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(rows, half * 2)


def block_tiles_available() -> bool:
    """Whether the library reads GGUF 4-bit blocks in tile order (mode 4: builds with AVX512-VNNI)."""
    lib = load()
    return lib is not None and bool(lib.tandem_block_tiles())


def tile_blocks(
    packed: torch.Tensor,  # [N, K / 2] uint8 (pack_rows), N % 16 == 0
    codes: torch.Tensor,  # [N, G, 2] int8, G = K / 32
    block_scales: torch.Tensor,  # [N, S, 2] float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mode 3's tensors in mode 4's tile order (`csrc/int4_cpu.c` states it): each block of 16 rows
    keeps its bytes where mode 3 has them, reordered so that a decode step reads them with plain
    64-byte loads instead of gathers across 16 rows (K / 2 bytes apart). Returns packed as
    [N / 16, 16, K / 2] (the shape says the order), codes [N, G, 2] and block scales [N, S, 2] in
    the same shapes, reordered."""
    rows, half = packed.shape
    assert rows % 16 == 0 and half % 16 == 0, "tile order: N % 16 == 0 and K % 32 == 0"
    runs = half // 16
    # [B, 16 rows, runs, 4 dwords, 4 bytes] -> [B, runs, 4 dwords, 16 rows, 4 bytes]
    tiled = packed.reshape(rows // 16, 16, runs, 4, 4).permute(0, 2, 3, 1, 4).reshape(rows // 16, 16, half)

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [N, X, 2] -> [B, X, 16, 2], viewed as [N, X, 2]
        return t.reshape(rows // 16, 16, t.shape[1], 2).transpose(1, 2).contiguous().view(t.shape)

    return tiled.contiguous(), per_block(codes), per_block(block_scales)


def packed_shape(packed: torch.Tensor) -> tuple[int, int]:
    """(N, K / 2) of a packed weight: [N, K / 2], or [N / 16, 16, K / 2] in tile order."""
    if packed.dim() == 3:
        return packed.shape[0] * packed.shape[1], packed.shape[2]
    return packed.shape[0], packed.shape[1]


def _library() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError("native INT4 kernel unavailable: " + unavailable_reason())
    return lib


def use_amx(enabled: bool) -> bool:
    """Turn the AMX paths on or off in this process (module docstring); returns whether they run
    now: False where the library, the CPU or Linux lacks them, whatever `enabled`."""
    lib = load()
    return bool(lib.tandem_set_amx(int(enabled))) if lib is not None else False


def amx_tile_calls() -> int:
    """How many matmul calls have put rows on the AMX tile unit in this process (0 without the
    library or AMX): for tests that must know the tile path ran, where its bits equal another's."""
    lib = load()
    return int(lib.tandem_amx_tile_calls()) if lib is not None else 0


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def weight_mode(
    packed: torch.Tensor, params: torch.Tensor, superblock_scales: torch.Tensor | None
) -> tuple[int, int]:
    """(mode, groups per super-block) for the C functions, after checking the parameter dtypes;
    a packed weight of three dimensions is in tile order (`tile_blocks`)."""
    if superblock_scales is None:
        assert params.dtype == torch.float16, "without super-block scales, params are float16 (scale, zero)"
        return MODE_F16_PARAMS, 1
    assert params.dtype == torch.int8 and superblock_scales.dtype in (torch.bfloat16, torch.float16)
    if superblock_scales.dtype == torch.bfloat16:
        mode = MODE_INT8_PARAMS
    else:
        mode = MODE_BLOCK_TILES if packed.dim() == 3 else MODE_BLOCK_PARAMS
    return mode, params.shape[1] // superblock_scales.shape[1]


def int4_mm(
    x: torch.Tensor,  # [M, K] float32, contiguous
    packed: torch.Tensor,  # [N, K / 2] uint8 (pack_rows), or [N / 16, 16, K / 2] (tile_blocks)
    params: torch.Tensor,  # [N, G, 2]: float16 (scale, zero), or int8 codes
    superblock_scales: torch.Tensor | None,  # [N, S, 2] bfloat16 (or float16: GGUF blocks), with int8 codes
    group_size: int,
) -> torch.Tensor:  # -> [M, N] float32
    lib = _library()
    rows, half = packed_shape(packed)
    num_tokens, cols = x.shape
    assert cols == 2 * half and x.dtype == torch.float32 and x.is_contiguous()
    mode, groups_per_superblock = weight_mode(packed, params, superblock_scales)
    y = torch.empty(num_tokens, rows, dtype=torch.float32)
    status = lib.tandem_int4_mm(
        x.data_ptr(), packed.data_ptr(), mode, params.data_ptr(), _ptr(superblock_scales),
        groups_per_superblock, num_tokens, rows, cols, group_size, y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status == -2:
        raise ValueError(f"native INT4 kernel: group size {group_size} is not one of {GROUP_SIZES}")
    if status == -3:
        raise ValueError("native INT4 kernel: tile order needs AVX512-VNNI and N % 16 == 0")
    if status != 0:
        raise MemoryError(
            f"native INT4 kernel could not allocate scratch for {num_tokens}x{cols} activations"
        )
    return y


def int4_dequantize(
    packed: torch.Tensor,  # as int4_mm's
    params: torch.Tensor,
    superblock_scales: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:  # -> [N, K] float32
    lib = _library()
    rows, half = packed_shape(packed)
    mode, groups_per_superblock = weight_mode(packed, params, superblock_scales)
    out = torch.empty(rows, 2 * half, dtype=torch.float32)
    lib.tandem_int4_dequantize(
        packed.data_ptr(), mode, params.data_ptr(), _ptr(superblock_scales), groups_per_superblock,
        rows, 2 * half, group_size, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


# The same two functions as custom ops, for torch.compile (see the module docstring); the fakes
# give inductor the output shapes.
_int4_mm_op = torch.library.custom_op("tandem::int4_mm", int4_mm, mutates_args=())
_int4_dequantize_op = torch.library.custom_op("tandem::int4_dequantize", int4_dequantize, mutates_args=())


@_int4_mm_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, *_: object) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed_shape(packed)[0])


@_int4_dequantize_op.register_fake
def _(packed: torch.Tensor, *_: object) -> torch.Tensor:
    rows, half = packed_shape(packed)
    return packed.new_empty(rows, 2 * half, dtype=torch.float32)
