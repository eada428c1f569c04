"""The deployment files under infra/: generated from the app's config and current, parseable, and
consistent with each other (Serve configs inside the RayService, images, Ray version, resources)."""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

INFRA = Path(__file__).parents[1] / "infra"
sys.path.insert(0, str(INFRA))
import generate  # noqa: E402


def apply_json_patch(document: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 `add` and `replace` (all the overlays use) on a copy of `document`."""
    out = copy.deepcopy(document)
    for op in patch:
        assert op["op"] in ("add", "replace"), op["op"]
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        node: Any = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if op["op"] == "add":
                node.insert(index, op["value"])
            else:
                assert index < len(node), op["path"]
                node[index] = op["value"]
        else:
            assert op["op"] == "add" or last in node, f"replace of a missing field: {op['path']}"
            node[last] = op["value"]
    return out


def overlay(name: str) -> dict[str, Any]:
    """What `kustomize build infra/k8s/overlays/<name>` gives for the RayService."""
    kustomization = yaml.safe_load((INFRA / "k8s" / "overlays" / name / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../../base"]
    base_dir = INFRA / "k8s" / "base"
    base = yaml.safe_load((base_dir / "kustomization.yaml").read_text())
    (service,) = [yaml.safe_load((base_dir / r).read_text()) for r in base["resources"]]
    for entry in kustomization["patches"]:
        target = entry["target"]
        assert (target["kind"], target["name"]) == (service["kind"], service["metadata"]["name"])
        service = apply_json_patch(service, yaml.safe_load(entry["patch"]))
    service["metadata"]["namespace"] = kustomization["namespace"]
    return service


def containers(service: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = service["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def ray_resources(group: dict[str, Any]) -> dict[str, float]:
    """A worker group's custom Ray resources (KubeRay's quoted JSON in rayStartParams)."""
    raw = group["rayStartParams"].get("resources")
    return json.loads(json.loads(raw)) if raw else {}


def test_generated_files_are_current() -> None:
    stale = [p for p, text in generate.files().items() if not p.exists() or p.read_text() != text]
    assert not stale, f"run python infra/generate.py: {stale}"


@pytest.mark.parametrize("name", sorted(generate.OVERLAYS))
def test_overlay_runs_its_serve_config_on_its_image_with_the_resources_it_asks(name: str) -> None:
    from tandem.deployments.app import AppConfig

    layout, image = generate.OVERLAYS[name]
    service = overlay(name)
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    # The Serve config inside is the one in infra/serve/, text for text.
    serve_text = service["spec"]["serveConfigV2"]
    assert serve_text == (INFRA / "serve" / f"{layout}.yaml").read_text()
    cfg = AppConfig(**yaml.safe_load(serve_text)["applications"][0]["args"])
    # Every container runs the overlay's image; its S3 settings come from a Secret.
    for container in containers(service):
        assert container["image"] == image
        assert {"secretRef": {"name": "tandem-s3"}} in container["envFrom"]
        assert container["resources"]["requests"] == container["resources"]["limits"]
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no replicas on the head
    annotations = cluster["headGroupSpec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    groups = cluster["workerGroupSpecs"]
    # Some worker group can hold each deployment's replicas.
    for deployment in ("LLMReplica", "OpenAIIngress", "BatchWorker", "FleetState"):
        placement = cfg.placement_of(deployment)
        fits = []
        for group in groups:
            offered = ray_resources(group)
            gpus = float(group["rayStartParams"].get("num-gpus", 0))
            requested = group["template"]["spec"]["containers"][0]["resources"]["requests"]
            if placement.num_gpus:
                assert float(requested.get("nvidia.com/gpu", 0)) == gpus, "pod GPUs and Ray's num-gpus differ"
            if gpus >= placement.num_gpus and all(
                offered.get(k, 0) >= v for k, v in placement.resources.items()
            ):
                fits.append(group["groupName"])
        assert fits, f"no worker group of the {name} overlay fits {deployment}'s placement {placement}"
    probes = [c.get("readinessProbe") for c in containers(service) if c.get("readinessProbe")]
    assert probes and all(p["httpGet"]["path"] == "/health" for p in probes)
    if name == "prod":
        assert any(
            "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["requests"]
            for g in groups
        )


def test_images_follow_the_ray_and_torch_the_package_pins() -> None:
    base = yaml.safe_load((INFRA / "k8s" / "base" / "rayservice.yaml").read_text())
    ray_version = base["spec"]["rayClusterConfig"]["rayVersion"]
    pyproject = (INFRA.parent / "pyproject.toml").read_text()
    pinned = re.search(r'"ray\[serve\]~=(\d+\.\d+)', pyproject)
    assert pinned and ray_version.startswith(pinned.group(1) + ".")
    torch_pin = re.search(r"TORCH_SPEC \?= (torch==[\d.]+)", (INFRA.parent / "Makefile").read_text())
    assert torch_pin
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (INFRA / "docker" / name).read_text()
        assert re.search(rf"^FROM rayproject/ray:{re.escape(ray_version)}-py311-", text, re.M), name
        assert f'"{torch_pin.group(1)}"' in text, name


@pytest.mark.parametrize("name", ["base", *sorted(generate.OVERLAYS)])
def test_pod_templates_follow_the_kubernetes_schema(name: str) -> None:
    """Each group's pod template is a valid Pod spec for Kubernetes' own published schema
    (`kubernetes-validate`, strict: unknown fields are errors); rayStartParams are strings, as
    KubeRay's map[string]string needs. The RayService fields around them (KubeRay's CRD) are not
    schema-checked: no validator for it installs here, and its CRD is not vendored."""
    import kubernetes_validate

    service = (
        yaml.safe_load((INFRA / "k8s" / "base" / "rayservice.yaml").read_text())
        if name == "base"
        else overlay(name)
    )
    cluster = service["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), group["rayStartParams"]
        template = group["template"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": group.get("groupName", "head"), **template.get("metadata", {})},
            "spec": template["spec"],
        }
        kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)
    broken = copy.deepcopy(pod)
    broken["spec"]["containers"][0]["resourcez"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):  # the check can fail
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)
