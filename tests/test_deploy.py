"""deploy/ checked without a cloud: what can be validated on one machine (deploy/README.md says what cannot).

* ``cluster.yaml`` by Ray's own cluster-config validation (the defaults ``ray up`` fills in, then its
  schema and checks);
* ``rayjob.yaml`` against the fields of KubeRay's ``RayJob`` CRD (``ray.io/v1``): a transcription of the
  CRD's field names, types and required fields for the parts a runnel job uses (the CRD itself, 1.4 MB of
  generated schema, is not vendored);
* the image: its base's Ray and Python versions against ``rayVersion`` and ``pyproject.toml``, every image
  named at runnel's version, the paths the Dockerfile copies;
* the commands: every ``runnel ...`` the job entrypoints and the walk-through run parses with runnel's own
  command line, names a tuned file the image holds -- and the RayJob's entrypoint trains, locally (slow);
* the image builds where docker exists (skipped, saying so, where it does not).
"""
from __future__ import annotations

import copy
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
from typing import Any

import pytest
import yaml
from packaging.specifiers import SpecifierSet

from pipeline.cli.main import build_parser

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
BASE_IMAGE = re.compile(r"^rayproject/ray:(?P<ray>\d+\.\d+\.\d+)-py(?P<major>\d)(?P<minor>\d+)-(?P<kind>cpu|gpu|cu\d+)$")


def load(name: str) -> Any:
    return yaml.safe_load((DEPLOY / name).read_text())


# --- the Dockerfile ----------------------------------------------------------------------------------
def dockerfile() -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(instructions as (KEYWORD, arguments), ARG defaults); continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    steps, args = [], {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        steps.append((keyword.upper(), rest.strip()))
        if keyword.upper() == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
    return steps, args


def expand(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], value)


def base_image() -> re.Match:
    steps, args = dockerfile()
    [image] = [expand(rest, args) for keyword, rest in steps if keyword == "FROM"]
    match = BASE_IMAGE.match(image)
    assert match, f"FROM {image}: expected rayproject/ray:<ray version>-py<python>-<cpu|gpu|cuXYZ>"
    return match


def workdir() -> str:
    steps, _ = dockerfile()
    [where] = [rest for keyword, rest in steps if keyword == "WORKDIR"]
    return where


def copied() -> list[str]:
    """The repository paths the Dockerfile copies into the image."""
    out = []
    for keyword, rest in dockerfile()[0]:
        if keyword == "COPY":
            parts = [p for p in shlex.split(rest) if not p.startswith("--")]
            out += parts[:-1]
    return out


def test_the_image_is_rays_at_the_jobs_ray_version_and_a_python_runnel_supports():
    match = base_image()
    ray_version, python = match["ray"], f"{match['major']}.{match['minor']}"
    assert load("rayjob.yaml")["spec"]["rayClusterSpec"]["rayVersion"] == ray_version
    ray_dep = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("ray"))
    assert ray_version in SpecifierSet(ray_dep.split("]", 1)[-1]), f"{ray_dep} excludes the image's Ray {ray_version}"
    assert python in SpecifierSet(PYPROJECT["project"]["requires-python"])


def test_the_dockerfile_copies_what_pip_install_needs_and_installs_the_runnel_command():
    sources = copied()
    for path in sources:
        assert (ROOT / path).exists(), f"the Dockerfile copies {path}, which the repository lacks"
    for package in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert package.rstrip("*") in sources, f"package {package} is not copied: `pip install .` would miss it"
    assert "pyproject.toml" in sources and "tuned" in sources
    runs = " ".join(rest for keyword, rest in dockerfile()[0] if keyword == "RUN")
    assert "pip install --no-cache-dir ." in runs
    assert PYPROJECT["project"]["scripts"]["runnel"] == "pipeline.cli.main:main"
    assert workdir() == "/home/ray/runnel"


def images_named() -> list[str]:
    cluster, job = load("cluster.yaml"), load("rayjob.yaml")
    out = [cluster["docker"]["image"]]
    out += [t["docker"]["worker_image"] for t in cluster["available_node_types"].values() if "docker" in t]
    spec = job["spec"]["rayClusterSpec"]
    for template in [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]:
        out += [c["image"] for c in template["spec"]["containers"]]
    text = (DEPLOY / "Dockerfile").read_text() + (DEPLOY / "README.md").read_text()
    out += re.findall(r"-t (?:<registry>/)?(\S*runnel:\S+)", text)
    return out


def test_every_image_named_is_runnels_at_the_projects_version():
    images = images_named()
    assert len(images) >= 6
    for image in images:
        assert re.fullmatch(rf"(\S+/)?runnel:{re.escape(VERSION)}(-gpu)?", image), \
            f"image {image}: expected runnel:{VERSION} (pyproject.toml's version), or its -gpu build"


# --- cluster.yaml: Ray's own validation ------------------------------------------------------------
def validate_cluster(config: dict) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config  # what `ray up` runs

    full = prepare_config(copy.deepcopy(config))
    validate_config(full)
    return full


def test_cluster_yaml_passes_rays_cluster_config_validation():
    config = load("cluster.yaml")
    full = validate_cluster(config)
    assert full["setup_commands"] == []  # the image has everything: no Ray wheel pip-installed over it
    assert set(full["available_node_types"]) == {"head", "cpu_workers", "gpu_workers"}
    bad = copy.deepcopy(config)
    bad["available_node_types"]["cpu_workers"]["min_workers"] = "one"
    with pytest.raises(Exception, match="'one' is not of type 'integer'"):  # the validator does check
        validate_cluster(bad)


# --- rayjob.yaml: the RayJob CRD's fields ----------------------------------------------------------
STR, INT, BOOL, NUM, STR_MAP, OBJ = "string", "integer", "boolean", "number", "map of strings", "object"
POD_TEMPLATE = "pod template"
RAY_JOB = {  # KubeRay's RayJob CRD, ray.io/v1: field -> type or nested fields; "!" marks required ones
    "apiVersion": STR, "kind": STR, "metadata": OBJ,
    "spec": {
        "entrypoint": STR, "shutdownAfterJobFinishes": BOOL, "ttlSecondsAfterFinished": INT,
        "activeDeadlineSeconds": INT, "backoffLimit": INT, "submissionMode": STR, "runtimeEnvYAML": STR,
        "entrypointNumCpus": NUM, "entrypointNumGpus": NUM, "entrypointResources": STR, "jobId": STR,
        "suspend": BOOL, "metadata": STR_MAP, "clusterSelector": STR_MAP, "submitterPodTemplate": POD_TEMPLATE,
        "rayClusterSpec": {
            "rayVersion": STR, "enableInTreeAutoscaling": BOOL, "autoscalerOptions": OBJ, "suspend": BOOL,
            "!headGroupSpec": {"rayStartParams": STR_MAP, "!template": POD_TEMPLATE, "serviceType": STR,
                               "enableIngress": BOOL, "headService": OBJ, "labels": STR_MAP, "resources": STR_MAP},
            "workerGroupSpecs": [{
                "!groupName": STR, "replicas": INT, "!minReplicas": INT, "!maxReplicas": INT,
                "rayStartParams": STR_MAP, "!template": POD_TEMPLATE, "idleTimeoutSeconds": INT,
                "numOfHosts": INT, "suspend": BOOL, "scaleStrategy": OBJ, "labels": STR_MAP, "resources": STR_MAP,
            }],
        },
    },
}
QUANTITY = re.compile(r"^\d+(\.\d+)?(m|[KMGTPE]i?)?$")


def check(doc: Any, schema: Any, where: str) -> list[str]:
    """What in ``doc`` the schema does not allow: unknown fields, wrong types, missing required fields."""
    if isinstance(schema, list):
        if not isinstance(doc, list):
            return [f"{where}: expected a list"]
        return [p for i, item in enumerate(doc) for p in check(item, schema[0], f"{where}[{i}]")]
    if isinstance(schema, dict):
        if not isinstance(doc, dict):
            return [f"{where}: expected a mapping"]
        fields = {k.lstrip("!"): v for k, v in schema.items()}
        problems = [f"{where}.{k}: not a field of the RayJob CRD here (fields: {sorted(fields)})"
                    for k in doc if k not in fields]
        problems += [f"{where}.{k[1:]}: required" for k in schema if k.startswith("!") and k[1:] not in doc]
        return problems + [p for k, v in doc.items() if k in fields for p in check(v, fields[k], f"{where}.{k}")]
    return check_value(doc, schema, where)


def check_value(doc: Any, kind: str, where: str) -> list[str]:
    types = {STR: str, BOOL: bool, NUM: (int, float), OBJ: dict}
    if kind == INT:
        return [] if isinstance(doc, int) and not isinstance(doc, bool) else [f"{where}: expected an integer"]
    if kind == STR_MAP:
        ok = isinstance(doc, dict) and all(isinstance(v, str) for v in doc.values())
        return [] if ok else [f"{where}: expected a mapping of strings"]
    if kind == POD_TEMPLATE:
        return check_pod_template(doc, where)
    return [] if isinstance(doc, types[kind]) else [f"{where}: expected {kind}"]


def check_pod_template(doc: Any, where: str) -> list[str]:
    containers = (doc or {}).get("spec", {}).get("containers")
    if not containers:
        return [f"{where}.spec.containers: a pod template needs containers"]
    problems = []
    for i, c in enumerate(containers):
        problems += [f"{where}.spec.containers[{i}].{k}: required" for k in ("name", "image") if k not in c]
        for part in ("limits", "requests"):
            for key, value in c.get("resources", {}).get(part, {}).items():
                if not QUANTITY.match(str(value)):
                    problems.append(f"{where}.spec.containers[{i}].resources.{part}.{key}: {value!r} is no quantity")
    return problems


def test_rayjob_yaml_uses_the_fields_of_the_rayjob_crd():
    job = load("rayjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert check(job, RAY_JOB, "RayJob") == []
    typo = copy.deepcopy(job)
    typo["spec"]["shutdownAfterJobFinish"] = True
    del typo["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["maxReplicas"]
    typo["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "2"
    assert check(typo, RAY_JOB, "RayJob") == [
        "RayJob.spec.shutdownAfterJobFinish: not a field of the RayJob CRD here (fields: "
        f"{sorted(k.lstrip('!') for k in RAY_JOB['spec'])})",
        "RayJob.spec.rayClusterSpec.workerGroupSpecs[0].maxReplicas: required",
        "RayJob.spec.rayClusterSpec.workerGroupSpecs[0].replicas: expected an integer"]


# --- the commands ---------------------------------------------------------------------------------
def submitted_commands() -> list[str]:
    """The ``runnel ...`` commands that the RayJob and the walk-throughs (README, cluster.yaml) submit."""
    commands = [load("rayjob.yaml")["spec"]["entrypoint"]]
    for name in ("README.md", "cluster.yaml"):
        text = (DEPLOY / name).read_text()
        text = re.sub(r"^\s*#", "", text, flags=re.M)  # the YAML's walk-through is in comments
        text = re.sub(r"\\\n\s*", " ", text)
        commands += [m.strip() for m in re.findall(r"ray job submit [^\n]*?\s--\s+(runnel [^\n`]+)", text)]
    return commands


def test_submitted_commands_parse_and_name_files_the_image_holds():
    commands = submitted_commands()
    assert len(commands) >= 3
    image_root = workdir().rstrip("/") + "/"
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "runnel" and "runnel" in PYPROJECT["project"]["scripts"]
        args = build_parser().parse_args(argv[1:])  # raises on an unknown flag
        assert args.command == "train" and args.target[0] == "file", command
        path = args.target[1]
        assert path.startswith(image_root), f"{command}: {path} is not a path inside the image ({image_root}...)"
        inside = path[len(image_root):]
        assert (ROOT / inside).is_file(), f"{command}: the repository has no {inside}"
        assert inside.split("/")[0] in copied(), f"{command}: {inside} is not copied into the image"


@pytest.mark.slow
def test_the_rayjob_entrypoint_trains_locally(tmp_path):
    """The entrypoint as the job runs it, with the image's paths mapped onto this checkout, for one iteration."""
    argv = shlex.split(load("rayjob.yaml")["spec"]["entrypoint"])
    image_root = workdir().rstrip("/") + "/"
    argv = [str(ROOT / a[len(image_root):]) if a.startswith(image_root) else a for a in argv]
    argv[argv.index("--output-dir") + 1] = str(tmp_path)
    runnel = pathlib.Path(sys.executable).with_name("runnel")
    proc = subprocess.run([str(runnel), *argv[1:], "--stop", '{"training_iteration": 1}'], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [run_dir] = [p for p in tmp_path.iterdir() if p.name.startswith("PPO_CartPole-v1")]
    assert (run_dir / "progress.csv").exists() and list(run_dir.glob("checkpoint_*"))


def docker_missing() -> str | None:
    """Why the image cannot be built here, or None when a docker daemon answers."""
    if shutil.which("docker") is None:
        return "no docker on this machine: the image build is not checked"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        why = (info.stderr.strip().splitlines() or ["docker info failed"])[-1]
        return f"docker is installed but its daemon does not answer ({why}): the image build is not checked"
    return None


@pytest.mark.slow
def test_the_image_builds_and_has_the_runnel_command():
    missing = docker_missing()
    if missing:
        pytest.skip(missing)
    tag = f"runnel-test:{VERSION}"
    build = subprocess.run(["docker", "build", "-f", str(DEPLOY / "Dockerfile"), "-t", tag, str(ROOT)],
                           capture_output=True, text=True, timeout=3600)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run(["docker", "run", "--rm", tag, "runnel", "--help"], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0 and "train" in run.stdout
