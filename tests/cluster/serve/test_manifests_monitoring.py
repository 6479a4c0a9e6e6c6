"""manifests/monitoring/podmonitor.yaml: valid against the Prometheus operator's PodMonitor CRD (../shared/k8s/crds,
unknown fields rejected as test_manifests.py does for KubeRay's), and pointed at what the RayService manifests run:
Ray's metrics port by name, on KubeRay's pods of those RayServices."""

import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from specserve.cluster.serve.manifests import VARIANTS, output_path
from tests.helpers.crds import CRDS, strict

PODMONITOR = Path(__file__).resolve().parents[3] / "manifests" / "monitoring" / "podmonitor.yaml"


@pytest.fixture(scope="module")
def podmonitor_schema():
    path = CRDS / "monitoring.coreos.com_podmonitors.yaml"
    if not path.is_file():
        pytest.skip(f"Prometheus operator CRDs not found at {path} (../shared is absent in a user's own clone)")
    crd = yaml.safe_load(path.read_text())
    assert crd["spec"]["group"] == "monitoring.coreos.com" and crd["spec"]["names"]["kind"] == "PodMonitor"
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return strict(version["schema"]["openAPIV3Schema"])


@pytest.fixture(scope="module")
def podmonitor():
    return yaml.safe_load(PODMONITOR.read_text())


def test_podmonitor_validates_against_the_crd(podmonitor, podmonitor_schema):
    assert (podmonitor["apiVersion"], podmonitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    jsonschema.validate(podmonitor, podmonitor_schema)


def test_strict_schema_catches_a_typo(podmonitor, podmonitor_schema):
    bad = yaml.safe_load(PODMONITOR.read_text())
    bad["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError, match="intervall"):
        jsonschema.validate(bad, podmonitor_schema)


@pytest.mark.parametrize("variant", VARIANTS)
def test_podmonitor_scrapes_the_rayservices_metrics_port(podmonitor, variant):
    manifest = yaml.safe_load(output_path(variant).read_text())
    head = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]
    port = next(p for p in head["template"]["spec"]["containers"][0]["ports"] if p["name"] == "metrics")
    endpoint = podmonitor["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
    # Ray serves its metrics there; KubeRay gives worker pods the same port and name by default.
    assert int(head["rayStartParams"]["metrics-export-port"]) == port["containerPort"] == 8080
    keep = next(r for r in endpoint["relabelings"] if r.get("action") == "keep")
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_label_ray_io_cluster"]
    name = manifest["metadata"]["name"]
    assert re.fullmatch(keep["regex"], f"{name}-x7k2p")  # KubeRay's RayCluster of it: the name and 5 characters
    assert not re.fullmatch(keep["regex"], "other-service-x7k2p")


def test_podmonitor_selects_kuberays_ray_pods(podmonitor):
    # Labels KubeRay puts on every head and worker pod it creates.
    assert podmonitor["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/created-by": "kuberay-operator",
        "ray.io/is-ray-node": "yes",
    }
