"""specbatch: offline batch generation with speculative decoding.

  specbatch run CONFIG.yaml [--set dotted.key=value ...] [--address ADDR] [--overwrite] [--date YYYY-MM-DD]
  specbatch status CONFIG.yaml|OUTPUT_PATH [--json] [--date YYYY-MM-DD]   ({date} in output.path: that day's)
  specbatch report OUTPUT_PATH --out DIR [--baseline OUTPUT_PATH] [--gpu-hour-price USD | --cpu-hour-price USD | --prices YAML]
  specbatch profile CONFIG.yaml --out profile.json
  specbatch estimate OUTPUT_PATH --profile profile.json [--batch-size B] [--draft-length recorded|none|fixed:K|goodput]
  specbatch train-head CONFIG.yaml --out DIR
  specbatch calibrate CONFIG.yaml [--prompts N] [--steps S] [--step F]
  specbatch check [CONFIG.yaml] [--address ADDR] [--json]
  specbatch config-reference
"""

from __future__ import annotations

import argparse
import json
import sys

from workers import logs
from workers.inputs import InputError
from workers.outputs import COUNTS
from workers.storage import StorageError, open_storage

from .driver import run_job
from .manifest import MANIFEST, SUCCESS, JobError, OutputError, error_counts, throughput
from .spec import DATE_ENV, ConfigError, config_reference, load_spec, resolve_output_path

DATE_HELP = (f"the date {{date}} in output.path stands for (YYYY-MM-DD; default: ${DATE_ENV}, else today in UTC), "
             "e.g. to resume or look at an earlier day's run")


def cmd_run(args) -> int:
    """Run a job to completion; re-running the same config resumes it (committed parts are kept)."""
    logs.setup(args.log_level)
    spec = load_spec(args.config, args.set, args.date)
    summary = run_job(spec, address=args.address, overwrite=args.overwrite, progress=not args.no_progress,
                      log_level=args.log_level, verbose=args.verbose)
    rate = summary["acceptance_rate"]
    mal = summary["mean_accepted_length"]
    print(f"specbatch: {spec.name}: {summary['rows_committed']}/{summary['rows_total']} rows committed "
          f"({summary['rows_this_run']} this run, {summary['rows_failed_this_run']} failed, "
          f"{summary['rows_from_earlier_runs']} from earlier runs) in {summary['wall_s']:.1f}s; "
          f"{_rates(summary)}"
          + (f", mean accepted length {mal:.2f}" if mal else "")
          + (f", acceptance rate {rate:.2f}" if rate is not None else "")
          + f" -> {spec.output.path}")
    if summary["step_path"]:
        peaks = summary["peak_gpu_gib_per_worker"]
        print(f"specbatch: steps ran on the {summary['step_path']} path"
              + ("; peak GPU memory per worker: " + ", ".join(f"{w} {g:.2f} GiB" for w, g in peaks.items())
                 if peaks else ""))
    errors = summary["errors_by_reason"]
    if errors:
        print("specbatch: error rows by reason: " + ", ".join(f"{k} {v}" for k, v in errors.items()))
    if summary.get("worker_logs"):
        print(f"specbatch: the workers' own output (model loading, Ray) is in {summary['worker_logs']}")
    if args.json:
        print(json.dumps(summary))
    return 3 if errors and args.fail_on_row_errors else 0


def _rates(figures: dict) -> str:
    """The two throughput figures as the run's summary and `status` print them (jobs/progress.py says which is
    which)."""
    out = []
    if figures["job_tokens_per_s"] is not None:
        out.append(f"{figures['job_tokens_per_s']:.1f} tokens/s for the job (wall clock)")
    if figures["worker_tokens_per_s"] is not None:
        out.append(f"{figures['worker_tokens_per_s']:.1f} tokens/s per worker (on its parts)")
    return ", ".join(out)


def cmd_status(args) -> int:
    """Show how far a job's output is (parts and rows committed, failed rows by reason, whether it finished) and
    what its rows cost (tokens in and out, acceptance, tokens per target call, tokens/s for the job and per
    worker), from its manifest."""
    target = args.target
    path = (load_spec(target, date=args.date).output.path if target.endswith((".yaml", ".yml"))
            else resolve_output_path(target, args.date))
    st = open_storage(path)
    raw = st.read_bytes(MANIFEST)
    if raw is None:
        print(f"{path}: no job output here yet")
        return 1
    m = json.loads(raw)
    parts = [n for n in st.list("part-") if n.endswith(".parquet")]
    entries = [m["parts"][p] for p in parts if p in m["parts"]]
    counts = {k: sum(e.get(k, 0) for e in entries) for k in COUNTS}
    errors = error_counts({"parts": dict(enumerate(entries))})
    status = {"name": m["name"], "finished": st.exists(SUCCESS), "parts": len(parts), "shards": m["num_shards"],
              "rows_committed": sum(e["rows"] for e in entries), "rows_total": m["input"]["rows"],
              "rows_failed": sum(errors.values()), "errors_by_reason": errors, **counts,
              "acceptance_rate": counts["accepted_tokens"] / counts["drafted_tokens"] if counts["drafted_tokens"] else None,
              "tokens_per_target_call": counts["generated_tokens"] / counts["rounds"] if counts["rounds"] else None,
              "wall_s": m.get("wall_s", 0.0), **throughput(entries, m.get("wall_s", 0.0))}
    if args.json:
        print(json.dumps(status))
        return 0
    s = status
    print(f"{s['name']}: {s['parts']}/{s['shards']} parts, {s['rows_committed']}/{s['rows_total']} rows, "
          f"{'finished' if s['finished'] else 'incomplete'}"
          + ("; error rows: " + ", ".join(f"{k} {v}" for k, v in errors.items()) if errors else ""))
    figures = [f"tokens in {s['prompt_tokens']} ({s['cached_prompt_tokens']} of them reused from cached prefixes), "
               f"out {s['generated_tokens']}"]
    if s["tokens_per_target_call"] is not None:
        figures.append(f"{s['tokens_per_target_call']:.2f} tokens per target call")
    if s["acceptance_rate"] is not None:
        figures.append(f"acceptance {s['acceptance_rate']:.1%}")
    if _rates(s):
        figures.append(_rates(s))
    print("  " + "; ".join(figures) + " (rows without errors)")
    return 0


def cmd_report(args) -> int:
    """Write a cost report of a job's output (local or S3): report.md, a self-contained report.html, report.json
    and PNG plots in --out."""
    from .report import Prices, write

    baseline = resolve_output_path(args.baseline, args.date) if args.baseline else None
    figures = write(resolve_output_path(args.output, args.date), args.out,
                    Prices.load(args.prices, args.gpu_hour_price, args.cpu_hour_price), baseline)
    cost = figures["usd_per_million_tokens"]
    print(f"specbatch: report written to {args.out}/report.html ({figures['generated_tokens']:,} tokens"
          + (f", ${cost:.4f} per 1M output tokens" if cost is not None else "")
          + (f", speed-up {figures['speedup']:.2f}x against {figures['speedup_from']}" if figures["speedup"] else "")
          + ")")
    return 0


def _one_process(spec, command: str):
    """The spec, if its target loads in one process; a tensor-parallel target is refused, naming what to do."""
    tp = spec.models.target.tensor_parallel
    if tp > 1:
        raise ConfigError(
            f"models.target.tensor_parallel: specbatch {command} loads the whole target in one process and does not "
            f"run it over {tp} devices; run it on a machine whose one device holds the target, with "
            f"--set models.target.tensor_parallel=1, or on a smaller target of the same family")
    return spec


def cmd_profile(args) -> int:
    """Measure the job's model pair on this machine (draft and target forward times per batch size and width,
    prefill) into a profile for `specbatch estimate`."""
    from .estimate import profile_job

    prof = profile_job(_one_process(load_spec(args.config, args.set), "profile"), args.out)
    print(f"specbatch: profile of {prof.hardware} written to {args.out}")
    return 0


def cmd_estimate(args) -> int:
    """Predict a finished job's throughput and cost at another batch size, draft-length policy or machine
    (a profile from `specbatch profile`), by replaying its recorded rows."""
    from specdec.plan.costmodel import Profile

    from .estimate import estimate, job_rows
    from .report import Prices

    rows, manifest = job_rows(resolve_output_path(args.output, args.date))
    batch = args.batch_size or manifest["spec"]["resources"]["batch_size"]
    prof = Profile.load(args.profile)
    est = estimate(rows, manifest, prof, batch, args.draft_length)
    hourly = Prices.load(args.prices, args.gpu_hour_price, args.cpu_hour_price).hourly(prof.hardware.split(",")[0])
    est["usd_per_million_tokens"] = hourly * est["seconds"] / 3600 / est["tokens"] * 1e6 if hourly else None
    est["profile"] = prof.hardware
    if args.json:
        print(json.dumps(est))
        return 0
    m = est["measured"]
    print(f"specbatch: {len(rows)} rows at batch {batch}, draft length {args.draft_length}, on {prof.hardware}: "
          f"{est['tokens_per_s']:.1f} tokens/s per worker predicted ({est['seconds']:.1f} worker-s)"
          + (f", ${est['usd_per_million_tokens']:.4f} per 1M output tokens" if est["usd_per_million_tokens"] else "")
          + (f"; the job itself ran {m['tokens_per_s']:.1f} tokens/s per worker" if m["tokens_per_s"] else "")
          + (f" (the profile calibrated by it: x{est['calibration']:.2f})" if est["calibrated"] else
             " (the profile is another machine's: not calibrated)"))
    return 0


def cmd_train_head(args) -> int:
    """Train a SpecDec++ acceptance head for the job's draft/target pair on the job's prompts."""
    from .train_head import format_report, run_train_head

    spec = _one_process(load_spec(args.config, args.set), "train-head")
    report = run_train_head(spec, args.out, max_prompts=args.max_prompts, response_tokens=args.response_tokens,
                            epochs=args.epochs, layers=args.layers, threshold=args.threshold, w_rej=args.w_rej,
                            reads=args.reads, progress=not args.no_progress)
    print(format_report(report))
    print(f"specbatch: head written to {args.out} (use speculation.acceptance_head.path: {args.out})")
    return 0


def cmd_calibrate(args) -> int:
    """FSD's threshold for the job's pair on a sample of its prompts (the paper's protocol): the threshold whose
    divergence rule accepts what the lossless rule does at the best length, then steps up; prints the
    speed-quality points to choose `speculation.fuzzy.threshold` from."""
    from specdec.plan.calibrate import calibrate, format_points
    from specdec.exec.models import load_pair
    from workers.fetch import localize

    from .train_head import collect_prompts

    spec = _one_process(load_spec(args.config, args.set), "calibrate")
    if spec.models.draft is None:
        raise ConfigError("calibrate needs models.draft in the job config (FSD verifies a draft model's tokens)")
    pair = load_pair(localize(spec.models.target), localize(spec.models.draft))
    prompts = collect_prompts(spec, pair.tokenizer, args.prompts)
    if not prompts:
        raise ConfigError(f"no usable prompts in {spec.input.path}")
    k, points = calibrate(pair, prompts, spec.generation, spec.speculation, spec.resources.batch_size, args.steps,
                          args.step)
    print(format_points(k, points))
    return 0


def cmd_check(args) -> int:
    """Preflight a cluster (or this machine) before a job: on every node its devices and the job's model
    sources; on workers of the job's shape their device, dtype, the weights' fit against the memory plan, one
    step on each path compared with eager (tensor-parallel: a lock-step call and the all-reduce's bandwidth)
    and the output prefix's storage. Prints a table; exits 0 when every check passes, 1 naming the failures."""
    from .check import failures, run_check, table

    spec = load_spec(args.config, args.set) if args.config else None
    rows = run_check(spec, args.address, args.log_level)
    print(json.dumps(rows) if args.json else table(rows))
    bad = failures(rows)
    if bad:
        print("specbatch: check failed: " + "; ".join(f"{r['where']}: {r['check']}: {r['result']}" for r in bad),
              file=sys.stderr)
        return 1
    return 0


def cmd_reference(args) -> int:
    """Print the config reference (every key, its default and what it does) as a markdown table."""
    print("| key | default | meaning |\n|---|---|---|")
    print("\n".join(config_reference()))
    return 0


def _price_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu-hour-price", type=float, help="USD per GPU-hour")
    parser.add_argument("--cpu-hour-price", type=float, help="USD per CPU worker-hour")
    parser.add_argument("--prices", help="a price table (configs/prices.yaml)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specbatch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    run = sub.add_parser("run", help=cmd_run.__doc__, description=cmd_run.__doc__)
    run.add_argument("config")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set generation.max_new_tokens=64 (repeatable)")
    run.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else an embedded local cluster)")
    run.add_argument("--overwrite", action="store_true", help="discard existing outputs at output.path first")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--json", action="store_true", help="also print the summary as JSON")
    run.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="warning",
                     help="log level of the driver, the workers and Ray (credentials are redacted at every level)")
    run.add_argument("--verbose", action="store_true",
                     help="show the workers' own output (model loading, progress bars, Ray's task messages) here "
                          "instead of in their log files")
    run.add_argument("--fail-on-row-errors", action="store_true",
                     help="exit 3 if any row became an error row (default: 0; error rows are data)")
    run.add_argument("--date", help=DATE_HELP)
    run.set_defaults(fn=cmd_run)
    status = sub.add_parser("status", help=cmd_status.__doc__, description=cmd_status.__doc__)
    status.add_argument("target", help="the job's config or its output path")
    status.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    status.add_argument("--date", help=DATE_HELP)
    status.set_defaults(fn=cmd_status)
    th = sub.add_parser("train-head", help=cmd_train_head.__doc__, description=cmd_train_head.__doc__)
    th.add_argument("config")
    th.add_argument("--out", required=True, help="folder for head.safetensors and head.json")
    th.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    th.add_argument("--max-prompts", type=int, default=256)
    th.add_argument("--response-tokens", type=int, default=128, help="longest target answer per prompt")
    th.add_argument("--epochs", type=int, default=3)
    th.add_argument("--layers", type=int, default=3, help="residual blocks in the head")
    th.add_argument("--threshold", type=float, default=0.3, help="default stop threshold stored with the head")
    th.add_argument("--w-rej", type=float, default=6.0,
                    help="loss weight of rejections (SpecDec++: 6, for pairs accepting ~80-90%%; 1 = calibrated)")
    th.add_argument("--reads", choices=["proposing", "fed"], default="proposing",
                    help="proposing: the draft state that drew the token, plus q(token) (no extra draft forward); "
                         "fed: the state after the token was fed back (the SpecDec++ paper's; one more forward)")
    th.add_argument("--no-progress", action="store_true")
    th.set_defaults(fn=cmd_train_head)
    cal = sub.add_parser("calibrate", help=cmd_calibrate.__doc__, description=cmd_calibrate.__doc__)
    cal.add_argument("config")
    cal.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    cal.add_argument("--prompts", type=int, default=32, help="prompts of the job's input to calibrate on")
    cal.add_argument("--steps", type=int, default=4, help="thresholds above the matched one")
    cal.add_argument("--step", type=float, default=0.05, help="more of the tokens each step accepts")
    cal.set_defaults(fn=cmd_calibrate)
    rep = sub.add_parser("report", help=cmd_report.__doc__, description=cmd_report.__doc__)
    rep.add_argument("output", help="the job's output path (local or s3://)")
    rep.add_argument("--out", required=True, help="folder for the report")
    rep.add_argument("--baseline", help="the output of an autoregressive run of the same prompts (default: the "
                                        "job's control shards, if it has any)")
    _price_options(rep)
    rep.add_argument("--date", help=DATE_HELP)
    rep.set_defaults(fn=cmd_report)
    pro = sub.add_parser("profile", help=cmd_profile.__doc__, description=cmd_profile.__doc__)
    pro.add_argument("config")
    pro.add_argument("--out", required=True, help="profile JSON to write")
    pro.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    pro.set_defaults(fn=cmd_profile)
    est = sub.add_parser("estimate", help=cmd_estimate.__doc__, description=cmd_estimate.__doc__)
    est.add_argument("output", help="a finished job's output path")
    est.add_argument("--profile", required=True, help="from `specbatch profile` (this or another machine)")
    est.add_argument("--batch-size", type=int, help="default: the job's")
    est.add_argument("--draft-length", default="recorded",
                     help="recorded (the job's own rounds), none, fixed:K or goodput")
    _price_options(est)
    est.add_argument("--json", action="store_true")
    est.add_argument("--date", help=DATE_HELP)
    est.set_defaults(fn=cmd_estimate)
    chk = sub.add_parser("check", help=cmd_check.__doc__, description=cmd_check.__doc__)
    chk.add_argument("config", nargs="?", help="the job's config (without one: the cluster's nodes and devices)")
    chk.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    chk.add_argument("--address", help="a Ray cluster to check (default: RAY_ADDRESS, else this machine)")
    chk.add_argument("--json", action="store_true", help="print the rows as JSON")
    chk.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    chk.set_defaults(fn=cmd_check)
    ref = sub.add_parser("config-reference", help=cmd_reference.__doc__, description=cmd_reference.__doc__)
    ref.set_defaults(fn=cmd_reference)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"specbatch: {exc}", file=sys.stderr)
        return 2
    except (InputError, JobError, OutputError, StorageError) as exc:
        print(f"specbatch: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
