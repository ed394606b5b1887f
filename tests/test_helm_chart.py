"""The Helm chart in deploy/helm/kvtier: lint it, render it, validate what it renders.

Everything runs offline: the Helm SDK's Python bindings render and lint (no helm binary, no
cluster), kubernetes-validate checks core objects against the bundled OpenAPI schemas of
KUBE_VERSION, and the custom resources (RayCluster, ServiceMonitor) are checked by shape
here, with their pod templates validated as core PodTemplates. The ConfigMap's TOML files
are loaded with kvtier's own config loader, so a misspelled setting name fails here.
"""

from __future__ import annotations

import base64
import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvtier.rpc import auth as auth_lib
from kvtier.runtime.config import ControllerConfig, WorkerConfig, load_config

try:
    import helm_python as helm
except Exception as exc:  # the package loads libhelm_c while it imports
    if type(exc).__name__ != "HelmLibraryError":
        raise
    pytest.skip(
        f"helm-python-sdk is installed but its native library libhelm_c did not load: {exc}",
        allow_module_level=True,
    )

CHART_DIR = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "kvtier"
# A recent release that kubernetes-validate ships schemas for offline; the chart's
# kubeVersion (>=1.31) is the floor, this is what the objects are checked against.
KUBE_VERSION = "1.35.0"
RELEASE = "kv"
NAMESPACE = "serving"
VALUE_SETS = ("default", "external-redis-tls", "gpu16")
CORE_KINDS = frozenset(
    {
        "ConfigMap",
        "Secret",
        "Deployment",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
        "StatefulSet",
    }
)
CRD_KINDS = frozenset({"RayCluster", "ServiceMonitor"})
GIB = 1 << 30


# --- rendering -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def ci_values(value_set: str) -> dict[str, Any]:
    return yaml.safe_load((CHART_DIR / "ci" / f"{value_set}-values.yaml").read_text()) or {}


def render(chart: Any, values: dict[str, Any]) -> list[dict[str, Any]]:
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return [
        obj
        for path, text in sorted(manifests.items())
        if path.endswith((".yaml", ".yml"))
        for obj in yaml.safe_load_all(text)
        if obj
    ]


@pytest.fixture(scope="module")
def rendered(chart: Any) -> dict[str, list[dict[str, Any]]]:
    return {value_set: render(chart, ci_values(value_set)) for value_set in VALUE_SETS}


@pytest.fixture(scope="module")
def merged(chart: Any) -> dict[str, dict[str, Any]]:
    """The values each set renders with (chart defaults coalesced with the set)."""
    return {value_set: chart.merge_values(ci_values(value_set)) for value_set in VALUE_SETS}


def of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objs if obj["kind"] == kind]


def named(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [obj for obj in of_kind(objs, kind) if obj["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name!r}, found {len(matches)}"
    return matches[0]


def controller_deployment(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return named(objs, "Deployment", f"{RELEASE}-kvtier-controller")


def raycluster(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (cluster,) = of_kind(objs, "RayCluster")
    return cluster


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod_spec["containers"] if c["name"] == name]
    return found


def env_of(ctr: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in ctr.get("env", [])}


def literal_env(ctr: dict[str, Any]) -> dict[str, str]:
    """The container's plain ``value`` variables, as the process would see them."""
    return {name: item["value"] for name, item in env_of(ctr).items() if "value" in item}


def pod_specs(objs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every pod spec the chart renders, including those inside the RayCluster."""
    for obj in objs:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            yield obj["metadata"]["name"], obj["spec"]["template"]["spec"]
        elif obj["kind"] == "RayCluster":
            yield "ray head", obj["spec"]["headGroupSpec"]["template"]["spec"]
            for group in obj["spec"]["workerGroupSpecs"]:
                yield f"ray group {group['groupName']}", group["template"]["spec"]


def config_toml(objs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    configmap = named(objs, "ConfigMap", f"{RELEASE}-kvtier-config")
    return tomllib.loads(configmap["data"][key])


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels + matchExpressions) selects ``labels``."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        present, value = expr["key"] in labels, labels.get(expr["key"])
        ok = {
            "In": present and value in expr.get("values", []),
            "NotIn": not present or value not in expr.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[expr["operator"]]
        if not ok:
            return False
    return True


def walk(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every scalar in a rendered object with its path of keys and indexes."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from walk(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from walk(value, (*path, index))
    else:
        yield path, node


# --- lint and Kubernetes schemas ------------------------------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_lint_strict_passes(value_set: str) -> None:
    report = helm.lint(
        CHART_DIR, ci_values(value_set), strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}"
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 = warning, 3 = error
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_core_objects_validate_against_kubernetes_schemas(
    rendered: dict[str, list[dict[str, Any]]], value_set: str
) -> None:
    objs = rendered[value_set]
    kinds = {obj["kind"] for obj in objs}
    assert kinds <= CORE_KINDS | CRD_KINDS, f"unchecked kinds rendered: {kinds - CORE_KINDS - CRD_KINDS}"
    assert {"ConfigMap", "Deployment", "Service", "NetworkPolicy", "ServiceAccount"} <= kinds
    for obj in objs:
        assert obj["metadata"].get("labels", {}).get("app.kubernetes.io/instance") == RELEASE, obj["kind"]
        if obj["kind"] in CORE_KINDS:
            where = f"{obj['kind']}/{obj['metadata']['name']}"
            try:
                kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{where} at {'.'.join(map(str, exc.path))}: {exc.message}")


EDGE_VALUES = {
    "no frontend or admin peers": {"networkPolicy": {"frontends": [], "admins": []}},
    "autoscaling": {
        "ray": {"autoscaling": {"enabled": True}, "worker": {"minReplicas": 0, "maxReplicas": 4}}
    },
    "nvme on emptyDir": {"kvCache": {"nvme": {"gibPerGpu": 50}}},
    "existing service accounts, no policies": {
        "serviceAccount": {"create": False, "controllerName": "ops-kvtier"},
        "networkPolicy": {"enabled": False},
        "controller": {"pdb": {"enabled": False}, "replicas": 1},
    },
}


@pytest.mark.parametrize("values", EDGE_VALUES.values(), ids=EDGE_VALUES.keys())
def test_edge_values_render_valid_objects(chart: Any, values: dict[str, Any]) -> None:
    objs = render(chart, values)
    for obj in objs:
        if obj["kind"] in CORE_KINDS:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    for policy in of_kind(objs, "NetworkPolicy"):
        assert all(rule.get("from") for rule in policy["spec"]["ingress"]), policy["metadata"]["name"]
    cluster = raycluster(objs)
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    # Only the autoscaler sidecar needs an API token.
    assert head["automountServiceAccountToken"] is cluster["spec"]["enableInTreeAutoscaling"]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_raycluster_has_the_kuberay_shape(
    rendered: dict[str, list[dict[str, Any]]], merged: dict[str, dict[str, Any]], value_set: str
) -> None:
    cluster, worker_values = raycluster(rendered[value_set]), merged[value_set]["ray"]["worker"]
    assert cluster["apiVersion"] == "ray.io/v1"
    spec = cluster["spec"]
    assert spec["rayVersion"] == merged[value_set]["ray"]["rayVersion"]
    head = spec["headGroupSpec"]
    assert all(isinstance(v, str) for v in head["rayStartParams"].values()), "rayStartParams are strings"
    assert head["template"]["spec"]["containers"][0]["name"] == "ray-head"
    (group,) = spec["workerGroupSpecs"]
    for field in ("groupName", "replicas", "minReplicas", "maxReplicas", "template", "rayStartParams"):
        assert field in group, field
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert group["replicas"] == worker_values["replicas"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == worker_values["gpusPerWorker"]
    assert group["rayStartParams"]["num-gpus"] == str(worker_values["gpusPerWorker"])
    # Pod templates inside the custom resource must still be valid core pod templates.
    for template in (head["template"], group["template"]):
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "t"},
            "template": template,
        }
        kubernetes_validate.validate(pod_template, KUBE_VERSION, strict=True)


def test_raycluster_head_runs_the_worker_pool(rendered: dict[str, list[dict[str, Any]]]) -> None:
    head = raycluster(rendered["default"])["spec"]["headGroupSpec"]["template"]["spec"]
    pool = container(head, "worker-pool")
    assert pool["command"] == [
        "kvtier",
        "worker-pool",
        "--ray-address",
        "auto",
        "--config",
        "/etc/kvtier/config.toml",
        # Auth is on: each actor's id is a free key of the worker-tokens Secret, listed and read
        # on the GPU worker pods (the only pods mounting it), never on the head.
        "--worker-tokens-dir",
        "/etc/kvtier/worker-tokens",
    ]
    assert "worker-tokens" not in {m["name"] for m in pool["volumeMounts"]}
    tokens_dir = pool["command"][pool["command"].index("--worker-tokens-dir") + 1]
    for group in raycluster(rendered["default"])["spec"]["workerGroupSpecs"]:
        mounts = {m["name"]: m for m in container(group["template"]["spec"], "ray-worker")["volumeMounts"]}
        assert mounts["worker-tokens"]["mountPath"] == tokens_dir
    # Ray's "auto" address needs the head's session directory and GCS address.
    assert literal_env(pool)["RAY_ADDRESS"] == "127.0.0.1:6379"
    head_tmp = {m["mountPath"]: m["name"] for m in container(head, "ray-head")["volumeMounts"]}
    pool_tmp = {m["mountPath"]: m["name"] for m in pool["volumeMounts"]}
    assert head_tmp["/tmp"] == pool_tmp["/tmp"]


def test_gpu16_places_sixteen_gpus_with_nvme_host_paths(
    rendered: dict[str, list[dict[str, Any]]], merged: dict[str, dict[str, Any]]
) -> None:
    objs, values = rendered["gpu16"], merged["gpu16"]
    (group,) = raycluster(objs)["spec"]["workerGroupSpecs"]
    gpus = group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert group["replicas"] * gpus == 16
    pod = group["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["nvme"]["hostPath"] == values["kvCache"]["nvme"]["volume"]["hostPath"]
    mounts = {m["name"]: m["mountPath"] for m in container(pod, "ray-worker")["volumeMounts"]}
    worker = config_toml(objs, "worker.toml")
    assert mounts["nvme"] == worker["nvme_dir"] == values["kvCache"]["nvme"]["mountPath"]
    assert worker["nvme_bytes"] == f"{values['kvCache']['nvme']['gibPerGpu']}GiB"
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "llama-3-1-8b-instruct"
    # Page files sit in gpu<i> subdirectories of the node's path: one worker pod per node.
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert selects(term["labelSelector"], group["template"]["metadata"]["labels"])
    ports = {p["name"]: p["containerPort"] for p in container(pod, "ray-worker")["ports"]}
    assert [ports[f"grpc-{i}"] for i in range(gpus)] == [worker["port"] + i for i in range(gpus)]


def test_servicemonitor_is_off_by_default_and_scrapes_the_controller_when_on(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    assert of_kind(rendered["default"], "ServiceMonitor") == []
    objs = rendered["gpu16"]
    (monitor,) = of_kind(objs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    service = named(objs, "Service", f"{RELEASE}-kvtier-controller")
    assert selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    assert "metrics" in service_ports


# --- controller ------------------------------------------------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_controller_probes_are_native_grpc(
    rendered: dict[str, list[dict[str, Any]]], merged: dict[str, dict[str, Any]], value_set: str
) -> None:
    values = merged[value_set]
    ctr = container(controller_deployment(rendered[value_set])["spec"]["template"]["spec"], "controller")
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    # The kubelet's gRPC probe cannot speak TLS: with TLS on, probes use the health-only port.
    expected = ports["health"] if values["tls"]["enabled"] else ports["grpc"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert set(ctr[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, probe
        assert ctr[probe]["grpc"]["port"] == expected, probe


def test_controller_runs_kvtier_controller_with_the_mounted_config(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    deployment = controller_deployment(rendered["default"])
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    ctr = container(pod, "controller")
    assert ctr["command"] == ["kvtier", "controller", "--config", "/etc/kvtier/config.toml"]
    (mount,) = [m for m in ctr["volumeMounts"] if m["mountPath"] == "/etc/kvtier/config.toml"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["items"] == [{"key": "controller.toml", "path": mount["subPath"]}]
    assert pod["automountServiceAccountToken"] is False
    pdb = named(rendered["default"], "PodDisruptionBudget", f"{RELEASE}-kvtier-controller")
    assert selects(pdb["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert pdb["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_configmap_holds_real_kvtier_settings(
    rendered: dict[str, list[dict[str, Any]]],
    merged: dict[str, dict[str, Any]],
    value_set: str,
    tmp_path: Path,
) -> None:
    """Each TOML file, with its pods' literal KVTIER_* env, loads as the process's config."""
    objs, values = rendered[value_set], merged[value_set]
    controller_ctr = container(controller_deployment(objs)["spec"]["template"]["spec"], "controller")
    controller_env = literal_env(controller_ctr)
    (group,) = raycluster(objs)["spec"]["workerGroupSpecs"]
    worker_env = literal_env(container(group["template"]["spec"], "ray-worker"))
    configs = {}
    for cls, key, env in (
        (ControllerConfig, "controller.toml", controller_env),
        (WorkerConfig, "worker.toml", worker_env),
    ):
        path = tmp_path / key
        path.write_text(named(objs, "ConfigMap", f"{RELEASE}-kvtier-config")["data"][key])
        configs[key] = load_config(cls, file=path, env=env)
    controller, worker = configs["controller.toml"], configs["worker.toml"]
    assert (controller.host, controller.port) == ("0.0.0.0", values["controller"]["port"])
    assert controller.metrics_port == values["controller"]["metricsPort"]
    otlp = values["monitoring"]["otlpEndpoint"] or None
    assert controller.otlp_endpoint == otlp and worker.otlp_endpoint == otlp
    assert worker.controller_address == f"{RELEASE}-kvtier-controller.{NAMESPACE}.svc:{controller.port}"
    assert worker.dram_bytes == values["kvCache"]["dramGiBPerGpu"] * GIB
    assert worker.nvme_bytes == values["kvCache"]["nvme"]["gibPerGpu"] * GIB
    assert worker.session_hold_fraction == values["kvCache"]["sessionHoldFraction"]
    assert controller.session_hold_max_s == values["controller"]["sessionHoldMaxS"]
    valkey = f"{RELEASE}-kvtier-valkey.{NAMESPACE}.svc:6379/0"
    if values["redis"]["mode"] == "external":
        assert controller.redis_url is None  # the whole URL comes from a Secret: KVTIER_REDIS_URL
        assert "secretKeyRef" in env_of(controller_ctr)["KVTIER_REDIS_URL"]["valueFrom"]
    else:  # the bundled Valkey always has a password
        # The kubelet expands $(KVTIER_REDIS_PASSWORD), itself from a secretKeyRef.
        assert controller.redis_url == f"redis://:$(KVTIER_REDIS_PASSWORD)@{valkey}"


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_worker_memory_covers_the_dram_tier(
    rendered: dict[str, list[dict[str, Any]]], merged: dict[str, dict[str, Any]], value_set: str
) -> None:
    values = merged[value_set]
    worker_values = values["ray"]["worker"]
    (group,) = raycluster(rendered[value_set])["spec"]["workerGroupSpecs"]
    ctr = container(group["template"]["spec"], "ray-worker")
    dram_gib = values["kvCache"]["dramGiBPerGpu"]
    assert literal_env(ctr)["KVTIER_DRAM_BYTES"] == f"{dram_gib}GiB"
    expected = worker_values["gpusPerWorker"] * dram_gib + worker_values["hostOverheadGiB"]
    expected += worker_values["shmGiB"]
    resources = ctr["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == f"{expected}Gi"


# --- redis, secrets, TLS, auth ---------------------------------------------------------


def test_external_redis_renders_no_valkey(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objs = rendered["external-redis-tls"]
    assert of_kind(objs, "StatefulSet") == []
    assert not [obj for obj in objs if "valkey" in obj["metadata"]["name"]]
    assert "redis_url" not in config_toml(objs, "controller.toml")
    ctr = container(controller_deployment(objs)["spec"]["template"]["spec"], "controller")
    assert env_of(ctr)["KVTIER_REDIS_URL"]["valueFrom"] == {
        "secretKeyRef": {"name": "kvtier-redis-url", "key": "url"}
    }
    (statefulset,) = of_kind(rendered["default"], "StatefulSet")
    assert statefulset["spec"]["replicas"] == 1


def test_an_external_redis_cluster_url_reaches_the_controller_config(chart: Any) -> None:
    url = "redis+cluster://redis-0.redis:6379,redis-1.redis:6379"
    objs = render(chart, {"redis": {"mode": "external", "external": {"url": url}}})
    assert config_toml(objs, "controller.toml")["redis_url"] == url
    with pytest.raises(helm.HelmValuesError, match="schema"):  # a password belongs in a Secret
        render(chart, {"redis": {"mode": "external", "external": {"url": "redis+cluster://:pw@r:6379"}}})


def test_bundled_valkey_persistence_and_password_come_from_values(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    default = named(rendered["default"], "StatefulSet", f"{RELEASE}-kvtier-valkey")
    assert "volumeClaimTemplates" not in default["spec"]
    gpu16 = named(rendered["gpu16"], "StatefulSet", f"{RELEASE}-kvtier-valkey")
    (claim,) = gpu16["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    assert claim["spec"]["resources"]["requests"]["storage"] == "64Gi"
    valkey = container(gpu16["spec"]["template"]["spec"], "valkey")
    assert env_of(valkey)["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"]["name"] == "kvtier-valkey"
    ctr = container(controller_deployment(rendered["gpu16"])["spec"]["template"]["spec"], "controller")
    assert env_of(ctr)["KVTIER_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "kvtier-valkey"
    assert "$(KVTIER_REDIS_PASSWORD)@" in literal_env(ctr)["KVTIER_REDIS_URL"]


def test_tls_and_auth_secrets_are_mounted_as_files(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objs = rendered["external-redis-tls"]
    controller_pod = controller_deployment(objs)["spec"]["template"]["spec"]
    (group,) = raycluster(objs)["spec"]["workerGroupSpecs"]
    worker_pod = group["template"]["spec"]
    for pod, ctr_name, tls_secret in (
        (controller_pod, "controller", "kvtier-controller-tls"),
        (worker_pod, "ray-worker", "kvtier-worker-tls"),
    ):
        volumes = {v["name"]: v for v in pod["volumes"]}
        ctr = container(pod, ctr_name)
        mounts = {m["name"]: m for m in ctr["volumeMounts"]}
        env = literal_env(ctr)
        assert volumes["tls"]["secret"]["secretName"] == tls_secret
        assert mounts["tls"]["mountPath"] == "/etc/kvtier/tls" and mounts["tls"]["readOnly"]
        for var, file in (("CERT", "tls.crt"), ("KEY", "tls.key"), ("CA", "ca.crt")):
            assert env[f"KVTIER_TLS_{var}_FILE"] == f"/etc/kvtier/tls/{file}"
        # Both verify callers with the token table, and nothing else of that Secret.
        assert volumes["auth"]["secret"]["secretName"] == "kvtier-auth"
        assert volumes["auth"]["secret"]["items"] == [{"key": "tokens", "path": "tokens"}]
        assert mounts["auth"]["mountPath"] == "/etc/kvtier/auth"
        assert "KVTIER_ALLOW_UNAUTHENTICATED" not in env
    assert literal_env(container(controller_pod, "controller"))["KVTIER_AUTH_TOKEN_FILE"] == "/etc/kvtier/auth/tokens"
    worker = container(worker_pod, "ray-worker")
    assert literal_env(worker)["KVTIER_AUTH_TOKENS_FILE"] == "/etc/kvtier/auth/tokens"
    # One credential per worker: the GPU pods mount the Secret of per-worker-id tokens, and no
    # token shared by every worker exists (the pool sets each actor's auth_token_file to its id's key).
    assert "KVTIER_AUTH_TOKEN_FILE" not in env_of(worker)
    volumes = {v["name"]: v for v in worker_pod["volumes"]}
    assert volumes["worker-tokens"]["secret"]["secretName"] == "kvtier-worker-tokens"
    mounts = {m["name"]: m for m in worker["volumeMounts"]}
    assert mounts["worker-tokens"]["mountPath"] == "/etc/kvtier/worker-tokens" and mounts["worker-tokens"]["readOnly"]
    head = raycluster(objs)["spec"]["headGroupSpec"]["template"]["spec"]
    assert "worker-tokens" not in {v["name"] for v in head["volumes"]}
    assert "worker-tokens" not in {v["name"] for v in controller_pod["volumes"]}


def test_auth_off_lets_callers_in_only_where_the_network_admits_them(chart: Any) -> None:
    objs = render(chart, {"auth": {"enabled": False}})
    controller = container(controller_deployment(objs)["spec"]["template"]["spec"], "controller")
    assert "KVTIER_AUTH_TOKEN_FILE" not in env_of(controller)
    # Without auth the processes listen on 0.0.0.0 only because the chart says the network admits callers.
    assert literal_env(controller)["KVTIER_ALLOW_UNAUTHENTICATED"] == "true"
    (group,) = raycluster(objs)["spec"]["workerGroupSpecs"]
    assert literal_env(container(group["template"]["spec"], "ray-worker"))["KVTIER_ALLOW_UNAUTHENTICATED"] == "true"
    # No tokens: the pool names workers after their slots.
    pool = container(raycluster(objs)["spec"]["headGroupSpec"]["template"]["spec"], "worker-pool")
    assert "--worker-tokens-dir" not in pool["command"]
    assert [s["metadata"]["name"] for s in of_kind(objs, "Secret")] == [f"{RELEASE}-kvtier-valkey"]


def secret_data(obj: dict[str, Any]) -> dict[str, str]:
    return {key: base64.b64decode(value).decode() for key, value in obj["data"].items()}


def test_the_default_render_has_auth_on_and_a_valkey_password(chart: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    objs = rendered["default"]
    assert chart.merge_values({})["auth"]["enabled"] is True
    secrets = {obj["metadata"]["name"]: secret_data(obj) for obj in of_kind(objs, "Secret")}
    assert set(secrets) == {f"{RELEASE}-kvtier-valkey", f"{RELEASE}-kvtier-auth", f"{RELEASE}-kvtier-worker-tokens"}
    password = secrets[f"{RELEASE}-kvtier-valkey"]["password"]
    assert re.fullmatch(r"[A-Za-z0-9]{40}", password)

    # Valkey requires the password (from the generated Secret) and never runs unprotected.
    valkey = container(named(objs, "StatefulSet", f"{RELEASE}-kvtier-valkey")["spec"]["template"]["spec"], "valkey")
    command = " ".join(valkey["args"])
    assert '--requirepass "$REDISCLI_AUTH"' in command and "protected-mode" not in command
    assert env_of(valkey)["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == {
        "name": f"{RELEASE}-kvtier-valkey", "key": "password"}
    ctr = container(controller_deployment(objs)["spec"]["template"]["spec"], "controller")
    assert env_of(ctr)["KVTIER_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == f"{RELEASE}-kvtier-valkey"
    assert "$(KVTIER_REDIS_PASSWORD)@" in literal_env(ctr)["KVTIER_REDIS_URL"]

    # Auth is on: the token table verifies callers, each worker id has its own token (bound to
    # the id), and the table admits exactly the generated admin and worker tokens (by digest only).
    auth = secrets[f"{RELEASE}-kvtier-auth"]
    workers = secrets[f"{RELEASE}-kvtier-worker-tokens"]
    table = auth_lib.parse_token_table(yaml.safe_load(auth["tokens"]), source="chart")
    assert table.authenticate(auth["admin-token"]).role is auth_lib.Role.ADMIN
    assert sorted(workers) == ["worker-0"]  # ray.worker.maxReplicas x gpusPerWorker
    for worker_id, token in workers.items():
        principal = table.authenticate(token)
        assert principal.role is auth_lib.Role.WORKER and principal.worker_id == worker_id
        assert token not in auth["tokens"]
    assert auth["admin-token"] not in auth["tokens"]
    assert literal_env(ctr)["KVTIER_AUTH_TOKEN_FILE"] == "/etc/kvtier/auth/tokens"
    assert "KVTIER_ALLOW_UNAUTHENTICATED" not in env_of(ctr)
    (group,) = raycluster(objs)["spec"]["workerGroupSpecs"]
    worker_pod = group["template"]["spec"]
    assert literal_env(container(worker_pod, "ray-worker"))["KVTIER_AUTH_TOKENS_FILE"] == "/etc/kvtier/auth/tokens"
    volumes = {v["name"]: v for v in worker_pod["volumes"]}
    assert volumes["auth"]["secret"]["secretName"] == f"{RELEASE}-kvtier-auth"
    assert volumes["worker-tokens"]["secret"]["secretName"] == f"{RELEASE}-kvtier-worker-tokens"

    # The generated values appear in their Secrets and nowhere else.
    for obj in objs:
        if obj["kind"] == "Secret":
            continue
        for path, value in walk(obj):
            for secret in (password, auth["admin-token"], *workers.values()):
                assert not (isinstance(value, str) and secret in value), f"{obj['kind']} {'.'.join(map(str, path))}"


CANARIES = {
    "auth": "tok-8c1f6e2d9b7a4c3e5f0a1b2c3d4e5f60",
    "tls": "tls-4f2a9c7e1b3d5f60718293a4b5c6d7e8",
    "redis": "url-0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d",
    "valkey": "pw-5e4d3c2b1a0f9e8d7c6b5a4f3e2d1c0b",
    "workers": "wt-3a1b5c7d9e0f2a4b6c8d0e1f3a5b7c9d",
}
# Where a Secret's *name* may appear; anywhere else would be a leak of a secret reference.
SECRET_NAME_FIELDS = {("secret", "secretName"), ("secretKeyRef", "name")}


def test_secret_references_render_only_as_secret_names(chart: Any) -> None:
    values = {
        "auth": {"enabled": True, "existingSecret": CANARIES["auth"], "workerTokensSecret": CANARIES["workers"]},
        "tls": {"enabled": True, "existingSecret": CANARIES["tls"]},
        "redis": {"bundled": {"auth": {"existingSecret": CANARIES["valkey"]}}},
    }
    external = {**values, "redis": {"mode": "external", "external": {"existingSecret": CANARIES["redis"]}}}
    seen = set()
    for objs in (render(chart, values), render(chart, external)):
        assert of_kind(objs, "Secret") == [], "with every Secret named, the chart creates none"
        for obj in objs:
            for path, value in walk(obj):
                for label, canary in CANARIES.items():
                    if isinstance(value, str) and canary in value:
                        assert value == canary and tuple(path[-2:]) in SECRET_NAME_FIELDS, (
                            f"{label} secret reference at {obj['kind']} {'.'.join(map(str, path))}"
                        )
                        seen.add(label)
    assert seen == set(CANARIES)


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_configmaps_hold_no_secret_material(
    rendered: dict[str, list[dict[str, Any]]], value_set: str
) -> None:
    credentials_in_url = re.compile(r"://[^/@\s]*:[^/@\s]+@")
    for configmap in of_kind(rendered[value_set], "ConfigMap"):
        text = json.dumps(configmap.get("data", {})) + json.dumps(configmap.get("binaryData", {}))
        for marker in ("BEGIN", "PRIVATE KEY", "token", "password", "secret"):
            assert marker.lower() not in text.lower(), (
                f"{marker!r} in ConfigMap {configmap['metadata']['name']}"
            )
        assert not credentials_in_url.search(text)


# --- network policy, RBAC, security context --------------------------------------------


def pod_labels(objs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Pod template labels by component: controller, valkey, ray-head, ray-worker."""
    labels = {}
    for obj in objs:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            template = obj["spec"]["template"]["metadata"]["labels"]
            labels[template["app.kubernetes.io/component"]] = template
        elif obj["kind"] == "RayCluster":
            labels["ray-head"] = obj["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
            for group in obj["spec"]["workerGroupSpecs"]:
                labels["ray-worker"] = group["template"]["metadata"]["labels"]
    return labels


def admitted(policy: dict[str, Any], labels: dict[str, str], port: str | int) -> bool:
    """Whether a same-namespace pod with ``labels`` may connect to ``port`` under ``policy``."""
    for rule in policy["spec"].get("ingress", []):
        ports = [p["port"] for p in rule.get("ports", [])]
        if ports and port not in ports:
            continue
        for peer in rule["from"]:
            if (
                "namespaceSelector" not in peer
                and "ipBlock" not in peer
                and selects(peer["podSelector"], labels)
            ):
                return True
    return False


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_network_policies_guard_controller_redis_and_workers(
    rendered: dict[str, list[dict[str, Any]]], merged: dict[str, dict[str, Any]], value_set: str
) -> None:
    objs, values = rendered[value_set], merged[value_set]
    policies = of_kind(objs, "NetworkPolicy")
    labels = pod_labels(objs)
    for policy in policies:
        for rule in policy["spec"]["ingress"]:
            assert rule.get("from"), f"{policy['metadata']['name']}: a rule without peers admits everyone"
    by_target = {
        component: [p for p in policies if selects(p["spec"]["podSelector"], pod)]
        for component, pod in labels.items()
    }
    assert all(by_target.values()), (
        f"pods without a NetworkPolicy: {[c for c, p in by_target.items() if not p]}"
    )
    (controller_policy,) = by_target["controller"]
    stranger = {"app": "something-else"}
    assert admitted(controller_policy, labels["ray-worker"], "grpc")
    assert not admitted(controller_policy, stranger, "grpc")
    peers = [peer for rule in controller_policy["spec"]["ingress"] for peer in rule["from"]]
    for peer in values["networkPolicy"]["frontends"] + values["networkPolicy"]["admins"]:
        assert peer in peers
    metrics_rule = [
        r
        for r in controller_policy["spec"]["ingress"]
        if r["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    ]
    assert (
        metrics_rule[0]["from"][0]["namespaceSelector"]
        == values["networkPolicy"]["metrics"]["namespaceSelector"]
    )
    # The controller proves each registering worker's address by calling its gRPC port.
    worker_port = values["ray"]["worker"]["port"]
    assert any(admitted(p, labels["controller"], worker_port) for p in by_target["ray-worker"])
    assert not any(admitted(p, labels["controller"], values["ray"]["worker"]["metricsPort"])
                   for p in by_target["ray-worker"])
    if values["redis"]["mode"] == "bundled":
        (redis_policy,) = by_target["valkey"]
        assert admitted(redis_policy, labels["controller"], "redis")
        assert admitted(redis_policy, labels["ray-worker"], "redis")
        frontend = {"kvtier.io/client": "frontend"}
        assert not admitted(redis_policy, frontend, "redis") and not admitted(redis_policy, stranger, "redis")
        assert len(redis_policy["spec"]["ingress"]) == 1


def test_rbac_is_opt_in_and_namespaced(chart: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    for objs in rendered.values():
        assert of_kind(objs, "Role") == of_kind(objs, "RoleBinding") == []
        assert {sa["metadata"]["name"] for sa in of_kind(objs, "ServiceAccount")} == {
            f"{RELEASE}-kvtier-controller",
            f"{RELEASE}-kvtier-ray",
        }
    rule = {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}
    objs = render(chart, {"rbac": {"extraControllerRules": [rule]}})
    (role,), (binding,) = of_kind(objs, "Role"), of_kind(objs, "RoleBinding")
    for obj in (role, binding):
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    assert role["rules"] == [rule]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{RELEASE}-kvtier-controller", "namespace": NAMESPACE}
    ]
    assert controller_deployment(objs)["spec"]["template"]["spec"]["automountServiceAccountToken"] is True


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_container_is_non_root_and_drops_capabilities(
    rendered: dict[str, list[dict[str, Any]]], value_set: str
) -> None:
    for where, spec in pod_specs(rendered[value_set]):
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert not spec.get("hostNetwork") and not spec.get("hostPID"), where
        for ctr in spec["containers"] + spec.get("initContainers", []):
            ctx = ctr["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False, (where, ctr["name"])
            assert ctx["capabilities"]["drop"] == ["ALL"], (where, ctr["name"])
            assert ctx["readOnlyRootFilesystem"] is True, (where, ctr["name"])
            assert not ctx.get("privileged"), (where, ctr["name"])
            assert "limits" in ctr["resources"] and "requests" in ctr["resources"], (where, ctr["name"])


# --- values schema ---------------------------------------------------------------------


def test_schema_is_draft7_and_accepts_every_value_set(merged: dict[str, dict[str, Any]]) -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(schema)
    validator.validate(yaml.safe_load((CHART_DIR / "values.yaml").read_text()))
    for value_set in VALUE_SETS:
        validator.validate(merged[value_set])  # Helm validates the coalesced values


INVALID_VALUES = {
    "unknown top-level key": {"replicaCount": 3},
    "misspelled nested key": {"controller": {"replica": 2}},
    "wrong type": {"controller": {"replicas": "two"}},
    "negative replicas": {"ray": {"worker": {"replicas": -1}}},
    "zero GPUs per worker": {"ray": {"worker": {"gpusPerWorker": 0}}},
    "unknown NVMe volume type": {"kvCache": {"nvme": {"volume": {"type": "ramdisk"}}}},
    "page size not a power of two": {"kvCache": {"pageSize": 12}},
    "session holds given no HBM": {"kvCache": {"sessionHoldFraction": 0}},
    "session holds given more than HBM": {"kvCache": {"sessionHoldFraction": 1.5}},
    "negative session hold bound": {"controller": {"sessionHoldMaxS": -1}},
    "password inside the Redis URL": {
        "redis": {"mode": "external", "external": {"url": "redis://:hunter2@redis.example:6379/0"}}
    },
    "external Redis without a URL": {"redis": {"mode": "external"}},
    "auth's table without the workers' tokens": {"auth": {"enabled": True, "existingSecret": "kvtier-auth"}},
    "workers' tokens without the table": {"auth": {"enabled": True, "workerTokensSecret": "kvtier-worker-tokens"}},
    "TLS without its Secret": {"tls": {"enabled": True}},
    "secret name that is not a name": {"auth": {"enabled": True, "existingSecret": "-----BEGIN KEY-----",
                                                "workerTokensSecret": "w"}},
}


@pytest.mark.parametrize("values", INVALID_VALUES.values(), ids=INVALID_VALUES.keys())
def test_invalid_values_fail_schema_validation(chart: Any, values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError, match="schema"):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_lint_reports_a_misspelled_key() -> None:
    report = helm.lint(CHART_DIR, {"controller": {"replica": 2}}, strict=True, namespace=NAMESPACE)
    text = json.dumps(report)
    assert report["errors"] or any(m["severity"] == 3 for m in report["messages"]), report
    assert "replica" in text


def test_replicas_outside_min_max_fail_the_render(chart: Any) -> None:
    with pytest.raises(
        helm.HelmRenderError,
        match=r"ray worker group gpu: replicas \(5\) must lie in \[minReplicas \(1\), maxReplicas \(1\)\]",
    ):
        chart.render({"ray": {"worker": {"replicas": 5}}}, name=RELEASE, namespace=NAMESPACE)


def test_several_worker_groups_each_merged_over_the_worker_defaults(chart: Any) -> None:
    groups = [
        {"groupName": "h100", "gpusPerWorker": 8, "nodeSelector": {"gpu": "h100"}},
        {"groupName": "l40s", "gpusPerWorker": 2, "replicas": 3, "maxReplicas": 3, "hostOverheadGiB": 8},
    ]
    objs = render(chart, {"ray": {"workerGroups": groups}})
    specs = raycluster(objs)["spec"]["workerGroupSpecs"]
    assert [g["groupName"] for g in specs] == ["h100", "l40s"]
    assert [g["rayStartParams"]["num-gpus"] for g in specs] == ["8", "2"]
    assert [g["replicas"] for g in specs] == [1, 3]
    pods = [g["template"]["spec"] for g in specs]
    assert pods[0]["nodeSelector"] == {"gpu": "h100"} and "nodeSelector" not in pods[1]
    # Memory per pod follows its own group: GPUs x DRAM per GPU + overhead + shm (defaults: 16, 24, 4).
    limits = [container(p, "ray-worker")["resources"]["limits"] for p in pods]
    assert [lim["memory"] for lim in limits] == [f"{8 * 16 + 24 + 4}Gi", f"{2 * 16 + 8 + 4}Gi"]
    assert [lim["nvidia.com/gpu"] for lim in limits] == [8, 2]
    ports = [[p["containerPort"] for p in container(p, "ray-worker")["ports"] if p["name"].startswith("grpc-")]
             for p in pods]
    assert ports == [[50061 + i for i in range(8)], [50061, 50062]]
    # Frontends may reach every worker port of the largest pod.
    worker_policy = next(p for p in of_kind(objs, "NetworkPolicy") if "ray" in p["metadata"]["name"])
    grpc_ports = [port for rule in worker_policy["spec"]["ingress"] for port in rule.get("ports", ())
                  if port["port"] == 50061]
    assert grpc_ports and grpc_ports[0]["endPort"] == 50061 + 7


def test_worker_groups_need_distinct_names(chart: Any) -> None:
    with pytest.raises(helm.HelmRenderError, match=r'groupName "a" is used twice'):
        chart.render({"ray": {"workerGroups": [{"groupName": "a"}, {"groupName": "a"}]}},
                     name=RELEASE, namespace=NAMESPACE)
    with pytest.raises(helm.HelmValuesError, match="workerGroups.*port"):  # one worker.toml: no per-group ports
        chart.render({"ray": {"workerGroups": [{"groupName": "a", "port": 1}]}}, name=RELEASE, namespace=NAMESPACE)


# --- the OpenAI-compatible gateway ------------------------------------------------------


def gateway_objects(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["metadata"]["labels"].get("app.kubernetes.io/component") == "gateway"]


def test_gateway_is_a_stateless_deployment_of_two_or_more_behind_a_service(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objs = rendered["gpu16"]  # the set with a model.path: the gateway reads its tokenizer
    deployment = named(objs, "Deployment", f"{RELEASE}-kvtier-gateway")
    assert deployment["spec"]["replicas"] >= 2
    pod = deployment["spec"]["template"]["spec"]
    # Stateless: nothing but scratch space and the read-only checkpoint.
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(volumes) == {"tmp", "model"} and "emptyDir" in volumes["tmp"]
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "llama-3-1-8b-instruct"
    assert not of_kind(gateway_objects(objs), "StatefulSet")
    ctr = container(pod, "gateway")
    command = ctr["command"]
    assert command[:2] == ["kvtier", "gateway"]
    assert command[command.index("--model") + 1] == "/models/Llama-3.1-8B-Instruct"
    assert command[command.index("--controller") + 1] == f"{RELEASE}-kvtier-controller.{NAMESPACE}.svc:50051"
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/health"
    service = named(objs, "Service", f"{RELEASE}-kvtier-gateway")
    selector = {"matchLabels": service["spec"]["selector"]}
    assert selects(selector, deployment["spec"]["template"]["metadata"]["labels"])
    assert not selects(selector, controller_deployment(objs)["spec"]["template"]["metadata"]["labels"])
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http" and ctr["ports"][0]["name"] == "http"


def test_gateway_tool_parser_comes_from_values(chart: Any, rendered: dict[str, list[dict[str, Any]]]) -> None:
    def command(objs: list[dict[str, Any]]) -> list[str]:
        deployment = named(objs, "Deployment", f"{RELEASE}-kvtier-gateway")
        return container(deployment["spec"]["template"]["spec"], "gateway")["command"]

    assert "--tool-parser" not in command(rendered["gpu16"])  # the chat template chooses
    values = ci_values("gpu16")
    values.setdefault("gateway", {})["toolParser"] = "llama3"
    chosen = command(render(chart, values))
    assert chosen[chosen.index("--tool-parser") + 1] == "llama3"
    values["gateway"]["toolParser"] = "mistral"
    with pytest.raises(helm.HelmValuesError, match="schema"):
        render(chart, values)


def test_gateway_renders_only_with_a_model_path(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert not gateway_objects(rendered["default"])
    assert gateway_objects(rendered["gpu16"])


def test_gateway_pods_reach_the_controller_and_workers_through_the_network_policies(
    rendered: dict[str, list[dict[str, Any]]], merged: dict[str, dict[str, Any]],
) -> None:
    objs = rendered["gpu16"]
    labels = named(objs, "Deployment", f"{RELEASE}-kvtier-gateway")["spec"]["template"]["metadata"]["labels"]
    assert admitted(named(objs, "NetworkPolicy", f"{RELEASE}-kvtier-controller"), labels, "grpc")
    ray = named(objs, "NetworkPolicy", f"{RELEASE}-kvtier-ray")
    assert admitted(ray, labels, merged["gpu16"]["ray"]["worker"]["port"])  # Generate on the workers
    gateway_policy = named(objs, "NetworkPolicy", f"{RELEASE}-kvtier-gateway")
    assert admitted(gateway_policy, {"kvtier.io/client": "frontend"}, "http")  # networkPolicy.frontends
    assert not admitted(gateway_policy, {"app": "other"}, "http")


def test_gateway_with_auth_needs_its_token_secret(chart: Any) -> None:
    values = {**ci_values("gpu16"), "auth": {"enabled": True, "existingSecret": "kvtier-auth",
                                             "workerTokensSecret": "kvtier-worker-tokens"}}
    with pytest.raises(helm.HelmRenderError, match="gateway.existingSecret is required"):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    values["gateway"] = {"existingSecret": "kvtier-gateway"}
    objs = render(chart, values)
    ctr = container(named(objs, "Deployment", f"{RELEASE}-kvtier-gateway")["spec"]["template"]["spec"], "gateway")
    assert env_of(ctr)["KVTIER_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "kvtier-gateway",
                                                                        "key": "gateway-token"}
    assert "--require-key" in ctr["command"]


def test_the_generated_auth_secret_holds_the_gateways_frontend_token(chart: Any) -> None:
    objs = render(chart, {**ci_values("gpu16"), "auth": {"enabled": True}})
    ctr = container(named(objs, "Deployment", f"{RELEASE}-kvtier-gateway")["spec"]["template"]["spec"], "gateway")
    assert env_of(ctr)["KVTIER_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": f"{RELEASE}-kvtier-auth",
                                                                        "key": "gateway-token"}
    auth = secret_data(named(objs, "Secret", f"{RELEASE}-kvtier-auth"))
    table = auth_lib.parse_token_table(yaml.safe_load(auth["tokens"]), source="chart")
    principal = table.authenticate(auth["gateway-token"])
    assert principal.role is auth_lib.Role.FRONTEND and principal.tenants == frozenset({"default"})
