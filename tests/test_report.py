"""`specbatch report`: its numbers are the parts' and the manifest's, and its page renders in a real browser."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from job_helpers import config, read_out, rows_of
from jobs.cli import main as cli
from jobs.driver import is_control, run_job
from jobs.report import Prices, write
from jobs.spec import load_spec


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_pair, ray_session):
    """A job of 16 rows in 8 shards, half of them control shards, and its report at $0.10 per CPU-hour."""
    tmp = tmp_path_factory.mktemp("report")
    path, _ = config(tmp, tiny_pair, rows_of(16), speculation__control_fraction=0.5, speculation__draft_length="fixed",
                     resources__shard_size=2)
    summary = run_job(load_spec(path), progress=False)
    figures = write(str(tmp / "out"), str(tmp / "report"), Prices.load(None, cpu=0.10))
    return tmp, figures, summary


def test_control_shards_are_evenly_spaced_and_stable():
    assert [i for i in range(20) if is_control(i, 0.05)] == [19]
    assert [i for i in range(8) if is_control(i, 0.5)] == [1, 3, 5, 7]
    assert not any(is_control(i, 0.0) for i in range(100)) and all(is_control(i, 1.0) for i in range(100))


def test_report_figures_are_the_parts_own(job):
    tmp, figures, _ = job
    rows, _ = read_out(tmp / "out")
    manifest = json.loads((tmp / "out" / "_manifest.json").read_text())
    control = [r for r in rows.values() if r["control"]]
    spec = [r for r in rows.values() if not r["control"]]
    assert len(control) == 8 and all(r["drafted_tokens"] == 0 and r["rounds"] == r["generated_tokens"] for r in control)
    tokens = sum(r["generated_tokens"] for r in rows.values())
    assert figures["generated_tokens"] == tokens and figures["rows"] == 16
    assert figures["rate"] == pytest.approx(sum(r["accepted_tokens"] for r in spec) / sum(r["drafted_tokens"] for r in spec))
    assert figures["tokens_per_call"] == pytest.approx(sum(r["generated_tokens"] for r in spec) / sum(r["rounds"] for r in spec))
    parts = manifest["parts"].values()
    seconds = sum(p["wall_s"] for p in parts)
    assert all(p["device"].startswith("cpu: ") for p in parts) and sum(figures["worker_hours"].values()) == pytest.approx(seconds / 3600)
    assert figures["usd_per_million_tokens"] == pytest.approx(0.10 * seconds / 3600 / tokens * 1e6)
    c_s = sum(p["wall_s"] for p in parts if p["control"])
    c_t = sum(p["generated_tokens"] for p in parts if p["control"])
    assert figures["speedup_from"] == "the job's control shards"
    assert figures["speedup"] == pytest.approx(((tokens - c_t) / (seconds - c_s)) / (c_t / c_s))
    md = (tmp / "report" / "report.md").read_text()
    assert "per 1M output tokens" in md and "tokens/s" in md and "worker-hours" in md
    assert manifest["wall_s"] > 0


def test_throughput_has_one_name_in_summary_status_and_report(job, capsys):
    """job_tokens_per_s: output tokens per second of the job's wall clock; worker_tokens_per_s: per second a worker
    spent on its parts. The run's summary, `status --json` and report.json name them alike and agree."""
    tmp, figures, summary = job
    manifest = json.loads((tmp / "out" / "_manifest.json").read_text())
    parts = manifest["parts"].values()
    tokens, worker_s = sum(p["generated_tokens"] for p in parts), sum(p["wall_s"] for p in parts)
    assert summary["generated_tokens"] == tokens and "tokens_per_s" not in summary
    assert summary["worker_tokens_per_s"] == pytest.approx(tokens / worker_s)
    assert summary["job_tokens_per_s"] == pytest.approx(tokens / summary["wall_s"])
    assert summary["wall_s"] >= manifest["wall_s"] > 0  # one run: the job's wall time, read after it was saved
    assert summary["job_tokens_per_s"] <= 2 * summary["worker_tokens_per_s"]  # 2 workers, each busy at most all along
    assert cli(["status", str(tmp / "out"), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    for figures_of in (status, figures):
        assert figures_of["worker_tokens_per_s"] == pytest.approx(tokens / worker_s)
        assert figures_of["job_tokens_per_s"] == pytest.approx(tokens / manifest["wall_s"])
    assert cli(["status", str(tmp / "out")]) == 0
    text = capsys.readouterr().out
    assert f"{tokens / manifest['wall_s']:.1f} tokens/s for the job" in text
    assert f"{tokens / worker_s:.1f} tokens/s per worker" in text


def test_report_plots_throughput_cost_and_worker_hours(job, tmp_path):
    """The plots the README promises are written and shown: by part, tokens/s per worker and $ per 1M output
    tokens; worker-hours by device; acceptance. Without a price there is no cost plot."""
    tmp, _, _ = job
    pngs = {"throughput.png", "cost.png", "worker_hours.png", "accept_lengths.png", "acceptance_by_position.png",
            "draft_lengths.png"}
    assert {p.name for p in (tmp / "report").glob("*.png")} == pngs
    md = (tmp / "report" / "report.md").read_text()
    assert all(f"]({name})" in md for name in pngs)
    assert all((tmp / "report" / name).read_bytes().startswith(b"\x89PNG") for name in pngs)
    write(str(tmp / "out"), str(tmp_path / "unpriced"), Prices.load(None))
    assert {p.name for p in (tmp_path / "unpriced").glob("*.png")} == pngs - {"cost.png"}
    assert "](cost.png)" not in (tmp_path / "unpriced" / "report.md").read_text()


def test_report_page_renders_in_chromium(job):
    tmp, _, _ = job
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "Debian's chromium is needed (scripts/install.sh installs it)"
    page = (tmp / "report" / "report.html").read_text()
    probe = ("<script>window.addEventListener('load', () => { document.body.dataset.images = "
             "[...document.images].map(i => i.naturalWidth + 'x' + i.naturalHeight).join(','); });</script>")
    check = tmp / "report" / "check.html"
    check.write_text(page.replace("</body>", probe + "</body>"))
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=3000",
                          "--dump-dom", check.as_uri()], capture_output=True, text=True, timeout=120).stdout
    sizes = re.search(r'data-images="([^"]*)"', dom)
    assert sizes, dom[:500]
    images = sizes.group(1).split(",")
    assert len(images) == 6 and all(int(w) > 100 and int(h) > 100 for w, h in (s.split("x") for s in images))
    assert "Generation cost report" in dom and "<table>" in dom


def test_report_cli_on_a_missing_output(tmp_path, capsys):
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "report", str(tmp_path / "nothing"), "--out",
                           str(tmp_path / "r")], capture_output=True, text=True)
    assert proc.returncode == 1 and "no job output here" in proc.stderr
    # estimate reads the output the same way, and says the same (it raised a traceback before)
    assert cli(["estimate", str(tmp_path / "nothing"), "--profile", str(tmp_path / "p.json")]) == 1
    assert "no job output here" in capsys.readouterr().err


def test_every_device_a_worker_holds_is_charged():
    """A worker's seconds count once per device it holds: four tensor-parallel ranks four times, half a GPU
    half; old manifests without `devices` count one."""
    from jobs.report import Figures, Prices

    parts = [{"device": "cuda: H100", "devices": 4, "worker": "a", "wall_s": 1800.0, "tokens": 500_000, "control": False},
             {"device": "cuda: L4", "devices": 0.5, "worker": "b", "wall_s": 3600.0, "tokens": 500_000, "control": False}]
    f = Figures("t", 2, {}, 1_000_000, 0, 0, parts, 3600.0, {}, {})
    assert f.worker_s == {"cuda: H100": 1800.0, "cuda: L4": 3600.0}
    assert f.device_s == {"cuda: H100": 7200.0, "cuda: L4": 1800.0}
    prices = Prices.load(None, 2.0, None)  # $2 per GPU-hour
    assert f.dollars_per_m(prices) == pytest.approx(2.0 * (2.0 + 0.5))  # 2.5 GPU-hours for 1M tokens
