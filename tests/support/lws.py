"""LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, kubernetes-sigs/lws) for the Kubernetes render's tests: the
object checked offline, and its pods made as the LWS controller and webhook make them.

The check: the CRD's schema cannot be fetched on these machines (its release lives outside the package
registries), so `SCHEMA` is dgr's transcription of the v1 API's spec (LeaderWorkerSetSpec,
LeaderWorkerTemplate, RolloutStrategy, RollingUpdateConfiguration, NetworkConfig, SubGroupPolicy of LWS
v0.7-v0.9: field names, required fields, enums and bounds as its kubebuilder markers give them; unknown
fields refused, as the API server's structural pruning would drop them silently), plus the webhook's rules
that a schema cannot say (maxUnavailable and maxSurge not both 0). The two pod templates, which the CRD
embeds from core/v1, are checked against Kubernetes' own PodTemplate schema (`kubernetes-validate`, strict),
and so is the object's metadata.

The pods (`pods`): group g's leader `<name>-<g>` from leaderTemplate (workerTemplate where there is none),
its workers `<name>-<g>-<i>` (i = 1..size-1) from workerTemplate; the webhook puts LWS_LEADER_ADDRESS,
LWS_GROUP_SIZE and LWS_WORKER_INDEX (0 for the leader) first in every container's and init container's
environment; each pod is `<pod>.<name>` in DNS (subdomainPolicy Shared: one headless Service, `<name>`).
"""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate as kv

NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"    # on every pod of a set (the controller's label)
_INT_OR_PERCENT = {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": r"^\d+%$"}]}
_OBJECT = {"type": "object"}            # a core/v1 part: checked by kubernetes-validate, not here

SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": _OBJECT,
        "spec": {
            "type": "object",
            "required": ["leaderWorkerTemplate"],
            "additionalProperties": False,
            "properties": {
                "replicas": {"type": "integer", "minimum": 0, "maximum": 1000000},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "networkConfig": {
                    "type": "object", "required": ["subdomainPolicy"], "additionalProperties": False,
                    "properties": {"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}}},
                "rolloutStrategy": {
                    "type": "object", "required": ["type"], "additionalProperties": False,
                    "properties": {
                        "type": {"enum": ["RollingUpdate"]},
                        "rollingUpdateConfiguration": {
                            "type": "object", "additionalProperties": False,
                            "properties": {"partition": {"type": "integer", "minimum": 0},
                                           "maxUnavailable": _INT_OR_PERCENT, "maxSurge": _INT_OR_PERCENT}}}},
                "leaderWorkerTemplate": {
                    "type": "object", "required": ["workerTemplate"], "additionalProperties": False,
                    "properties": {
                        "leaderTemplate": _OBJECT,
                        "workerTemplate": _OBJECT,
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"enum": ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart",
                                                   "None"]},
                        "subGroupPolicy": {
                            "type": "object", "additionalProperties": False,
                            "properties": {"subGroupPolicyType": {"enum": ["LeaderWorker", "LeaderExcluded"]},
                                           "subGroupSize": {"type": "integer", "minimum": 1}}},
                        "volumeClaimTemplates": {"type": "array", "items": _OBJECT},
                        "persistentVolumeClaimRetentionPolicy": _OBJECT}}}}}}


def validate(obj: dict, k8s: str) -> None:
    """Raise where `obj` is not a LeaderWorkerSet the v1 API and its webhook accept (module doc)."""
    jsonschema.validate(obj, SCHEMA)
    update = obj["spec"].get("rolloutStrategy", {}).get("rollingUpdateConfiguration", {})
    if update.get("maxUnavailable", 1) in (0, "0%") and update.get("maxSurge", 0) in (0, "0%"):
        raise jsonschema.ValidationError("maxUnavailable must not be 0 when maxSurge is 0 (LWS webhook)")
    t = obj["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
        if key in t:
            kv.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": obj["metadata"], "template": t[key]},
                        k8s, strict=True)


def pods(obj: dict) -> list[tuple[str, int, int, dict]]:
    """(pod name, group, worker index, pod spec with the webhook's environment) for every pod of the set."""
    name, spec = obj["metadata"]["name"], obj["spec"]
    t = spec["leaderWorkerTemplate"]
    size = t.get("size", 1)
    out = []
    for g in range(spec.get("replicas", 1)):
        for i in range(size):
            template = t.get("leaderTemplate", t["workerTemplate"]) if i == 0 else t["workerTemplate"]
            pod = f"{name}-{g}" if i == 0 else f"{name}-{g}-{i}"
            podspec = copy.deepcopy(template["spec"])
            lws_env = [{"name": "LWS_LEADER_ADDRESS", "value": f"{name}-{g}.{name}"},
                       {"name": "LWS_GROUP_SIZE", "value": str(size)},
                       {"name": "LWS_WORKER_INDEX", "value": str(i)}]
            for c in podspec.get("initContainers", []) + podspec["containers"]:
                own = [e for e in c.get("env", []) if e["name"] not in {x["name"] for x in lws_env}]
                c["env"] = lws_env + own
            out.append((pod, g, i, podspec))
    return out
