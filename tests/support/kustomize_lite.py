"""A small kustomize: exactly the features deploy/k8s uses, for machines without kubectl.

Supported kustomization fields: `resources` (files, or directories with their own
kustomization.yaml), `namespace`, `patches` (JSON patches, RFC 6902, inline or from a
file, chosen by `target.kind` and `target.name`) and `images` (`newName`, `newTag`).
Anything else raises NotImplementedError, so a new feature in the manifests fails the
tests instead of being ignored. test_k8s.py checks that this renders what
`kubectl kustomize` renders wherever kubectl is installed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "patches", "images"}
#: Kinds without a namespace among those a deployment like ours could contain.
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass", "PriorityClass"}


def build(directory: Path) -> list[dict[str, Any]]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(spec) - SUPPORTED
    if unsupported:
        raise NotImplementedError(f"{directory}: kustomization fields {sorted(unsupported)} are not supported here")
    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += build(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for patch in spec.get("patches", []):
        _apply_patch(directory, objects, patch)
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = spec["namespace"]
    for image in spec.get("images", []):
        for container in _containers(objects):
            container["image"] = _retag(container["image"], image)
    return objects


def _apply_patch(directory: Path, objects: list[dict[str, Any]], patch: dict[str, Any]) -> None:
    if set(patch) - {"target", "patch", "path"} or set(patch["target"]) - {"kind", "name"}:
        raise NotImplementedError(f"patch fields beyond target.kind/name and patch/path: {patch}")
    text = patch["patch"] if "patch" in patch else (directory / patch["path"]).read_text()
    operations = yaml.safe_load(text)
    if not isinstance(operations, list):
        raise NotImplementedError("only JSON patches (a list of operations) are supported, not strategic merge")
    matches = [o for o in objects if all(_field(o, key) == value for key, value in patch["target"].items())]
    if not matches:
        raise ValueError(f"patch target {patch['target']} matches no resource")
    for obj in matches:
        for operation in operations:
            json_patch(obj, operation)


def _field(obj: dict[str, Any], key: str) -> Any:
    return obj["kind"] if key == "kind" else obj["metadata"]["name"]


def json_patch(document: dict[str, Any], operation: dict[str, Any]) -> None:
    """Apply one RFC 6902 `add`, `replace` or `remove` in place."""
    op, pointer = operation["op"], operation["path"]
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]
    parent: Any = document
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    if op not in ("add", "replace", "remove"):
        raise NotImplementedError(f"JSON patch op {op!r}")
    if isinstance(parent, list):
        if op == "add":
            parent.insert(len(parent) if last == "-" else int(last), copy.deepcopy(operation["value"]))
        elif op == "replace":
            parent[int(last)] = copy.deepcopy(operation["value"])
        else:
            del parent[int(last)]
        return
    if op in ("replace", "remove") and last not in parent:
        raise KeyError(f"{pointer}: nothing to {op}")
    if op == "remove":
        del parent[last]
    else:
        parent[last] = copy.deepcopy(operation["value"])


def _containers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    pods = [o["spec"]["template"]["spec"] for o in objects if "template" in o.get("spec", {})]
    return [c for pod in pods for c in pod.get("initContainers", []) + pod["containers"]]


def _retag(reference: str, image: dict[str, str]) -> str:
    if set(image) - {"name", "newName", "newTag"} or "@" in reference:
        raise NotImplementedError(f"image transformer beyond newName/newTag: {image}, {reference}")
    name, _, tag = reference.rpartition(":") if ":" in reference.rsplit("/", 1)[-1] else (reference, "", "")
    if name != image["name"]:
        return reference
    name = image.get("newName", name)
    tag = image.get("newTag", tag)
    return f"{name}:{tag}" if tag else name
