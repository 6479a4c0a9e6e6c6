"""KubeRay manifests rendered from the Serve config files, so `serveConfigV2` is never a second copy to drift.

`manifests/serve-<variant>.yaml` is the source (a Serve config file with specserve's app args, also usable with
`specserve serve --config`); `specserve manifests render` writes `manifests/rayservice-<variant>.yaml` from it, and a
test fails when the committed RayService is stale.

Variants: `gpu` (draft workers on a pool of cheap GPU nodes, target workers on large GPU nodes) and `cpu` (the same
shape on CPU nodes, for kind/minikube). Worker groups declare the Ray custom resources `draft_gpu` / `target_gpu`
through the group's `resources` field; the pools' Serve replicas ask for one unit, so each pool lands on its group.
The `gpu` variant's head pod also runs the gRPC TLS gateway (port 9443, certificate from the `specserve-grpc-tls`
Secret).

Unlike a laptop's `specserve serve`, the cluster binds wide (http_options.host 0.0.0.0, Serve's proxies on every
interface, workers on their pod IPs), so every Ray container takes the API key from the `specserve-api-key` Secret
(the variable the config's auth.api_key_env names; an ingress replica may land on any node), and the head's container
carries the proxies' limits (cluster/serve/proxy_limits.py) from the config's `limits`.
"""

from __future__ import annotations

import copy
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel

from specserve.cluster.app_config import IMPORT_PATH, AppConfig, app_config, load_serve_config
from specserve.cluster.serve.proxy_limits import proxy_env

Variant = Literal["gpu", "cpu"]
VARIANTS: tuple[Variant, ...] = ("gpu", "cpu")
RAY_VERSION = "2.60.0"
IMAGE = "ghcr.io/specserve/specserve:0.1.0"
MANIFEST_DIR = Path(__file__).resolve().parents[2] / "manifests"

_HEAD_PORTS = [
    {"containerPort": 6379, "name": "gcs-server"},
    {"containerPort": 8265, "name": "dashboard"},
    {"containerPort": 10001, "name": "client"},
    {"containerPort": 8000, "name": "serve"},  # KubeRay's serve service exposes the HTTP proxy by this name
    {"containerPort": 9000, "name": "serve-grpc"},  # ... and the gRPC proxy by this one
    {"containerPort": 8080, "name": "metrics"},
]

# Draft groups start empty: n-gram drafting (the default model's) deploys no draft pool, and the in-tree autoscaler
# adds draft nodes once a draft pool's replicas ask for `draft_gpu`.
_GROUPS: dict[Variant, list[dict]] = {
    "gpu": [
        {"name": "draft", "resource": "draft_gpu", "cpu": "4", "memory": "16Gi", "gpus": 1, "min": 0, "max": 8,
         "node_selector": {"cloud.google.com/gke-accelerator": "nvidia-l4"}},
        {"name": "target", "resource": "target_gpu", "cpu": "8", "memory": "64Gi", "gpus": 1, "min": 1, "max": 4,
         "node_selector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}},
    ],
    "cpu": [
        {"name": "draft", "resource": "draft_gpu", "cpu": "1", "memory": "2Gi", "gpus": 0, "min": 0, "max": 2,
         "node_selector": {}},
        {"name": "target", "resource": "target_gpu", "cpu": "2", "memory": "4Gi", "gpus": 0, "min": 1, "max": 2,
         "node_selector": {}},
    ],
}  # fmt: skip


def source_path(variant: Variant) -> Path:
    return MANIFEST_DIR / f"serve-{variant}.yaml"


def output_path(variant: Variant) -> Path:
    return MANIFEST_DIR / f"rayservice-{variant}.yaml"


API_KEY_SECRET = "specserve-api-key"
API_KEY_SECRET_KEY = "api-key"


def _container(name: str, cpu: str, memory: str, gpus: int, ports: list | None = None,
               env: list[dict] | None = None) -> dict:  # fmt: skip
    limits: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = gpus
    c: dict[str, Any] = {
        "name": name,
        "image": IMAGE,
        "env": [{"name": "SPECSERVE_HOME", "value": "/models/specserve-home"}, *copy.deepcopy(env or [])],
        "resources": {"limits": dict(limits), "requests": dict(limits)},
        "volumeMounts": [{"name": "models", "mountPath": "/models"}],
    }
    if ports:
        c["ports"] = ports
    return c


def _pull_models(names: list[str]) -> dict:
    """An init container that pulls the config's known model names onto the models volume (a no-op once they are
    there), so replicas start from the cache and the serving containers download nothing."""
    pull = " && ".join(f"specserve models pull {n}" for n in names)
    c = _container("pull-models", "1", "2Gi", 0)
    c["command"] = ["sh", "-c", pull]
    return c


def _pod(container: dict, node_selector: dict, gpus: int, pulls: list[str]) -> dict:
    spec: dict[str, Any] = {
        "containers": [container],
        # Models live on a volume (a PVC, filled by the init container or by hand with .gguf files / directories).
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "specserve-models"}}],
    }
    if pulls:
        spec["initContainers"] = [_pull_models(pulls)]
    if node_selector:
        spec["nodeSelector"] = node_selector
    if gpus:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {"spec": spec}


_STOP_MARGIN_S = 30  # after the drain: Serve's and Ray's own shutdown


def _worker_probes() -> dict:
    """KubeRay's default worker probes, pinned (it injects none where a pod sets its own) and as httpGet, which needs
    no wget in the image: ready while the node's Serve proxy is healthy (every node with a replica runs one under
    proxy_location EveryNode; it answers 503 while draining), alive while its raylet is."""
    raylet = {"httpGet": {"path": "/api/local_raylet_healthz", "port": 52365}}
    return {
        "readinessProbe": {"httpGet": {"path": "/-/healthz", "port": 8000}, "initialDelaySeconds": 10,
                           "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**raylet, "initialDelaySeconds": 30, "periodSeconds": 10, "timeoutSeconds": 5,
                          "failureThreshold": 12},
    }  # fmt: skip


GRPC_TLS_SECRET = "specserve-grpc-tls"
GRPC_TLS_PORT = 9443


def _grpc_tls_sidecar() -> dict:
    """The TLS gateway beside the head's gRPC proxy: clients reach gRPC over TLS on 9443 (Serve's proxy has no TLS
    option); the certificate comes from a `kubernetes.io/tls` Secret."""
    return {
        "name": "grpc-tls",
        "image": IMAGE,
        "command": [
            "specserve",
            "gateway",
            "--cert",
            "/tls/tls.crt",
            "--key",
            "/tls/tls.key",
            "--listen",
            f"0.0.0.0:{GRPC_TLS_PORT}",
            "--upstream",
            "127.0.0.1:9000",
        ],  # fmt: skip
        "ports": [{"containerPort": GRPC_TLS_PORT, "name": "grpc-tls"}],
        "resources": {"limits": {"cpu": "500m", "memory": "512Mi"}, "requests": {"cpu": "500m", "memory": "512Mi"}},
        "volumeMounts": [{"name": "grpc-tls", "mountPath": "/tls", "readOnly": True}],
    }


def _app(serve_config: dict) -> AppConfig:
    app = next(a for a in serve_config["applications"] if a.get("import_path") == IMPORT_PATH)
    return app_config(app.get("args") or {})


def known_names(serve_config: dict) -> list[str]:
    """The known model names (`specserve models list`) the config's models use, in order."""
    from specserve.workers.models.catalog import known_models

    known = known_models()
    refs = [r for m in _app(serve_config).models for r in (m.target, m.draft)]
    return [r for i, r in enumerate(refs) if r in known and r not in refs[:i]]


def _api_key_env(app: AppConfig) -> list[dict]:
    """The API key from its Secret (required: pods do not start without it), unless the config turns keys off."""
    if not app.auth.api_key_env:
        return []
    ref = {"secretKeyRef": {"name": API_KEY_SECRET, "key": API_KEY_SECRET_KEY}}
    return [{"name": app.auth.api_key_env, "valueFrom": ref}]


def rayservice(serve_config: dict, variant: Variant) -> dict:
    pulls = known_names(serve_config)
    app = _app(serve_config)
    key_env = _api_key_env(app)
    limits = proxy_env(app.limits.max_grpc_message_bytes, app.limits.max_request_bytes)
    # Serve's proxies run on every node with a replica (proxy_location EveryNode) and read their limits from its
    # environment.
    proxy_vars = [{"name": k, "value": v} for k, v in limits.items()]
    groups = []
    for g in _GROUPS[variant]:
        # the metrics port is scraped (manifests/monitoring/)
        container = _container("ray-worker", g["cpu"], g["memory"], g["gpus"], env=key_env + proxy_vars,
                               ports=[{"containerPort": 8080, "name": "metrics"}])  # fmt: skip
        container |= _worker_probes()
        groups.append({
            "groupName": g["name"],
            "replicas": g["min"],
            "minReplicas": g["min"],
            "maxReplicas": g["max"],
            "rayStartParams": {"metrics-export-port": "8080"},
            # Ray resources of each node of the group; with this field, rayStartParams carries no num-cpus/num-gpus/
            # memory/resources (KubeRay rejects both at once).
            "resources": {"CPU": g["cpu"], **({"GPU": str(g["gpus"])} if g["gpus"] else {}),
                          g["resource"]: str(max(g["gpus"], 1))},
            "template": _pod(container, g["node_selector"], g["gpus"], pulls),
        })  # fmt: skip
    head = _container("ray-head", "2", "8Gi", 0, ports=_HEAD_PORTS, env=key_env + proxy_vars)
    # A stopping head (an upgrade's old cluster, a deleted RayService) first drains the app: no new requests, the
    # running ones finish; KubeRay's own head probes stay (a failing head readiness probe would take the head out of
    # the head Service the workers reach it through).
    drain_s = app.scheduler.drain_timeout_s
    head["lifecycle"] = {"preStop": {"exec": {"command": ["specserve", "drain", "--timeout", f"{drain_s:g}"]}}}
    head_pod = _pod(head, {}, 0, pulls)
    head_pod["spec"]["terminationGracePeriodSeconds"] = int(drain_s) + _STOP_MARGIN_S
    if variant == "gpu":  # production shape: gRPC over TLS (the cpu variant is for kind/minikube, plaintext)
        head_pod["spec"]["containers"].append(_grpc_tls_sidecar())
        head_pod["spec"]["volumes"].append({"name": "grpc-tls", "secret": {"secretName": GRPC_TLS_SECRET}})
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": f"specserve-{variant}", "labels": {"app.kubernetes.io/name": "specserve"}},
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config, sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {"upscalingMode": "Default", "idleTimeoutSeconds": 120},
                "authOptions": {"mode": "token"},  # Ray's token authentication stays on
                "headGroupSpec": {
                    # No model work on the head: Serve's controller, proxies and the ingress only.
                    "rayStartParams": {"num-cpus": "2", "dashboard-host": "0.0.0.0", "metrics-export-port": "8080"},
                    "template": head_pod,
                },
                "workerGroupSpecs": groups,
            },
        },
    }


class _LiteralStr(str):
    pass


def _literal(dumper, data):
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|")


yaml.SafeDumper.add_representer(_LiteralStr, _literal)


def render(variant: Variant) -> str:
    config = load_serve_config(source_path(variant))
    manifest = rayservice(config, variant)
    manifest["spec"]["serveConfigV2"] = _LiteralStr(manifest["spec"]["serveConfigV2"])
    header = (f"# Generated by `specserve manifests render` from manifests/serve-{variant}.yaml: edit that file, "
              "then re-render.\n# Needs the API key in a Secret first: kubectl create secret generic "
              f"{API_KEY_SECRET} --from-literal={API_KEY_SECRET_KEY}=\"$(openssl rand -hex 32)\"\n")  # fmt: skip
    return header + yaml.safe_dump(manifest, sort_keys=False, width=120)


def write_all() -> list[Path]:
    paths = []
    for v in VARIANTS:
        output_path(v).write_text(render(v))
        paths.append(output_path(v))
    return paths


def unknown_keys(model: type[BaseModel], data: Any, path: str = "") -> list[str]:
    """Keys of `data` that `model` (a pydantic schema such as Ray's ServeDeploySchema, which ignores unknown keys)
    does not define, recursively through nested models and lists of models."""
    if not isinstance(data, dict):
        return []
    fields = {}
    for name, f in model.model_fields.items():
        fields[name] = f
        if f.alias:
            fields[f.alias] = f
    found = []
    for key, value in data.items():
        if key not in fields:
            found.append(f"{path}{key}")
            continue
        for sub in _models_in(fields[key].annotation):
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                suffix = f"[{i}]" if isinstance(value, list) else ""
                found += unknown_keys(sub, item, f"{path}{key}{suffix}.")
    return found


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
