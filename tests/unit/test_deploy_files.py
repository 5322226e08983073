"""Deployment files, checked without a Docker engine or cluster: they parse and agree.

The checks tie each file to the contract it serves: metric names to docs/contract.md
(section 3, itself checked against the registry by test_contract.py),
environment names to the service's settings, paths to files that exist in the repository,
and ports/hosts between compose, Prometheus and Grafana.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from streamtrain.config import Settings, load_settings
from streamtrain.tools.simulation_config import ENV_SETTINGS, load_simulation_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
IMAGE_ROOT = "/opt/streamtrain"  # where the Dockerfile copies the repository's services/
CHECKPOINT_DIR = "/var/lib/streamtrain"

METRIC_NAME = re.compile(r"\bstreamtrain_[a-z0-9_]+")


def contract_metrics() -> dict[str, str]:
    """docs/contract.md, section 3: the metric names dashboards may rely on -> type."""
    text = (REPO / "docs" / "contract.md").read_text(encoding="utf-8")
    section = text.split("\n## 3. ", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| `streamtrain_") and len(cells) >= 2:
            for name in METRIC_NAME.findall(cells[0]):
                out[name] = cells[1]
    return out


CONTRACT_METRICS = contract_metrics()
CONTRACT_HISTOGRAMS = {name for name, kind in CONTRACT_METRICS.items() if kind == "histogram"}
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def env_dict(environment: Any) -> dict[str, str | None]:
    """Compose allows a map or a list of NAME=value / bare NAME (pass-through)."""
    if isinstance(environment, dict):
        return {k: None if v is None else str(v) for k, v in environment.items()}
    out: dict[str, str | None] = {}
    for item in environment or []:
        name, sep, value = item.partition("=")
        out[name] = value if sep else None
    return out


def setting_of(env_name: str) -> str:
    assert env_name.startswith("STREAMTRAIN_"), env_name
    return env_name.removeprefix("STREAMTRAIN_").lower()


def repo_path_of_image_path(path: str) -> Path:
    assert path.startswith(IMAGE_ROOT + "/"), path
    return REPO / path.removeprefix(IMAGE_ROOT + "/")


def config_arg(command: list[str]) -> str:
    return command[command.index("--config") + 1]


# --- compose -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml(DEPLOY / "compose.yaml")


def test_compose_has_every_service_with_its_port(compose):
    services = compose["services"]
    assert set(services) >= {"kafka", "trainer", "simulator", "prometheus", "grafana"}
    container_ports = {name: {str(p).split(":")[-1] for p in svc.get("ports", [])} for name, svc in services.items()}
    assert "8000" in container_ports["trainer"]
    assert "9090" in container_ports["prometheus"]
    assert "3000" in container_ports["grafana"]
    assert container_ports["kafka"]  # reachable from the host
    declared = set(compose.get("volumes") or {})
    for svc in services.values():
        for mount in svc.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"bind mount source {source} is missing"
            else:
                assert source in declared, f"named volume {source} is not declared"


def test_compose_kafka_is_single_node_kraft(compose):
    kafka = compose["services"]["kafka"]
    assert kafka["image"] == "apache/kafka:4.1.1"
    env = env_dict(kafka["environment"])
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    node_id = env["KAFKA_NODE_ID"]
    listeners = dict(re.match(r"(\w+)://[^:]*:(\d+)", item).groups() for item in env["KAFKA_LISTENERS"].split(","))
    controller = env["KAFKA_CONTROLLER_LISTENER_NAMES"]
    assert controller in listeners
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{node_id}@{kafka['hostname']}:{listeners[controller]}"
    protocol_map = dict(item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert set(listeners) <= set(protocol_map)
    advertised = env["KAFKA_ADVERTISED_LISTENERS"]
    assert controller not in advertised
    assert f"//{kafka['hostname']}:9092" in advertised  # what the other services use
    for key in ("KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR", "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"):
        assert env[key] == "1"
    assert re.fullmatch(r"[A-Za-z0-9_-]{22}", env["CLUSTER_ID"])  # base64 of 16 bytes
    assert env["KAFKA_LOG_DIRS"] in {m.split(":")[1] for m in kafka["volumes"]}
    # the simulator's too_large messages must fit through the broker to be dead-lettered
    sim = load_simulation_config(REPO / "services/sensor-sim/sensor-sim.toml", environ={})
    assert int(env["KAFKA_MESSAGE_MAX_BYTES"]) >= 2 * sim.max_message_bytes
    assert "/healthz" not in str(kafka["healthcheck"]["test"])


def test_compose_trainer_and_simulator(compose):
    services = compose["services"]
    for name in ("trainer", "simulator"):
        svc = services[name]
        assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
        env = env_dict(svc["environment"])
        assert env["STREAMTRAIN_KAFKA_BOOTSTRAP"] == "kafka:9092"
        assert svc["depends_on"]["kafka"]["condition"] == "service_healthy"
        for env_name in env:
            assert setting_of(env_name) in Settings.model_fields, f"{name}: {env_name} is not a setting"
    trainer = services["trainer"]
    assert env_dict(trainer["environment"])["STREAMTRAIN_CHECKPOINT_DIR"] == CHECKPOINT_DIR
    assert any(m.split(":")[1] == CHECKPOINT_DIR for m in trainer["volumes"])
    assert "/healthz" in " ".join(trainer["healthcheck"]["test"])
    simulator = services["simulator"]
    assert simulator["command"][:2] == ["streamtrain", "simulate"]
    assert repo_path_of_image_path(config_arg(simulator["command"])).is_file()
    assert simulator["healthcheck"]["disable"] is True  # no HTTP server to probe
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")


# --- Prometheus and Grafana ---------------------------------------------------------------


def test_prometheus_scrapes_the_trainer_metrics(compose):
    config = load_yaml(DEPLOY / "prometheus/prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    job = jobs["streamtrain"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    host, port = targets[0].split(":")
    assert host in compose["services"] and f"{port}" in str(compose["services"][host]["ports"])
    mounts = compose["services"]["prometheus"]["volumes"]
    assert any(m.startswith("./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml") for m in mounts)


def test_grafana_provisioning_points_at_prometheus_and_the_dashboards(compose):
    datasources = load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yaml")["datasources"]
    (prometheus,) = [d for d in datasources if d["type"] == "prometheus"]
    assert prometheus["url"] == "http://prometheus:9090"
    providers = load_yaml(DEPLOY / "grafana/provisioning/dashboards/streamtrain.yaml")["providers"]
    mounts = dict(m.split(":")[:2] for m in compose["services"]["grafana"]["volumes"] if m.startswith("."))
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    assert providers[0]["options"]["path"] == mounts["./grafana/dashboards"]
    dashboard = json.loads((DEPLOY / "grafana/dashboards/streamtrain.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]} | {
        p["datasource"]["uid"] for p in dashboard["panels"]
    }
    assert uids == {prometheus["uid"]}


def dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads((DEPLOY / "grafana/dashboards/streamtrain.json").read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def base_metric(name: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in CONTRACT_HISTOGRAMS:
            return name.removesuffix(suffix)
    return name


def test_dashboard_uses_only_spec_metric_names():
    exprs = dashboard_exprs()
    assert exprs
    used = set()
    for title, expr in exprs:
        names = METRIC_NAME.findall(expr)
        assert names, f"panel {title!r}: {expr!r} reads no streamtrain metric"
        for name in names:
            assert base_metric(name) in CONTRACT_METRICS, (
                f"panel {title!r} uses {name}, which docs/contract.md, section 3, does not define"
            )
            used.add(base_metric(name))
        assert expr.count("(") == expr.count(")"), f"panel {title!r}: unbalanced parentheses"
    # the panels the operators asked for
    assert {
        "streamtrain_events_consumed_total",
        "streamtrain_events_accepted_total",
        "streamtrain_events_rejected_total",
        "streamtrain_window_size",
        "streamtrain_window_capacity",
        "streamtrain_window_age_seconds",
        "streamtrain_train_loss",
        "streamtrain_train_padding_tokens_total",
        "streamtrain_train_tokens_total",
        "streamtrain_predict_latency_seconds",
        "streamtrain_dp_epsilon",
        "streamtrain_consumer_lag_messages",
        "streamtrain_model_version",
        "streamtrain_prequential_mse",
        "streamtrain_prequential_naive_mse",
        "streamtrain_drift_detected_total",
    } <= used


def test_dashboard_promql_uses_each_metric_type_correctly():
    for title, expr in dashboard_exprs():
        for inner in re.findall(r"\b(?:rate|increase)\((streamtrain_[a-z0-9_]+)", expr):
            assert inner.endswith(("_total",) + HISTOGRAM_SUFFIXES), f"panel {title!r}: rate() over gauge {inner}"
        for inner in re.findall(r"histogram_quantile\(\s*[0-9.]+\s*,.*?(streamtrain_[a-z0-9_]+)", expr):
            assert inner.endswith("_bucket") and inner.removesuffix("_bucket") in CONTRACT_HISTOGRAMS, title
            assert "by (le)" in expr.replace("by(le)", "by (le)"), f"panel {title!r}: quantile must keep le"
        for name in METRIC_NAME.findall(expr):
            if name.endswith("_bucket"):
                assert "histogram_quantile" in expr, f"panel {title!r}: raw bucket series"


def test_dashboard_layout_is_valid():
    dashboard = json.loads((DEPLOY / "grafana/dashboards/streamtrain.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
    assert dashboard["uid"] and dashboard["title"]


def test_the_contract_lists_the_metrics_dashboards_rely_on():
    """Runs in every clone: the list is the project's own (docs/contract.md)."""
    assert len(CONTRACT_METRICS) >= 20
    assert {
        "streamtrain_train_step_seconds", "streamtrain_train_batch_sequences",
        "streamtrain_train_sample_age_seconds", "streamtrain_predict_latency_seconds",
    } == CONTRACT_HISTOGRAMS  # fmt: skip
    assert all(kind in {"counter", "gauge", "histogram"} for kind in CONTRACT_METRICS.values())
    assert all(name.endswith("_total") == (kind == "counter") for name, kind in CONTRACT_METRICS.items())


# --- Kubernetes --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def manifests() -> dict[str, list[dict[str, Any]]]:
    docs: dict[str, list[dict[str, Any]]] = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            assert isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind"), (
                f"{path.name}: no apiVersion/kind"
            )
            assert "namespace" not in doc.get("metadata", {}), f"{path.name}: manifests stay namespace-less"
            docs.setdefault(doc["kind"], []).append(doc | {"_file": path.name})
    return docs


def the(manifests: dict[str, list[dict[str, Any]]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in manifests.get(kind, []) if d["metadata"]["name"] == name]
    return doc


def test_k8s_trainer_statefulset(manifests):
    trainer = the(manifests, "StatefulSet", "streamtrain-trainer")
    spec = trainer["spec"]
    assert spec["replicas"] == 1
    pod = spec["template"]["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    (container,) = pod["containers"]
    assert container["args"][:2] == ["streamtrain", "serve"]
    assert repo_path_of_image_path(config_arg(container["args"])).is_file()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "rendezvous": 29500}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] in ports
    assert {"cpu", "memory"} <= set(container["resources"]["requests"]) and {"cpu", "memory"} <= set(
        container["resources"]["limits"]
    )
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    # checkpoints: one claim per replica, mounted where the settings point
    claims = {t["metadata"]["name"] for t in spec["volumeClaimTemplates"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[CHECKPOINT_DIR] in claims
    config = the(manifests, "ConfigMap", container["envFrom"][0]["configMapRef"]["name"])
    assert config["data"]["STREAMTRAIN_CHECKPOINT_DIR"] == CHECKPOINT_DIR
    token = {e["name"]: e for e in container["env"]}["STREAMTRAIN_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token["name"] and token["key"] and token["optional"] is True
    assert the(manifests, "Service", spec["serviceName"])["spec"]["clusterIP"] == "None"


def test_k8s_trainer_is_a_world_of_its_replicas(manifests):
    """torch.distributed's env:// variables: one rank per pod, rank 0 reached through the headless Service."""
    trainer = the(manifests, "StatefulSet", "streamtrain-trainer")
    (container,) = trainer["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["WORLD_SIZE"]["value"] == str(trainer["spec"]["replicas"]) == "1"  # one process, as before
    assert env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    headless = the(manifests, "Service", trainer["spec"]["serviceName"])
    assert env["MASTER_ADDR"]["value"] == f"{trainer['metadata']['name']}-0.{headless['metadata']['name']}"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(env["MASTER_PORT"]["value"]) == ports["rendezvous"]
    assert headless["spec"]["publishNotReadyAddresses"] is True  # ranks meet before any is ready
    assert {p["targetPort"] for p in headless["spec"]["ports"]} == {"http", "rendezvous"}
    assert trainer["spec"]["podManagementPolicy"] == "Parallel"  # start together: the rendezvous waits for all


def _strategic_merge(base: Any, patch: Any) -> Any:
    """Kubernetes' strategic merge as far as these manifests use it: maps merge, named lists merge by name."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: _strategic_merge(base[k], v) if k in base else v for k, v in patch.items()}}
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(i, dict) and "name" in i for i in base + patch)
    ):
        merged = {item["name"]: item for item in base}
        for item in patch:
            merged[item["name"]] = _strategic_merge(merged[item["name"]], item) if item["name"] in merged else item
        return list(merged.values())
    return patch


def _json_patch(doc: dict[str, Any], operations: list[dict[str, Any]]) -> dict[str, Any]:
    for op in operations:
        *parents, last = op["path"].strip("/").split("/")
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if op["op"] == "remove":
            del node[last]
        else:
            node[last] = op["value"]
    return doc


@pytest.fixture(scope="module")
def scale_out(manifests) -> dict[str, Any]:
    """deploy/k8s-scale-out rendered as kustomize renders it (also checked against kubectl when present)."""
    overlay = DEPLOY / "k8s-scale-out"
    kustomization = load_yaml(overlay / "kustomization.yaml")
    assert kustomization["resources"][0] == "../k8s"
    extra = [load_yaml(overlay / name) for name in kustomization["resources"][1:]]
    trainer = {k: v for k, v in the(manifests, "StatefulSet", "streamtrain-trainer").items() if k != "_file"}
    for patch in kustomization["patches"]:
        if "path" in patch:
            trainer = _strategic_merge(trainer, load_yaml(overlay / patch["path"]))
        else:
            assert patch["target"] == {"kind": "StatefulSet", "name": "streamtrain-trainer"}
            trainer = _json_patch(trainer, yaml.safe_load(patch["patch"]))
    return {"trainer": trainer, "extra": extra}


def test_k8s_scale_out_overlay_runs_ranks_over_one_shared_volume(scale_out):
    trainer = scale_out["trainer"]
    spec = trainer["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert int(env["WORLD_SIZE"]["value"]) == spec["replicas"] == 2, "change replicas and WORLD_SIZE together"
    assert "volumeClaimTemplates" not in spec, "a volume per pod cannot hold one checkpoint of every rank"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    claim = volumes[mounts[CHECKPOINT_DIR]]["persistentVolumeClaim"]["claimName"]
    (pvc,) = [d for d in scale_out["extra"] if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == claim]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    probe = container["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 900, "the rendezvous may wait 15 min for the last pod"
    assert pod["terminationGracePeriodSeconds"] >= 30
    assert env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"].endswith("['apps.kubernetes.io/pod-index']")


def test_k8s_scale_out_overlay_renders_with_kubectl_when_it_is_installed(scale_out):
    import shutil
    import subprocess

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the overlay is checked by the emulation above")
    rendered = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / "k8s-scale-out")], capture_output=True, text=True, timeout=120
    )
    assert rendered.returncode == 0, rendered.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(rendered.stdout)}
    trainer = docs[("StatefulSet", "streamtrain-trainer")]
    assert trainer["spec"] == scale_out["trainer"]["spec"] | {"template": trainer["spec"]["template"]}
    container = trainer["spec"]["template"]["spec"]["containers"][0]
    expected = scale_out["trainer"]["spec"]["template"]["spec"]["containers"][0]
    assert sorted(container["env"], key=lambda e: e["name"]) == sorted(expected["env"], key=lambda e: e["name"])
    assert container["startupProbe"] == expected["startupProbe"]
    assert ("PersistentVolumeClaim", "streamtrain-checkpoints") in docs


def test_k8s_configmap_holds_only_real_settings(manifests):
    (config,) = manifests["ConfigMap"]
    for env_name, value in config["data"].items():
        assert setting_of(env_name) in Settings.model_fields, f"{env_name} is not a setting"
        assert isinstance(value, str)
    overrides = {setting_of(k): v for k, v in config["data"].items()}
    settings = Settings(**overrides)  # every value is valid for the service
    assert settings.http_port == 8000
    shared = {
        ENV_SETTINGS[k.removeprefix("STREAMTRAIN_")]: v
        for k, v in config["data"].items()
        if k.removeprefix("STREAMTRAIN_") in ENV_SETTINGS
    }
    load_simulation_config(None, environ={}, overrides=shared)  # and for the simulator


def test_k8s_service_routes_to_the_trainer(manifests):
    trainer = the(manifests, "StatefulSet", "streamtrain-trainer")
    labels = trainer["spec"]["template"]["metadata"]["labels"]
    service = the(manifests, "Service", "streamtrain-trainer")
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == 8000 and port["targetPort"] == "http"


def test_k8s_simulator_deployment(manifests):
    sim = the(manifests, "Deployment", "streamtrain-simulator")
    pod = sim["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["args"][:2] == ["streamtrain", "simulate"]
    assert repo_path_of_image_path(config_arg(container["args"])).is_file()
    assert container["envFrom"][0]["configMapRef"]["name"] == manifests["ConfigMap"][0]["metadata"]["name"]
    assert sim["spec"]["selector"]["matchLabels"].items() <= sim["spec"]["template"]["metadata"]["labels"].items()


def test_k8s_kustomization_lists_every_manifest(manifests):
    (kustomization,) = manifests["Kustomization"]
    others = {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {kustomization["_file"]}
    assert set(kustomization["resources"]) == others


# --- Dockerfile --------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (REPO / "Dockerfile").read_text(encoding="utf-8")
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_dockerfile_runs_the_service_unprivileged_with_a_healthcheck():
    instructions = dockerfile_instructions()
    by_keyword: dict[str, list[str]] = {}
    for keyword, rest in instructions:
        by_keyword.setdefault(keyword, []).append(rest)
    assert by_keyword["FROM"] == ["python:3.11-slim"]
    user = by_keyword["USER"][-1].split(":")[0]
    assert user not in {"root", "0"}
    assert [k for k, _ in instructions].index("USER") > max(i for i, (k, _) in enumerate(instructions) if k == "RUN")
    assert "8000" in by_keyword["EXPOSE"][-1].split()
    healthcheck = by_keyword["HEALTHCHECK"][-1]
    assert "/healthz" in healthcheck and "curl" not in healthcheck
    assert CHECKPOINT_DIR in by_keyword["VOLUME"][-1]
    assert any("pip install" in run and " ." in run for run in by_keyword["RUN"])
    cmd = json.loads(by_keyword["CMD"][-1])
    assert cmd[:2] == ["streamtrain", "serve"]
    assert repo_path_of_image_path(config_arg(cmd)).is_file()
    # the service runs on jemalloc (streamtrain.runtime.allocator): installed, linked, preloaded
    assert any("libjemalloc2" in run and "/usr/local/lib/libjemalloc.so.2" in run for run in by_keyword["RUN"])
    assert any(env.startswith("LD_PRELOAD=/usr/local/lib/libjemalloc.so.2") for env in by_keyword["ENV"])
    copied = {shlex.split(rest)[0] for rest in by_keyword["COPY"]}
    for source in copied:
        assert (REPO / source).exists(), f"COPY {source}: missing in the repository"


def test_the_container_runs_the_service_itself_so_its_exit_status_reaches_the_runtime(manifests, compose):
    """SIGTERM goes to PID 1 and PID 1's status is the container's: PID 1 must be ``streamtrain
    serve`` (exit 0 after the final checkpoint), not a shell that dies of the signal (143)."""
    instructions = dockerfile_instructions()
    keywords = [k for k, _ in instructions]
    assert "ENTRYPOINT" not in keywords  # CMD is run as it is
    assert "STOPSIGNAL" not in keywords  # the runtime sends SIGTERM, the signal the service stops on
    cmd = [rest for keyword, rest in instructions if keyword == "CMD"][-1]
    assert cmd.startswith("[") and json.loads(cmd)[0] == "streamtrain"  # exec form: no `sh -c` around it
    # Kubernetes and compose keep the image's way to run it: no command of their own (a shell) in front
    (container,) = the(manifests, "StatefulSet", "streamtrain-trainer")["spec"]["template"]["spec"]["containers"]
    assert "command" not in container and container["args"][0] == "streamtrain"
    assert "command" not in compose["services"]["trainer"] and "entrypoint" not in compose["services"]["trainer"]


FAKE_SERVICE = """import json, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(int(os.environ["FAKE_STATUS"])))
with open(os.environ["FAKE_OUT"] + ".tmp", "w") as out:
    json.dump({"pid": os.getpid(), "argv": sys.argv[1:]}, out)
os.replace(os.environ["FAKE_OUT"] + ".tmp", os.environ["FAKE_OUT"])
time.sleep(60)
"""


@pytest.mark.parametrize("status", [0, 1])
def test_the_trainer_run_script_execs_the_service_and_ends_with_its_status(tmp_path, status):
    """services/trainer/run.sh, with a stand-in ``streamtrain`` on PATH: the script's own process
    becomes the service (exec), SIGTERM reaches it, and its exit status is the service's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "streamtrain"
    fake.write_text(f"#!{sys.executable}\n{FAKE_SERVICE}")
    fake.chmod(0o755)
    out = tmp_path / "service.json"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_OUT": str(out),
        "FAKE_STATUS": str(status),
    }
    script = REPO / "services" / "trainer" / "run.sh"
    process = subprocess.Popen([str(script), "--port", "8123"], env=env, stdin=subprocess.DEVNULL)
    started = None
    try:
        deadline = time.monotonic() + 30
        while not out.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        started = json.loads(out.read_text())
        assert started["argv"] == ["serve", "--config", str(script.parent / "trainer.toml"), "--port", "8123"]
        assert started["pid"] == process.pid, "run.sh must exec the service, not run it as a child"
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == status
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        if started is not None and started["pid"] != process.pid:
            try:
                os.kill(started["pid"], signal.SIGKILL)  # the orphaned stand-in of a script that did not exec
            except ProcessLookupError:
                pass


def test_dockerignore_keeps_the_build_context_small_but_complete():
    patterns = {
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".venv", ".git"} <= patterns
    copied = {"src", "services", "pyproject.toml", "README.md"}
    assert not copied & patterns


# --- service configs ----------------------------------------------------------------------


def test_service_configs_load_and_agree(monkeypatch):
    for name in list(os.environ):
        if name.startswith("STREAMTRAIN_"):
            monkeypatch.delenv(name)
    trainer_toml = REPO / "services/trainer/trainer.toml"
    settings = load_settings(trainer_toml)
    assert set(tomllib.loads(trainer_toml.read_text())) <= set(Settings.model_fields)
    assert "admin_token" not in tomllib.loads(trainer_toml.read_text())  # secrets stay in the environment
    sim = load_simulation_config(REPO / "services/sensor-sim/sensor-sim.toml", environ={})
    assert (sim.topic, sim.channels, sim.n_classes, sim.max_len, sim.max_message_bytes) == (
        settings.topic,
        settings.channels,
        settings.n_classes,
        settings.max_len,
        settings.max_message_bytes,
    )
    assert sim.bootstrap == settings.kafka_bootstrap
    profile = REPO / "services/trainer/low-latency.toml"  # overrides a few keys, defaults for the rest
    assert set(tomllib.loads(profile.read_text())) <= set(Settings.model_fields)
    low = load_settings(profile)
    assert (low.pass_max_items, low.pass_fresh_share, low.token_budget) == (256, 0.9, 2048)
    assert low.topic == Settings().topic


@pytest.mark.parametrize(
    ("folder", "command", "config"),
    [("trainer", "serve", "trainer.toml"), ("sensor-sim", "simulate", "sensor-sim.toml")],
)
def test_service_entry_points(folder, command, config):
    script = REPO / "services" / folder / "run.sh"
    assert os.access(script, os.X_OK), f"{script} is not executable"
    text = script.read_text()
    assert text.startswith("#!")
    assert f'exec streamtrain {command} --config "$(dirname "$0")/{config}"' in text
    assert (REPO / "services" / folder / config).is_file() and (REPO / "services" / folder / "README.md").is_file()
