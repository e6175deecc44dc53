"""deploy/kubernetes, checked offline: no cluster, no network.

Core kinds are validated strictly (no unknown field) against the Kubernetes
OpenAPI schemas that ``kubernetes-validate`` bundles, at the oldest Kubernetes
the docs name and at the newest the package knows. The gateway's CRDs
(InferencePool, HTTPRoute, Gateway) are not in those schemas: they are checked
against subsets of their CRDs' schemas written out here, and every reference
between objects (selectors, ports, names) is followed. The rest ties the
manifests to the code they deploy, so that neither can drift alone: probe paths
are routes of the app, the port is the server's and the image's, the cache
volume is where the image keeps its cache, and the endpoint picker reads metrics
that /metrics exports.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml
from packaging.version import Version

from pagedserve.engine.metrics.prometheus import PrometheusStatLogger
from pagedserve.server.app import ServerArgs, build_app

pytestmark = pytest.mark.infra

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
GATEWAY = DEPLOY / "gateway"
#: The oldest Kubernetes docs/kubernetes.md supports (gRPC probes of the endpoint picker: GA in 1.27), or the
#: oldest whose schemas the installed kubernetes-validate still bundles (it keeps about a dozen releases).
MIN_KUBERNETES = max("1.29", kubernetes_validate.utils.all_versions()[0], key=Version)
#: Kinds with no bundled schema, checked by the CRD tests below instead; any other kind without one is an
#: error (a mistyped apiVersion would otherwise skip validation silently).
NOT_IN_KUBERNETES_SCHEMAS = {"Kustomization", "InferencePool", "HTTPRoute", "Gateway"}


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def manifests() -> list[Path]:
    return sorted(DEPLOY.rglob("*.yaml"))


def find(path: Path, kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (and ``name``) in ``path``."""
    [found] = [doc for doc in documents(path) if doc["kind"] == kind
               and (name is None or doc["metadata"]["name"] == name)]
    return found


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def container_port(container_spec: dict[str, Any], port: int | str) -> int:
    """A probe's or a Service's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        assert port in {p["containerPort"] for p in container_spec["ports"]}, port
        return port
    [number] = [p["containerPort"] for p in container_spec["ports"] if p["name"] == port]
    return number


def dockerfile_env() -> dict[str, str]:
    """The runtime stage's ``ENV`` values (``KEY=value`` pairs, continuation lines included)."""
    text = (ROOT / "Dockerfile").read_text()
    runtime = text[text.index("AS runtime"):]
    env_lines = re.findall(r"^ENV ((?:.*\\\n)*.*)$", runtime, re.MULTILINE)
    pairs = re.findall(r"(\w+)=(\S+)", " ".join(env_lines).replace("\\\n", " "))
    return dict(pairs)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


@pytest.fixture(scope="module")
def server() -> dict[str, Any]:
    return find(DEPLOY / "deployment.yaml", "Deployment", "pagedserve")


@pytest.fixture(scope="module")
def epp() -> dict[str, Any]:
    return find(GATEWAY / "epp.yaml", "Deployment", "pagedserve-epp")


# --------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("version", [MIN_KUBERNETES, kubernetes_validate.latest_version()])
def test_core_kinds_validate_strictly_against_kubernetes_schemas(version: str) -> None:
    unvalidated = set()
    for path in manifests():
        for doc in documents(path):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                unvalidated.add(doc["kind"])
            except kubernetes_validate.ValidationError as error:
                pytest.fail(f"{path.relative_to(ROOT)}: {doc['kind']} {doc['metadata']['name']}: {error}")
    assert unvalidated == NOT_IN_KUBERNETES_SCHEMAS


def test_kustomizations_apply_every_manifest_of_their_folder() -> None:
    """``kubectl apply -k`` applies what is there, and nothing is forgotten; gateway.yaml is left out on
    purpose (its class is the cluster's; it is applied on its own after editing)."""
    for folder, left_out in ((DEPLOY, set()), (GATEWAY, {"gateway.yaml"})):
        kustomization = find(folder / "kustomization.yaml", "Kustomization")
        assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
        listed = set(kustomization["resources"])
        present = {path.name for path in folder.glob("*.yaml")} - {"kustomization.yaml"}
        assert listed == present - left_out, folder


#: The fields of InferencePool (inference.networking.k8s.io/v1, GIE v1.0.0's CRD) that these manifests may
#: use, typed as the CRD types them; additionalProperties is false so that a misspelt field fails here
#: rather than being pruned by the API server.
INFERENCE_POOL_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {
                    "type": "object", "additionalProperties": False, "required": ["matchLabels"],
                    "properties": {"matchLabels": {"type": "object", "minProperties": 1,
                                                   "additionalProperties": {"type": "string", "maxLength": 63}}}},
                "targetPorts": {
                    "type": "array", "minItems": 1, "maxItems": 1,
                    "items": {"type": "object", "additionalProperties": False, "required": ["number"],
                              "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}},
                "endpointPickerRef": {
                    "type": "object", "additionalProperties": False,
                    # port: required when kind is Service, the default (the CRD's CEL rule).
                    "required": ["name", "port"],
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"const": "Service"},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": {"type": "object", "additionalProperties": False, "required": ["number"],
                                 "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}},
                        "failureMode": {"enum": ["FailOpen", "FailClose"]}}}}}},
}
_PARENT_REF = {
    "type": "object", "additionalProperties": False, "required": ["name"],
    "properties": {"group": {"const": "gateway.networking.k8s.io"}, "kind": {"const": "Gateway"},
                   "name": {"type": "string"}, "namespace": {"type": "string"},
                   "sectionName": {"type": "string"}}}
#: The fields of HTTPRoute (gateway.networking.k8s.io/v1, Gateway API's standard channel) these manifests use.
HTTP_ROUTE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "HTTPRoute"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["parentRefs", "rules"],
            "properties": {
                "parentRefs": {"type": "array", "minItems": 1, "items": _PARENT_REF},
                "rules": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["backendRefs"],
                    "properties": {
                        "matches": {"type": "array", "items": {
                            "type": "object", "additionalProperties": False,
                            "properties": {"path": {
                                "type": "object", "additionalProperties": False,
                                "properties": {"type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                               "value": {"type": "string", "pattern": "^/"}}}}}},
                        "backendRefs": {"type": "array", "minItems": 1, "items": {
                            "type": "object", "additionalProperties": False, "required": ["name"],
                            "properties": {"group": {"type": "string"}, "kind": {"type": "string"},
                                           "name": {"type": "string"}, "port": {"type": "integer"},
                                           "weight": {"type": "integer", "minimum": 0}}}},
                        "timeouts": {
                            "type": "object", "additionalProperties": False,
                            "properties": {name: {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
                                           for name in ("request", "backendRequest")}}}}}}}},
}
#: The fields of Gateway (gateway.networking.k8s.io/v1) that gateway.yaml uses.
GATEWAY_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "Gateway"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["gatewayClassName", "listeners"],
            "properties": {
                "gatewayClassName": {"type": "string", "minLength": 1},
                "listeners": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["name", "port", "protocol"],
                    "properties": {"name": {"type": "string"}, "hostname": {"type": "string"},
                                   "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                                   "protocol": {"enum": ["HTTP", "HTTPS"]}}}}}}},
}


@pytest.mark.parametrize(("file", "schema"), [("inferencepool.yaml", INFERENCE_POOL_SCHEMA),
                                              ("httproute.yaml", HTTP_ROUTE_SCHEMA),
                                              ("gateway.yaml", GATEWAY_SCHEMA)])
def test_gateway_resources_match_their_crds(file: str, schema: dict[str, Any]) -> None:
    for doc in documents(GATEWAY / file):
        jsonschema.validate(doc, schema)


# --------------------------------------------------------------------------- the manifests agree with the code


def test_probes_ask_routes_the_app_serves_on_the_container_port(server: dict[str, Any]) -> None:
    """Every probe is an HTTP GET that ``pagedserve.server.app`` answers itself (not a 404 or 405), on the port the
    container listens on. Asked before the engine has started, /health answers 503 (the engine is not
    running), which is what keeps a loading pod out of the Service."""
    spec = container(server, "pagedserve")
    probes = {name: spec[name] for name in ("startupProbe", "readinessProbe", "livenessProbe")}

    async def get_all(paths: set[str]) -> dict[str, httpx.Response]:
        transport = httpx.ASGITransport(app=build_app())  # no lifespan: no engine
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return {path: await http.get(path) for path in paths}

    responses = asyncio.run(get_all({probe["httpGet"]["path"] for probe in probes.values()}))
    for name, probe in probes.items():
        response = responses[probe["httpGet"]["path"]]
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead", name
        assert container_port(spec, probe["httpGet"]["port"]) == ServerArgs().port, name
    # Liveness must not fail while the model loads: the startup probe holds it off that long.
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # the image HEALTHCHECK's start period


def test_port_is_the_servers_and_the_images(server: dict[str, Any]) -> None:
    """The image's entrypoint listens on $PORT (Dockerfile: ENV PORT, EXPOSE); the server's own default
    is the same; the container port, the Service's target and the pool's target port all name it."""
    default = ServerArgs().port
    env = {e["name"]: e.get("value") for e in container(server, "pagedserve")["env"]}
    assert int(env["PORT"]) == int(dockerfile_env()["PORT"]) == default
    assert f"EXPOSE {default}" in (ROOT / "Dockerfile").read_text()
    assert "--port \"${PORT:-8000}\"" in (ROOT / "scripts" / "image_entrypoint.sh").read_text()
    service = find(DEPLOY / "service.yaml", "Service")
    [service_port] = service["spec"]["ports"]
    assert container_port(container(server, "pagedserve"), service_port["targetPort"]) == default
    pool = find(GATEWAY / "inferencepool.yaml", "InferencePool")
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [default]


def test_cache_volume_is_where_the_image_keeps_its_caches(server: dict[str, Any]) -> None:
    """The root filesystem is read-only: the cache directory (HF_HOME and Triton's cache under it) and /tmp
    are the writable paths docs/deployment.md names, and each is a volume."""
    env = dockerfile_env()
    spec = container(server, "pagedserve")
    assert spec["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m["name"] for m in spec["volumeMounts"]}
    assert set(mounts) == {env["PAGEDSERVE_CACHE_DIR"], "/tmp"}
    for cache in ("HF_HOME", "TRITON_CACHE_DIR"):
        assert env[cache].startswith(env["PAGEDSERVE_CACHE_DIR"] + "/"), cache
    volumes = {v["name"]: v for v in server["spec"]["template"]["spec"]["volumes"]}
    assert set(mounts.values()) == set(volumes)


def test_pod_runs_as_the_images_non_root_user(server: dict[str, Any]) -> None:
    """runAsNonRoot without a runAsUser works only because the image's USER is numeric and not 0."""
    [user] = re.findall(r"^USER (\S+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    uid, _, _ = user.partition(":")
    assert uid.isdigit() and int(uid) != 0
    pod = server["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and "runAsUser" not in pod["securityContext"]


def test_grace_period_covers_the_servers_drain(server: dict[str, Any]) -> None:
    """The kubelet waits terminationGracePeriodSeconds from the preStop hook's start to SIGKILL: it must cover
    the hook, the server's --shutdown-timeout and uvicorn's own last 5 s (docs/deployment.md)."""
    pod = server["spec"]["template"]["spec"]
    [_, pre_stop_s] = container(server, "pagedserve")["lifecycle"]["preStop"]["exec"]["command"]
    assert pod["terminationGracePeriodSeconds"] > int(pre_stop_s) + ServerArgs().shutdown_timeout + 5


def test_selectors_names_and_ports_agree(server: dict[str, Any], epp: dict[str, Any]) -> None:
    """Each reference lands: Deployments select their pods, the Service and the pool select pagedserve's,
    the route reaches the pool through the Gateway, the pool reaches the picker's Service and port, and the
    picker runs with its account, its configuration and the pool's name."""
    pod_labels = server["spec"]["template"]["metadata"]["labels"]
    for deployment in (server, epp):
        template_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selects(deployment["spec"]["selector"]["matchLabels"], template_labels)
    assert selects(find(DEPLOY / "service.yaml", "Service")["spec"]["selector"], pod_labels)

    pool = find(GATEWAY / "inferencepool.yaml", "InferencePool")
    assert selects(pool["spec"]["selector"]["matchLabels"], pod_labels)
    route = find(GATEWAY / "httproute.yaml", "HTTPRoute")
    gateway = find(GATEWAY / "gateway.yaml", "Gateway")
    assert [ref["name"] for ref in route["spec"]["parentRefs"]] == [gateway["metadata"]["name"]]
    backends = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    assert [(ref["group"], ref["kind"], ref["name"]) for ref in backends] == [
        ("inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])]

    picker_ref = pool["spec"]["endpointPickerRef"]
    picker_service = find(GATEWAY / "epp.yaml", "Service", picker_ref["name"])
    assert selects(picker_service["spec"]["selector"], epp["spec"]["template"]["metadata"]["labels"])
    [ext_proc] = [p for p in picker_service["spec"]["ports"] if p["port"] == picker_ref["port"]["number"]]
    epp_container = container(epp, "epp")
    assert container_port(epp_container, ext_proc["targetPort"]) == 9002  # the picker's --grpc-port default

    args = epp_container["args"]
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    account = epp["spec"]["template"]["spec"]["serviceAccountName"]
    find(GATEWAY / "epp.yaml", "ServiceAccount", account)
    binding = find(GATEWAY / "epp.yaml", "RoleBinding")
    assert [(s["kind"], s["name"]) for s in binding["subjects"]] == [("ServiceAccount", account)]
    role = find(GATEWAY / "epp.yaml", "Role", binding["roleRef"]["name"])
    granted = {(group, resource) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] if {"get", "list", "watch"} <= set(rule["verbs"])}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted


def epp_config(epp: dict[str, Any]) -> dict[str, Any]:
    """The EndpointPickerConfig the picker's --config-file names, read from its mounted ConfigMap."""
    args = container(epp, "epp")["args"]
    config_path = Path(args[args.index("--config-file") + 1])
    [mount] = [m for m in container(epp, "epp")["volumeMounts"] if m["mountPath"] == str(config_path.parent)]
    [volume] = [v for v in epp["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    config_map = find(GATEWAY / "epp.yaml", "ConfigMap", volume["configMap"]["name"])
    return yaml.safe_load(config_map["data"][config_path.name])


def test_endpoint_picker_reads_metrics_that_the_server_exports(epp: dict[str, Any]) -> None:
    """The picker's engine config names metrics /metrics has (as PrometheusStatLogger registers them),
    as gauges, LoRA is off (pagedserve has none), and the scheduling profile uses configured plugins."""
    config = epp_config(epp)
    assert (config["apiVersion"], config["kind"]) == ("inference.networking.x-k8s.io/v1alpha1",
                                                      "EndpointPickerConfig")
    plugins = {plugin.get("name", plugin["type"]): plugin for plugin in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        assert {ref["pluginRef"] for ref in profile["plugins"]} <= set(plugins)
    extractor = plugins["core-metrics-extractor"]["parameters"]
    [engine] = [e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"]]

    registry = PrometheusStatLogger("m", 2048, block_size=16, num_gpu_blocks=100).registry
    gauges = {family.name for family in registry.collect() if family.type == "gauge"}
    for spec in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"):
        assert engine[spec].partition("{")[0] in gauges, spec
    assert engine["loraSpec"] == ""
