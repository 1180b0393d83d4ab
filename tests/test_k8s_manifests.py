"""deploy/k8s: the core kinds validated (strict: unknown fields refused) against the
Kubernetes API schemas kubernetes-validate ships, for the oldest and newest API versions
we claim; the pieces that must agree with each other or with the code checked to agree.

The custom resources (ServiceMonitor, PrometheusRule, PyTorchJob) against their CRDs'
openAPIV3Schema, vendored in tests/data/crds (no registry package ships them; each one's .md
names its source), also strict: a key the schema does not know fails (the API server would
prune it without a word). The PyTorchJob schema is abridged: its pod templates are checked
as core PodTemplates instead; the alert rules also pass promtool.

Not tested here (no cluster, no kustomize): `kustomize build`, the CRDs' CEL rules
(x-kubernetes-validations), and the responder against a real API server."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

from ckpt.inprocess.launch import parse  # noqa: E402
from predictor.alerts.actions.kubernetes import TAINT_KEY, drain_patch, standby_pod  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
VERSIONS = ("1.29", "1.37")   # the oldest we claim (docs/kubernetes.md) and the newest schemas shipped
CUSTOM = {"monitoring.coreos.com/v1", "kubeflow.org/v1"}
CRDS = REPO / "tests" / "data" / "crds"
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule",
               ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor",
               ("kubeflow.org/v1", "PyTorchJob"): "pytorchjob"}   # abridged: pod templates checked as core
RULE_FILES = (REPO / "deploy" / "prometheus" / "rules.yml", REPO / "deploy" / "agents" / "alerts.yml")


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def base() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    return [d for f in kustomization["resources"] for d in documents(K8S / "base" / f)]


def prometheus_rule() -> dict:
    """The PrometheusRule the base ships: the promtool-tested rule files' groups."""
    groups = [g for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"]]
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "ckpt-guard", "namespace": "ckpt-guard", "labels": {"role": "alert-rules"}},
            "spec": {"groups": groups}}


def validate(doc: dict) -> None:
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(str(p) for p in e.absolute_path)
            pytest.fail(f"{doc['kind']} {doc['metadata'].get('name')} (Kubernetes {version}) at {path}: "
                        f"{e.message}")


def crd_schema(doc: dict) -> dict:
    return json.loads((CRDS / f"{CRD_SCHEMAS[doc['apiVersion'], doc['kind']]}.schema.json").read_text())


def int_or_string(schema: object) -> object:
    """The schema with Kubernetes' `x-kubernetes-int-or-string` spelled as JSON Schema (anyOf)."""
    if isinstance(schema, list):
        return [int_or_string(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: int_or_string(v) for k, v in schema.items()}
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def unknown_keys(schema: dict, value: object, path: str = "") -> list[str]:
    """Keys a structural schema does not declare: the API server prunes them without a word,
    so a misspelt field would pass a plain validation. `metadata` is the API server's own."""
    if isinstance(value, list):
        return [k for i, v in enumerate(value) for k in unknown_keys(schema.get("items", {}), v, f"{path}[{i}]")]
    if not isinstance(value, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    for key, item in value.items():
        if path == "" and key == "metadata":
            continue
        if key in schema.get("properties", {}):
            found += unknown_keys(schema["properties"][key], item, f"{path}.{key}")
        elif isinstance(schema.get("additionalProperties"), dict):
            found += unknown_keys(schema["additionalProperties"], item, f"{path}.{key}")
        else:
            found.append(f"{path}.{key}")
    return found


def validate_custom(doc: dict) -> None:
    """A custom resource against its vendored CRD schema: types, patterns, required; then unknown keys."""
    schema = crd_schema(doc)
    errors = sorted(jsonschema.Draft7Validator(int_or_string(schema)).iter_errors(doc), key=lambda e: e.path)
    name = f"{doc['kind']} {doc['metadata'].get('name')}"
    if errors:
        pytest.fail("\n".join(f"{name} at {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors))
    assert not unknown_keys(schema, doc), f"{name}: fields its CRD does not know: {unknown_keys(schema, doc)}"


def custom_resources() -> list[dict]:
    return [d for d in base() + documents(K8S / "training" / "pytorchjob.yaml")
            if (d["apiVersion"], d["kind"]) in CRD_SCHEMAS]


def test_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in (K8S / "base").glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize("doc", [d for d in base() if d["apiVersion"] not in CUSTOM],
                         ids=lambda d: f"{d['kind']}-{d['metadata']['name']}")
def test_core_kinds_match_the_api_schema(doc: dict) -> None:
    validate(doc)


@pytest.mark.parametrize("doc", custom_resources(), ids=lambda d: f"{d['kind']}-{d['metadata']['name']}")
def test_custom_resources_match_their_crd_schema(doc: dict) -> None:
    validate_custom(doc)


def test_crd_validation_refuses_a_wrong_type_and_an_unknown_key() -> None:
    [rule] = [d for d in custom_resources() if d["kind"] == "PrometheusRule"]
    wrong_type = json.loads(json.dumps(rule))
    wrong_type["spec"]["groups"][0]["rules"][0]["labels"] = {"severity": 1}
    with pytest.raises(pytest.fail.Exception, match=r"groups/0/rules/0/labels/severity: 1 is not of type 'string'"):
        validate_custom(wrong_type)
    misspelt = json.loads(json.dumps(rule))
    misspelt["spec"]["groups"][0]["rules"][0]["annotation"] = {"summary": "x"}
    with pytest.raises(AssertionError, match=r"\.spec\.groups\[0\]\.rules\[0\]\.annotation"):
        validate_custom(misspelt)
    int_expr = json.loads(json.dumps(rule))
    int_expr["spec"]["groups"][0]["rules"][0]["expr"] = 1   # int-or-string: an integer is a valid expr
    validate_custom(int_expr)


def test_prometheusrule_is_the_tested_rules(tmp_path: Path) -> None:
    [shipped] = [d for d in base() if d["kind"] == "PrometheusRule"]
    assert shipped == prometheus_rule(), "regenerate: python -m tests.test_k8s_manifests"
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: install the Debian package prometheus")
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(shipped["spec"]))
    res = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_servicemonitor_finds_the_services_ports() -> None:
    docs = base()
    [monitor] = [d for d in docs if d["kind"] == "ServiceMonitor"]
    wanted = set(monitor["spec"]["selector"]["matchExpressions"][0]["values"])
    services = [d for d in docs if d["kind"] == "Service" and d["metadata"]["labels"]["app.kubernetes.io/name"]
                in wanted]
    assert {s["metadata"]["labels"]["app.kubernetes.io/name"] for s in services} == wanted
    ports = {p["name"] for s in services for p in s["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
    # the rules' up{job=...} series: prometheus-operator names the job after the Service
    assert {"ckpt-guard-predictor", "ckpt-guard-agents"} <= {s["metadata"]["name"] for s in services}


def test_pods_use_the_secret_keys_and_the_responders_taint() -> None:
    docs = base()
    [agent] = [d for d in docs if d["kind"] == "DaemonSet"]
    pod = agent["spec"]["template"]["spec"]
    assert any(t["key"] == TAINT_KEY for t in pod["tolerations"])
    assert "resources" not in pod["containers"][0] or "nvidia.com/gpu" not in str(pod["containers"][0]["resources"])
    for d in docs:
        for vol in d.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            if "secret" in vol:
                assert vol["secret"]["secretName"] == "ckpt-guard-tokens"
                assert {i["key"] for i in vol["secret"]["items"]} <= {"tokens", "agent"}
    [actions] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "ckpt-guard-actions"]
    assert "--apply" not in actions["spec"]["template"]["spec"]["containers"][0]["command"]   # dry run as shipped


def test_standby_pod_and_drain_patch_match_the_api_schema() -> None:
    [config] = [d for d in base() if d["kind"] == "ConfigMap"]
    pod = standby_pod(json.loads(config["data"]["standby-pod.json"]), "gpu-node-7", "ckpt-guard: test")
    validate(pod)
    assert pod["metadata"]["generateName"].startswith("ckpt-guard-standby-gpu-node-7-")
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-7"},
            "spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}}
    patch = drain_patch(node, "ckpt-guard: alertmanager:GPUFailurePredicted risk=0.9")
    validate({**node, "metadata": {**node["metadata"], **patch["metadata"]}, "spec": patch["spec"]})
    assert [t["key"] for t in patch["spec"]["taints"]] == ["nvidia.com/gpu", TAINT_KEY]   # others kept
    assert drain_patch({"spec": patch["spec"]}, "again")["spec"]["taints"] == patch["spec"]["taints"]  # no duplicate


def test_apply_overlay_only_adds_apply() -> None:
    overlay = K8S / "overlays" / "apply-drains"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../../base"]
    [patch] = [d for p in kustomization["patches"] for d in documents(overlay / p["path"])]
    [actions] = [d for d in base() if d["kind"] == "Deployment" and d["metadata"]["name"] == patch["metadata"]["name"]]
    [container] = actions["spec"]["template"]["spec"]["containers"]
    [patched] = patch["spec"]["template"]["spec"]["containers"]
    assert patched == {"name": container["name"], "command": container["command"] + ["--apply"]}


def test_training_job_pods_match_the_api_schema() -> None:
    [job] = documents(K8S / "training" / "pytorchjob.yaml")
    for role, replica in job["spec"]["pytorchReplicaSpecs"].items():
        template = replica["template"]
        validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()},
                  "template": template})
        [container] = template["spec"]["containers"]
        shm = next(v for v in template["spec"]["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
        assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert {"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"} in container["ports"]
        node = next(e for e in container["env"] if e["name"] == "CKPT_GUARD_NODE")
        assert node["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_inprocess_job_matches_the_api_schema_and_the_launcher() -> None:
    """deploy/k8s/training/inprocess-job.yaml: an Indexed Job whose pods are node launchers; one
    failed pod fails its index only (no restart of the set); the job launcher is reached at pod 0
    through the headless Service; the job's secret is a Secret mounted as a file, not argv."""
    docs = documents(K8S / "training" / "inprocess-job.yaml")
    for doc in docs:
        validate(doc)
    [service] = [d for d in docs if d["kind"] == "Service"]
    [job] = [d for d in docs if d["kind"] == "Job"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert spec["backoffLimitPerIndex"] == 0 and pod["restartPolicy"] == "Never"
    assert [r["action"] for r in spec["podFailurePolicy"]["rules"]] == ["FailIndex"]
    assert pod["subdomain"] == service["metadata"]["name"]
    [container] = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    command = [c.replace("$(NODE_RANK)", "0") for c in container["command"]]
    assert command[:3] == ["python", "-m", "ckpt.inprocess.launch"]
    args = parse(command[3:])
    assert args.nodes == spec["completions"] and 0 < args.spare_nodes < args.nodes
    assert args.master_addr == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert args.master_port == service["spec"]["ports"][0]["port"] == container["ports"][0]["containerPort"]
    [secret] = [v for v in pod["volumes"] if "secret" in v]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == secret["name"]]
    assert secret["secret"]["defaultMode"] == 0o400 and mount["readOnly"]
    assert env["CKPT_JOB_SECRET_FILE"]["value"] == f"{mount['mountPath']}/{secret['secret']['items'][0]['path']}"
    assert "CKPT_JOB_SECRET" not in env and not any("secret" in c.lower() for c in container["command"])


if __name__ == "__main__":   # regenerate deploy/k8s/base/prometheusrule.yaml
    sys.stdout.write((K8S / "base" / "prometheusrule.yaml").read_text().split("apiVersion:", 1)[0])
    sys.stdout.write(yaml.safe_dump(prometheus_rule(), sort_keys=False, width=120, allow_unicode=True))
