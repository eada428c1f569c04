"""The request router's policy (pure parts): prefix digests, the prefix index, replica ranking."""

from __future__ import annotations

import pytest

from tandem.deployments.routing import (
    PrefixIndex,
    ReplicaLoad,
    RoutingConfig,
    place,
    prefix_hashes,
    rank_replicas,
)
from tandem.engine.protocol import GenerationRequest

CONFIG = RoutingConfig.model_validate({"prefix_chunk_chars": 8, "max_imbalance": 2, "kv_saturation": 0.9})


def digests(**fields: object) -> list[str]:
    return prefix_hashes(GenerationRequest("r", **fields), CONFIG.prefix_chunk_chars, 100)[0]  # type: ignore[arg-type]


def test_prefix_digests_are_shared_exactly_as_far_as_the_prompts_are() -> None:
    a = digests(prompt="A" * 8 + "B" * 8 + "C" * 8)
    b = digests(prompt="A" * 8 + "B" * 8 + "D" * 8)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert digests(prompt="A" * 7) == []  # a partial chunk is not indexed
    # The same text under an adapter is another cache.
    assert digests(prompt="A" * 8, lora_name="t:x") != digests(prompt="A" * 8)
    # Conversations sharing their first turns share digests; token-id prompts are chunked too.
    system = {"role": "system", "content": "You are terse. " * 4}
    one = digests(messages=[system, {"role": "user", "content": "one"}])
    two = digests(messages=[system, {"role": "user", "content": "two"}])
    assert len(one) >= 5 and one[:4] == two[:4]
    assert digests(prompt_token_ids=[1]) == [] and len(digests(prompt_token_ids=list(range(4)))) == 2


def test_prefix_index_matches_the_longest_contiguous_prefix_per_replica() -> None:
    index = PrefixIndex(max_entries=100)
    long, short = digests(prompt="x" * 40), digests(prompt="x" * 16 + "y" * 24)
    index.record(long, "r1")
    index.record(short, "r2")
    assert index.match(long) == {"r1": 5, "r2": 2}
    assert index.match(digests(prompt="z" * 40)) == {}
    index.forget_replicas({"r2"})
    assert index.match(long) == {"r2": 2}
    bounded = PrefixIndex(max_entries=3)
    bounded.record(long, "r1")
    assert len(bounded) == 3 and bounded.match(long) == {}  # the oldest (leading) entries went first


def load(rid: str, ongoing: int, kv: float = 0.1) -> ReplicaLoad:
    return ReplicaLoad(rid, ongoing, kv)


@pytest.mark.parametrize(
    ("loads", "affinity", "expected"),
    [
        # Affinity wins while the preferred replica is within max_imbalance of the least loaded.
        ([load("a", 3), load("b", 1)], {"a": 2.0}, [["a"], ["b"]]),
        # ... but not beyond it, nor when its KV cache is saturated: least load decides.
        ([load("a", 4), load("b", 1)], {"a": 2.0}, [["b", "a"]]),
        ([load("a", 0, kv=0.95), load("b", 1)], {"a": 2.0}, [["b"], ["a"]]),
        # The longest match wins among preferred replicas.
        ([load("a", 0), load("b", 0), load("c", 0)], {"a": 1.0, "b": 3.0}, [["b"], ["a", "c"]]),
        # No affinity: roomy replicas by load, saturated last.
        ([load("a", 2), load("b", 0), load("c", 0, kv=0.99)], {}, [["b", "a"], ["c"]]),
    ],
)
def test_rank_replicas(
    loads: list[ReplicaLoad], affinity: dict[str, float], expected: list[list[str]]
) -> None:
    ranks = rank_replicas(loads, affinity, CONFIG)
    assert ranks == expected
    assert sorted(rid for rank in ranks for rid in rank) == sorted(r.replica_id for r in loads)


def test_placement_without_a_key_is_the_least_loaded_with_kv_room() -> None:
    assert place([load("a", 0, kv=0.99), load("b", 5), load("c", 3)], None, CONFIG) == "c"


def test_placement_by_key_agrees_everywhere_and_respects_the_load_guard() -> None:
    loads = [load(f"r{i}", 0) for i in range(4)]
    chosen = {key: place(loads, key, CONFIG) for key in (f"adapter-{i}" for i in range(40))}
    assert len(set(chosen.values())) == 4  # keys spread over the replicas ...
    assert all(
        place(list(reversed(loads)), key, CONFIG) == rid for key, rid in chosen.items()
    )  # ... the same way
    # A replica that leaves moves only its own keys.
    survivors = [r for r in loads if r.replica_id != "r0"]
    assert all(place(survivors, key, CONFIG) == rid for key, rid in chosen.items() if rid != "r0")
    # An overloaded or saturated replica is not chosen by key.
    key = next(k for k, rid in chosen.items() if rid == "r1")
    busy = [load("r0", 0), load("r1", 3), load("r2", 0), load("r3", 0)]
    assert place(busy, key, CONFIG) != "r1"
    assert place([*busy[:1], load("r1", 0, kv=0.95), *busy[2:]], key, CONFIG) != "r1"
