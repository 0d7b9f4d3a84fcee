"""infra/compose.yaml is not run in CI (no Docker daemon there), so its wiring is checked
here: the files it names exist, the environment it gives the workers is what the code
reads, the worker flags exist, Prometheus scrapes the ports the workers serve, and the
search attributes it registers are the ones the dev server registers."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra.temporal_server import SEARCH_ATTRIBUTES

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
COMPOSE = INFRA / "compose.yaml"
CODE_DIRS = ("workers", "gpu_runtime", "activities", "workflows", "milestone_cli")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict) -> dict[str, dict]:
    return compose["services"]


def worker_services(services: dict[str, dict]) -> dict[str, dict]:
    """The services that run our own image (control worker, node agents)."""
    return {name: s for name, s in services.items() if "build" in s}


def command_of(service: dict) -> list[str]:
    cmd = service.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def flag_value(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def env_vars_read(root: Path = ROOT, dirs: tuple[str, ...] = CODE_DIRS) -> set[str]:
    """Names the code reads from the environment: ``os.environ.get("X")``, ``env.get("X")``
    on an ``os.environ`` alias, ``os.getenv("X")``, ``os.environ["X"]``, and a name built from a
    module-level string constant (``env.get(PREFIX + "NAMESPACE")``)."""
    names: set[str] = set()
    env_name = re.compile(r"^[A-Z][A-Z0-9_]+$")
    for d in dirs:
        for path in (root / d).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                      and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                      for t in n.targets if isinstance(t, ast.Name)}
            for node in ast.walk(tree):
                key = None
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                    if node.func.attr in ("get", "getenv", "pop", "setdefault"):
                        key = node.args[0]
                elif isinstance(node, ast.Subscript):
                    key = node.slice
                if (isinstance(key, ast.BinOp) and isinstance(key.op, ast.Add) and isinstance(key.left, ast.Name)
                        and key.left.id in consts and isinstance(key.right, ast.Constant)
                        and isinstance(key.right.value, str)):
                    key = ast.Constant(consts[key.left.id] + key.right.value)
                if isinstance(key, ast.Constant) and isinstance(key.value, str) and env_name.match(key.value):
                    names.add(key.value)
    return names


def bind_sources(service: dict) -> list[Path]:
    out = []
    for volume in service.get("volumes", []):
        source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
        if source.startswith((".", "/")):
            out.append((INFRA / source).resolve())
    return out


def test_every_file_the_stack_names_exists(compose: dict, services: dict[str, dict]) -> None:
    named_volumes = set(compose.get("volumes") or {})
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        for source in bind_sources(service):
            assert source.exists(), f"{name}: bind mount source {source} does not exist"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in named_volumes, f"{name}: volume {source!r} is not declared under volumes:"
        for dep in service.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown service {dep!r}"
    for name, service in worker_services(services).items():
        context = (INFRA / service["build"]["context"]).resolve()
        dockerfile = context / service["build"]["dockerfile"]
        assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY "):
                for src in line.split()[1:-1]:
                    assert (context / src).exists(), f"{dockerfile}: COPY {src} not in the build context"


def test_the_dockerfile_installs_the_cpu_torch_pin() -> None:
    text = (INFRA / "Dockerfile").read_text()
    installs = [line for line in text.splitlines() if "pip install" in line]
    assert installs and all("torch==2.13.0" in line for line in installs)  # never an unpinned torch


def test_worker_environment_is_what_the_code_reads(services: dict[str, dict]) -> None:
    read = env_vars_read()
    assert {"MILESTONE_TEMPORAL_ADDRESS", "MILESTONE_S3_ENDPOINT", "AWS_SECRET_ACCESS_KEY"} <= read  # the scan works
    workers = worker_services(services)
    assert {"control", "node0", "node1"} <= set(workers)
    for name, service in workers.items():
        env = service["environment"]
        unknown = set(env) - read
        assert not unknown, f"{name}: environment variables no code reads: {sorted(unknown)}"
        # inside a container localhost is the container itself: the address must be set
        assert env["MILESTONE_TEMPORAL_ADDRESS"] == "temporal:7233"
        assert env["MILESTONE_S3_ENDPOINT"].startswith("http://seaweedfs:")


def test_worker_commands_use_flags_the_workers_accept(services: dict[str, dict]) -> None:
    node_ids = []
    for name, service in worker_services(services).items():
        cmd = command_of(service)
        assert cmd[:2] == ["python", "-m"], name
        usage = subprocess.run([sys.executable, "-m", cmd[2], "--help"], cwd=ROOT, capture_output=True, text=True,
                               check=True, timeout=120).stdout  # the worker's own parser says what it accepts
        for flag in (c for c in cmd[3:] if c.startswith("--")):
            assert re.search(rf"(^|[\s,]){re.escape(flag)}(?=[\s,=]|$)", usage), f"{name}: {cmd[2]} has no {flag}"
        if cmd[2] == "workers.gpu":
            node_ids.append(flag_value(cmd, "--node-id"))
            assert flag_value(cmd, "--device") == "cpu"  # the compose file is the CPU profile
        assert flag_value(cmd, "--metrics-host") == "0.0.0.0", f"{name}: /metrics must be reachable from Prometheus"
    assert len(node_ids) == len(set(node_ids)) >= 2  # distinct ids: a spare to move a run to


def test_prometheus_scrapes_every_worker_and_only_real_ports(services: dict[str, dict]) -> None:
    config = yaml.safe_load((INFRA / "compose" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    served = {
        f"{name}:{flag_value(command_of(s), '--metrics-port')}"
        for name, s in worker_services(services).items()
    }
    served.add(f"temporal:{services['temporal']['environment']['PROMETHEUS_ENDPOINT'].rsplit(':', 1)[1]}")
    assert targets == served
    assert "prometheus" in services


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(services: dict[str, dict]) -> None:
    provisioning = INFRA / "compose" / "grafana" / "provisioning"
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert [s["url"] for s in sources if s["type"] == "prometheus"] == ["http://prometheus:9090"]
    dashboards = yaml.safe_load((provisioning / "dashboards" / "milestone.yml").read_text())["providers"]
    mounted = {v.split(":")[1] for v in services["grafana"]["volumes"]}
    assert any(m.startswith(dashboards[0]["options"]["path"] + "/") and m.endswith(".json") for m in mounted)


def test_registered_search_attributes_are_the_dev_servers() -> None:
    script = (INFRA / "compose" / "temporal" / "register-search-attributes.sh").read_text()
    pairs = dict(re.findall(r"\b(Rl\w+)=(\w+)\b", script))
    assert pairs == SEARCH_ATTRIBUTES


def test_env_scan_sees_reads_and_ignores_other_strings(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "import os\nenv = os.environ\n"
        "a = os.environ.get('ONE_VAR', 'x')\nb = env.get('TWO_VAR')\nc = os.environ['THREE_VAR']\n"
        "d = os.getenv('FOUR_VAR')\nprint('NOT_READ')\n"
    )
    assert env_vars_read(tmp_path, ("pkg",)) == {"ONE_VAR", "TWO_VAR", "THREE_VAR", "FOUR_VAR"}
