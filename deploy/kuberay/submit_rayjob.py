"""Create tonight's RayJob: what the nightly Kubernetes CronJob (cronjob.yaml) runs, for clusters whose KubeRay has
no RayCronJob (before 1.6, or its feature gate off).

    python deploy/kuberay/submit_rayjob.py /etc/specbatch/rayjob.yaml

From the RayJob manifest (rayjob.yaml, mounted from a ConfigMap by kustomization.yaml) it creates a fresh RayJob
through the Kubernetes API, with the pod's service account (create, list and delete of rayjobs in its namespace):
- named `<name>-<date>-<5 random>` (generateName), labelled `specbatch/schedule: <name>` and `specbatch/date`;
- the run's UTC date pinned: `--date YYYY-MM-DD` added to a `specbatch run` entrypoint, so a run that passes
  midnight, or a RayJob retry, goes on writing to the same `{date}` folder (and resumes there);
- none while an earlier RayJob of the schedule is still unfinished (exit 0; `SKIP_IF_RUNNING=0` creates one anyway);
- finished RayJobs of the schedule beyond the newest `KEEP` (default 7) deleted (their clusters are gone already).

Standard library and PyYAML only (both in the image); no kubectl needed.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import ssl
import sys
import urllib.parse
import urllib.request

import yaml

SA = "/var/run/secrets/kubernetes.io/serviceaccount"
API = "apis/ray.io/v1"
SCHEDULE_LABEL = "specbatch/schedule"
DATE_LABEL = "specbatch/date"
FINISHED = {"Complete", "Failed", "ValidationFailed"}  # RayJob status.jobDeploymentStatus of a run that is over


def pin_date(entrypoint: str, date: str) -> str:
    """`specbatch run ...` with `--date DATE` added, unless it names one; any other entrypoint as it is."""
    argv = shlex.split(entrypoint)
    if argv[:2] != ["specbatch", "run"] or any(a == "--date" or a.startswith("--date=") for a in argv):
        return entrypoint
    return f"{entrypoint} --date {date}"


def tonight(manifest: dict, date: str) -> dict:
    """The RayJob to create for `date` (YYYY-MM-DD) from the manifest (a RayJob, left unchanged)."""
    if manifest.get("kind") != "RayJob":
        raise ValueError(f"expected a RayJob manifest, got kind {manifest.get('kind')!r}")
    job = json.loads(json.dumps(manifest))  # a deep copy
    meta = job["metadata"]
    name = meta.pop("name")
    meta.pop("namespace", None)  # the pod's own namespace
    meta["generateName"] = f"{name}-{date}-"
    meta["labels"] = {**meta.get("labels", {}), SCHEDULE_LABEL: name, DATE_LABEL: date}
    job["spec"]["entrypoint"] = pin_date(job["spec"]["entrypoint"], date)
    return job


def unfinished(items: list[dict]) -> list[str]:
    """Names of the RayJobs that are not over (initializing, running, retrying, suspended...)."""
    return [j["metadata"]["name"] for j in items
            if (j.get("status") or {}).get("jobDeploymentStatus") not in FINISHED]


def to_prune(items: list[dict], keep: int) -> list[str]:
    """Names of the finished RayJobs beyond the newest `keep` of them, oldest first."""
    done = [j for j in items if (j.get("status") or {}).get("jobDeploymentStatus") in FINISHED]
    done.sort(key=lambda j: j["metadata"].get("creationTimestamp", ""), reverse=True)
    return [j["metadata"]["name"] for j in reversed(done[keep:])]


class Kube:
    """The Kubernetes API from inside a pod, as its service account."""

    def __init__(self, sa: str = SA):
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        self.base = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        with open(f"{sa}/token") as f:
            self.token = f.read().strip()
        with open(f"{sa}/namespace") as f:
            self.namespace = f.read().strip()
        self.tls = ssl.create_default_context(cafile=f"{sa}/ca.crt")

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(f"{self.base}/{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {self.token}",
                                              "Content-Type": "application/json", "Accept": "application/json"})
        with urllib.request.urlopen(req, context=self.tls, timeout=60) as resp:
            return json.loads(resp.read() or b"{}")

    def rayjobs(self, schedule: str) -> list[dict]:
        selector = urllib.parse.quote(f"{SCHEDULE_LABEL}={schedule}")
        return self.call("GET", f"{API}/namespaces/{self.namespace}/rayjobs?labelSelector={selector}")["items"]

    def create(self, job: dict) -> dict:
        return self.call("POST", f"{API}/namespaces/{self.namespace}/rayjobs", job)

    def delete(self, name: str) -> None:
        self.call("DELETE", f"{API}/namespaces/{self.namespace}/rayjobs/{name}?propagationPolicy=Background")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        manifest = yaml.safe_load(f)
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    job = tonight(manifest, date)
    schedule = job["metadata"]["labels"][SCHEDULE_LABEL]
    kube = Kube()
    items = kube.rayjobs(schedule)
    busy = unfinished(items)
    if busy and os.environ.get("SKIP_IF_RUNNING", "1") != "0":
        print(f"submit_rayjob: {', '.join(busy)} not finished yet: no new run tonight")
        return 0
    created = kube.create(job)
    print(f"submit_rayjob: created RayJob {created['metadata']['name']} in {kube.namespace} "
          f"({job['spec']['entrypoint']})")
    for name in to_prune(items, int(os.environ.get("KEEP", "7"))):
        kube.delete(name)
        print(f"submit_rayjob: deleted finished RayJob {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
