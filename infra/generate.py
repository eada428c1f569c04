"""Writes the deployment files under infra/ from the application's own config, so they cannot
drift from `tandem serve`:

- `infra/serve/<layout>.yaml`: Serve config files (`serve deploy` / `serve run`), one per layout;
- `infra/k8s/base/` and `infra/k8s/overlays/{dev,prod}/`: a KubeRay `RayService` (kustomize), whose
  `serveConfigV2` is the matching Serve config, text for text.

    python infra/generate.py            # rewrite the files
    python infra/generate.py --check    # exit 1 if a committed file differs (the tests run this)

Layouts (the app's `placement` says which nodes each deployment's replicas need):
- `colocated`: CPU engine nodes that declare the custom resource `tandem_engine`; ingress, batch
  workers and the fleet state on nodes that declare `tandem_service` (the dev overlay).
- `colocated-gpu`: engine replicas each ask one GPU (`nvidia.com/gpu` on the GPU worker group);
  the rest as above (the prod overlay).
- `disaggregated-gpu`: prefill replicas (16-bit) and decode replicas (INT4 + FP8 KV) on GPUs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from tandem.cli import serve_config
from tandem.cli.serve_config import SERVE_ENV_VARS

INFRA = Path(__file__).resolve().parent
IMAGE_CPU = "ghcr.io/tandem-llm/tandem:0.1.0-cpu"
IMAGE_GPU = "ghcr.io/tandem-llm/tandem:0.1.0-cuda"
SERVICE_NODES = {"resources": {"tandem_service": 0.01}}  # a sliver: many fit on one node
ENGINE_NODE_RESOURCE = "tandem_engine"
SERVE_PORT = 8000

_COMMON: dict[str, Any] = {
    # Files and batches: an S3 bucket every node can reach (endpoint and credentials from the
    # TANDEM_S3_ENDPOINT_URL / AWS_* environment, a Secret on Kubernetes).
    "object_store": "s3://tandem-batches/prod",
    "max_concurrent_requests_per_tenant": 32,
}
# A GPU node's engine: the KV cache takes most of the memory the weights leave (the rest is
# activations and the decode graphs), and batches are as large as a GPU serves well.
GPU_ENGINE = {
    "model": "/models/served-model", "device": "cuda", "kv_cache_memory_fraction": 0.85, "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
}  # fmt: skip
LAYOUTS: dict[str, dict[str, Any]] = {
    "colocated": {
        **_COMMON,
        "engine": {"model": "smollm2-135m-instruct", "kv_cache_memory": 1 << 30},
        "replica_num_cpus": 2,
        "placement": {
            "LLMReplica": {"resources": {ENGINE_NODE_RESOURCE: 1}},
            "OpenAIIngress": SERVICE_NODES,
            "BatchWorker": SERVICE_NODES,
            "FleetState": SERVICE_NODES,
        },
    },
    "colocated-gpu": {
        **_COMMON,
        "engine": GPU_ENGINE,
        "replica_num_cpus": 2,
        "placement": {
            "LLMReplica": {"num_gpus": 1},
            "OpenAIIngress": SERVICE_NODES,
            "BatchWorker": SERVICE_NODES,
            "FleetState": SERVICE_NODES,
        },
    },
    "disaggregated-gpu": {
        **_COMMON,
        "mode": "disaggregated",
        "engine": GPU_ENGINE,
        "num_prefill_replicas": 1,
        "replica_num_cpus": 2,
        "placement": {
            "LLMReplica": {"num_gpus": 1},
            "PrefillReplica": {"num_gpus": 1},
            "OpenAIIngress": SERVICE_NODES,
            "BatchWorker": SERVICE_NODES,
            "FleetState": SERVICE_NODES,
        },
    },
}
# Which Serve config each Kubernetes overlay runs, on which image.
OVERLAYS = {"dev": ("colocated", IMAGE_CPU), "prod": ("colocated-gpu", IMAGE_GPU)}


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (embedded Serve configs, patches) as literal blocks, readable in review."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def _dump(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=120)


def serve_yaml(layout: str) -> str:
    config = serve_config(LAYOUTS[layout], host="0.0.0.0", port=SERVE_PORT)
    header = (
        f"# Serve config of the `{layout}` layout, written by infra/generate.py from AppConfig (do not\n"
        "# edit: change LAYOUTS there and run it). Deploy: serve deploy infra/serve/"
        f"{layout}.yaml\n# API keys come from $TANDEM_API_KEYS on the nodes (or keys_file); /metrics "
        "needs $TANDEM_OPERATOR_KEYS.\n"
    )
    return header + _dump(config)


def _container(
    name: str, image: str, resources: dict[str, Any], ports: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "name": name,
        "image": image,
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "ports": ports,
        # S3 endpoint and credentials for files, batches and adapters, from a Secret
        "envFrom": [{"secretRef": {"name": "tandem-s3"}}, {"secretRef": {"name": "tandem-keys"}}],
        # Serve's mode (`serve_config.SERVE_ENV_VARS`) for every Ray process of the node: the
        # controller and proxies too, which the app's runtime_env does not reach
        "env": [{"name": name, "value": value} for name, value in SERVE_ENV_VARS.items()],
    }


# Readiness of a service node: the app's /health on its Serve proxy (200 once an engine replica
# answers). On the service group only: KubeRay deploys the app once the head is ready, so the head
# must not wait on the app.
READINESS = {
    "httpGet": {"path": "/health", "port": SERVE_PORT},
    "initialDelaySeconds": 30,
    "periodSeconds": 10,
    "failureThreshold": 30,
}


def _worker_group(
    name: str, image: str, replicas: int, resources: dict[str, Any], ray_resources: str
) -> dict[str, Any]:
    return {
        "groupName": name,
        "replicas": replicas,
        "minReplicas": replicas,
        "maxReplicas": replicas * 4,
        "rayStartParams": {"resources": ray_resources},
        "template": {"spec": {"containers": [_container("ray-worker", image, resources, [])]}},
    }


def rayservice(serve_text: str, image: str) -> dict[str, Any]:
    """The base RayService: a head (no Serve replicas of its own: num-cpus 0), a CPU worker group
    for ingress, batch workers and fleet state (`tandem_service`), and a CPU engine group
    (`tandem_engine`); the prod overlay swaps the engine group for GPU nodes."""
    head_ports = [
        {"containerPort": 6379, "name": "gcs"},
        {"containerPort": 8265, "name": "dashboard"},
        {"containerPort": 10001, "name": "client"},
        {"containerPort": SERVE_PORT, "name": "serve"},
        {"containerPort": 8080, "name": "metrics"},
    ]
    head = _container("ray-head", image, {"cpu": "2", "memory": "8Gi"}, head_ports)
    service = _worker_group(
        "service", image, 1, {"cpu": "2", "memory": "4Gi"}, '"{\\"tandem_service\\": 100}"'
    )
    service["template"]["spec"]["containers"][0]["readinessProbe"] = READINESS
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": "tandem"},
        "spec": {
            "serveConfigV2": serve_text,
            "rayClusterConfig": {
                "rayVersion": "2.60.0",
                "enableInTreeAutoscaling": True,
                "headGroupSpec": {
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                    "template": {
                        "metadata": {
                            "annotations": {
                                "prometheus.io/scrape": "true",
                                "prometheus.io/port": "8080",
                                "prometheus.io/path": "/metrics",
                            }
                        },
                        "spec": {"containers": [head]},
                    },
                },
                "workerGroupSpecs": [
                    service,
                    _worker_group(
                        "engine-cpu",
                        image,
                        1,
                        {"cpu": "4", "memory": "16Gi"},
                        f'"{{\\"{ENGINE_NODE_RESOURCE}\\": 1}}"',
                    ),
                ],
            },
        },
    }


def overlay_patches(overlay: str) -> list[dict[str, Any]]:
    """JSON 6902 patches of the base RayService for `overlay`."""
    layout, image = OVERLAYS[overlay]
    spec = "/spec/rayClusterConfig"
    patches: list[dict[str, Any]] = [
        {"op": "replace", "path": "/spec/serveConfigV2", "value": serve_yaml(layout)},
        {"op": "replace", "path": f"{spec}/headGroupSpec/template/spec/containers/0/image", "value": image},
        {
            "op": "replace",
            "path": f"{spec}/workerGroupSpecs/0/template/spec/containers/0/image",
            "value": image,
        },
    ]
    if overlay == "prod":
        gpu = {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"}
        group = _worker_group("engine-gpu", image, 1, gpu, '"{}"')
        group["rayStartParams"] = {"num-gpus": "1"}
        group["template"]["spec"]["tolerations"] = [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
        patches.append({"op": "replace", "path": f"{spec}/workerGroupSpecs/1", "value": group})
    else:
        patches.append(
            {
                "op": "replace",
                "path": f"{spec}/workerGroupSpecs/1/template/spec/containers/0/image",
                "value": image,
            }
        )
    return patches


def files() -> dict[Path, str]:
    out: dict[Path, str] = {}
    for layout in LAYOUTS:
        out[INFRA / "serve" / f"{layout}.yaml"] = serve_yaml(layout)
    note = "# Written by infra/generate.py (do not edit).\n"
    base = INFRA / "k8s" / "base"
    out[base / "rayservice.yaml"] = note + _dump(rayservice(serve_yaml("colocated"), IMAGE_CPU))
    out[base / "kustomization.yaml"] = note + _dump(
        {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": ["rayservice.yaml"],
        }
    )
    for overlay in OVERLAYS:
        kustomization = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": ["../../base"],
            "namespace": f"tandem-{overlay}",
            "patches": [
                {
                    "target": {"group": "ray.io", "version": "v1", "kind": "RayService", "name": "tandem"},
                    "patch": _dump(overlay_patches(overlay)),
                }
            ],
        }
        out[INFRA / "k8s" / "overlays" / overlay / "kustomization.yaml"] = note + _dump(kustomization)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    stale = []
    for path, text in files().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        print(f"stale: {path.relative_to(INFRA.parent)} (run python infra/generate.py)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
