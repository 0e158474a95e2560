"""The GPU lease kit (bench/gpu/): what its stages import is on the device image or carried, the check that
says so refuses what the image lacks, the calls fit the lease, and its calls (three, and the optional fourth and
joins) rehearse here on CPU."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT = os.path.join(ROOT, "bench", "gpu")
VIEW = os.path.join(KIT, "view")
MIB64 = 64 * 1024 * 1024
# the real draft the kit packs (prepare.sh): the team's folder beside the checkout, which CI has and a user's clone
# lacks
SHARED_DRAFT = os.path.join(ROOT, "..", "shared", "models", "smollm2-draft-4l")


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
    for script in ("prepare.sh", "rehearse.sh"):  # both take the pins from wheels.txt, and name none themselves
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
    stage = {"first": setup + step[0] + default["KIT_TEST_S"],
             "second": setup + default["KIT_EQUAL_S"] + default["KIT_SMALL_S"] + default["KIT_GEMV_S"],
             "third": setup + default["KIT_POLICY_S"] + default["KIT_PROFILE_S"]}
    limits = {s: int(t) for _, s, t in calls}
    assert all(stage[s] <= limits[s] for s in limits), (stage, limits)
    assert 30 + sum(limits.values()) + 2 * 10 <= 600, limits
    # the optional fourth (no model part of its own): within its limit, the four within 14 of the lease's 15 minutes
    (fourth,) = re.findall(r'run\(carry=\["\.carry/whl"\], command="bash bench/gpu/run\.sh fourth", timeout_s=(\d+)\)',
                           readme)
    shape = setup + default["KIT_PREFIX_S"] + int(re.search(r"\$\{KIT_SHAPE_S:-(\d+)\}", run_sh).group(1))
    assert shape <= int(fourth) and 30 + sum(limits.values()) + int(fourth) + 3 * 10 <= 14 * 60, (shape, fourth)
    # the optional joins call (no model part), within its limit
    (joins,) = re.findall(r'run\(carry=\["\.carry/whl"\], command="bash bench/gpu/run\.sh joins", timeout_s=(\d+)\)',
                          readme)
    assert setup + default["KIT_JOINS_S"] + setup + default["KIT_LOOKUP_S"] <= int(joins), joins
    assert 30 + sum(limits.values()) + int(joins) + 3 * 10 <= 14 * 60, joins


def wheel_requirements(path: str) -> set[str]:
    with zipfile.ZipFile(path) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs = re.findall(r"^Requires-Dist: (.+)$", meta, re.M)
    return {re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ (]", r, maxsplit=1)[0]).lower()
            for r in reqs if "extra ==" not in r.replace('"', "").replace("'", "")}


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(SHARED_DRAFT), reason="needs the team's ../shared/models/smollm2-draft-4l "
                    "beside the checkout (CI has it)")
def test_the_kit_rehearses_on_cpu(tmp_path):
    """prepare.sh packs the real pair and the cp312 wheels; rehearse.sh runs the four calls as the device would."""
    carry, work = tmp_path / "carry", tmp_path / "work"
    r = subprocess.run(["bash", os.path.join(KIT, "rehearse.sh"), str(work)], cwd=ROOT, capture_output=True,
                       text=True, timeout=1200, env=dict(os.environ, KIT_CARRY=str(carry)))
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-6000:]
    # what prepare.sh packed: the wheels for the image's Python, needing nothing the image and they lack
    whl = glob.glob(str(carry / "whl" / "*.whl"))
    assert {re.sub(r"[-_.]+", "-", os.path.basename(w).split("-")[0]).lower() for w in whl} == set(listed("wheels.txt"))
    assert all("cp312" in w or "py3-none-any" in w for w in whl), whl
    for w in whl:
        assert wheel_requirements(w) <= set(listed("image.txt")) | set(listed("wheels.txt")), w
    payloads = [int(b) for b in re.findall(r"^# call \w+: carries (\d+) bytes", log, re.M)]
    assert len(payloads) == 5 and all(p <= MIB64 for p in payloads), payloads
    out = {s: work / f"out-{s}" for s in ("first", "second", "third", "fourth", "joins")}
    for stage, folder in out.items():
        text = (folder / f"{stage}.log").read_text()
        assert f"# stage {stage}: every step exited 0" in text, text[-3000:]
        assert "/machine/site/pydantic" in text  # the carried wheels, not site-packages
        assert len(os.listdir(folder)) <= 8  # the device brings back 8 files a call
    for stage, paths in (("first", ("fast", "fast-fused", "hf eager", "hf compiled")),
                         ("second", ("fast", "fast-fused", "hf eager"))):
        speed = (out[stage] / "step_speed.txt").read_text()
        for path in paths:
            assert re.search(rf"^tiny\s+{path}\s+1\s+\d+\.\d", speed, re.M), (stage, path, speed)
        assert re.search(r"^# ops per step \d+, \d+\.\d+ ms per step", speed, re.M), speed  # the profiled step
    joins = (out["joins"] / "step_speed.txt").read_text()  # rows that join a running batch, and rows that do not
    assert all(re.search(rf"^tiny\s+{path}\s+2\s+\d+\.\d", joins, re.M)
               for path in ("fast", "fast-joins", "fast-joins-eager")), joins
    lookup = (out["joins"] / "lookup_ahead.txt").read_text()  # the real target's trees, ahead and waiting: same tokens
    assert re.search(r"^\s+2 trees:k=2:s=1\s+\d+\.\d\s+\d+\.\d\s+\d+\.\d+\s+\d\.\d+ True \S+ \d+$", lookup, re.M), \
        lookup
    for name in ("test_greedy_batches", "test_fused", "test_fastpath", "test_engine", "test_sampling", "test_memory"):
        text = (out["first"] / f"{name}.txt").read_text()
        assert re.search(r"^\d+ passed", text, re.M) and f"tests/{name}.py: exit 0 after" in text, text[-3000:]
    assert "files: tests/test_sampling.py tests/test_noise.py tests/test_capture.py" in \
        (out["first"] / "test_sampling.txt").read_text()
    assert "files: tests/test_greedy_batches.py)" in (out["first"] / "test_greedy_batches.txt").read_text()
    gemv = (out["second"] / "gemv.txt").read_text()  # every linear at 1 and 3 rows, cuBLAS's output checked
    rows = re.findall(r"^tiny\s+(\w+)\s+\d+x\d+\s+([13])\s+\d+\.\d \(\d\.\d\d\)\s.*\s\S+/\d\.\de-0\d$", gemv, re.M)
    assert rows == [(name, m) for name in ("qkv", "o", "gate_up", "down", "head") for m in "13"], gemv
    table = (out["third"] / "policies.txt").read_text()
    rows = re.findall(r"^(autoregressive|fixed k=\d+)\s+1\s+(\d+)\s.*\s(\d+)/(\d+)\s+\d+$", table, re.M)
    assert [r[0] for r in rows] == ["autoregressive", "fixed k=2"], table
    assert all(same == n == rows_ for _, rows_, same, n in rows), table  # lossless: the AR tokens, row for row
    prefix = (out["fourth"] / "prefix_speed.txt").read_text()  # the real target, prefix caching off and on
    assert re.search(r"^none\s+2\s+dense on\s+2\s+\d+\.\d.*\s\d+\s+\d+\s+2/2$", prefix, re.M), prefix
    shape = json.loads((out["fourth"] / "shape_pair.json").read_text())  # both batch sizes, lossless
    assert set(shape) == {"1", "2"} and all(r["equal_to_ar"] and r["best_fixed_k"] == 2 for r in shape.values()), shape
    equal = (out["second"] / "greedy_equality.txt").read_text()  # the real target's rows, transformers' tokens
    assert re.search(r"^none\s+2\s+2/2\s", equal, re.M) and re.search(r"^generator\s+2\s+2/2\s", equal, re.M), equal
    profile = (out["third"] / "round_profile.txt").read_text()
    assert re.search(r"^## plain: \d+\.\d+ ms per round", profile, re.M), profile[:2000]
    assert re.search(r"^## fixed k=2: \d+\.\d+ ms per round", profile, re.M) and "Self CPU" in profile, profile[:2000]
