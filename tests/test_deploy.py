"""deploy/ without a cluster: every manifest parses and has the fields KubeRay and Kubernetes require, typed as they
require them; every manifest runs the one image the Dockerfile builds (deploy/IMAGE) at the Ray version it is built
on; the entrypoints name real `specbatch` verbs, parse, and name configs that exist here and validate; the job fits
the cluster it runs on; credentials come from Secrets only; the nightly submitter builds the RayJob it should."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shlex
import subprocess

import pytest
import yaml

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), ".."))
DEPLOY = os.path.join(ROOT, "deploy")
KUBERAY = os.path.join(DEPLOY, "kuberay")
LAUNCHER = os.path.join(DEPLOY, "ray-cluster-aws.yaml")
WORKDIR = "/home/ray/specbatch"  # the checkout inside the image: where entrypoints run
SUBMISSION_MODES = {"K8sJobMode", "HTTPMode", "SidecarMode", "InteractiveMode"}
GPUS_PER_INSTANCE = {"p5.48xlarge": 8, "p5e.48xlarge": 8, "p4d.24xlarge": 8, "p4de.24xlarge": 8}
DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
SECRET_NAMES = re.compile(r"TOKEN|SECRET|PASSWORD|ACCESS_KEY|SESSION")


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def yaml_files() -> list[str]:
    out = []
    for folder, _, files in os.walk(DEPLOY):
        out += [os.path.join(folder, f) for f in files if f.endswith((".yaml", ".yml"))]
    return sorted(out)


def docs(path: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(read(path)) if d is not None]


def manifests() -> list[tuple[str, dict]]:
    """(file, document) of every Kubernetes object under deploy/kuberay (the Kustomization left out)."""
    return [(os.path.relpath(p, ROOT), d) for p in yaml_files() if p.startswith(KUBERAY + os.sep)
            for d in docs(p) if d.get("kind") != "Kustomization"]


def by_kind(kind: str) -> list[dict]:
    found = [d for _, d in manifests() if d["kind"] == kind]
    assert found, f"no {kind} under deploy/kuberay"
    return found


def one(kind: str) -> dict:
    (found,) = by_kind(kind)
    return found


IMAGE = read(os.path.join(DEPLOY, "IMAGE")).strip()
DOCKERFILE = read(os.path.join(DEPLOY, "Dockerfile"))


def dockerfile_arg(name: str) -> str:
    m = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.M)
    assert m, f"deploy/Dockerfile has no `ARG {name}=...`"
    return m.group(1)


def containers(tree) -> list[dict]:
    """Every container (and init container) anywhere in a manifest: pod templates, RayJob and RayCronJob specs."""
    found = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                found += value
            else:
                found += containers(value)
    elif isinstance(tree, list):
        for item in tree:
            found += containers(item)
    return found


def version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


# --- cron -------------------------------------------------------------------------------------------------------

CRON_FIELDS = ((0, 59, {}), (0, 23, {}), (1, 31, {}),
               (1, 12, {m: i + 1 for i, m in enumerate("JAN FEB MAR APR MAY JUN JUL AUG SEP OCT NOV DEC".split())}),
               (0, 7, {d: i for i, d in enumerate("SUN MON TUE WED THU FRI SAT".split())}))


def valid_cron(expr: str) -> bool:
    """A standard 5-field cron expression (minute hour day-of-month month day-of-week), as Kubernetes and KubeRay
    parse it: *, numbers, names of months and weekdays, ranges, lists and steps."""
    fields = expr.split()
    if len(fields) != 5:
        return False

    def value(text: str, lo: int, hi: int, names: dict) -> int | None:
        v = names.get(text.upper()) if not text.isdigit() else int(text)
        return v if v is not None and lo <= v <= hi else None

    for field, (lo, hi, names) in zip(fields, CRON_FIELDS):
        for part in field.split(","):
            base, _, step = part.partition("/")
            if step and (not step.isdigit() or int(step) == 0):
                return False
            if base == "*":
                continue
            start, dash, end = base.partition("-")
            a = value(start, lo, hi, names)
            b = value(end, lo, hi, names) if dash else a
            if a is None or b is None or a > b or (step and not dash):
                return False
    return True


@pytest.mark.parametrize("expr,ok", [("0 2 * * *", True), ("*/15 0-6 1,15 * MON-FRI", True), ("0 0 * JAN,JUL 0", True),
                                     ("0 2 * *", False), ("60 2 * * *", False), ("0 24 * * *", False),
                                     ("0 2 0 * *", False), ("0 2 * * 8", False), ("*/0 * * * *", False),
                                     ("5-1 * * * *", False), ("@daily", False)])
def test_cron_check_itself(expr, ok):
    assert valid_cron(expr) is ok


# --- every YAML, every manifest ----------------------------------------------------------------------------------


def test_every_yaml_under_deploy_parses():
    files = yaml_files()
    assert len(files) >= 7, files
    for path in files:
        parsed = docs(path)
        assert parsed and all(isinstance(d, dict) for d in parsed), path


def test_every_manifest_has_api_version_kind_and_a_name():
    found = manifests()
    kinds = {d["kind"] for _, d in found}
    assert {"RayCluster", "RayJob", "RayCronJob", "CronJob", "ServiceAccount", "Role", "RoleBinding"} <= kinds
    for path, d in found:
        assert isinstance(d.get("apiVersion"), str) and "/" in d["apiVersion"] or d.get("apiVersion") == "v1", path
        assert isinstance(d.get("kind"), str) and d["kind"], path
        name = d.get("metadata", {}).get("name")
        assert isinstance(name, str) and len(name) <= 63 and DNS1123.fullmatch(name), (path, name)
        if d["apiVersion"].startswith("ray.io/"):
            assert d["apiVersion"] == "ray.io/v1", path


def test_every_manifest_runs_the_image_the_dockerfile_builds():
    assert re.fullmatch(r"[\w.\-/:]+:[\w.\-]+", IMAGE), f"deploy/IMAGE: {IMAGE!r} is not a tagged image name"
    assert re.search(r'docker build -f deploy/Dockerfile -t "\$\(cat deploy/IMAGE\)" \.', DOCKERFILE)
    seen = 0
    for path, d in manifests():
        for c in containers(d):
            assert c.get("image") == IMAGE, (path, c.get("name"), c.get("image"))
            seen += 1
    assert seen >= 7  # heads and workers of the RayCluster, the RayJob and the RayCronJob, the CronJob's pod
    docker = yaml.safe_load(read(LAUNCHER))["docker"]
    for key in ("image", "head_image", "worker_image"):
        assert docker.get(key, IMAGE) == IMAGE, key


def test_the_image_is_ray_cuda_at_the_manifests_ray_version():
    ray = dockerfile_arg("RAY_VERSION")
    assert re.fullmatch(r"2\.\d+\.\d+", ray)
    assert re.search(r"^FROM rayproject/ray:\$\{RAY_VERSION\}-py311-gpu$", DOCKERFILE, re.M)  # Ray's CUDA image
    pin = re.search(r'"ray>=([\d.]+)"', read(os.path.join(ROOT, "pyproject.toml")))
    assert pin and version(ray) >= version(pin.group(1))
    for path, d in manifests():
        specs = {"RayCluster": lambda: d["spec"], "RayJob": lambda: d["spec"]["rayClusterSpec"],
                 "RayCronJob": lambda: d["spec"]["jobTemplate"]["rayClusterSpec"]}
        if d["kind"] in specs:
            assert specs[d["kind"]]()["rayVersion"] == ray, path


def test_the_image_installs_specbatch_as_the_readme_does_with_cuda_torch():
    assert re.search(r"^ENV SPECBATCH_TORCH=cuda\b", DOCKERFILE, re.M)
    assert "bash scripts/install.sh" in DOCKERFILE and "command -v specbatch" in DOCKERFILE
    assert re.search(rf"^WORKDIR {WORKDIR}$", DOCKERFILE, re.M)
    for text in (DOCKERFILE, read(os.path.join(ROOT, "scripts", "install.sh"))):
        assert "://" not in text and "index-url" not in text  # pip's own configuration says where from


def test_install_sh_honours_specbatch_torch():
    script = os.path.join(ROOT, "scripts", "install.sh")
    bad = subprocess.run(["bash", script], env={**os.environ, "SPECBATCH_TORCH": "gpu"}, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "SPECBATCH_TORCH must be auto, cuda or cpu" in bad.stderr
    torch = pytest.importorskip("torch")
    if torch.version.cuda is not None:
        pytest.skip("a CUDA torch is installed here: install.sh would go on installing")
    cpu = subprocess.run(["bash", script], env={**os.environ, "SPECBATCH_TORCH": "cuda"}, capture_output=True,
                         text=True, timeout=120)
    assert cpu.returncode == 1 and "has no CUDA" in cpu.stderr  # refused before it installs anything


# --- KubeRay ---------------------------------------------------------------------------------------------------


def check_pod_template(template: dict, where: str) -> list[dict]:
    spec = template["spec"]
    cs = spec["containers"]
    assert isinstance(cs, list) and cs, where
    for c in cs:
        assert isinstance(c["name"], str) and DNS1123.fullmatch(c["name"]), where
        assert c["image"] == IMAGE, where
    return cs


def check_ray_cluster_spec(spec: dict, where: str) -> None:
    assert isinstance(spec["rayVersion"], str), where
    head = spec["headGroupSpec"]
    params = head["rayStartParams"]
    assert isinstance(params, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in params.items()), where
    (ray_head,) = check_pod_template(head["template"], where)
    assert "nvidia.com/gpu" not in ray_head.get("resources", {}).get("limits", {})  # the head is CPU only
    groups = spec["workerGroupSpecs"]
    assert isinstance(groups, list) and groups, where
    for g in groups:
        assert isinstance(g["groupName"], str) and g["groupName"], where
        for key in ("replicas", "minReplicas", "maxReplicas"):
            assert type(g[key]) is int and g[key] >= 0, (where, key)
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], where
        params = g["rayStartParams"]
        assert isinstance(params, dict) and all(isinstance(v, str) for v in params.values()), where
        for c in check_pod_template(g["template"], where):
            res = c["resources"]
            gpus = res["limits"]["nvidia.com/gpu"]
            assert type(gpus) is int and gpus == 8, (where, gpus)  # one pod per 8-GPU node
            assert res.get("requests", {}).get("nvidia.com/gpu", gpus) == gpus, where  # extended: requests = limits


def check_ray_job_spec(spec: dict, where: str) -> None:
    assert isinstance(spec["entrypoint"], str) and spec["entrypoint"], where
    assert spec["shutdownAfterJobFinishes"] is True, where
    ttl = spec["ttlSecondsAfterFinished"]
    assert type(ttl) is int and ttl >= 0, where
    assert spec["submissionMode"] in SUBMISSION_MODES, where
    if "activeDeadlineSeconds" in spec:
        assert type(spec["activeDeadlineSeconds"]) is int and spec["activeDeadlineSeconds"] > 0, where
    check_ray_cluster_spec(spec["rayClusterSpec"], where)


def test_raycluster():
    for rc in by_kind("RayCluster"):
        check_ray_cluster_spec(rc["spec"], "RayCluster")


def test_rayjob():
    job = one("RayJob")
    check_ray_job_spec(job["spec"], "RayJob")
    assert len(job["metadata"]["name"]) <= 47  # KubeRay refuses longer RayJob names (names derived from it)
    assert shlex.split(job["spec"]["entrypoint"])[:3] == ["specbatch", "run", "configs/llama70b_tp4.yaml"]


def test_raycronjob():
    cron = one("RayCronJob")
    assert cron["apiVersion"] == "ray.io/v1"
    spec = cron["spec"]
    assert isinstance(spec["schedule"], str) and valid_cron(spec["schedule"])
    assert type(spec.get("suspend", False)) is bool
    assert "spec" not in spec["jobTemplate"]  # KubeRay 1.6: jobTemplate is a RayJob's spec itself
    check_ray_job_spec(spec["jobTemplate"], "RayCronJob.spec.jobTemplate")
    text = read(os.path.join(KUBERAY, "raycronjob.yaml"))
    assert "alpha" in text and "1.6" in text and "feature gate" in text and "RayCronJob=true" in text


def test_one_cluster_shape_one_job_everywhere():
    job = one("RayJob")["spec"]
    cron = one("RayCronJob")["spec"]["jobTemplate"]
    assert cron == job  # the nightly runs are the one-off run
    for rc in by_kind("RayCluster"):
        assert rc["spec"] == job["rayClusterSpec"]


def test_containers_run_in_the_images_checkout():
    for path, d in manifests():
        for c in containers(d):
            assert c.get("workingDir") == WORKDIR, (path, c["name"])  # relative config paths resolve there


def test_credentials_come_from_secrets_only():
    for path, d in manifests():
        for c in containers(d):
            for env in c.get("env", []):
                if SECRET_NAMES.search(env["name"]):
                    assert "value" not in env, (path, env["name"])
                    assert env["valueFrom"]["secretKeyRef"]["name"] == "specbatch-credentials", (path, env["name"])
    for path in yaml_files() + [os.path.join(DEPLOY, f) for f in os.listdir(DEPLOY) if not f.endswith(".yaml")]:
        if os.path.isfile(path):
            text = read(path)
            assert not re.search(r"\bhf_[A-Za-z0-9]{30,}|\bAKIA[0-9A-Z]{16}\b", text), path
            assert not re.search(r"(?m)^\s*-\s*--env\s+\w*(TOKEN|SECRET|ACCESS_KEY)\w*=", text), path
    heads = [c for c in containers(one("RayJob")) if c["name"] == "ray-head"]
    names = {e["name"] for e in heads[0]["env"]}
    assert {"HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= names


# --- the plain Kubernetes CronJob ------------------------------------------------------------------------------


def test_cronjob_creates_the_rayjob_with_least_rights():
    cj = one("CronJob")
    assert cj["apiVersion"] == "batch/v1"
    spec = cj["spec"]
    assert valid_cron(spec["schedule"])
    assert spec.get("concurrencyPolicy", "Allow") in {"Allow", "Forbid", "Replace"}
    for key in ("startingDeadlineSeconds", "successfulJobsHistoryLimit", "failedJobsHistoryLimit"):
        assert type(spec.get(key, 0)) is int, key
    pod = spec["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["restartPolicy"] in {"Never", "OnFailure"}
    (c,) = check_pod_template(spec["jobTemplate"]["spec"]["template"], "CronJob")
    # its service account, bound to a role that may create rayjobs
    sa = pod["serviceAccountName"]
    assert sa in {d["metadata"]["name"] for d in by_kind("ServiceAccount")}
    (binding,) = [b for b in by_kind("RoleBinding") if any(s["kind"] == "ServiceAccount" and s["name"] == sa
                                                           for s in b["subjects"])]
    assert binding["roleRef"]["kind"] == "Role"
    (role,) = [r for r in by_kind("Role") if r["metadata"]["name"] == binding["roleRef"]["name"]]
    rules = [r for r in role["rules"] if "ray.io" in r["apiGroups"] and "rayjobs" in r["resources"]]
    assert rules and "create" in rules[0]["verbs"]
    assert all(set(r["resources"]) <= {"rayjobs"} for r in role["rules"])  # nothing else
    # the command runs the submitter from the image's checkout on the RayJob the ConfigMap mounts
    script, manifest = c["command"][1:3]
    assert c["command"][0] == "python" and os.path.exists(os.path.join(ROOT, script))
    (mount,) = [m for m in c["volumeMounts"] if manifest.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    kz = yaml.safe_load(read(os.path.join(KUBERAY, "kustomization.yaml")))
    (gen,) = [g for g in kz["configMapGenerator"] if g["name"] == volume["configMap"]["name"]]
    assert os.path.basename(manifest) in gen["files"]


def test_kustomization_names_files_that_exist():
    kz = yaml.safe_load(read(os.path.join(KUBERAY, "kustomization.yaml")))
    assert kz["kind"] == "Kustomization" and kz["apiVersion"].startswith("kustomize.config.k8s.io/")
    files = kz["resources"] + [f.split("=")[-1] for g in kz.get("configMapGenerator", []) for f in g["files"]]
    for f in files:
        assert os.path.isfile(os.path.join(KUBERAY, f)), f
    assert "cronjob.yaml" in kz["resources"] and "rayjob.yaml" in files


def submitter():
    spec = importlib.util.spec_from_file_location("submit_rayjob", os.path.join(KUBERAY, "submit_rayjob.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_submitter_builds_tonights_rayjob():
    sub = submitter()
    manifest = one("RayJob")
    before = copy.deepcopy(manifest)
    job = sub.tonight(manifest, "2026-11-24")
    assert manifest == before  # the template is left as it is
    meta = job["metadata"]
    assert "name" not in meta and meta["generateName"] == "specbatch-llama70b-2026-11-24-"
    assert len(meta["generateName"]) + 5 <= 47
    assert meta["labels"]["specbatch/schedule"] == "specbatch-llama70b" and meta["labels"]["specbatch/date"] == "2026-11-24"
    assert job["spec"]["entrypoint"] == before["spec"]["entrypoint"] + " --date 2026-11-24"
    assert {k: v for k, v in job["spec"].items() if k != "entrypoint"} == \
        {k: v for k, v in before["spec"].items() if k != "entrypoint"}
    check_entrypoint(job["spec"]["entrypoint"])  # still a specbatch command that parses and validates
    assert sub.pin_date("specbatch run c.yaml --date 2026-01-01", "2026-11-24") == "specbatch run c.yaml --date 2026-01-01"
    assert sub.pin_date("python x.py", "2026-11-24") == "python x.py"
    with pytest.raises(ValueError):
        sub.tonight({"kind": "RayCluster", "metadata": {"name": "x"}, "spec": {}}, "2026-11-24")


def test_submitter_skips_and_prunes():
    sub = submitter()

    def job(name, status, created):
        return {"metadata": {"name": name, "creationTimestamp": created},
                "status": {"jobDeploymentStatus": status} if status else {}}

    items = [job("a", "Complete", "2026-11-01T02:00:00Z"), job("b", "Failed", "2026-11-02T02:00:00Z"),
             job("c", "Complete", "2026-11-03T02:00:00Z"), job("d", "Running", "2026-11-04T02:00:00Z"),
             job("e", None, "2026-11-05T02:00:00Z")]
    assert sub.unfinished(items) == ["d", "e"]
    assert sub.to_prune(items, keep=1) == ["a", "b"]  # oldest first; the newest finished (c) kept
    assert sub.to_prune(items, keep=7) == []


# --- entrypoints: real verbs, arguments that parse, configs that exist and validate -------------------------------


def check_entrypoint(entrypoint: str) -> None:
    """The command parses as `specbatch` does (jobs/cli.py's own parser, the commands themselves replaced by a
    recorder), and the config it names exists in the repository (the image's checkout) and validates."""
    from jobs import cli
    from jobs.spec import load_spec

    argv = shlex.split(entrypoint)
    assert argv[0] == "specbatch", entrypoint
    calls = []
    patch = pytest.MonkeyPatch()
    try:
        for name in [n for n in dir(cli) if n.startswith("cmd_")]:
            patch.setattr(cli, name, lambda args, _name=name: calls.append((_name, args)) or 0)
        try:
            assert cli.main(argv[1:]) == 0, entrypoint
        except SystemExit as exc:  # argparse: an unknown verb or argument
            pytest.fail(f"`{entrypoint}` does not parse as a specbatch command (exit {exc.code})")
    finally:
        patch.undo()
    ((_, args),) = calls
    assert args.verb == "run", entrypoint
    config = os.path.join(ROOT, args.config)
    assert not os.path.isabs(args.config) and os.path.isfile(config), args.config
    load_spec(config, args.set, getattr(args, "date", None))  # ConfigError if it does not validate


def entrypoints() -> list[str]:
    return [one("RayJob")["spec"]["entrypoint"], one("RayCronJob")["spec"]["jobTemplate"]["entrypoint"]]


@pytest.mark.parametrize("which", [0, 1], ids=["RayJob", "RayCronJob"])
def test_entrypoints_name_real_verbs_and_valid_configs(which):
    check_entrypoint(entrypoints()[which])


def test_entrypoint_check_catches_mistakes():
    from jobs.spec import ConfigError

    for bad in ("specbatch runn configs/llama70b_tp4.yaml", "specbatch run configs/nope.yaml",
                "specbatch run configs/llama70b_tp4.yaml --no-such-flag", "python -m jobs.cli run configs/demo.yaml",
                "specbatch run configs/llama70b_tp4.yaml --set resources.num_workers=0"):
        with pytest.raises((AssertionError, ConfigError, pytest.fail.Exception)):
            check_entrypoint(bad)


# --- the example job and the cluster it runs on -------------------------------------------------------------------


def test_llama70b_config_is_the_documented_job():
    raw = yaml.safe_load(read(os.path.join(ROOT, "configs", "llama70b_tp4.yaml")))
    target, draft = raw["models"]["target"], raw["models"]["draft"]
    assert target["path"] == "meta-llama/Llama-3.1-70B-Instruct" and target["tensor_parallel"] == 4
    assert draft["path"] == "meta-llama/Llama-3.2-1B-Instruct" and raw["speculation"]["method"] == "draft_model"
    assert raw["input"]["path"].startswith("s3://") and raw["output"]["path"].startswith("s3://")
    assert "{date}" in raw["output"]["path"]
    assert raw["resources"]["num_workers"] == 2 and raw["resources"]["gpus_per_worker"] == 1


def ranks(spec) -> tuple[int, float, float]:
    """(ranks per worker, GPUs per rank, CPUs per rank) of a job spec."""
    return (spec.models.target.tensor_parallel, spec.resources.gpus_per_worker or 1.0, spec.resources.cpus_per_worker)


def test_the_job_fits_the_kuberay_cluster():
    from jobs.spec import load_spec

    job = one("RayJob")["spec"]
    args = shlex.split(job["entrypoint"])
    spec = load_spec(os.path.join(ROOT, args[2]))
    tp, gpus, cpus = ranks(spec)
    (group,) = job["rayClusterSpec"]["workerGroupSpecs"]
    (worker,) = group["template"]["spec"]["containers"]
    node_gpus = worker["resources"]["limits"]["nvidia.com/gpu"]
    node_cpus = float(worker["resources"]["limits"]["cpu"])
    per_node = int(node_gpus // (tp * gpus))  # a worker's ranks are packed on one node
    assert per_node >= 1
    assert spec.resources.num_workers <= per_node * group["replicas"]
    assert per_node * tp * cpus <= node_cpus
    head = job["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]
    assert head.get("num-cpus") == "0"  # no worker lands on the CPU-only head


def test_cluster_launcher_yaml():
    from jobs.spec import load_spec

    cfg = yaml.safe_load(read(LAUNCHER))
    jsonschema = pytest.importorskip("jsonschema")  # a dependency of ray
    ray = pytest.importorskip("ray")
    with open(os.path.join(os.path.dirname(ray.__file__), "autoscaler", "ray-schema.json")) as f:
        jsonschema.validate(cfg, json.load(f))  # the launcher's own schema: keys and their types
    assert isinstance(cfg["cluster_name"], str) and cfg["cluster_name"]
    assert type(cfg["max_workers"]) is int
    provider = cfg["provider"]
    assert provider["type"] == "aws" and isinstance(provider["region"], str)
    assert isinstance(cfg["auth"]["ssh_user"], str)
    types = cfg["available_node_types"]
    assert isinstance(types, dict) and cfg["head_node_type"] in types
    head = types[cfg["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["resources"].get("CPU") == 0
    gpu_types = {name: t for name, t in types.items() if t["resources"].get("GPU")}
    assert gpu_types
    spec = load_spec(os.path.join(ROOT, "configs", "llama70b_tp4.yaml"))
    tp, gpus, _ = ranks(spec)
    for name, t in gpu_types.items():
        instance = t["node_config"]["InstanceType"]
        assert t["resources"]["GPU"] == GPUS_PER_INSTANCE[instance], name
        assert t["resources"]["GPU"] >= tp * gpus, name
        assert isinstance(t["node_config"]["ImageId"], str)
        assert type(t["min_workers"]) is int and type(t["max_workers"]) is int
        assert 0 <= t["min_workers"] <= t["max_workers"] <= cfg["max_workers"], name
    assert sum(t.get("min_workers", 0) for t in types.values()) <= cfg["max_workers"]
    assert cfg["docker"]["image"] == IMAGE
    assert any("scripts/install.sh" in c for c in cfg["setup_commands"])
    assert f"--env AWS_DEFAULT_REGION={provider['region']}" in cfg["docker"]["run_options"]
    assert cfg["file_mounts"] == {WORKDIR: "."}
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = " ".join(cfg[key])
        assert "ray start" in start and f"source {WORKDIR}/deploy/launcher-env.sh" in start
    assert os.path.isfile(os.path.join(DEPLOY, "launcher-env.sh"))
