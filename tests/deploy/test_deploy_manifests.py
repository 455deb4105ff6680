"""deploy/: every overlay renders with `kubectl kustomize`, validates against the Kubernetes schemas (offline,
strict), and runs what the image really offers: the engine's and the gateway's command lines parse with
kvserve's own parsers and config loader, the probes hit routes the servers have on the ports they listen on."""

from __future__ import annotations

import shutil
from urllib.parse import urlsplit

import pytest
from deploy_manifests import (
    DEPLOY,
    Rendered,
    container,
    dockerfile_entrypoint,
    gib,
    needs_kubectl,
    overlay_names,
    parse_command_line,
    render,
)

pytestmark = needs_kubectl
# The oldest Kubernetes still widely run, and the newest the validator bundles.
KUBERNETES_VERSIONS = ("1.29.0", None)
OVERLAYS = overlay_names()
_rendered: dict[str, Rendered] = {}


def rendered(overlay: str) -> Rendered:
    if overlay not in _rendered:
        _rendered[overlay] = Rendered(render(DEPLOY / "overlays" / overlay))
    return _rendered[overlay]


def test_there_is_a_cpu_overlay_and_one_per_gpu_class():
    from kvserve.planner.gpus import lookup_gpu

    assert "cpu" in OVERLAYS
    gpu_overlays = [name for name in OVERLAYS if name != "cpu"]
    assert len(gpu_overlays) >= 3
    for name in gpu_overlays:  # named after the planner's GPU catalog
        assert lookup_gpu(name).name.lower() == name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_against_the_kubernetes_schemas(overlay):
    import kubernetes_validate

    docs = rendered(overlay).docs
    kinds = {d["kind"] for d in docs}
    assert {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget", "ConfigMap"} <= kinds
    for version in KUBERNETES_VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version or kubernetes_validate.latest_version(), strict=True)


def test_the_validator_rejects_what_the_cluster_would():
    """The check has teeth: a misspelt field fails it."""
    import kubernetes_validate

    engine = rendered("cpu").one("StatefulSet", "kvserve-engine")
    engine["spec"]["template"]["spec"]["terminationGracePeriod"] = 90
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(engine, kubernetes_validate.latest_version(), strict=True)
    del engine["spec"]["template"]["spec"]["terminationGracePeriod"]


def engine_args(manifests: Rendered, tmp_path):
    engine = manifests.one("StatefulSet", "kvserve-engine")
    pod = engine["spec"]["template"]["spec"]
    main = container(engine, "engine")
    entrypoint = dockerfile_entrypoint()
    assert "command" not in main  # the image's entrypoint, with the container's args
    argv = entrypoint[1:] + main["args"]
    config_path = argv[argv.index("--config") + 1]
    return parse_command_line(argv, manifests.mounted_config(pod, main, config_path), tmp_path), engine, main


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engine_command_line_and_probes_match_kvserve_serve(overlay, tmp_path):
    from kvserve.server.routes_info import router

    args, engine, main = engine_args(rendered(overlay), tmp_path)
    pod = engine["spec"]["template"]["spec"]
    assert args.command == "serve"
    port = next(p["containerPort"] for p in main["ports"] if p["name"] == "http")
    assert args.port == port
    server_paths = {route.path for route in router.routes}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = main[probe]["httpGet"]
        assert check["path"] == "/health" and check["path"] in server_paths
        assert check["port"] in ("http", port)
    annotations = engine["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port) and annotations["prometheus.io/path"] in server_paths

    startup = main["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 300  # model load, profiling, kernels
    liveness = main["livenessProbe"]
    # A draining engine answers 503: liveness must not kill it before its drain is over.
    assert liveness["failureThreshold"] * liveness["periodSeconds"] > args.shutdown_timeout
    assert pod["terminationGracePeriodSeconds"] > args.shutdown_timeout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disk_tier_and_host_tier_fit_their_volume_and_memory(overlay, tmp_path):
    args, engine, main = engine_args(rendered(overlay), tmp_path)
    mount = next(m for m in main["volumeMounts"] if args.kv_disk_path.startswith(m["mountPath"]))
    claim = next(c for c in engine["spec"]["volumeClaimTemplates"] if c["metadata"]["name"] == mount["name"])
    assert args.kv_disk_size < gib(claim["spec"]["resources"]["requests"]["storage"])
    memory = gib(main["resources"]["limits"]["memory"])
    assert (args.kv_offloading_size or 0) < gib(main["resources"]["requests"]["memory"]) <= memory


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_routes_to_every_engine_pod_and_the_redis_service(overlay, tmp_path, monkeypatch):
    from kvserve.gateway.app import build_app
    from kvserve.gateway.cli import settings_from_args

    manifests = rendered(overlay)
    serve_args, engine, _ = engine_args(manifests, tmp_path)
    gateway = manifests.one("Deployment", "kvserve-gateway")
    main = container(gateway, "gateway")
    for variable in main["env"]:  # what the gateway process sees (its parser reads defaults from the environment)
        monkeypatch.setenv(variable["name"], variable["value"])
    argv = main["command"][1:] + main["args"]
    assert main["command"][0] == "kvserve"
    config_path = argv[argv.index("--config") + 1]
    config_text = manifests.mounted_config(gateway["spec"]["template"]["spec"], main, config_path)
    settings = settings_from_args(parse_command_line(argv, config_text, tmp_path))

    service = engine["spec"]["serviceName"]
    assert manifests.one("Service", service)["spec"]["clusterIP"] == "None"  # per-pod DNS names
    expected = [f"http://{engine['metadata']['name']}-{i}.{service}:{serve_args.port}"
                for i in range(engine["spec"]["replicas"])]
    assert settings.backends == expected
    redis = urlsplit(settings.redis_url)
    redis_service = manifests.one("Service", redis.hostname)
    assert redis.port in [p["port"] for p in redis_service["spec"]["ports"]]

    args = parse_command_line(argv, config_text, tmp_path)
    port = next(p["containerPort"] for p in main["ports"] if p["name"] == "http")
    assert args.port == port
    gateway_paths = {route.path for route in build_app(settings).routes}
    assert main["readinessProbe"]["httpGet"]["path"] == "/health" in gateway_paths
    init = gateway["spec"]["template"]["spec"]["initContainers"][0]
    assert config_path in init["command"][-1]  # waits for the same backends the gateway checks


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_and_anti_affinity_select_the_pods(overlay):
    manifests = rendered(overlay)
    engine = manifests.one("StatefulSet", "kvserve-engine")
    engine_labels = engine["spec"]["template"]["metadata"]["labels"]
    budget = manifests.one("PodDisruptionBudget", "kvserve-engine")["spec"]
    assert budget["maxUnavailable"] == 1 and budget["selector"]["matchLabels"].items() <= engine_labels.items()
    spread = engine["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = spread["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= engine_labels.items()
    gateway = manifests.one("Deployment", "kvserve-gateway")
    gateway_budget = manifests.one("PodDisruptionBudget", "kvserve-gateway")["spec"]
    assert gateway_budget["selector"]["matchLabels"].items() <= gateway["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("overlay", [name for name in OVERLAYS if name != "cpu"])
def test_gpu_overlays_ask_for_a_gpu_on_that_gpu_class(overlay):
    engine = rendered(overlay).one("StatefulSet", "kvserve-engine")
    main = container(engine, "engine")
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 1
    terms = engine["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    products = {v for term in terms for e in term["matchExpressions"] if e["key"] == "nvidia.com/gpu.product"
                for v in e["values"]}
    assert products and all(overlay.split("-")[0] in p.lower() for p in products)
    tolerations = engine["spec"]["template"]["spec"]["tolerations"]
    assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)


def test_service_monitor_component_selects_the_engines_metrics_port(tmp_path):
    """The ServiceMonitor (a prometheus-operator CRD) is an optional component, so plain clusters validate."""
    shutil.copytree(DEPLOY, tmp_path / "deploy")  # kustomize takes relative paths only
    overlay = tmp_path / "deploy" / "overlays" / "cpu-with-monitor"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "resources:\n  - ../cpu\ncomponents:\n  - ../../components/servicemonitor\n")
    manifests = Rendered(render(overlay))
    monitors = [d for d in manifests.docs if d["kind"] == "ServiceMonitor"]
    assert monitors
    for monitor in monitors:
        selected = [d for d in manifests.docs if d["kind"] == "Service" and
                    monitor["spec"]["selector"]["matchLabels"].items() <= d["metadata"]["labels"].items()]
        assert len(selected) == 1
        ports = {p["name"] for p in selected[0]["spec"]["ports"]}
        assert all(e["port"] in ports and e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])
