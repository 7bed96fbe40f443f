"""Offline checks of k8s/: a renderer for the kustomize subset the manifests use, and a
validator: KubeRay objects against the KubeRay v1.7 CRDs (the v1 openAPIV3Schema, with
properties that have a default dropped from `required`, nulls removed and unknown fields
rejected, as `kubectl --validate=strict` would), core objects with kubernetes-validate in
strict mode.

    .venv/bin/python -m tests.k8s_tools k8s/ k8s/overlays/postgres ...
"""
from __future__ import annotations

import copy
import functools
import os
import sys
from pathlib import Path

import jsonpatch
import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[1]
# the KubeRay v1.7 CRDs: shared/ beside the checkout (as in CI), or RELAYTRAIN_KUBERAY_CRDS
CRDS = Path(os.environ.get("RELAYTRAIN_KUBERAY_CRDS") or ROOT.parent / "shared" / "kuberay" / "crds")
K8S_VERSION = "1.33.0"
KUSTOMIZE_FIELDS = {"apiVersion", "kind", "namespace", "resources", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}


def render(folder: Path) -> list[dict]:
    """The objects `kubectl apply -k folder` would apply (resources, JSON 6902 patches, namespace)."""
    folder = Path(folder)
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(k) - KUSTOMIZE_FIELDS
    if unknown:
        raise ValueError(f"{folder}/kustomization.yaml uses {sorted(unknown)}, which this renderer does not know")
    objs: list[dict] = []
    for res in k.get("resources", []):
        path = folder / res
        if path.is_dir():
            objs += render(path)
        else:
            objs += [o for o in yaml.safe_load_all(path.read_text()) if o]
    for patch in k.get("patches", []):
        ops = yaml.safe_load((folder / patch["path"]).read_text())
        if not isinstance(ops, list):
            raise ValueError(f"{patch['path']}: only JSON 6902 patches (a list of operations) are used here")
        hits = [i for i, o in enumerate(objs) if _matches(o, patch["target"])]
        if not hits:
            raise ValueError(f"patch {patch['path']} matches no object ({patch['target']})")
        for i in hits:
            objs[i] = jsonpatch.apply_patch(objs[i], ops)
    if k.get("namespace"):
        for o in objs:
            if o["kind"] not in CLUSTER_SCOPED:
                o.setdefault("metadata", {})["namespace"] = k["namespace"]
    return objs


def _matches(obj: dict, target: dict) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    checks = {"kind": obj["kind"], "name": obj["metadata"]["name"], "group": group, "version": version}
    return all(checks[key] == value for key, value in target.items())


@functools.lru_cache(maxsize=None)
def crd_schema(kind: str) -> dict:
    for path in CRDS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
            return _strict(copy.deepcopy(v1["schema"]["openAPIV3Schema"]))
    raise FileNotFoundError(f"no KubeRay CRD for kind {kind} in {CRDS}: put shared/kuberay/crds beside the "
                            "checkout or set RELAYTRAIN_KUBERAY_CRDS to the folder of ray.io_*.yaml")


def _strict(node):
    """Defaults make a property optional; unknown properties are errors."""
    if isinstance(node, dict):
        props = node.get("properties")
        if isinstance(props, dict):
            if "required" in node:
                node["required"] = [r for r in node["required"] if "default" not in props.get(r, {})]
            if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
        for key, value in node.items():
            if key in ("properties", "patternProperties"):
                for sub in value.values():
                    _strict(sub)
            elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
                _strict(value)
            elif key in ("anyOf", "allOf", "oneOf"):
                for sub in value:
                    _strict(sub)
    return node


def _without_nulls(obj):
    if isinstance(obj, dict):
        return {k: _without_nulls(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_without_nulls(v) for v in obj]
    return obj


def validate(obj: dict) -> list[str]:
    """Problems with one object, as 'Kind/name: path: message' lines (empty: valid)."""
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    if str(obj.get("apiVersion", "")).startswith("ray.io/"):
        schema = crd_schema(obj["kind"])
        errors = jsonschema.Draft7Validator(schema).iter_errors(_without_nulls(obj))
        return [f"{name}: {'.'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message}"
                for e in sorted(errors, key=lambda e: list(map(str, e.absolute_path)))]
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{name}: {'.'.join(str(p) for p in e.path) or '(top)'}: {e.message}"]
    return []


def main(folders: list[str]) -> int:
    bad = 0
    for folder in folders:
        objs = render(Path(folder))
        for obj in objs:
            for line in validate(obj):
                print(line)
                bad += 1
        print(f"{folder}: {len(objs)} objects, {bad} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or [str(ROOT / "k8s")]))
