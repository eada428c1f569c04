"""The KV-occupancy + queue-depth policy as pure functions, and its Serve adapter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tandem.deployments.autoscaling import KVOccupancyPolicy, ScalingTargets, desired_replicas

T = ScalingTargets(
    target_kv_occupancy=0.7,
    target_waiting_per_replica=2.0,
    min_replicas=1,
    max_replicas=4,
)


@pytest.mark.parametrize(
    ("current", "kv", "waiting", "want"),
    [
        (1, [0.0], [0], 1),  # idle stays at min
        (1, [0.7], [0], 1),  # at target
        (1, [0.95], [0], 2),  # KV pressure
        (2, [0.9, 0.9], [0, 0], 3),
        (1, [0.1], [5], 3),  # prefill-heavy: low KV, long queue
        (3, [0.1, 0.1, 0.1], [0, 0, 0], 1),  # drained: back to min
        (4, [1.0] * 4, [50] * 4, 4),  # capped at max
    ],
)
def test_desired_replicas(current: int, kv: list[float], waiting: list[float], want: int) -> None:
    assert desired_replicas(current, kv, waiting, T) == want


def test_serve_adapter_reads_replica_metrics() -> None:
    policy = KVOccupancyPolicy(max_replicas=8)
    ctx = SimpleNamespace(
        aggregated_metrics={"kv_occupancy": {"r1": 0.9, "r2": 0.95}, "num_waiting": {"r1": 1.0, "r2": 0.0}},
        current_num_replicas=2,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=8,
        current_time=10.0,
        policy_state={},
    )
    target, _ = policy(ctx)
    assert target == 3
    with pytest.raises(ValueError, match="target_kv_occupancy"):
        KVOccupancyPolicy(target_kv_occupancy=1.5)


def test_app_hands_delays_to_serve_and_targets_to_the_policy() -> None:
    from ray.serve.config import AutoscalingConfig

    from tandem.deployments.app import AppConfig, replica_options

    options = replica_options(
        AppConfig(autoscaling={"max_replicas": 3, "target_kv_occupancy": 0.5, "downscale_delay_s": 7})
    )
    assert "num_replicas" not in options
    config = AutoscalingConfig(**options["autoscaling_config"])  # Serve accepts it
    assert (config.min_replicas, config.max_replicas) == (1, 3)
    assert (config.upscale_delay_s, config.downscale_delay_s) == (5.0, 7.0)
    assert config.policy.policy_kwargs == {
        "target_kv_occupancy": 0.5,
        "target_waiting_per_replica": 2.0,
        "min_replicas": 1,
        "max_replicas": 3,
    }
    with pytest.raises(ValueError, match="target_kv_occupancy"):
        replica_options(AppConfig(autoscaling={"target_kv_occupancy": 2.0}))


def test_replicas_get_an_explicit_thread_count() -> None:
    """Ray sets OMP_NUM_THREADS to an actor's CPUs (1 when it reserves none): the engine must not
    silently run on one thread."""
    import os

    from tandem.deployments.app import AppConfig, replica_engine_options

    assert replica_engine_options(AppConfig(replica_num_cpus=0))["num_threads"] == (os.cpu_count() or 1)
    assert replica_engine_options(AppConfig(replica_num_cpus=4))["num_threads"] == 4
    assert replica_engine_options(AppConfig(engine={"num_threads": 3}))["num_threads"] == 3


def test_batch_workers_follow_queued_shards() -> None:
    from tandem.deployments.autoscaling import BatchQueueTargets, desired_batch_workers

    targets = BatchQueueTargets(target_shards_per_replica=4, min_replicas=1, max_replicas=3)
    assert desired_batch_workers(0, targets) == 1  # idle: the floor
    assert desired_batch_workers(4, targets) == 1
    assert desired_batch_workers(5, targets) == 2
    assert desired_batch_workers(100, targets) == 3  # the ceiling
    assert desired_batch_workers(0, BatchQueueTargets(min_replicas=0)) == 0  # scale to zero
    # No more workers than the engines' batch seats keep busy: one replica of 64 seats, 64 lines
    # per worker -> 1; three such replicas -> 3; no replica reporting -> the floor.
    assert desired_batch_workers(100, targets, workers_for_seats=1.0) == 1
    assert desired_batch_workers(100, targets, workers_for_seats=2.5) == 3
    assert desired_batch_workers(8, targets, workers_for_seats=3.0) == 2  # the queue still decides
    assert desired_batch_workers(100, targets, workers_for_seats=0.0) == 1


@pytest.mark.parametrize("layout", ["colocated", "colocated-gpu", "disaggregated-gpu"])
def test_serve_config_files_are_valid_apps(layout: str) -> None:
    """infra/serve/*.yaml are valid Serve configs of the app `tandem serve --print-config`
    describes: its args are AppConfig fields (extra fields are refused), and the app builds
    (composition only: nothing is deployed) with the placement the layout promises."""
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from tandem.cli import serve_config
    from tandem.deployments.app import AppConfig, build_app, replica_options

    config = yaml.safe_load((Path(__file__).parents[1] / "infra" / "serve" / f"{layout}.yaml").read_text())
    ServeDeploySchema.model_validate(config)  # what `serve deploy` accepts
    args = config["applications"][0]["args"]
    cfg = AppConfig(**args)
    build_app(args)
    actor = replica_options(cfg)["ray_actor_options"]
    if layout == "colocated":
        assert actor.get("resources") == {"tandem_engine": 1.0} and "num_gpus" not in actor
    else:
        assert actor.get("num_gpus") == 1.0
    assert cfg.placement_of("OpenAIIngress").resources == {"tandem_service": 0.01}
    # The same application as `tandem serve --print-config` writes: builder, name and prefix.
    printed = serve_config(args)["applications"][0]
    for key in ("name", "route_prefix", "import_path"):
        assert config["applications"][0][key] == printed[key], key
    with pytest.raises(ValueError, match="direct_streaming"):
        AppConfig(**{**args, "direct_streaming": True})  # that wiring is gone: refused, not ignored


def test_prefill_replicas_follow_queued_prompt_tokens() -> None:
    """Disaggregated mode: the prefill pool scales on the prompt tokens its engines have yet to
    compute (summed over replicas), within its bounds; the app hands Serve a policy it accepts."""
    from ray.serve.config import AutoscalingConfig

    from tandem.deployments.app import AppConfig, prefill_replica_options
    from tandem.deployments.autoscaling import PrefillQueuePolicy

    policy = PrefillQueuePolicy(target_prompt_tokens_per_replica=1000, max_replicas=4)

    def wanted(queued: dict[str, float], low: int = 1, high: int = 4) -> int:
        ctx = SimpleNamespace(
            aggregated_metrics={"queued_prompt_tokens": queued},
            current_num_replicas=len(queued),
            capacity_adjusted_min_replicas=low,
            capacity_adjusted_max_replicas=high,
            policy_state={},
        )
        return policy(ctx)[0]

    assert wanted({"p1": 0.0}) == 1  # idle: the floor
    assert wanted({"p1": 1500.0, "p2": 900.0}) == 3  # 2400 queued tokens
    assert wanted({"p1": 99_000.0}) == 4  # the ceiling
    options = prefill_replica_options(
        AppConfig(
            mode="disaggregated",
            prefill_autoscaling={"target_prompt_tokens_per_replica": 2048, "max_replicas": 3},
        )
    )
    config = AutoscalingConfig(**options["autoscaling_config"])
    assert (config.min_replicas, config.max_replicas) == (1, 3) and "num_replicas" not in options
    assert config.policy.policy_kwargs["target_prompt_tokens_per_replica"] == 2048
    assert (
        prefill_replica_options(AppConfig(mode="disaggregated", num_prefill_replicas=2))["num_replicas"] == 2
    )


def test_prefill_engine_overrides_are_engine_settings() -> None:
    """`prefill_engine` is checked when the config is read: an unknown key, a bad value, or the
    model (always `engine`'s) is refused by name before any replica starts."""
    from pydantic import ValidationError

    from tandem.deployments.app import AppConfig

    assert AppConfig(mode="disaggregated", prefill_engine={"max_num_seqs": 4}).prefill_engine == {
        "max_num_seqs": 4
    }
    for overrides, named in (
        ({"max_num_seq": 4}, "max_num_seq are not engine settings"),
        ({"max_num_seqs": "four"}, "max_num_seqs"),
        ({"model": "other"}, "model come from `engine`"),
    ):
        with pytest.raises(ValidationError, match=named):
            AppConfig(mode="disaggregated", prefill_engine=overrides)


def test_engine_reports_its_prefill_backlog(tiny_llm) -> None:  # type: ignore[no-untyped-def]
    from tandem import GenerationRequest, SamplingParams

    engine = tiny_llm.engine
    assert engine.stats()["queued_prompt_tokens"] == 0
    engine.add_request(
        GenerationRequest("backlog", prompt_token_ids=[5] * 40, sampling_params=SamplingParams(max_tokens=2))
    )
    assert engine.stats()["queued_prompt_tokens"] == 40
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["queued_prompt_tokens"] == 0


def test_batch_requests_per_replica_leave_seats_for_real_time_requests() -> None:
    """Batch work takes at most half of a replica's Serve seats by default (and never all of them):
    the engine's max_num_seqs, capped at max_ongoing_requests / 2."""
    from tandem.deployments.app import AppConfig, max_batch_requests

    assert max_batch_requests(AppConfig()) == 64  # max_num_seqs 64, 128 seats
    assert max_batch_requests(AppConfig(max_ongoing_requests=32)) == 16
    assert max_batch_requests(AppConfig(engine={"max_num_seqs": 8})) == 8
    assert max_batch_requests(AppConfig(max_batch_requests_per_replica=100)) == 100
    with pytest.raises(ValueError, match="must be below max_ongoing_requests"):
        AppConfig(max_batch_requests_per_replica=128)
