#!/usr/bin/env python3
"""Validates minimesh's Kubernetes manifests without a cluster.

Each kustomization (crds, deploy/base, deploy/examples/demo, deploy/monitoring) is built, with
`kubectl kustomize` when kubectl is installed and otherwise with the small
built-in renderer below (resources, namespace, images: all our
kustomizations use). Every object it yields, and every file given with
--extra, is validated against the Kubernetes OpenAPI schemas of each version
in --versions (strict: unknown fields are errors) by the `kubernetes-validate`
package, installed from PyPI when missing. DestinationRules (the rule files
in examples/rules/ and any in the manifests) are validated against the
schema of our own CRD in crds/, with unknown fields refused as the API
server's strict field validation refuses them. The Prometheus operator's
ServiceMonitor and PodMonitor (deploy/monitoring) are checked against a schema
of the fields they use, written from the operator's API reference.

    python3 deploy/validate.py [--versions 1.33,1.37] [--extra FILE ...]

Prints one line per object; exits 1 if any is invalid.
"""

import argparse
import glob
import importlib
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KUSTOMIZATIONS = ["crds", "deploy/base", "deploy/examples/demo", "deploy/monitoring"]
CRD_FILE = "crds/destinationrules.minimesh.io.yaml"
RULE_FILES = "examples/rules/*.yaml"


# Packages installed by this script go here (not into the system Python,
# which may be externally managed), inside the build directory.
DEPS = os.path.join(ROOT, "target", "python-deps")
sys.path.insert(0, DEPS)


def ensure(module, package):
    """Imports `module`, installing `package` from PyPI into DEPS first if needed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        print(f"installing {package} from PyPI into {os.path.relpath(DEPS, ROOT)}", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet",
             "--disable-pip-version-check", "--target", DEPS, package],
            check=True,
        )
        importlib.invalidate_caches()
        return importlib.import_module(module)


def build_builtin(directory, yaml):
    """Renders a kustomization: resources (files or directories), namespace, images."""
    path = os.path.join(directory, "kustomization.yaml")
    with open(path) as f:
        k = yaml.safe_load(f)
    unknown = set(k) - {"apiVersion", "kind", "resources", "namespace", "images"}
    if unknown:
        raise ValueError(f"{path}: fields the built-in renderer does not know: {sorted(unknown)}")
    objects = []
    for r in k.get("resources", []):
        target = os.path.normpath(os.path.join(directory, r))
        if os.path.isdir(target):
            objects.extend(build_builtin(target, yaml))
        elif os.path.isfile(target):
            with open(target) as f:
                objects.extend(d for d in yaml.safe_load_all(f) if d)
        else:
            raise ValueError(f"{path}: resource {r!r} does not exist")
    cluster_scoped = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding",
                      "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"}
    for o in objects:
        if "namespace" in k and o.get("kind") not in cluster_scoped:
            o.setdefault("metadata", {})["namespace"] = k["namespace"]
        for image in k.get("images", []):
            for pod in pod_specs(o):
                for c in pod.get("containers", []) + pod.get("initContainers", []):
                    if c.get("image") == image["name"]:
                        c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return objects


def pod_specs(o):
    spec = o.get("spec") or {}
    template = spec.get("template") or {}
    return [template["spec"]] if "spec" in template else []


def build(directory, yaml):
    full = os.path.join(ROOT, directory)
    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "kustomize", full], check=True,
                             capture_output=True, text=True).stdout
        return [d for d in yaml.safe_load_all(out) if d], "kubectl kustomize"
    return build_builtin(full, yaml), "built-in renderer (kubectl not installed)"


# The Prometheus operator's kinds (deploy/monitoring): their CRDs are not
# bundled here, so the fields our manifests use are checked against the
# operator's API reference (monitoring.coreos.com/v1), unknown fields refused.
_SELECTOR = {
    "type": "object",
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "required": ["key", "operator"],
            "properties": {
                "key": {"type": "string"},
                "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                "values": {"type": "array", "items": {"type": "string"}},
            }}},
    },
}
_ENDPOINT = {
    "type": "object", "required": ["port"],
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string"},
        "interval": {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
        "scheme": {"enum": ["http", "https"]},
    },
}
_META = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string"}, "namespace": {"type": "string"},
    "labels": {"type": "object", "additionalProperties": {"type": "string"}}}}
_NAMESPACES = {"type": "object", "properties": {
    "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}}
MONITORING = {
    "ServiceMonitor": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
            "metadata": _META,
            "spec": {"type": "object", "required": ["selector"], "properties": {
                "selector": _SELECTOR, "namespaceSelector": _NAMESPACES,
                "endpoints": {"type": "array", "items": _ENDPOINT}}},
        },
    },
    "PodMonitor": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"},
            "metadata": _META,
            "spec": {"type": "object", "required": ["selector"], "properties": {
                "selector": _SELECTOR, "namespaceSelector": _NAMESPACES,
                "podMetricsEndpoints": {"type": "array", "items": _ENDPOINT}}},
        },
    },
}


def strict(schema):
    """The schema with unknown fields refused wherever the API server's strict
    field validation (kubectl's default) refuses them: every object that
    lists its properties and does not preserve unknown fields. JSON Schema
    alone lets them through, so `simpel: RANDOM` passed."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if (out.get("type") == "object" and "properties" in out
                and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", default="1.33,1.37",
                        help="Kubernetes versions whose schemas to validate against")
    parser.add_argument("--extra", nargs="*", default=[],
                        help="more manifest files to validate")
    args = parser.parse_args()

    yaml = ensure("yaml", "pyyaml")
    kv = ensure("kubernetes_validate", "kubernetes-validate")
    jsonschema = ensure("jsonschema", "jsonschema")

    with open(os.path.join(ROOT, CRD_FILE)) as f:
        crd = yaml.safe_load(f)
    rule_schema = strict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    # The fields every object has, which the API server adds to a CRD's schema.
    for field, kind in (("apiVersion", "string"), ("kind", "string"), ("metadata", "object")):
        rule_schema["properties"].setdefault(field, {"type": kind})
    rule_group = crd["spec"]["group"] + "/" + crd["spec"]["versions"][0]["name"]

    sources = []  # (where, object)
    for k in KUSTOMIZATIONS:
        objects, how = build(k, yaml)
        print(f"{k}: {len(objects)} objects ({how})")
        sources.extend((k, o) for o in objects)
    for path in sorted(glob.glob(os.path.join(ROOT, RULE_FILES))) + args.extra:
        with open(path) as f:
            sources.extend((os.path.relpath(path, ROOT), d) for d in yaml.safe_load_all(f) if d)

    failures = 0
    for where, obj in sources:
        name = f"{obj.get('kind')} {obj.get('metadata', {}).get('namespace', '')}/{obj.get('metadata', {}).get('name')}"
        try:
            if obj.get("apiVersion") == rule_group and obj.get("kind") == "DestinationRule":
                jsonschema.validate(obj, rule_schema)
                checked = "CRD schema, unknown fields refused"
            elif obj.get("apiVersion", "").startswith("monitoring.coreos.com/"):
                jsonschema.validate(obj, strict(MONITORING.get(obj.get("kind"), {"not": {}})))
                checked = "the Prometheus operator's API reference, unknown fields refused"
            else:
                for v in args.versions.split(","):
                    kv.validate(obj, v, strict=True)
                checked = f"Kubernetes {args.versions} (strict)"
            print(f"ok    {where}: {name} [{checked}]")
        except Exception as e:  # every kind of failure is reported the same way
            failures += 1
            path = "/".join(str(p) for p in getattr(e, "absolute_path", []) or [])
            message = getattr(e, "message", None) or str(e) or type(e).__name__
            print(f"FAIL  {where}: {name}: {path or '(object)'}: {message}")
    print(f"{len(sources) - failures} valid, {failures} invalid")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
