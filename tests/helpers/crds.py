"""Kubernetes CRDs to validate the manifests against (../shared/k8s/crds: KubeRay's, the Prometheus operator's), made
strict: unknown fields rejected."""

import copy
from pathlib import Path

CRDS = Path(__file__).resolve().parents[2].parent / "shared" / "k8s" / "crds"


def strict(schema):
    """additionalProperties: false on every object schema that lists properties (and allows nothing else)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not (node.get("x-kubernetes-preserve-unknown-fields"))
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema
