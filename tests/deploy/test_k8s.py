"""The Kubernetes manifests (``deploy/k8s/``) are valid objects and agree with the server.

No cluster is needed.  The manifests are assembled the way ``kubectl apply -k deploy/k8s/<variant>``
does (each kustomization's ``resources``: files and directories, nothing else), one object list per
variant (``cpu``, ``gpu``).  Then:

* Built-in kinds are validated with kubernetes-validate, strictly (an unknown field fails), against
  the Kubernetes schemas of the oldest version we claim (1.30) and the newest the package ships.
* The custom resources are not in the Kubernetes schemas and kubernetes-validate ships none for CRDs,
  so ``ScaledObject`` (keda.sh/v1alpha1) and ``PodMonitor`` (monitoring.coreos.com/v1) are validated
  against the small JSON schemas below, written from their CRDs' OpenAPI schemas (KEDA's
  ``keda.sh_scaledobjects.yaml``, the Prometheus Operator's ``monitoring.coreos.com_podmonitors.yaml``):
  the required fields, the types and enums of the fields these manifests use, and no unknown fields
  where we write them.  The HorizontalPodAutoscaler KEDA makes from the ScaledObject is built here and
  validated with kubernetes-validate as an ``autoscaling/v2`` object.
* Cross-checks against the code: every ``MCSD_*`` variable is a setting (``server.settings``) and the
  pod's environment (the image's ``ENV`` < the ConfigMap < the container's ``env``) loads; the port,
  host and device it gives; probes on ``/health`` at that port; ``terminationGracePeriodSeconds``
  covering preStop + ``shutdown_grace`` + uvicorn's extra seconds (read from ``server/__main__.py``);
  the Service, PodMonitor and ScaledObject pointing at the Deployment's labels, port and name; and
  every ``mcsd:*`` metric the manifests name being a series ``server.metrics.ServerMetrics`` exports.
"""

from __future__ import annotations

import copy
import math
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from server.metrics import ServerMetrics
from server.settings import ENV_PREFIX, Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
VARIANTS = ("cpu", "gpu")
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
KINDS = {"Namespace", "ConfigMap", "PersistentVolumeClaim", "Service", "Deployment", "ScaledObject", "PodMonitor"}
CUSTOM_GROUPS = ("keda.sh/", "monitoring.coreos.com/")
KUSTOMIZE = "kustomize.config.k8s.io/"
# Variables the code reads outside the settings model: MCSD_CONFIG by load_settings (the preset),
# MCSD_CACHE by engine.models.fetch (the cache root).
NON_SETTING_VARS = {"MCSD_CONFIG", "MCSD_CACHE"}
SHUTDOWN_MARGIN_S = 3  # process exit after uvicorn's graceful timeout (lifespan shutdown, engine join)
MIN_LIVENESS_WINDOW_S = 60
TYPE_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
                 "summary": ("", "_sum", "_count")}


# ---------------------------------------------------------------------------------------- loading
def _docs(path: Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} holds no YAML document"
    return docs


def _build(directory: Path, seen: set[Path]) -> list[dict]:
    """The objects ``kubectl apply -k directory`` applies (resources only: the test refuses any other
    kustomize feature, which it would have to emulate)."""
    (kust,) = _docs(directory / "kustomization.yaml")
    assert kust["apiVersion"].startswith(KUSTOMIZE) and kust["kind"] == "Kustomization"
    assert set(kust) <= {"apiVersion", "kind", "resources"}, f"{directory}: kustomize features this test ignores"
    seen.add(directory / "kustomization.yaml")
    out = []
    for ref in kust["resources"]:
        target = (directory / ref).resolve()
        if target.is_dir():
            out += _build(target, seen)
        else:
            assert target.is_file(), f"{directory}/kustomization.yaml lists missing {ref}"
            seen.add(target)
            out += _docs(target)
    return out


def _variants() -> tuple[dict[str, list[dict]], set[Path]]:
    seen: set[Path] = set()
    return {v: _build(K8S / v, seen) for v in VARIANTS}, seen


BUILT, REACHED = _variants()
ALL = [doc for v in VARIANTS for doc in BUILT[v]]


def _one(variant: str, kind: str) -> dict:
    found = [d for d in BUILT[variant] if d["kind"] == kind]
    assert len(found) == 1, f"{variant}: {len(found)} {kind} objects"
    return found[0]


def _unique(kind: str) -> list[dict]:
    """Each distinct object of ``kind`` over the variants (the shared ones once)."""
    out: list[dict] = []
    for doc in ALL:
        if doc["kind"] == kind and doc not in out:
            out.append(doc)
    return out


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _dockerfile() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [(op.upper(), rest.strip()) for op, _, rest in (line.partition(" ") for line in lines)
            if op and not op.startswith("#")]


def _image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for op, rest in _dockerfile():
        if op == "ENV":
            env.update(item.partition("=")[::2] for item in shlex.split(rest))
    assert env, "no ENV in the Dockerfile"
    return env


def _pod_env(variant: str) -> dict[str, str]:
    """The container's environment as the server sees it: the image's ENV, then the ConfigMaps of
    ``envFrom``, then ``env`` (literal values; a Secret's variable gets a stand-in value)."""
    container = _container(_one(variant, "Deployment"))
    env = _image_env()
    maps = {d["metadata"]["name"]: d for d in BUILT[variant] if d["kind"] == "ConfigMap"}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in maps, f"{variant}: envFrom names ConfigMap {name!r}, which is not in the manifests"
        env.update(maps[name]["data"])
    for var in container.get("env", []):
        env[var["name"]] = var["value"] if "value" in var else "from-a-secret"
    return env


def _settings(variant: str):
    return load_settings([], _pod_env(variant))


def _seconds(value: str) -> float:
    """A Docker duration (``10m``, ``30s``, ``1h30m``) in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"cannot read duration {value!r}"
    return sum(float(n) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[u] for n, u in parts)


def _exported_series() -> dict[str, str]:
    """Every series name the server's registry exports (``name_total`` for a counter, ``_bucket``...
    for a histogram) -> the metric's type, from :class:`server.metrics.ServerMetrics` itself."""
    out = {}
    for family in ServerMetrics().registry.collect():
        for suffix in TYPE_SUFFIXES[family.type]:
            out[family.name + suffix] = family.type
    return out


METRIC_REF = re.compile(r"(?<![\w:.-])mcsd:[A-Za-z0-9_:]+")


# ---------------------------------------------------------------------------------------- schemas
# From the CRDs' openAPIV3Schema: required fields and the types of what these manifests set.  The
# parts we write are closed (additionalProperties: false) so a misspelt key fails here, not silently
# in the cluster; their other documented fields are listed so that using them is not an error.
_INT32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
_META = {"type": "object", "required": ["name", "namespace"],
         "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                        "namespace": {"type": "string"}, "labels": {"type": "object",
                                                                    "additionalProperties": {"type": "string"}},
                        "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}
_HPA_RULES = {"type": "object", "additionalProperties": False, "properties": {
    "stabilizationWindowSeconds": {**_INT32, "minimum": 0, "maximum": 3600},
    "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
    "tolerance": {"type": ["string", "number"]},
    "policies": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["type", "value", "periodSeconds"], "additionalProperties": False,
        "properties": {"type": {"enum": ["Pods", "Percent"]}, "value": {**_INT32, "minimum": 1},
                       "periodSeconds": {**_INT32, "minimum": 1, "maximum": 1800}}}}}}
SCALED_OBJECT_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"}, "metadata": _META,
        "spec": {
            "type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                   "properties": {"name": {"type": "string"}, "kind": {"type": "string"},
                                                  "apiVersion": {"type": "string"},
                                                  "envSourceContainerName": {"type": "string"}}},
                "minReplicaCount": {**_INT32, "minimum": 0}, "maxReplicaCount": {**_INT32, "minimum": 1},
                "idleReplicaCount": _INT32, "pollingInterval": {**_INT32, "minimum": 1},
                "cooldownPeriod": _INT32, "initialCooldownPeriod": _INT32,
                "fallback": {"type": "object", "required": ["failureThreshold", "replicas"]},
                "advanced": {"type": "object", "additionalProperties": False, "properties": {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "scalingModifiers": {"type": "object"},
                    "horizontalPodAutoscalerConfig": {"type": "object", "additionalProperties": False, "properties": {
                        "name": {"type": "string"},
                        "behavior": {"type": "object", "additionalProperties": False,
                                     "properties": {"scaleUp": _HPA_RULES, "scaleDown": _HPA_RULES}}}}}},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                    "properties": {
                        "type": {"type": "string"}, "name": {"type": "string"},
                        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                        "useCachedMetrics": {"type": "boolean"},
                        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                        "authenticationRef": {"type": "object", "required": ["name"]}},
                    # KEDA's prometheus scaler: serverAddress, query and threshold are required.
                    "if": {"properties": {"type": {"const": "prometheus"}}},
                    "then": {"properties": {"metadata": {
                        "required": ["serverAddress", "query", "threshold"], "additionalProperties": False,
                        "properties": {k: {"type": "string"} for k in (
                            "serverAddress", "query", "threshold", "activationThreshold", "namespace",
                            "customHeaders", "ignoreNullValues", "unsafeSsl", "queryParameters",
                            "timeout", "authModes")}}}}}}}}}}
_DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
POD_MONITOR_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"}, "metadata": _META,
        "spec": {
            "type": "object", "required": ["selector"], "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "additionalProperties": False, "properties": {
                    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "matchExpressions": {"type": "array"}}},
                "namespaceSelector": {"type": "object"}, "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "sampleLimit": {"type": "integer"}, "targetLimit": {"type": "integer"},
                "attachMetadata": {"type": "object"}, "scrapeClass": {"type": "string", "minLength": 1},
                "podMetricsEndpoints": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False, "properties": {
                        "port": {"type": "string"}, "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
                        "path": {"type": "string"}, "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                        "interval": {"type": "string", "pattern": _DURATION},
                        "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                        "honorLabels": {"type": "boolean"}, "honorTimestamps": {"type": "boolean"},
                        "params": {"type": "object"}, "relabelings": {"type": "array"},
                        "metricRelabelings": {"type": "array"}, "authorization": {"type": "object"},
                        "tlsConfig": {"type": "object"}, "enableHttp2": {"type": "boolean"},
                        "filterRunning": {"type": "boolean"}, "followRedirects": {"type": "boolean"}}}}}}}}
CUSTOM_SCHEMAS = {"ScaledObject": SCALED_OBJECT_SCHEMA, "PodMonitor": POD_MONITOR_SCHEMA}


def _validate_custom(doc: dict) -> None:
    jsonschema.Draft202012Validator(CUSTOM_SCHEMAS[doc["kind"]]).validate(doc)


def _keda_hpa(scaled: dict) -> dict:
    """The autoscaling/v2 HorizontalPodAutoscaler KEDA creates for ``scaled`` (one External metric per
    trigger, named s<i>-<type>, with the trigger's threshold as its target)."""
    spec = scaled["spec"]
    metrics = []
    for i, trig in enumerate(spec["triggers"]):
        kind = trig.get("metricType", "AverageValue")
        target = {"type": kind, {"AverageValue": "averageValue", "Value": "value"}[kind]: trig["metadata"]["threshold"]}
        metrics.append({"type": "External", "external": {
            "metric": {"name": f"s{i}-{trig['type']}",
                       "selector": {"matchLabels": {"scaledobject.keda.sh/name": scaled["metadata"]["name"]}}},
            "target": target}})
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": f"keda-hpa-{scaled['metadata']['name']}", "namespace": scaled["metadata"]["namespace"]},
           "spec": {"scaleTargetRef": {k: spec["scaleTargetRef"][k] for k in ("apiVersion", "kind", "name")},
                    "minReplicas": spec.get("minReplicaCount", 1), "maxReplicas": spec.get("maxReplicaCount", 100),
                    "metrics": metrics}}
    behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
    if behavior:
        hpa["spec"]["behavior"] = behavior
    return hpa


# ---------------------------------------------------------------------------------------- layout
def test_every_variant_has_each_kind_once():
    assert len(ALL) > 0
    for variant in VARIANTS:
        kinds = [d["kind"] for d in BUILT[variant]]
        assert sorted(kinds) == sorted(KINDS), f"{variant}: {sorted(kinds)}"


def test_every_yaml_file_is_applied():
    files = {p.resolve() for p in K8S.rglob("*.y*ml")}
    assert files and files == REACHED, f"not in any kustomization: {sorted(map(str, files - REACHED))}"


def test_namespaced_objects_share_the_namespace():
    namespaces = _unique("Namespace")
    assert len(namespaces) == 1
    name = namespaces[0]["metadata"]["name"]
    for doc in ALL:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == name, f"{doc['kind']} {doc['metadata']['name']}"


# ---------------------------------------------------------------------------------------- schemas
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_kinds_validate(version):
    checked = set()
    for doc in ALL:
        if not doc["apiVersion"].startswith(CUSTOM_GROUPS):
            kubernetes_validate.validate(doc, version, strict=True)
            checked.add(doc["kind"])
    assert checked == KINDS - set(CUSTOM_SCHEMAS)


def test_schema_validation_rejects_mistakes():
    """The validators in use do reject a misspelt field and a missing required one."""
    deployment = copy.deepcopy(_one("cpu", "Deployment"))
    c = _container(deployment)
    c["readinesProbe"] = c.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)
    for kind, (path, key) in {"PodMonitor": (("spec",), "selector"),
                              "ScaledObject": (("spec", "triggers", 0, "metadata"), "query")}.items():
        doc = copy.deepcopy(_unique(kind)[0])
        node = doc
        for step in path:
            node = node[step]
        del node[key]
        with pytest.raises(jsonschema.ValidationError):
            _validate_custom(doc)
    scaled = copy.deepcopy(_unique("ScaledObject")[0])
    scaled["spec"]["maxReplicas"] = 3  # the HPA's spelling, not KEDA's
    with pytest.raises(jsonschema.ValidationError):
        _validate_custom(scaled)


def test_custom_resources_validate():
    checked = set()
    for doc in ALL:
        if doc["apiVersion"].startswith(CUSTOM_GROUPS):
            _validate_custom(doc)
            checked.add(doc["kind"])
    assert checked == set(CUSTOM_SCHEMAS)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_hpa_keda_makes_validates(version):
    (scaled,) = _unique("ScaledObject")
    hpa = _keda_hpa(scaled)
    assert hpa["spec"]["behavior"]["scaleDown"]["policies"]
    kubernetes_validate.validate(hpa, version, strict=True)


# ---------------------------------------------------------------------------------------- settings
def test_env_names_are_settings():
    fields = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    names = set()
    for doc in ALL:
        if doc["kind"] == "ConfigMap":
            names |= set(doc["data"])
        if doc["kind"] == "Deployment":
            c = _container(doc)
            names |= {v["name"] for v in c.get("env", [])}
    names = {n for n in names if n.startswith(ENV_PREFIX)}
    assert {"MCSD_SHUTDOWN_GRACE", "MCSD_THREADS", "MCSD_DEVICE"} <= names
    unknown = names - fields - NON_SETTING_VARS
    assert not unknown, f"not server settings: {sorted(unknown)}"


def test_non_setting_variables_are_read_by_the_code(monkeypatch):
    from engine.models.fetch import default_cache_dir

    for variant in VARIANTS:
        cache = _pod_env(variant)["MCSD_CACHE"]
        monkeypatch.setenv("MCSD_CACHE", cache)
        assert default_cache_dir() == Path(cache)
        preset = _pod_env(variant)["MCSD_CONFIG"]
        assert load_settings([], {"MCSD_CONFIG": preset}).model, f"preset {preset!r} names no model"
    assert load_settings([], {}).model is None  # so the model above came from the preset


@pytest.mark.parametrize("variant", VARIANTS)
def test_pod_environment_gives_a_reachable_server(variant):
    settings = _settings(variant)
    c = _container(_one(variant, "Deployment"))
    (port,) = [p for p in c["ports"] if p["name"] == "http"]
    assert settings.port == port["containerPort"]
    assert settings.host == "0.0.0.0"
    assert not settings.health_auth, "the probes send no API key"
    assert not settings.metrics_auth, "the PodMonitor sends no API key"
    assert settings.model, "no model: the server would refuse to start"


def test_service_links_stay_out_of_the_settings():
    """A Service named ``x`` injects ``X_SERVICE_HOST``, ``X_PORT``... into pods that have service
    links; for ``mcsd-server`` those are MCSD_SERVER_*, so links are off and would not collide."""
    fields = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    for variant in VARIANTS:
        assert _one(variant, "Deployment")["spec"]["template"]["spec"]["enableServiceLinks"] is False
    for svc in _unique("Service"):
        stem = svc["metadata"]["name"].upper().replace("-", "_")
        injected = {f"{stem}_SERVICE_HOST", f"{stem}_SERVICE_PORT", f"{stem}_PORT"}
        for p in svc["spec"]["ports"]:
            injected |= {f"{stem}_SERVICE_PORT_{p['name'].upper()}",
                         *(f"{stem}_PORT_{p['port']}_TCP{s}" for s in ("", "_PROTO", "_PORT", "_ADDR"))}
        assert not injected & (fields | NON_SETTING_VARS)


# ---------------------------------------------------------------------------------------- variants
def test_gpu_variant_requests_a_gpu_and_runs_on_cuda():
    c = _container(_one("gpu", "Deployment"))
    for part in ("requests", "limits"):
        assert int(c["resources"][part]["nvidia.com/gpu"]) == 1
    assert _pod_env("gpu")["MCSD_DEVICE"] == "cuda"
    assert _settings("gpu").device == "cuda"
    assert c["image"].rpartition(":")[2] == "cuda", "the GPU variant needs the CUDA image"


def test_cpu_variant_has_no_gpu_and_threads_fit_its_cpus():
    c = _container(_one("cpu", "Deployment"))
    assert not any("gpu" in key for part in c["resources"].values() for key in part)
    settings = _settings("cpu")
    assert settings.device == "cpu"
    assert settings.threads and settings.threads <= float(c["resources"]["requests"]["cpu"])
    assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"]
    assert "cuda" not in c["image"]


# ---------------------------------------------------------------------------------------- probes
def _port_number(container: dict, port: Any) -> int:
    if isinstance(port, int):
        return port
    (found,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return found


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_hit_health_on_the_server_port(variant):
    c = _container(_one(variant, "Deployment"))
    port = _settings(variant).port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert _port_number(c, get["port"]) == port, probe
        assert get.get("scheme", "HTTP") == "HTTP", probe
    # The first start fetches the models: at least the image's HEALTHCHECK start period.
    (health,) = [rest for op, rest in _dockerfile() if op == "HEALTHCHECK"]
    start_period = _seconds(re.search(r"--start-period=(\S+)", health).group(1))
    startup = c["startupProbe"]
    startup_window = startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"]
    assert startup_window >= start_period, (startup_window, start_period)
    # Liveness: lenient, so a busy engine is not restarted.
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= MIN_LIVENESS_WINDOW_S
    assert live["timeoutSeconds"] >= 5
    ready = c["readinessProbe"]
    assert ready["periodSeconds"] * ready["failureThreshold"] <= live["periodSeconds"] * live["failureThreshold"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_termination_grace_covers_the_shutdown(variant):
    pod = _one(variant, "Deployment")["spec"]["template"]["spec"]
    c = _container(_one(variant, "Deployment"))
    grace = _settings(variant).shutdown_grace
    assert grace == float(_pod_env(variant)["MCSD_SHUTDOWN_GRACE"]) > 0
    # uvicorn's timeout_graceful_shutdown, as server/__main__.py sets it.
    main = (ROOT / "server" / "__main__.py").read_text()
    extra = re.search(r"timeout_graceful_shutdown=int\(settings\.shutdown_grace\)\s*\+\s*(\d+)", main)
    assert extra, "server/__main__.py no longer sets timeout_graceful_shutdown = shutdown_grace + N"
    pre_stop = c.get("lifecycle", {}).get("preStop", {})
    if "exec" in pre_stop:
        cmd = pre_stop["exec"]["command"]
        assert cmd[0] == "sleep" and len(cmd) == 2
        sleep = float(cmd[1])
    else:
        sleep = pre_stop.get("sleep", {}).get("seconds", 0)
    needed = sleep + math.ceil(grace) + int(extra.group(1)) + SHUTDOWN_MARGIN_S
    assert pod["terminationGracePeriodSeconds"] >= needed, (pod["terminationGracePeriodSeconds"], needed)


# ---------------------------------------------------------------------------------------- wiring
def _selects(selector: dict, labels: dict) -> bool:
    assert selector, "empty selector"
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("variant", VARIANTS)
def test_deployment_selects_its_pods(variant):
    spec = _one(variant, "Deployment")["spec"]
    assert _selects(spec["selector"]["matchLabels"], spec["template"]["metadata"]["labels"])
    assert "replicas" not in spec, "the autoscaler owns the replica count; apply would reset it"


@pytest.mark.parametrize("variant", VARIANTS)
def test_service_targets_the_pods_port(variant):
    svc, dep = _one(variant, "Service"), _one(variant, "Deployment")
    assert _selects(svc["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])
    c = _container(dep)
    (port,) = svc["spec"]["ports"]
    assert port["name"] == "http" and port["port"] == 8000
    assert _port_number(c, port["targetPort"]) == _settings(variant).port


@pytest.mark.parametrize("variant", VARIANTS)
def test_podmonitor_scrapes_metrics_on_http(variant):
    mon, dep = _one(variant, "PodMonitor"), _one(variant, "Deployment")
    assert _selects(mon["spec"]["selector"]["matchLabels"], dep["spec"]["template"]["metadata"]["labels"])
    (endpoint,) = mon["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    assert _port_number(_container(dep), endpoint["port"]) == _settings(variant).port


@pytest.mark.parametrize("variant", VARIANTS)
def test_autoscaler_targets_the_deployment(variant):
    scaled, dep = _one(variant, "ScaledObject"), _one(variant, "Deployment")
    ref = scaled["spec"]["scaleTargetRef"]
    assert ref["name"] == dep["metadata"]["name"]
    assert ref.get("kind", "Deployment") == "Deployment" and ref.get("apiVersion", "apps/v1") == dep["apiVersion"]
    assert scaled["metadata"]["namespace"] == dep["metadata"]["namespace"]
    assert scaled["spec"]["minReplicaCount"] >= 1, "no scale to zero: a cold start takes minutes"
    assert scaled["spec"]["maxReplicaCount"] >= scaled["spec"]["minReplicaCount"]
    # Replicas on several nodes share the cache claim only if it is ReadWriteMany.
    pvc = _one(variant, "PersistentVolumeClaim")
    if scaled["spec"]["maxReplicaCount"] > 1:
        assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    assert not _unique("HorizontalPodAutoscaler"), "KEDA makes the HPA; a second one would fight it"


@pytest.mark.parametrize("variant", VARIANTS)
def test_cache_volume_is_the_claim_at_mcsd_cache(variant):
    dep, pvc = _one(variant, "Deployment"), _one(variant, "PersistentVolumeClaim")
    c = _container(dep)
    (mount,) = c["volumeMounts"]
    assert mount["mountPath"] == _pod_env(variant)["MCSD_CACHE"]
    (volume,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]


# ---------------------------------------------------------------------------------------- metrics
def test_metric_names_exist_in_the_server():
    """Every ``mcsd:*`` name in deploy/k8s (manifests, comments, README) is a series the server exports."""
    series = _exported_series()
    assert "mcsd:num_requests_waiting" in series  # the registry was read
    named = {m for p in K8S.rglob("*") if p.is_file() for m in METRIC_REF.findall(p.read_text())}
    assert named, "no metric named in deploy/k8s"
    missing = named - set(series)
    assert not missing, f"not exported by server.metrics: {sorted(missing)}"


def test_autoscaler_scales_on_the_queue_depth_gauge():
    series = _exported_series()
    (scaled,) = _unique("ScaledObject")
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    query = trigger["metadata"]["query"]
    used = set(METRIC_REF.findall(query))
    assert used == {"mcsd:num_requests_waiting"}, used
    assert all(series[m] == "gauge" for m in used), "a counter would need rate()"
    assert float(trigger["metadata"]["threshold"]) > 0


def test_autoscaler_query_selects_labels_the_podmonitor_adds():
    (scaled,) = _unique("ScaledObject")
    (mon,) = _unique("PodMonitor")
    dep = _one("cpu", "Deployment")
    assert all(d["spec"]["template"]["metadata"]["labels"] == dep["spec"]["template"]["metadata"]["labels"]
               for d in _unique("Deployment"))
    labels = dep["spec"]["template"]["metadata"]["labels"]
    query = scaled["spec"]["triggers"][0]["metadata"]["query"]
    matchers = dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', query))
    assert matchers, "the query selects no labels: it would count other apps' pods"
    target_labels = {re.sub(r"[^A-Za-z0-9_]", "_", k): k for k in mon["spec"].get("podTargetLabels", [])}
    for name, value in matchers.items():
        if name == "namespace":
            assert value == dep["metadata"]["namespace"]
        else:
            assert name in target_labels, f"{name} is not a label the PodMonitor puts on the series"
            assert labels[target_labels[name]] == value
