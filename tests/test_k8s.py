"""The Kubernetes manifests (deploy/k8s) stay valid and in step with the code: each
overlay renders with `kubectl kustomize`, every object passes the Kubernetes schemas
(kubernetes-validate, offline), and every kvmesh container's command line and
environment parse with the real config class of its role, as the pod would see them.

Offline and fast: no cluster. The manifests are written for kustomize v2.0.3 (Debian's
kubernetes-client, what scripts/setup.sh installs) as well as current ones; set KUBECTL
to run these tests with another kubectl binary. Without kubectl they skip, except under
CI (CI=true), where they fail.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvmesh.services.common.config import ConfigError, load
from kvmesh.services.common.health import service_names
from kvmesh.services.conductor.config import ConductorConfig
from kvmesh.services.decode.server import DecodeConfig
from kvmesh.services.prefill.server import PrefillConfig
from kvmesh.services.store_master.config import StoreMasterConfig

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ["overlays/cpu", "overlays/gpu", "examples/external-etcd", "examples/tls"]
ROLES = {
    "conductor": ConductorConfig,
    "store-master": StoreMasterConfig,
    "prefill": PrefillConfig,
    "decode": DecodeConfig,
}
# the Dockerfile's targets: `control` (no torch) and `node` (kvmesh[engine])
IMAGES = {
    "conductor": "kvmesh-control:local",
    "store-master": "kvmesh-control:local",
    "prefill": "kvmesh:local",
    "decode": "kvmesh:local",
}
# Kubernetes versions the objects must be valid for: the first with GA gRPC probes, and
# the newest that kubernetes-validate bundles.
K8S_VERSIONS = ["1.27.0", "1.37.0"]
POD_IP = "10.244.3.17"  # what status.podIP gives the pod
OPERATOR_SECRETS = {  # what the operator puts in the Secrets the manifests reference
    ("kvmesh-secret", "secret"): "5f2b" * 16,
    ("kvmesh-api-keys", "keys"): "k-team-a:team-a\nk-team-b:team-b\n",
    ("kvmesh-tls", "tls.crt"): "-----BEGIN CERTIFICATE-----\n",
    ("kvmesh-tls", "tls.key"): "-----BEGIN PRIVATE KEY-----\n",
    ("kvmesh-tls", "ca.crt"): "-----BEGIN CERTIFICATE-----\n",
}
# Service.shutdown: deregister (at most 3 s), --grace-s, drain (at most 30 s), server
# stop (2 s grace), then teardown; a pod's grace period must cover it with a margin.
DEREGISTER_S, DRAIN_CAP_S, SERVER_STOP_S, MARGIN_S = 3, 30, 2, 5


# --------------------------------------------------------------------------- rendering


def kubectl() -> str:
    exe = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if not exe:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true and kubectl is missing: scripts/setup.sh installs it")
        pytest.skip("kubectl is missing (Debian: apt-get install kubernetes-client)")
    return exe


@functools.cache
def _render(exe: str, overlay: str) -> tuple[dict, ...]:
    r = subprocess.run(
        [exe, "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, f"kubectl kustomize {overlay}:\n{r.stderr}"
    return tuple(d for d in yaml.safe_load_all(r.stdout) if d)


def render(overlay: str) -> list[dict]:
    return list(_render(kubectl(), overlay))


def objects(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}


def kvmesh_containers(docs: list[dict]) -> dict[str, tuple[dict, dict]]:
    """{role: (workload, container)} of the kvmesh services."""
    out = {}
    for w in objects(docs, "Deployment").values():
        for c in w["spec"]["template"]["spec"]["containers"]:
            role = c["args"][0]
            assert role not in out, f"{role} runs in two Deployments"
            out[role] = (w, c)
    return out


def port(container: dict, name: str) -> int | None:
    for p in container.get("ports", []):
        if p.get("name") == name:
            return p["containerPort"]
    return None


# --------------------------------------------------------------------------- the pod's view


def container_env(docs: list[dict], w: dict, c: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom first, then env
    (which overrides); fieldRefs, ConfigMaps and the operator's Secrets resolved."""
    configmaps = objects(docs, "ConfigMap")
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        ref = src["configMapRef"]["name"]
        assert ref in configmaps, f"envFrom names ConfigMap {ref}, which is not rendered"
        env.update(configmaps[ref]["data"])
    fields = {"status.podIP": POD_IP, "metadata.name": f"{w['metadata']['name']}-7d9f-x2"}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
            continue
        vf = e["valueFrom"]
        if "fieldRef" in vf:
            env[e["name"]] = fields[vf["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in vf:
            ref = vf["secretKeyRef"]
            env[e["name"]] = OPERATOR_SECRETS[(ref["name"], ref["key"])]
        elif "configMapKeyRef" in vf:
            ref = vf["configMapKeyRef"]
            env[e["name"]] = configmaps[ref["name"]]["data"][ref["key"]]
        else:
            raise AssertionError(f"{e['name']}: unexpected valueFrom {vf}")
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command and args ($$ escapes)."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        arg,
    )


def mount_secrets(w: dict, c: dict, root: Path) -> dict[str, str]:
    """Writes the container's Secret volumes under ``root`` as the kubelet mounts them;
    returns {mountPath: where it is under root}."""
    volumes = {v["name"]: v for v in w["spec"]["template"]["spec"].get("volumes", [])}
    where = {}
    for m in c.get("volumeMounts", []):
        v = volumes[m["name"]]
        if "secret" not in v:
            continue
        name = v["secret"]["secretName"]
        d = root / m["mountPath"].lstrip("/")
        d.mkdir(parents=True)
        keys = [k for (s, k) in OPERATOR_SECRETS if s == name]
        assert keys, f"Secret {name}: not one of the documented ones"
        for k in keys:
            (d / k).write_text(OPERATOR_SECRETS[(name, k)])
        where[m["mountPath"]] = str(d)
    return where


def relocate(value: str, where: dict[str, str]) -> str:
    for mount, real in where.items():
        value = value.replace(mount + "/", real + "/")
    return value


def pod_config(docs, role, tmp_path):
    """(workload, container, argv, env, config) of ``role`` as its pod would start."""
    w, c = kvmesh_containers(docs)[role]
    assert "command" not in c, f"{role}: keep the image's entrypoint (kvmesh), give args"
    env = container_env(docs, w, c)
    where = mount_secrets(w, c, tmp_path)
    env = {k: relocate(v, where) for k, v in env.items()}
    argv = [relocate(expand(a, env), where) for a in c["args"][1:]]
    cfg = load(ROLES[role], argv, prog=f"kvmesh {role}", section=role, env=env)
    return w, c, argv, env, cfg


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_matches_the_kubernetes_schemas(overlay: str):
    kv = pytest.importorskip("kubernetes_validate")
    docs = render(overlay)
    assert docs
    for doc in docs:
        for version in K8S_VERSIONS:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                raise AssertionError(
                    f"{overlay}: {doc['kind']}/{doc['metadata']['name']} is not valid for "
                    f"Kubernetes {version}: {e.message} at {list(e.path)}"
                ) from None


def test_validation_catches_a_wrong_manifest():
    """kubernetes-validate really checks: a probe with a named gRPC port (must be a
    number) and a misspelt field both fail."""
    kv = pytest.importorskip("kubernetes_validate")
    docs = render("overlays/cpu")
    dep = objects(docs, "Deployment")["kvmesh-conductor"]
    bad = yaml.safe_load(yaml.safe_dump(dep))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSIONS[-1], strict=True)
    bad = yaml.safe_load(yaml.safe_dump(dep))
    bad["spec"]["template"]["spec"]["terminationGracePeriod"] = 60
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_role_once_with_its_image(overlay: str):
    docs = render(overlay)
    found = kvmesh_containers(docs)
    assert sorted(found) == sorted(ROLES)
    for role, (_, c) in found.items():
        assert c["image"] == IMAGES[role], f"{role}: image {IMAGES[role]}"
    deps = objects(docs, "Deployment")
    # two store-masters (one leads, one stands by: issue 17, part 2); two conductors,
    # both serving (each counts the other's work through the nodes' reports: part 3)
    assert deps["kvmesh-store-master"]["spec"]["replicas"] == 2
    assert deps["kvmesh-store-master"]["spec"]["strategy"]["type"] == "RollingUpdate"
    assert deps["kvmesh-conductor"]["spec"]["replicas"] == 2
    services = objects(docs, "Service")
    svc = services["kvmesh-conductor"]
    conductor = found["conductor"][1]
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {
        "grpc": "grpc",
        "http": "http",
    }
    assert (
        svc["spec"]["selector"].items()
        <= deps["kvmesh-conductor"]["spec"]["template"]["metadata"]["labels"].items()
    )
    assert port(conductor, "grpc") and port(conductor, "http")
    if overlay == "examples/external-etcd":
        assert "kvmesh-etcd" not in workloads(docs) and "kvmesh-etcd" not in services
    else:
        etcd = objects(docs, "StatefulSet")["kvmesh-etcd"]
        assert etcd["spec"]["replicas"] == 3
        assert services[etcd["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("role", sorted(ROLES))
def test_container_command_parses_with_the_role_config(overlay, role, tmp_path):
    docs = render(overlay)
    w, c, argv, env, cfg = pod_config(docs, role, tmp_path)
    assert isinstance(cfg, ROLES[role])
    # what the manifests say reached the config
    assert cfg.host == POD_IP, f"{role}: must bind and advertise the pod's address"
    assert cfg.node_id == env["POD_NAME"], f"{role}: node id = the pod's name"
    assert cfg.port == port(c, "grpc") != 0
    assert cfg.metrics_port == port(c, "metrics") > 0
    annotations = w["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(cfg.metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"
    etcd = [e.split(":")[0] for e in cfg.etcd_endpoints]
    if overlay == "examples/external-etcd":
        assert all(h.endswith(".example.internal") for h in etcd)
    else:
        # the members of the bundled StatefulSet, by their stable names
        sts = objects(docs, "StatefulSet")["kvmesh-etcd"]
        want = [f"kvmesh-etcd-{i}.{sts['spec']['serviceName']}" for i in range(3)]
        assert etcd == want
    if role in ("prefill", "decode"):
        assert cfg.data_port == port(c, "data") != 0
        assert cfg.secret == OPERATOR_SECRETS[("kvmesh-secret", "secret")]
        assert not any(cfg.secret in a for a in c["args"]), "secret on the command line"
        ref = next(e for e in c["env"] if e["name"] == "KVMESH_SECRET")["valueFrom"]
        assert ref["secretKeyRef"]["name"] == "kvmesh-secret"
    if role == "store-master":
        assert cfg.fast_port == port(c, "fast") != 0
    if role == "conductor":
        assert cfg.http_port == port(c, "http") != 0
        assert cfg.api_keys_file, "the conductor's API must not be open in a cluster"
        assert Path(cfg.api_keys_file).is_file()
    if overlay == "examples/tls":
        assert cfg.tls_cert and cfg.tls_key and cfg.tls_ca, f"{role}: mutual TLS"
        assert cfg.tls_server_name == "kvmesh"

    # A wrong flag or a wrong value must fail, or this test proves nothing.
    with pytest.raises(SystemExit):
        load(ROLES[role], argv + ["--no-such-flag", "1"], env=env)
    with pytest.raises(ConfigError):
        load(ROLES[role], argv + ["--port", "not-a-port"], env=env)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_nodes_refuse_a_missing_or_well_known_secret(role, tmp_path):
    """The manifests ship no secret: a node whose Secret holds a well-known value (or
    that got none) refuses to start on its pod address, telling to set KVMESH_SECRET."""
    docs = render("overlays/cpu")
    _, _, argv, env, _ = pod_config(docs, role, tmp_path)
    for secret in (None, "change-me", "kvmesh-dev-secret"):
        e = dict(env)
        e.pop("KVMESH_SECRET")
        if secret is not None:
            e["KVMESH_SECRET"] = secret
        with pytest.raises(ConfigError, match="KVMESH_SECRET"):
            load(ROLES[role], argv, section=role, env=e)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_values_in_the_manifests(overlay: str):
    docs = render(overlay)
    assert not objects(docs, "Secret"), "ship references to Secrets, never Secrets"
    for cm in objects(docs, "ConfigMap").values():
        for key in cm["data"]:
            assert not re.search(r"SECRET|PASSWORD|API_KEYS$|TLS_KEY", key), (
                f"{key} belongs in a Secret"
            )
    for role, (_, c) in kvmesh_containers(docs).items():
        for e in c.get("env", []):
            if re.search(r"SECRET|PASSWORD|API_KEYS$", e["name"]):
                assert "secretKeyRef" in e.get("valueFrom", {}), f"{role}: {e['name']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_shutdown(overlay: str, tmp_path):
    docs = render(overlay)
    for role, (w, c) in kvmesh_containers(docs).items():
        cfg = pod_config(docs, role, tmp_path / role)[4]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]
            if overlay == "examples/tls":
                # the native gRPC probe speaks no TLS: `kvmesh health` with the pod's files
                assert "grpc" not in probe
                script = probe["exec"]["command"]
                assert script[:2] == ["sh", "-c"]
                words = shlex.split(script[2])
                assert words[:3] == ["exec", "kvmesh", "health"]
                assert words[-1] == f"$KVMESH_HOST:{cfg.port}"
                for flag in ("--tls-ca", "--tls-cert", "--tls-key"):
                    assert words[words.index(flag) + 1].startswith("/etc/kvmesh/tls/")
            else:
                # Kubernetes' native gRPC probe on grpc.health.v1, for the role's service
                assert probe["grpc"]["port"] == cfg.port, f"{role} {kind}"
                assert probe["grpc"]["service"] in ["", *service_names(role)]
        # loading a model may take minutes; liveness never fires during a drain
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
        live = c["livenessProbe"]
        grace = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        sleep_s = int(pre_stop[1]) if pre_stop and pre_stop[0] == "sleep" else 0
        drain = DEREGISTER_S + cfg.grace_s + DRAIN_CAP_S + SERVER_STOP_S + MARGIN_S
        assert grace >= sleep_s + drain, f"{role}: grace {grace}s < {sleep_s + drain}s"
        assert live["periodSeconds"] * live["failureThreshold"] >= sleep_s + drain
        if role == "conductor":
            assert cfg.drain_timeout_s < DRAIN_CAP_S
    for name, w in workloads(docs).items():
        for c in w["spec"]["template"]["spec"]["containers"]:
            assert c.get("readinessProbe") and c.get("livenessProbe"), f"{name}: probes"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_workload_has_a_disruption_budget(overlay: str):
    docs = render(overlay)
    pdbs = list(objects(docs, "PodDisruptionBudget").values())
    for name, w in workloads(docs).items():
        labels = w["spec"]["template"]["metadata"]["labels"]
        covering = [
            p for p in pdbs if p["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ]
        assert len(covering) == 1, f"{name}: want one PodDisruptionBudget"
        spec = covering[0]["spec"]
        if name == "kvmesh-etcd":
            assert spec["minAvailable"] == 2, "etcd keeps its quorum through drains"
        else:
            # with one replica, minAvailable: 1 would block every node drain
            assert (
                spec.get("maxUnavailable") == 1
                or spec.get("minAvailable", 0) < (w["spec"]["replicas"])
            )


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, "keep NetworkPolicy selectors to matchLabels"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _rule_admits(rule: dict, c: dict, port_name: str) -> bool:
    number = port(c, port_name)
    ports = rule.get("ports")
    if not ports:
        return True
    return any(p.get("port") in (port_name, number) for p in ports)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_keeps_the_data_plane_among_kvmesh_pods(overlay: str):
    docs = render(overlay)
    policies = list(objects(docs, "NetworkPolicy").values())
    kvmesh = {"app.kubernetes.io/part-of": "kvmesh"}
    checked = 0
    for name, w in workloads(docs).items():
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert kvmesh.items() <= labels.items(), f"{name}: label it part-of kvmesh"
        mine = [p for p in policies if _selects(p["spec"]["podSelector"], labels)]
        assert mine, f"{name}: no NetworkPolicy selects it, so every port is open"
        for c in w["spec"]["template"]["spec"]["containers"]:
            for port_name in ("data", "fast", "client", "peer"):
                if port(c, port_name) is None:
                    continue
                checked += 1
                for p in mine:
                    assert "Ingress" in p["spec"]["policyTypes"]
                    for rule in p["spec"].get("ingress", []):
                        if not _rule_admits(rule, c, port_name):
                            continue
                        peers = rule.get("from")
                        assert peers, f"{p['metadata']['name']} opens {name}:{port_name}"
                        for peer in peers:
                            assert set(peer) == {"podSelector"}, (
                                f"{p['metadata']['name']}: {name}:{port_name} only from "
                                "kvmesh pods of this namespace"
                            )
                            sel = peer["podSelector"]["matchLabels"]
                            assert kvmesh.items() <= sel.items()
    assert checked >= 2  # at least the prefill's and the decode's data ports
    # and the client API stays reachable from outside the kvmesh pods
    w, c = kvmesh_containers(docs)["conductor"]
    labels = w["spec"]["template"]["metadata"]["labels"]
    for port_name in ("grpc", "http"):
        assert any(
            _rule_admits(rule, c, port_name) and not rule.get("from")
            for p in policies
            if _selects(p["spec"]["podSelector"], labels)
            for rule in p["spec"].get("ingress", [])
        ), f"conductor {port_name} is closed to clients"


def test_gpu_overlay_requests_gpus_and_cpu_does_not():
    for overlay, gpus in (("overlays/gpu", 1), ("overlays/cpu", None)):
        found = kvmesh_containers(render(overlay))
        for role, (_, c) in found.items():
            limits = c.get("resources", {}).get("limits", {})
            want = gpus if role in ("prefill", "decode") else None
            assert limits.get("nvidia.com/gpu") == want, f"{overlay} {role}"
            assert not any(k.startswith("rdma/") for k in limits), "RDMA stays optional"
    # the optional RDMA device resource is there to uncomment
    text = (K8S / "overlays" / "gpu" / "gpu.yaml").read_text()
    assert re.search(r"^\s*# rdma/\S+: 1$", text, re.M)


@pytest.mark.parametrize("overlay", ["overlays/cpu", "overlays/gpu"])
def test_conductor_and_nodes_read_models_from_a_model_volume(overlay: str):
    """The conductor loads its tokenizer by the model's name from the Hugging Face cache
    on a volume of its own (no node's path), as the nodes load the model: HF_HOME lies on
    the `models` volume in each."""
    docs = render(overlay)
    containers = kvmesh_containers(docs)
    for role in ("conductor", "prefill", "decode"):
        w, c = containers[role]
        home = {e["name"]: e.get("value") for e in c.get("env", [])}.get("HF_HOME")
        mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
        volumes = {v["name"] for v in w["spec"]["template"]["spec"]["volumes"]}
        assert "models" in mounts and "models" in volumes, f"{role}: no models volume"
        assert home and home.startswith(mounts["models"] + "/"), f"{role}: HF_HOME {home}"
