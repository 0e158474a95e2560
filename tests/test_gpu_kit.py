"""The GPU lease kit (bench/gpu/): what its stages import is on the device image or carried, the check that
says so refuses what the image lacks, and the calls fit the lease."""

from __future__ import annotations

import os
import re
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT = os.path.join(ROOT, "bench", "gpu")
VIEW = os.path.join(KIT, "view")


def listed(name: str) -> dict[str, str]:
    """A kit list's distributions (normalised name -> its line)."""
    out = {}
    for line in open(os.path.join(KIT, name)):
        line = line.split("#", 1)[0].strip()
        if line:
            out[re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0]).lower()] = line
    return out


def under_view(args: list[str], pythonpath: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONPATH=f"{VIEW}:{pythonpath}", **env))


def test_the_kits_imports_hold_on_the_device_image(tmp_path):
    r = under_view([os.path.join(KIT, "kit_imports.py")], ROOT, KIT_VIEW_LOG=str(tmp_path / "refused.txt"))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "every import of the kit's stages succeeded" in r.stdout
    assert re.search(r"^\d+ tests collected", r.stdout, re.M)  # the three GPU test files, collected


def test_the_image_view_refuses_what_the_image_lacks(tmp_path):
    (tmp_path / "planted.py").write_text("import ray\n")
    probe = ("import importlib.util, importlib.metadata as md\n"
             "assert importlib.util.find_spec('ray') is None, 'find_spec answers None, as on the image'\n"
             "assert importlib.util.find_spec('yaml') is not None and importlib.util.find_spec('pydantic')\n"
             "try:\n    md.version('ray')\nexcept md.PackageNotFoundError:\n    pass\n"
             "else:\n    raise AssertionError('ray metadata visible')\n"
             "import yaml, pydantic  # on the image; carried\n"
             "import planted\n")
    r = under_view(["-c", probe], str(tmp_path))
    assert r.returncode == 1 and "ModuleNotFoundError: No module named 'ray'" in r.stderr, r.stderr[-3000:]
    assert "neither on the device image" in r.stderr and "AssertionError" not in r.stderr
    # the refusal is the view's: without it, the same module imports here
    plain = subprocess.run([sys.executable, "-c", "import planted"], cwd=tmp_path, capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(tmp_path)), timeout=300)
    assert plain.returncode == 0, plain.stderr[-2000:]


def test_one_list_of_carried_wheels_pinned_and_off_the_image():
    wheels, image = listed("wheels.txt"), listed("image.txt")
    assert len(image) > 150 and {"torch", "transformers", "pytest", "safetensors"} <= set(image)
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9.]*", line) for line in wheels.values()), wheels
    assert {"pydantic", "pydantic-core", "gguf"} <= set(wheels) and not {"ray", "boto3", "llguidance"} & set(wheels)
    assert not {"pydantic", "gguf", "ray", "boto3", "llguidance"} & set(image)
    for script in ("prepare.sh",):  # it takes the pins from wheels.txt, and names none itself
        text = open(os.path.join(KIT, script)).read()
        assert "bench/gpu/wheels.txt" in text and not any(line in text for line in wheels.values()), script


def test_the_calls_fit_the_lease():
    """The README's three calls: every stage's budgets inside its call's limit, all within 10 minutes of device
    time with the start-up (~30 s) and the gaps between calls (~10 s each)."""
    readme = open(os.path.join(KIT, "README.md")).read()
    calls = re.findall(r'run\(carry=\["\.carry/whl", "\.carry/p(\d)"\], command="bash bench/gpu/run\.sh (\w+)", '
                       r"timeout_s=(\d+)\)", readme)
    assert [(p, s) for p, s, _ in calls] == [("0", "first"), ("1", "second"), ("2", "third")]
    run_sh = open(os.path.join(KIT, "run.sh")).read()
    default = {k: int(v) for k, v in re.findall(r"\$\{(KIT_\w+_S):-(\d+)\}", run_sh) if k != "KIT_STEP_S"}
    step = [int(v) for v in re.findall(r"\$\{KIT_STEP_S:-(\d+)\}", run_sh)]
    setup = 15  # wheels, the environment's line, the parts
    stage = {"first": setup + step[0] + default["KIT_TEST_S"], "second": setup + step[1],
             "third": setup + default["KIT_POLICY_S"]}
    limits = {s: int(t) for _, s, t in calls}
    assert all(stage[s] <= limits[s] for s in limits), (stage, limits)
    assert 30 + sum(limits.values()) + 2 * 10 <= 600, limits
