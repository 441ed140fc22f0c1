"""Offline validation of the LeaderWorkerSet manifests in deploy/lws (make validate-deploy).

The LeaderWorkerSet v1 schema is generated here from the API's types (LeaderWorkerSetSpec,
LeaderWorkerTemplate, RolloutStrategy, RollingUpdateConfiguration, SubGroupPolicy,
NetworkConfig of sigs.k8s.io/lws api/leaderworkerset/v1, with their kubebuilder enums and
minimums), and its embedded Kubernetes types (PodTemplateSpec, PersistentVolumeClaim,
ObjectMeta, StatefulSetPersistentVolumeClaimRetentionPolicy) refer to the Kubernetes schemas
that PyPI kubernetes-validate bundles, so a pod template is checked field by field as a
StatefulSet's is. Unknown fields are errors (strict, as validate-deploy runs kubernetes-validate).
Every other kind in the files goes to kubernetes-validate itself; a kind it has no schema for
(an llm-d InferencePool) is reported as not validated.

usage: PYTHONPATH=<kubernetes-validate dir> python3 tools/validate_lws.py FILE...
"""
import sys

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import yaml
from importlib import resources
import json
from referencing import Registry, Resource

K8S_VERSION = "1.37.0"
DEFS = "/api/_definitions.json#/$defs/"


def ref(name):
    return {"$ref": DEFS + name}


def obj(props, required=()):
    return {"type": "object", "properties": props, "required": list(required),
            "additionalProperties": False}


def enum(*values):
    return {"type": "string", "enum": list(values)}


int32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
int_or_string = {"oneOf": [{"type": "integer"}, {"type": "string"}]}

# api/leaderworkerset/v1/leaderworkerset_types.go, field by field.
rolling_update = obj({
    "partition": {**int32, "minimum": 0},
    "maxUnavailable": int_or_string,
    "maxSurge": int_or_string,
})
rollout = obj({
    "type": enum("RollingUpdate"),
    "rollingUpdateConfiguration": rolling_update,
}, required=["type"])
sub_group_policy = obj({
    "subGroupPolicyType": enum("LeaderWorker", "LeaderExcluded"),
    "subGroupSize": {**int32, "minimum": 1},
})
template = obj({
    "leaderTemplate": ref("io.k8s.api.core.v1.PodTemplateSpec"),
    "workerTemplate": ref("io.k8s.api.core.v1.PodTemplateSpec"),
    "size": {**int32, "minimum": 1},
    "restartPolicy": enum("Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart",
                          "None"),
    "subGroupPolicy": sub_group_policy,
    "volumeClaimTemplates": {"type": "array",
                             "items": ref("io.k8s.api.core.v1.PersistentVolumeClaim")},
    "persistentVolumeClaimRetentionPolicy":
        ref("io.k8s.api.apps.v1.StatefulSetPersistentVolumeClaimRetentionPolicy"),
}, required=["workerTemplate"])
spec = obj({
    "replicas": {**int32, "minimum": 0},
    "leaderWorkerTemplate": template,
    "rolloutStrategy": rollout,
    "startupPolicy": enum("LeaderCreated", "LeaderReady"),
    "networkConfig": obj({"subdomainPolicy": enum("Shared", "UniquePerReplica")},
                         required=["subdomainPolicy"]),
}, required=["leaderWorkerTemplate"])
LWS_SCHEMA = obj({
    "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
    "kind": {"const": "LeaderWorkerSet"},
    "metadata": ref("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"),
    "spec": spec,
    "status": {"type": "object"},
}, required=["apiVersion", "kind", "metadata", "spec"])
LWS_SCHEMA["$schema"] = "https://json-schema.org/draft/2020-12/schema"
LWS_SCHEMA["$id"] = "https://kubernetes.io/api/leaderworkerset-v1.json"  # (refs: /api/_definitions.json)


def k8s_definitions():
    d = (resources.files("kubernetes_validate") / "kubernetes-json-schema" /
         f"v{K8S_VERSION}-local-strict" / "_definitions.json")
    return json.loads(d.read_text())


def lws_validator():
    registry = Resource.from_contents(k8s_definitions()) @ Registry()
    return jsonschema.validators.Draft202012Validator(LWS_SCHEMA, registry=registry)


def check_semantics(doc):
    """What the LWS webhook checks beyond the schema, for our manifests."""
    t = doc["spec"]["leaderWorkerTemplate"]
    size = t.get("size", 1)
    sg = t.get("subGroupPolicy")
    if sg and "subGroupSize" in sg:
        n = sg["subGroupSize"]
        assert n <= size and (size % n == 0 or (size - 1) % n == 0), \
            f"subGroupSize {n} does not divide size {size} (or size - 1)"


def main(files):
    validator = lws_validator()
    failed = 0
    unchecked = []
    for f in files:
        for doc in yaml.safe_load_all(open(f)):
            if not doc:
                continue
            name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            try:
                if doc.get("kind") == "LeaderWorkerSet":
                    validator.validate(doc)
                    check_semantics(doc)
                else:
                    try:
                        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
                    except kubernetes_validate.utils.SchemaNotFoundError:
                        unchecked.append(f"{f}: {name}")
            except (jsonschema.ValidationError, kubernetes_validate.ValidationError,
                    AssertionError) as e:
                path = ".".join(str(p) for p in getattr(e, "absolute_path", []))
                print(f"ERROR {f}: {name}: {path}: {getattr(e, 'message', e)}")
                failed += 1
    if failed:
        sys.exit(1)
    for u in unchecked:
        print(f"validate_lws: no schema, not validated: {u}")
    print(f"validate_lws: {len(files)} file(s) valid")


if __name__ == "__main__":
    main(sys.argv[1:])
