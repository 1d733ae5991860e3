"""cluster_configs/: every launcher YAML passes Ray's own config preparation and schema validation,
and the KubeRay manifest is a well-formed RayCluster whose pods run the hvdray image.

Nothing of the clouds is contacted or mocked: ``prepare_config`` merges Ray's provider defaults and
``validate_config`` checks the result against Ray's JSON schema, exactly what ``ray up`` does first.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CONFIGS = Path(__file__).resolve().parents[2] / "cluster_configs"
LAUNCHER_CONFIGS = ["local.yaml", "aws.yaml", "gcp.yaml"]


def _load(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_launcher_config_passes_ray_validation(name):
    config = _load(name)
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_launcher_config_installs_hvdray_with_cpu_torch(name):
    config = _load(name)
    commands = "\n".join(config["setup_commands"])
    assert "download.pytorch.org/whl/cpu" in commands and "constraints.txt torch" in commands
    assert "hvdray[" in commands
    # Ray's token authentication: the launching machine's token goes to every node, whose shells enable it
    assert config["file_mounts"] == {"~/hvdray": ".", "~/.ray/auth_token": "~/.ray/auth_token"}
    assert "echo 'export RAY_AUTH_MODE=token' >> ~/.bashrc" in commands
    assert ".venv" in config["rsync_exclude"]
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])
    assert any("ray start --address=$RAY_HEAD_IP" in c for c in config["worker_start_ray_commands"])


def test_validation_rejects_a_broken_config():
    """The check above can fail: a misspelled field is refused by Ray's schema."""
    import jsonschema

    config = prepare_config(_load("aws.yaml"))
    config["setup_comands"] = config.pop("setup_commands")
    with pytest.raises(jsonschema.ValidationError):
        validate_config(config)


def test_kuberay_manifest_is_a_raycluster_running_the_hvdray_image():
    manifest = _load("kuberay.yaml")
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayCluster"
    assert manifest["metadata"]["name"]
    spec = manifest["spec"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", spec["rayVersion"])
    # The operator is told the Ray version the image really has.
    assert f"FROM rayproject/ray:{spec['rayVersion']}-py311-cpu" in (CONFIGS / "Dockerfile").read_text()
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    pods = [head["template"]] + [group["template"] for group in spec["workerGroupSpecs"]]
    for group in spec["workerGroupSpecs"]:
        assert group["groupName"] and isinstance(group["rayStartParams"], dict)
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert container["image"].endswith("/hvdray:0.1.0")
        assert {"cpu", "memory"} <= set(container["resources"]["limits"])
        env = {e["name"]: e for e in container["env"]}  # Ray's token authentication on every node
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hvdray-auth-token", "key": "auth_token"}
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert ports == {"gcs-server": 6379, "dashboard": 8265, "client": 10001}


def test_kuberay_image_installs_hvdray():
    dockerfile = (CONFIGS / "Dockerfile").read_text()
    assert "download.pytorch.org/whl/cpu" in dockerfile and "hvdray[" in dockerfile


# -- every node installs what `make install` installs, with the same pins -----------------------------

ROOT = CONFIGS.parent


def _constraints() -> list:
    from packaging.requirements import Requirement

    lines = [line.split("#")[0].strip() for line in (ROOT / "constraints.txt").read_text().splitlines()]
    return [Requirement(line) for line in lines if line]


def _pin(name: str, platform: str) -> str:
    """The version constraints.txt pins ``name`` to on ``platform`` (a sys.platform value)."""
    (requirement,) = [r for r in _constraints() if r.name == name
                      and (r.marker is None or r.marker.evaluate({"sys_platform": platform}))]
    (specifier,) = requirement.specifier
    assert specifier.operator == "==", requirement
    return specifier.version


def _install_commands() -> dict[str, str]:
    """Each config's (and the Dockerfile's) install commands, as one text."""
    texts = {name: "\n".join(_load(name)["setup_commands"]) for name in LAUNCHER_CONFIGS}
    texts["Dockerfile"] = (CONFIGS / "Dockerfile").read_text()
    return texts


def test_cluster_nodes_install_the_extras_of_make_install():
    make_extras = re.search(r"^EXTRAS := (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1).split(",")
    node_extras = set(make_extras) - {"test", "docs"}  # what runs jobs, not what checks the checkout
    assert "tensorflow" in node_extras
    for name, commands in _install_commands().items():
        (extras,) = re.findall(r"hvdray\[([\w,]+)\]", commands)
        assert set(extras.split(",")) == node_extras, name
        assert re.search(r"-c \S*constraints\.txt \S*hvdray\[", commands), f"{name}: hvdray installed without the pins"


def test_cluster_nodes_pin_the_ray_of_the_package():
    """constraints.txt's Ray is what the package accepts, what KubeRay is told and what its image holds."""
    from packaging.specifiers import SpecifierSet

    ray_version = _pin("ray", "linux")
    import tomllib

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (ray_requirement,) = [d for d in dependencies if d.startswith("ray[")]
    assert ray_version in SpecifierSet(ray_requirement.split("]", 1)[1])
    assert _load("kuberay.yaml")["spec"]["rayVersion"] == ray_version
    assert f"FROM rayproject/ray:{ray_version}-" in (CONFIGS / "Dockerfile").read_text()


def test_constraints_admit_only_torchs_cpu_build_on_linux():
    """On Linux PyPI's torch wheel is the CUDA build (plain version); the pin admits only the +cpu one,
    which every install command fetches from torch's CPU index."""
    from packaging.specifiers import SpecifierSet

    linux, mac = _pin("torch", "linux"), _pin("torch", "darwin")
    assert linux.endswith("+cpu") and mac == linux.removesuffix("+cpu")
    assert linux in SpecifierSet(f"=={linux}") and linux.removesuffix("+cpu") not in SpecifierSet(f"=={linux}")
    for name, commands in {**_install_commands(), "Makefile": (ROOT / "Makefile").read_text()}.items():
        assert re.search(r"-c \S*constraints\.txt torch .*download\.pytorch\.org/whl/cpu", commands) or (
            "TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu" in commands
            and "-c constraints.txt torch --extra-index-url $(TORCH_CPU_INDEX)" in commands), name
