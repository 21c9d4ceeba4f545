"""The deployment files in `deploy/` hold together: HAProxy accepts its config, the Compose files and the
Kubernetes manifests parse, every server command line is one `voicewire serve` accepts, and the names agree
across them (server ids = HAProxy server names = Compose services = StatefulSet pods). tests/test_balancer.py
runs the same haproxy.cfg in front of real servers; `docker compose` and a cluster are not available here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from voicewire.realtime.cli import build_parser
from voicewire.realtime.settings import Settings

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
HAPROXY = shutil.which("haproxy", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
GRACE_S = Settings().shutdown_grace_s


def load(name: str) -> Any:
    return yaml.safe_load((DEPLOY / name).read_text())


def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """Every Kubernetes object of the kustomization, by (kind, name)."""
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for resource in load("kustomization.yaml")["resources"]:
        for doc in yaml.safe_load_all((DEPLOY / resource).read_text()):
            objects[doc["kind"], doc["metadata"]["name"]] = doc
    return objects


def server_names() -> list[str]:
    """The `server` lines of haproxy.cfg, in order, and a check that each has its resume route."""
    config = (DEPLOY / "haproxy.cfg").read_text()
    names = re.findall(r"^\s+server (\S+) ", config, flags=re.M)
    routed = re.findall(r"^\s+use-server (\S+) if \{ url_param\(session_id\) -m beg (\S+)\. \}", config, flags=re.M)
    assert routed == [(name, name) for name in names]
    for index, name in enumerate(names):
        assert f'server {name} "${{VOICEWIRE_SERVER_{index}}}"' in config
        assert f"presetenv VOICEWIRE_SERVER_{index} {name}:8000" in config
    return names


def serve_args(argv: list[str]) -> Any:
    """The flags as `voicewire serve` parses them (argparse exits on a flag it does not know)."""
    assert argv[0] == "serve"
    args = build_parser().parse_args(argv)
    Settings(server_id=args.server_id)  # a valid server id
    return args


def test_haproxy_accepts_the_config_it_runs_in_the_tests() -> None:
    if HAPROXY is None:
        if os.environ.get("CI"):
            pytest.fail("haproxy is not installed (apt-get install haproxy)")
        pytest.skip("needs Debian's haproxy (apt-get install haproxy; always run in CI)")
    env = {**os.environ, "VOICEWIRE_BALANCER_BIND": "127.0.0.1:18000",
           **{f"VOICEWIRE_SERVER_{i}": f"127.0.0.1:{18001 + i}" for i in range(3)}}
    checked = subprocess.run([HAPROXY, "-c", "-f", str(DEPLOY / "haproxy.cfg")], env=env, capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "Configuration file is valid" in checked.stdout + checked.stderr
    assert server_names() == ["voicewire-0", "voicewire-1", "voicewire-2"]


def test_compose_runs_one_server_per_haproxy_line_with_the_keys_secret_and_the_shared_voices() -> None:
    names = server_names()
    compose = load("compose.yaml")
    services = compose["services"]
    assert sorted(services) == sorted([*names, "balancer"])
    for name in names:
        service = services[name]
        args = serve_args(service["command"])
        assert args.server_id == name and args.trust_forwarded_for and args.host == "0.0.0.0"
        assert args.port == 8000 and str(args.api_keys_file) == "/run/secrets/voicewire_keys"
        assert service["secrets"] == ["voicewire_keys"] and "voices:/data/voices" in service["volumes"]
        assert str(args.voices_dir) == "/data/voices"
        grace = service["stop_grace_period"]
        assert service["stop_signal"] == "SIGTERM" and grace.endswith("s") and float(grace[:-1]) > GRACE_S
        assert "/ready" in " ".join(service["healthcheck"]["test"])
    balancer = services["balancer"]
    assert "./haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro" in balancer["volumes"]
    assert balancer["environment"] == {"VOICEWIRE_BALANCER_BIND": ":8000",
                                       **{f"VOICEWIRE_SERVER_{i}": f"{n}:8000" for i, n in enumerate(names)}}
    assert compose["secrets"]["voicewire_keys"]["file"] == "./keys" and "voices" in compose["volumes"]

    gpu = load("compose.gpu.yaml")["services"]
    assert sorted(gpu) == names
    devices = []
    for name in names:
        args = serve_args(gpu[name]["command"])
        assert args.server_id == name and args.engine == "talker" and args.talker_model and args.codec_model
        assert str(args.api_keys_file) == "/run/secrets/voicewire_keys" and str(args.voices_dir) == "/data/voices"
        (device,) = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        devices.extend(device["device_ids"])
    assert devices == [str(i) for i in range(len(names))], "one GPU per server"


def test_kubernetes_runs_the_servers_as_a_statefulset_behind_haproxy() -> None:
    names = server_names()
    objects = manifests()
    statefulset = objects["StatefulSet", "voicewire"]
    assert statefulset["spec"]["replicas"] == len(names)
    assert [f"{statefulset['metadata']['name']}-{i}" for i in range(len(names))] == names
    pod = statefulset["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > GRACE_S
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    args = serve_args([a.replace("$(POD_NAME)", names[0]) for a in container["args"]])
    assert args.server_id == names[0] and args.trust_forwarded_for and args.port == 8000
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert str(args.api_keys_file).startswith(mounts["keys"] + "/")
    assert volumes["keys"]["secret"]["secretName"] == "voicewire-keys"
    assert str(args.voices_dir) == mounts["voices"]
    claim = volumes["voices"]["persistentVolumeClaim"]["claimName"]
    assert objects["PersistentVolumeClaim", claim]["spec"]["accessModes"] == ["ReadWriteMany"]

    service = objects["Service", statefulset["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True

    balancer = objects["Deployment", "voicewire-balancer"]["spec"]["template"]["spec"]
    (haproxy,) = balancer["containers"]
    values = {e["name"]: e.get("value") for e in haproxy["env"]}
    for index, name in enumerate(names):
        assert values[f"VOICEWIRE_SERVER_{index}"] == f"{name}.voicewire.$(NAMESPACE).svc.cluster.local:8000"
    config_volume = next(v for v in balancer["volumes"] if "configMap" in v)
    generated = load("kustomization.yaml")["configMapGenerator"]
    assert generated == [{"name": config_volume["configMap"]["name"], "files": ["haproxy.cfg"]}]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (its built-in kustomize renders offline)")
def test_kustomize_renders_the_manifests_with_the_balancer_config_as_a_configmap() -> None:
    rendered = subprocess.run(["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    objects = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(rendered.stdout)}
    (config_name,) = [name for kind, name in objects if kind == "ConfigMap"]
    assert objects["ConfigMap", config_name]["data"]["haproxy.cfg"] == (DEPLOY / "haproxy.cfg").read_text()
    pod = objects["Deployment", "voicewire-balancer"]["spec"]["template"]["spec"]
    assert [v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v] == [config_name]
