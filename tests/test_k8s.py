"""k8s/ validated offline: every object of the base and each overlay against the KubeRay
v1.7 CRDs or Kubernetes' own schemas (strict); versions and ranges agree with the project;
Ray's token authentication is on, with the control plane sending the RayCluster's token; every Ray
container and the control plane read the checkpoints' S3 credentials from one Secret; and the
validator itself catches broken manifests."""
from __future__ import annotations

import copy
import re
import tomllib

import pytest

from service.rayconnect import auth_config, unusable_token_message
from service.spec import ELASTIC_MAX_WORKERS, ELASTIC_MIN_WORKERS
from tests.k8s_tools import ROOT, render, validate

K8S = ROOT / "k8s"
FOLDERS = [K8S, *sorted(p for p in (K8S / "overlays").iterdir() if p.is_dir())]


def pinned_ray() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(re.match(r"ray\[[^\]]*\]==(.+)", d).group(1) for d in deps if d.startswith("ray["))


def objects(folder=K8S) -> list[dict]:
    return render(folder)


def the(objs, kind, name=None):
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_every_object_validates(folder):
    objs = objects(folder)
    assert objs
    problems = [line for o in objs for line in validate(o)]
    assert problems == []
    assert all(o["metadata"].get("namespace") == "relaytrain" for o in objs if o["kind"] != "Namespace")


def test_ray_versions_match_the_pin():
    ray = pinned_ray()
    cluster = the(objects(), "RayCluster")
    assert cluster["spec"]["rayVersion"] == ray
    images = [c["image"] for o in objects() for c in _containers(o)]
    assert images and all(f"ray{ray}" in img for img in images if "relaytrain" in img)
    dockerfile = (K8S / "Dockerfile").read_text()
    assert re.search(rf"^ARG RAY_IMAGE=rayproject/ray:{re.escape(ray)}-", dockerfile, re.M)
    assert f"rayproject/ray:{ray}-py311-gpu" in dockerfile
    # the project's pins hold CI's CPU build of torch: the image's own torch (cu128 in the GPU
    # image) must not meet that pin, which pip cannot satisfy without the CPU index (a user trial)
    [second] = re.findall(r"pip install --no-cache-dir -c (\S+) \"\.\[postgres\]\"", dockerfile)
    assert second != "constraints.txt" and f"grep -v '^torch==' constraints.txt > {second}" in dockerfile
    assert re.search(r"^torch==\S+\+cpu$", (K8S.parent / "constraints.txt").read_text(), re.M)


def _containers(obj):
    spec = obj.get("spec", {})
    templates = []
    if obj["kind"] == "RayCluster":
        templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    elif "template" in spec:
        templates = [spec["template"]]
    return [c for t in templates for c in t["spec"]["containers"]]


def test_autoscaling_range_matches_the_elastic_defaults():
    spec = the(objects(), "RayCluster")["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == {"cpu", "gpu"}
    assert groups["cpu"]["minReplicas"] == ELASTIC_MIN_WORKERS
    assert groups["cpu"]["maxReplicas"] == groups["gpu"]["maxReplicas"] == ELASTIC_MAX_WORKERS
    assert groups["gpu"]["rayStartParams"]["num-gpus"] == "1"
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def test_worker_pods_drain_before_they_die():
    for group in the(objects(), "RayCluster")["spec"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        cmd = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert cmd[:2] == ["ray", "drain-node"]
        deadline = int(cmd[cmd.index("--deadline-remaining-seconds") + 1])
        assert pod["terminationGracePeriodSeconds"] > deadline


def test_control_plane_references_exist():
    objs = objects()
    api = the(objs, "Deployment", "relaytrain-api")
    container = api["spec"]["template"]["spec"]["containers"][0]
    for ref in container["envFrom"]:
        if "configMapRef" in ref:
            the(objs, "ConfigMap", ref["configMapRef"]["name"])
        else:
            the(objs, "Secret", ref["secretRef"]["name"])
    for env in container["env"]:
        if "value" in env:
            continue
        key = env["valueFrom"]["secretKeyRef"]
        assert key["key"] in the(objs, "Secret", key["name"])["stringData"]
    settings = the(objs, "ConfigMap", "relaytrain-settings")["data"]
    assert settings["RELAYTRAIN_RAY_ADDRESS"].startswith("ray://relaytrain-head-svc:")
    svc = the(objs, "Service", "relaytrain-api")
    assert svc["spec"]["selector"] == api["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_ray_token_auth_is_on_and_the_control_plane_sends_the_same_token(folder):
    objs = objects(folder)
    cluster = the(objs, "RayCluster")
    auth = cluster["spec"]["authOptions"]
    assert auth == {"mode": "token", "secretName": auth["secretName"]}
    secret = the(objs, "Secret", auth["secretName"])
    assert set(secret["stringData"]) == {"auth_token"}  # the key KubeRay reads
    api = the(objs, "Deployment", "relaytrain-api")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in api["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"  # Ray Client sends the token only in token mode
    assert env["RAY_AUTH_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": auth["secretName"], "key": "auth_token"}}
    assert the(objs, "ConfigMap", "relaytrain-settings")["data"]["RELAYTRAIN_RAY_ADDRESS"].startswith("ray://")
    # KubeRay injects both into every Ray container unless one sets them itself: none may
    for c in _containers(cluster):
        assert not {e["name"] for e in c.get("env", [])} & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"}
    assert not {e["name"] for e in cluster["spec"]["autoscalerOptions"].get("env", [])} & {"RAY_AUTH_MODE"}


STORAGE_KEYS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"}


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_every_ray_container_and_the_control_plane_get_the_storage_secret(folder):
    """Each stage's worker writes its checkpoint part straight to the storage, and the control plane
    checks it and restarts jobs from it: all of them read the S3 credentials from one Secret."""
    objs = objects(folder)
    secret = the(objs, "Secret", "relaytrain-storage")
    assert set(secret["stringData"]) == STORAGE_KEYS
    assert all("CHANGE-ME" in secret["stringData"][k]
               for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"))
    cluster = the(objs, "RayCluster")
    containers = _containers(cluster) + _containers(the(objs, "Deployment", "relaytrain-api"))
    assert len(containers) == 1 + len(cluster["spec"]["workerGroupSpecs"]) + 1
    for c in containers:
        assert {"secretRef": {"name": "relaytrain-storage", "optional": True}} in c.get("envFrom", []), c["name"]
        # from the Secret only: never a value of its own in a manifest
        assert not {e["name"] for e in c.get("env", [])} & STORAGE_KEYS, c["name"]


def test_the_placeholder_ray_token_is_refused_by_the_control_plane():
    token = the(objects(), "Secret", "relaytrain-ray-auth")["stringData"]["auth_token"]
    message = unusable_token_message("ray://relaytrain-head-svc:10001",
                                     auth_config({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}))
    assert message and "still the placeholder of k8s/secret.yaml" in message


def test_overlays_apply_their_patches():
    pg = objects(K8S / "overlays" / "postgres")
    assert the(pg, "Secret", "relaytrain-db")["stringData"]["url"].endswith("@relaytrain-postgres:5432/relaytrain")
    the(pg, "StatefulSet", "relaytrain-postgres")
    ft = the(objects(K8S / "overlays" / "gcs-ft-redis"), "RayCluster")
    assert ft["spec"]["gcsFaultToleranceOptions"]["redisAddress"] == "relaytrain-redis:6379"


# ---- the validator itself


def test_validator_catches_misspelled_kuberay_field():
    cluster = copy.deepcopy(the(objects(), "RayCluster"))
    cluster["spec"]["workerGroupSpec"] = cluster["spec"].pop("workerGroupSpecs")
    problems = validate(cluster)
    assert any("workerGroupSpec" in p and "not allowed" in p for p in problems)


def test_validator_catches_string_for_integer_in_kuberay():
    cluster = copy.deepcopy(the(objects(), "RayCluster"))
    cluster["spec"]["workerGroupSpecs"][0]["maxReplicas"] = "16"
    problems = validate(cluster)
    assert any("workerGroupSpecs.0.maxReplicas" in p and "is not of type 'integer'" in p for p in problems)


def test_validator_catches_missing_required_kuberay_field():
    cluster = copy.deepcopy(the(objects(), "RayCluster"))
    del cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"]
    assert any("containers" in p and "required" in p for p in validate(cluster))


def test_validator_catches_bad_auth_options():
    cluster = copy.deepcopy(the(objects(), "RayCluster"))
    cluster["spec"]["authOptions"]["mode"] = "tokens"
    assert any("authOptions.mode" in p and "is not one of ['disabled', 'token']" in p for p in validate(cluster))
    cluster["spec"]["authOptions"] = {"mode": "token", "secret": "relaytrain-ray-auth"}
    assert any("authOptions" in p and "'secret' was unexpected" in p for p in validate(cluster))


def test_validator_ignores_nulls_and_defaulted_required_fields():
    cluster = copy.deepcopy(the(objects(), "RayCluster"))
    cluster["spec"]["suspend"] = None
    assert validate(cluster) == []


def test_validator_catches_broken_core_objects():
    api = copy.deepcopy(the(objects(), "Deployment", "relaytrain-api"))
    api["spec"]["replica"] = api["spec"].pop("replicas")
    assert any("replica" in p for p in validate(api))
    svc = copy.deepcopy(the(objects(), "Service", "relaytrain-api"))
    svc["spec"]["ports"][0]["port"] = "eight thousand"
    assert validate(svc)


def test_renderer_refuses_what_it_cannot_render(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nconfigMapGenerator: []\n")
    with pytest.raises(ValueError, match="configMapGenerator"):
        render(tmp_path)


def test_job_size_ceiling_matches_the_autoscaling_groups():
    objs = objects()
    groups = the(objs, "RayCluster")["spec"]["workerGroupSpecs"]
    settings = the(objs, "ConfigMap", "relaytrain-settings")["data"]
    cpus = sum(g["maxReplicas"] * int(g["rayStartParams"]["num-cpus"]) for g in groups)
    gpus = sum(g["maxReplicas"] * int(g["rayStartParams"].get("num-gpus", "0")) for g in groups)
    assert float(settings["RELAYTRAIN_CLUSTER_MAX_CPUS"]) == cpus
    assert float(settings["RELAYTRAIN_CLUSTER_MAX_GPUS"]) == gpus
    assert float(settings["RELAYTRAIN_START_TIMEOUT_S"]) >= 300  # room for new pods to start


def test_the_image_copies_every_package_the_project_installs():
    """`pip install .` in the image installs what setuptools finds among the folders it was given:
    a package left out of the COPY lines is missing on every pod (relaytrain/, which the workers
    import, was)."""
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and any(p.glob("*.py"))
                      and any(re.fullmatch(pat.replace("*", ".*"), p.name) for pat in found))
    assert {"service", "actors", "api", "relaytrain"} <= set(packages)
    copied = set(re.findall(r"^COPY (\S+) \./\1$", (K8S / "Dockerfile").read_text(), re.M))
    assert [p for p in packages if p not in copied] == []


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_every_ray_pod_can_write_under_the_control_planes_home(folder):
    """A submitted job with a local checkpoint.path (examples/digits_mlp.yaml, k8s/README.md's first
    job) writes under the control plane's RELAYTRAIN_HOME from the Ray pods, whose user (ray)
    cannot create that folder in the image: each Ray container mounts a volume there."""
    objs = objects(folder)
    home = the(objs, "ConfigMap")["data"]["RELAYTRAIN_HOME"]
    cluster = the(objs, "RayCluster")
    spec = cluster["spec"]
    for template in [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]:
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        for c in template["spec"]["containers"]:
            [mount] = [m for m in c.get("volumeMounts", []) if m["mountPath"] == home]
            assert mount["name"] in volumes and not mount.get("readOnly"), c["name"]


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_every_ray_node_starts_a_jobs_processes_with_what_they_need(folder):
    """Every Ray container has the environment a job's processes need (actors/nodeenv.py), and
    every group the node label that says so: jobs then start their processes without a
    runtime_env (a second Python start each)."""
    from actors import nodeenv

    cluster = the(objects(folder), "RayCluster")
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    for g in groups:
        assert g.get("labels", {}).get(nodeenv.LABEL) == nodeenv.VERSION, g.get("groupName", "head")
    want = nodeenv.settings(0, env={})
    for c in _containers(cluster):
        assert {e["name"]: e.get("value") for e in c.get("env", []) if e["name"] in want} == want, c["name"]
