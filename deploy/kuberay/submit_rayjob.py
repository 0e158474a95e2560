"""Start a run of the job: what the CronJob in nightly.yaml runs each night (and `kubectl create job --from=...`).

    python submit_rayjob.py TEMPLATE        (TEMPLATE: the suspended RayJob of rayjob.yaml, `specbatch`)

Through the Kubernetes API, as the pod's service account (get, list, create and delete of rayjobs in its namespace),
it copies the RayJob TEMPLATE into a new RayJob:
- named `<TEMPLATE>-<date>-<5 random>` (generateName), labelled `specbatch/template: <TEMPLATE>` and `specbatch/date`;
- its spec the template's, `suspend` dropped, with the run's UTC date pinned: `--date YYYY-MM-DD` added to a
  `specbatch run` entrypoint, so that a run that passes midnight, or a retry, writes to (and resumes) one `{date}`;
- none while an earlier run of the template is unfinished (exit 0; `SKIP_IF_RUNNING=0` starts one anyway);
- finished runs beyond the newest `KEEP` (default 7) deleted (their Ray clusters are gone already).

Standard library only; no kubectl needed.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import shlex
import ssl
import sys
import urllib.parse
import urllib.request

SA = "/var/run/secrets/kubernetes.io/serviceaccount"
API = "apis/ray.io/v1"
TEMPLATE_LABEL = "specbatch/template"
DATE_LABEL = "specbatch/date"
FINISHED = {"Complete", "Failed", "ValidationFailed"}  # RayJob status.jobDeploymentStatus of a run that is over


def pin_date(entrypoint: str, date: str) -> str:
    """`specbatch run ...` with `--date DATE` added, unless it names one; any other entrypoint as it is."""
    argv = shlex.split(entrypoint)
    if argv[:2] != ["specbatch", "run"] or any(a == "--date" or a.startswith("--date=") for a in argv):
        return entrypoint
    return f"{entrypoint} --date {date}"


def tonight(template: dict, date: str) -> dict:
    """The RayJob to create for `date` (YYYY-MM-DD) from the template (a RayJob as the API returns it, unchanged)."""
    if template.get("kind") != "RayJob":
        raise ValueError(f"expected a RayJob template, got kind {template.get('kind')!r}")
    name = template["metadata"]["name"]
    spec = copy.deepcopy(template["spec"])
    spec.pop("suspend", None)
    spec["entrypoint"] = pin_date(spec["entrypoint"], date)
    labels = {**(template["metadata"].get("labels") or {}), TEMPLATE_LABEL: name, DATE_LABEL: date}
    return {"apiVersion": template.get("apiVersion", "ray.io/v1"), "kind": "RayJob",
            "metadata": {"generateName": f"{name}-{date}-", "labels": labels}, "spec": spec}


def unfinished(items: list[dict]) -> list[str]:
    """Names of the runs that are not over (initializing, running, retrying, suspended...)."""
    return [j["metadata"]["name"] for j in items
            if (j.get("status") or {}).get("jobDeploymentStatus") not in FINISHED]


def to_prune(items: list[dict], keep: int) -> list[str]:
    """Names of the finished runs beyond the newest `keep` of them, oldest first."""
    done = [j for j in items if (j.get("status") or {}).get("jobDeploymentStatus") in FINISHED]
    done.sort(key=lambda j: j["metadata"].get("creationTimestamp", ""), reverse=True)
    return [j["metadata"]["name"] for j in reversed(done[keep:])]


class Kube:
    """The Kubernetes API from inside a pod, as its service account: the RayJobs of its namespace."""

    def __init__(self, sa: str = SA):
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        self.base = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        with open(f"{sa}/token") as f:
            self.token = f.read().strip()
        with open(f"{sa}/namespace") as f:
            self.namespace = f.read().strip()
        self.tls = ssl.create_default_context(cafile=f"{sa}/ca.crt")

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(f"{self.base}/{API}/namespaces/{self.namespace}/rayjobs{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {self.token}",
                                              "Content-Type": "application/json", "Accept": "application/json"})
        with urllib.request.urlopen(req, context=self.tls, timeout=60) as resp:
            return json.loads(resp.read() or b"{}")

    def get(self, name: str) -> dict:
        return self.call("GET", f"/{name}")

    def runs(self, template: str) -> list[dict]:
        return self.call("GET", "?labelSelector=" + urllib.parse.quote(f"{TEMPLATE_LABEL}={template}"))["items"]

    def create(self, job: dict) -> dict:
        return self.call("POST", "", job)

    def delete(self, name: str) -> None:
        self.call("DELETE", f"/{name}?propagationPolicy=Background")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    kube = Kube()
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    job = tonight(kube.get(argv[0]), date)
    runs = kube.runs(argv[0])
    busy = unfinished(runs)
    if busy and os.environ.get("SKIP_IF_RUNNING", "1") != "0":
        print(f"submit_rayjob: {', '.join(busy)} not finished yet: no new run")
        return 0
    created = kube.create(job)
    print(f"submit_rayjob: created RayJob {created['metadata']['name']} in {kube.namespace} "
          f"({job['spec']['entrypoint']})")
    for name in to_prune(runs, int(os.environ.get("KEEP", "7"))):
        kube.delete(name)
        print(f"submit_rayjob: deleted finished RayJob {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
