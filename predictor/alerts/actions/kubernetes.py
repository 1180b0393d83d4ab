"""Kubernetes: cordon and taint a node (nothing new is scheduled there; the running job
saves on the predictor's alarm and its controller restarts it elsewhere) and create a
standby pod from a template (the spare: it holds a node's worth of GPUs so the restarted
job finds room).

A small client over the API's HTTPS with the service account's bearer token: three calls
(GET and PATCH a node, POST a pod) do not justify the official client's dependencies.
Needs RBAC: nodes get/patch, pods create (deploy/k8s/base/actions-rbac.yaml)."""
from __future__ import annotations

import copy
import json
import os
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from .errors import ActionError, NotOneNode

TAINT_KEY = "ckpt-guard.io/predicted-failure"
REASON_ANNOTATION = "ckpt-guard.io/drain-reason"
STANDBY_LABEL = "ckpt-guard.io/standby-for"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def drain_patch(node: dict[str, Any], reason: str) -> dict[str, Any]:
    """The strategic-merge patch that cordons ``node`` and adds the NoSchedule taint (the
    taints list is replaced whole by the API, so the node's other taints are carried)."""
    taints = [t for t in node.get("spec", {}).get("taints") or [] if t.get("key") != TAINT_KEY]
    taints.append({"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"})
    return {"metadata": {"annotations": {REASON_ANNOTATION: reason}},
            "spec": {"unschedulable": True, "taints": taints}}


def standby_pod(template: dict[str, Any], node: str, reason: str) -> dict[str, Any]:
    """A pod from ``template`` (a Pod manifest) named after the drained node, labelled so
    an operator finds it, and kept off that node."""
    pod = copy.deepcopy(template)
    meta = pod.setdefault("metadata", {})
    meta.pop("name", None)
    meta["generateName"] = f"ckpt-guard-standby-{node}-"[:58]
    meta.setdefault("labels", {})[STANDBY_LABEL] = node
    meta.setdefault("annotations", {})[REASON_ANNOTATION] = reason
    away = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": [node]}
    terms = (pod.setdefault("spec", {}).setdefault("affinity", {}).setdefault("nodeAffinity", {})
             .setdefault("requiredDuringSchedulingIgnoredDuringExecution", {}).setdefault("nodeSelectorTerms", []))
    if not terms:
        terms.append({"matchExpressions": []})
    for term in terms:
        term.setdefault("matchExpressions", []).append(away)
    return pod


class KubernetesNodes:
    """Cordons, taints and asks for standby pods through the Kubernetes API."""

    def __init__(self, api_url: str, token: str, ca_file: str | None = None, namespace: str = "default",
                 standby_template: dict[str, Any] | None = None, timeout_s: float = 30.0) -> None:
        self.api_url = api_url.rstrip("/")
        self.token = token
        self.ssl = ssl.create_default_context(cafile=ca_file) if self.api_url.startswith("https") else None
        self.namespace = namespace
        self.standby_template = standby_template
        self.timeout_s = timeout_s

    @classmethod
    def in_cluster(cls, standby_template: dict[str, Any] | None = None) -> "KubernetesNodes":
        """From the pod's service account (token, CA, namespace) and KUBERNETES_SERVICE_*."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host or not (SERVICE_ACCOUNT / "token").exists():
            raise ActionError("not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST or service account token): "
                              "pass --kube-api and --kube-token-file")
        return cls(f"https://{host}:{port}", (SERVICE_ACCOUNT / "token").read_text().strip(),
                   str(SERVICE_ACCOUNT / "ca.crt"), (SERVICE_ACCOUNT / "namespace").read_text().strip(),
                   standby_template)

    def _call(self, method: str, path: str, body: dict | None = None,
              content_type: str = "application/json") -> dict[str, Any]:
        req = urllib.request.Request(self.api_url + path, method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {self.token}", "Accept": "application/json",
                                              "Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self.ssl) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            said = e.read()[:500].decode(errors="replace")
            hint = ("; the service account needs nodes get/patch and pods create (deploy/k8s/base/actions-rbac.yaml)"
                    if e.code in (401, 403) else "")
            raise ActionError(f"{method} {path}: HTTP {e.code}: {said}{hint}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ActionError(f"{method} {path}: cannot reach the Kubernetes API at {self.api_url}: {e}") from None

    def node(self, node: str) -> dict[str, Any]:
        """The API's Node object named ``node``; NotOneNode when there is none."""
        try:
            found = self._call("GET", f"/api/v1/nodes/{node}")
        except ActionError as e:
            if "HTTP 404" in str(e):
                raise NotOneNode(f"{node!r} is not a node of this cluster: {e}") from None
            raise
        if found.get("kind", "Node") != "Node" or found.get("metadata", {}).get("name") != node:
            raise NotOneNode(f"GET /api/v1/nodes/{node} did not answer that one node")
        return found

    def is_out_of_service(self, node: str) -> bool:
        spec = self.node(node).get("spec", {})
        return bool(spec.get("unschedulable")) and any(t.get("key") == TAINT_KEY for t in spec.get("taints") or [])

    def plan(self, node: str, reason: str) -> list[str]:
        steps = [f"PATCH /api/v1/nodes/{node}: unschedulable=true, taint {TAINT_KEY}=true:NoSchedule"]
        if self.standby_template is not None:
            steps.append(f"POST /api/v1/namespaces/{self.namespace}/pods: a standby pod kept off {node}")
        return steps

    def drain(self, node: str, reason: str) -> list[str]:
        patch = drain_patch(self.node(node), reason)
        self._call("PATCH", f"/api/v1/nodes/{node}", patch, "application/strategic-merge-patch+json")
        return [f"cordoned {node} and tainted it {TAINT_KEY}=true:NoSchedule"]

    def request_spare(self, node: str, reason: str) -> list[str]:
        if self.standby_template is None:
            return []
        made = self._call("POST", f"/api/v1/namespaces/{self.namespace}/pods",
                          standby_pod(self.standby_template, node, reason))
        return [f"created standby pod {made.get('metadata', {}).get('name', '?')} in {self.namespace}"]
