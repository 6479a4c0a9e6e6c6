"""KubeRay manifests: rendered from the Serve config files (stale -> fail), valid against the KubeRay v1.7.0 CRDs with
unknown fields rejected, KubeRay's own rules, and serveConfigV2 valid for Ray Serve with no unknown keys."""

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from specserve.cluster.app_config import IMPORT_PATH, app_config
from specserve.cluster.serve.manifests import VARIANTS, output_path, render, unknown_keys
from tests.helpers.crds import CRDS, strict


@pytest.fixture(scope="module")
def rayservice_schema():
    path = CRDS / "ray.io_rayservices.yaml"
    if not path.is_file():
        pytest.skip(f"KubeRay CRDs not found at {path} (../shared is absent in a user's own clone)")
    crd = yaml.safe_load(path.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return strict(version["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_committed_manifest_is_rendered_from_its_serve_config(variant):
    assert output_path(variant).read_text() == render(variant), "stale: run `specserve manifests render`"


@pytest.mark.parametrize("variant", VARIANTS)
def test_manifest_validates_against_the_kuberay_crd(variant, rayservice_schema):
    manifest = yaml.safe_load(output_path(variant).read_text())
    jsonschema.validate(manifest, rayservice_schema)


def test_strict_schema_catches_a_typo(rayservice_schema):
    manifest = yaml.safe_load(output_path("gpu").read_text())
    manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        jsonschema.validate(manifest, rayservice_schema)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kuberay_rules_and_serve_config(variant):
    manifest = yaml.safe_load(output_path(variant).read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True and cluster["authOptions"]["mode"] == "token"
    head_ports = {p["name"]: p["containerPort"] for p in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
                  ["ports"]}  # fmt: skip
    assert head_ports["serve"] == 8000 and head_ports["serve-grpc"] == 9000
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"draft", "target"}
    for group in (cluster["headGroupSpec"], *groups.values()):
        if group.get("resources"):
            clash = {"num-cpus", "num-gpus", "memory", "resources"} & set(group.get("rayStartParams") or {})
            assert not clash, f"rayStartParams {clash} conflict with the group's resources field"
    serve = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve)
    assert unknown_keys(ServeDeploySchema, serve) == []
    (app,) = [a for a in serve["applications"] if a["import_path"] == IMPORT_PATH]
    cfg = app_config(app["args"])
    grpc_port = serve["grpc_options"]["port"]
    assert grpc_port == head_ports["serve-grpc"] and serve["http_options"]["port"] == head_ports["serve"]
    for model in cfg.models:  # each pool asks for the custom resource its worker group offers
        assert "target_gpu" in groups["target"]["resources"] and model.target_pool.resources == {"target_gpu": 1}
        assert "draft_gpu" in groups["draft"]["resources"] and model.draft_pool.resources == {"draft_gpu": 1}
        if variant == "gpu":
            limits = groups["target"]["template"]["spec"]["containers"][0]["resources"]["limits"]
            assert limits["nvidia.com/gpu"] >= model.target_pool.num_gpus > 0


def test_gpu_head_serves_grpc_over_tls_through_the_gateway():
    from specserve.cluster.cli.main import build_parser

    head = yaml.safe_load(output_path("gpu").read_text())["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    (sidecar,) = [c for c in head["spec"]["containers"] if c["name"] == "grpc-tls"]
    args = build_parser().parse_args(sidecar["command"][1:])  # a command line the CLI accepts
    assert args.func.__name__ == "_gateway" and args.upstream == "127.0.0.1:9000"
    assert args.listen.endswith(":9443") and {"containerPort": 9443, "name": "grpc-tls"} in sidecar["ports"]
    (mount,) = sidecar["volumeMounts"]
    volumes = {v["name"]: v for v in head["spec"]["volumes"]}
    assert volumes[mount["name"]]["secret"]["secretName"] == "specserve-grpc-tls"
    assert args.cert.startswith(mount["mountPath"]) and args.key.startswith(mount["mountPath"])


def test_unknown_keys_finds_nested_typos():
    serve = {"applications": [{"import_path": "a:b", "nmae": "x", "deployments": [{"name": "d", "num_replica": 2}]}],
             "http_option": {}}  # fmt: skip
    assert sorted(unknown_keys(ServeDeploySchema, serve)) == [
        "applications[0].deployments[0].num_replica",
        "applications[0].nmae",
        "http_option",
    ]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_pod_pulls_the_known_models_its_config_serves(variant):
    manifest = yaml.safe_load(output_path(variant).read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    serve = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    app = next(a for a in serve["applications"] if a["import_path"] == IMPORT_PATH)
    targets = [m.target for m in app_config(app["args"]).models]
    assert "smollm2-135m-instruct" in targets  # the real model, by name
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        (init,) = pod["spec"]["initContainers"]
        assert init["command"][-1] == "specserve models pull smollm2-135m-instruct"
        serving = pod["spec"]["containers"][0]
        assert init["env"] == serving["env"][:1] and init["volumeMounts"] == serving["volumeMounts"]  # same cache
        assert init["env"] == [{"name": "SPECSERVE_HOME", "value": "/models/specserve-home"}]  # and no secrets


@pytest.mark.parametrize("variant", VARIANTS)
def test_cluster_binds_wide_with_the_api_key_from_a_secret_and_the_proxy_limits(variant):
    manifest = yaml.safe_load(output_path(variant).read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    serve = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert serve["http_options"]["host"] == "0.0.0.0"  # reachable through the cluster's services
    cfg = app_config(next(a for a in serve["applications"] if a["import_path"] == IMPORT_PATH)["args"])
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:  # an ingress replica may run on any node: each one needs the key
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        ref = env[cfg.auth.api_key_env]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "specserve-api-key", "key": "api-key"} and "value" not in env[cfg.auth.api_key_env]
    head = {e["name"]: e.get("value") for e in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
    assert head["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] == str(cfg.limits.max_grpc_message_bytes)
    assert head["SPECSERVE_PROXY_MAX_REQUEST_BYTES"] == str(cfg.limits.max_request_bytes)
    assert head["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "specserve.cluster.serve.proxy_limits.proxy_middlewares"
    assert "kubectl create secret generic specserve-api-key" in output_path(variant).read_text().splitlines()[1]


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_work_with_a_proxy_on_every_node_and_the_head_drains_before_it_stops(variant):
    """kuberay #4994: worker pods probe their node's Serve proxy, so every node with a replica runs one; the head
    keeps KubeRay's probes, drains the app in preStop, and its grace period covers the drain."""
    manifest = yaml.safe_load(output_path(variant).read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    serve = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert serve["proxy_location"] == "EveryNode"
    assert (
        "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"
        in serve["grpc_options"]["grpc_servicer_functions"]
    )
    cfg = app_config(next(a for a in serve["applications"] if a["import_path"] == IMPORT_PATH)["args"])
    for group in cluster["workerGroupSpecs"]:
        worker = group["template"]["spec"]["containers"][0]
        assert worker["readinessProbe"]["httpGet"] == {"path": "/-/healthz", "port": 8000}
        assert worker["livenessProbe"]["httpGet"] == {"path": "/api/local_raylet_healthz", "port": 52365}
        assert {"containerPort": 8080, "name": "metrics"} in worker["ports"]  # the PodMonitor scrapes every pod
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
        env = {e["name"]: e.get("value") for e in worker["env"]}
        assert env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] == str(cfg.limits.max_grpc_message_bytes)  # its own proxy
    head_pod = cluster["headGroupSpec"]["template"]["spec"]
    head = head_pod["containers"][0]
    assert "readinessProbe" not in head and "livenessProbe" not in head  # KubeRay's own
    timeout = cfg.scheduler.drain_timeout_s
    assert head["lifecycle"]["preStop"]["exec"]["command"] == ["specserve", "drain", "--timeout", f"{timeout:g}"]
    assert head_pod["terminationGracePeriodSeconds"] >= timeout + 10
