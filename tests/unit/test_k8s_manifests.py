"""deploy/k8s against Kubernetes' own OpenAPI schemas, offline (kubernetes-validate bundles them),
and against the settings the services actually run with: ports, drain grace, secrets.

No cluster here (and no kubectl or kubeconform: neither installs without GitHub), so this is what
`kubectl apply --dry-run=server` would catch short of admission; strict mode refuses unknown fields.
"""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.settings import Settings

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
# The oldest Kubernetes with gRPC probes GA (1.27) and the newest the validator knows.
VERSIONS = ("1.27", kubernetes_validate.latest_version())
SERVICES = ("asr", "llm", "tts", "gateway")


def documents() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in sorted(K8S.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for _, doc in documents() if doc["kind"] == kind}


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_kubernetes(version):
    found = documents()
    assert len(found) >= 12
    for _, doc in found:
        kubernetes_validate.validate(doc, version, strict=True)  # raises with the field's path


def test_the_validator_refuses_a_misspelled_field():
    deployment = copy.deepcopy(by_kind("Deployment")["llm"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grcp"] = {"port": 50052}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)


def test_the_kustomization_applies_every_manifest_but_the_secret():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    assert set(kustomization["resources"]) == files


def test_probes_ports_and_grace_match_the_settings():
    settings = Settings()
    config = by_kind("ConfigMap")["specvox"]["data"]
    assert float(config["SPECVOX_DRAIN_GRACE_S"]) == settings.drain_grace_s
    deployments = by_kind("Deployment")
    assert set(deployments) == set(SERVICES)
    for service, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        # SIGKILL only after the drain and the close hooks: the kubelet's grace must outlast the drain.
        assert pod["terminationGracePeriodSeconds"] == settings.drain_grace_s + 5
        [container] = pod["containers"]
        assert container["args"] == ["serve", service]
        port = getattr(settings, f"{service}_port")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port, (service, probe)
        secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
        assert secrets["SPECVOX_REDIS_URL"] == {"name": "specvox", "key": "redis-url"}
        assert secrets["SPECVOX_AUTH__SERVICE_TOKEN"] == {"name": "specvox", "key": "service-token"}
        assert not any("value" in e for e in container["env"])  # plain settings come from the ConfigMap
    for service in ("asr", "llm", "tts"):
        port = getattr(settings, f"{service}_port")
        assert config[f"SPECVOX_{service.upper()}_ADDRESS"] == f"dns:///{service}:{port}"
    # Every env name the pods set is a setting the services accept (Settings forbids unknown ones).
    env = dict(config) | {"SPECVOX_REDIS_URL": "redis://:x@valkey:6379/0", "SPECVOX_AUTH__SERVICE_TOKEN": "t",
                          "SPECVOX_AUTH__KEYS": ""}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        loaded = Settings()
    assert loaded.llm_address == config["SPECVOX_LLM_ADDRESS"] and loaded.redis_url.startswith("redis://")


def test_the_secret_example_names_every_key_the_pods_read():
    keys = set(by_kind("Secret")["specvox"]["stringData"])
    read = {ref["key"] for _, doc in documents() if doc["kind"] in ("Deployment", "StatefulSet")
            for c in doc["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])
            for ref in [e.get("valueFrom", {}).get("secretKeyRef")] if ref}
    assert read == keys
