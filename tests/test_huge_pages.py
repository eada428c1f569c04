"""The KV cache in huge pages (`tandem.kernels.huge_pages`): where the system grants them on
request, the engine's cache pool is mapped in 2 MiB pages; the values are untouched."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.runner import KVCacheSpec, allocate_kv_caches
from tandem.kernels import huge_pages


def _huge_bytes_under(tensor: torch.Tensor) -> int:
    """Bytes of huge pages in the mapping that holds the tensor's first byte (/proc/self/smaps)."""
    address = tensor.data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: start-end perms ...
                start, end = (int(part, 16) for part in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "AnonHugePages:":
                return int(fields[1]) * 1024
    return 0


needs_thp = pytest.mark.skipif(
    not huge_pages.available(), reason="transparent huge pages are not granted on request here"
)


@needs_thp
def test_the_kv_cache_pool_is_in_huge_pages() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
    num_blocks = 512  # 6 MiB a tensor
    caches = allocate_kv_caches(spec, num_blocks, torch.device("cpu"))
    for k, v, k_scale, v_scale in caches:
        assert k_scale is None and v_scale is None
        for cache in (k, v):
            assert cache.shape == (num_blocks, 16, 3, 64) and cache.is_contiguous()
            assert cache.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
            assert not cache.any()  # zeroed
            assert _huge_bytes_under(cache) >= huge_pages.HUGE_PAGE_BYTES


@needs_thp
def test_huge_pages_even_where_the_allocator_would_hand_out_touched_memory() -> None:
    """After large tensors come and go, glibc serves the next ones from memory it touched before
    (its mmap threshold rises): the cache takes a fresh mapping of its own (the full test suite's
    process, where an allocation from the allocator had no huge page under it)."""
    for _ in range(4):
        torch.ones(6 << 20).sum()  # 24 MiB, touched and freed
    cache = huge_pages.zeros((3 << 20,), torch.float32)
    assert _huge_bytes_under(cache) >= huge_pages.HUGE_PAGE_BYTES
    assert not cache.any()


@needs_thp
def test_a_tensor_in_huge_pages_keeps_every_value() -> None:
    source = torch.randn(3, 1 << 19)  # 6 MiB
    copied = huge_pages.empty((3, 1 << 19), torch.float32).copy_(source)
    assert copied.data_ptr() != source.data_ptr()
    assert torch.equal(copied.view(torch.int32), source.view(torch.int32))
    assert _huge_bytes_under(copied) >= huge_pages.HUGE_PAGE_BYTES


def test_small_tensors_are_ordinary() -> None:
    fresh = huge_pages.zeros((7, 5), torch.bfloat16)
    assert fresh.shape == (7, 5) and fresh.dtype == torch.bfloat16 and not fresh.any()
