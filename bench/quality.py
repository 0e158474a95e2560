"""Speed against quality for relaxed verification (fuzzy on the draft model, conditional on AASD token
trees) beside the lossless settings, on code completion (stdlib n-r, bench/code_prompts.py) and chat
(bench/prompts.py HELD_OUT), in one run.

    python bench/quality.py [--tasks code,chat] [--batches 1,8] [--settings ar,dm:k=4,...] [--n 32]
                            [--max-new 64] [--repeats 2] [--heal] [--dtype float32] [--plot quality.png]
                            [--json quality.json]

The full defaults take about 12 runs x (repeats + 1) x tasks x batches; on the 2-core CPU a run of 32
prompts x 64 tokens takes 50-120 s at batch 1: trim with --repeats or --settings. Exact-match figures
need --dtype float32 (in bf16 a multi-token verification rounds differently from a one-token step).

A setting is `ar` (autoregressive: method none) or METHOD:k=K[:s=S][:fuzzy=DIV@T][:cond=A@B], where
METHOD is `dm` (draft model), `pld` (prompt lookup, n-grams 6..1) or `aasd` (prompt lookup with AASD
token trees: needs s=S, alignment sampling 1..3); K is num_draft_tokens (draft_length fixed), or
`auto`: the default policy (goodput, which also chooses a tree's width per round);
fuzzy=DIV@T is fuzzy verification with divergence DIV (js, kl, tv) under threshold T; cond=A@B is
conditional verification with alpha A and beta B. Without fuzzy/cond a setting is lossless, and it is
the lossless counterpart of its relaxed variants. Every setting's SpecConfig is built before models load.

Per (task, batch, setting): `ratio` is tokens/s paired against autoregressive (each repeat starts with
an AR run and one more ends the last; a run is divided by AR's speed interpolated in time between the
two AR runs bracketing it, other settings rotate each repeat; median over repeats, as bench/policies.py; goodput's cost profile is
measured once per method and batch size, as a job's worker does once),
tokens per target call, acceptance, `exact` the fraction of rows identical to the lossless counterpart's
output (AR's for lossless settings and where the counterpart did not run; in float32 greedy lossless
equals AR), `=ar` the fraction identical to AR, `loglik` the target's mean log-probability per generated
token of the output (teacher-forced, float32 log_softmax, untimed, token-weighted over rows), and for code
the mean edit similarity to the reference and the parse rate (code_prompts.parses). Outputs are the
first repeat's.

Power: 32 prompts per task by default (chat has 16 held-out instructions at most). Quality figures carry a
95% bootstrap interval over prompts (`[lo-hi]`); a relaxed setting is also compared with its lossless
counterpart pairwise: `vs ll` its speed over the counterpart's in the same repeat (median over repeats), and
`dsim%` its edit similarity's relative change (log-likelihood's difference for chat) with the interval of
the same bootstrap, prompts resampled jointly for both.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(__file__))
from code_prompts import code_prompts, edit_similarity, parses  # noqa: E402
from engine_speed import add_model_args, describe, engine_run, load_bench_pair, sync, timed_generate  # noqa: E402
from policies import interpolate  # noqa: E402
from prompts import HELD_OUT, chat_ids  # noqa: E402

from specdec.config import SamplingParams, SpecConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402

DEFAULT_SETTINGS = ("ar,dm:k=auto,dm:k=auto:fuzzy=js@0.1,dm:k=auto:fuzzy=js@0.2,dm:k=auto:fuzzy=js@0.3,"
                    "dm:k=auto:fuzzy=js@0.5,pld:k=auto,aasd:k=auto:s=2,aasd:k=auto:s=2:cond=0.3@0.2,"
                    "aasd:k=auto:s=2:cond=0.1@0.1,aasd:k=auto:s=2:cond=0.05@0.05,aasd:k=auto:s=2:cond=0.02@0.02")
DIVERGENCES = ("js", "kl", "tv")


def parse_setting(text: str) -> dict:
    """A setting string (grammar in the docstring) as a dict with its canonical name and counterpart."""
    head, *parts = text.strip().split(":")
    if head == "ar" and not parts:
        return {"name": "ar", "method": "ar", "k": 0, "s": 0, "relax": None, "lossless": "ar"}
    if head not in ("dm", "pld", "aasd"):
        raise ValueError(f"{text!r}: `ar` alone, or dm, pld or aasd with options")
    kv = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or key not in ("k", "s", "fuzzy", "cond") or key in kv:
            raise ValueError(f"{text!r}: {part!r} is not one of k=, s=, fuzzy=, cond= (each once)")
        kv[key] = value
    try:
        k = 0 if kv.get("k") == "auto" else int(kv["k"])
        s = int(kv.get("s", "0"))
    except (KeyError, ValueError):
        raise ValueError(f"{text!r}: needs k=INT or k=auto (and s=INT for aasd)") from None
    if (k < 1 and kv["k"] != "auto") or (head == "aasd") != ("s" in kv) or (head == "aasd" and not 1 <= s <= 3):
        raise ValueError(f"{text!r}: k >= 1 or auto; s=1..3 with aasd only (pld is s=0)")
    base = f"{head}:k={kv['k']}" + (f":s={s}" if head == "aasd" else "")
    relax = None
    if "fuzzy" in kv and "cond" in kv:
        raise ValueError(f"{text!r}: fuzzy or cond, not both")
    if "fuzzy" in kv:
        m = re.fullmatch(r"(\w+)@([0-9.eE+-]+)", kv["fuzzy"])
        if not m or m[1] not in DIVERGENCES:
            raise ValueError(f"{text!r}: fuzzy=DIV@T with DIV one of {DIVERGENCES}")
        relax = ("fuzzy", m[1], float(m[2]))
    elif "cond" in kv:
        m = re.fullmatch(r"([0-9.eE+-]+)@([0-9.eE+-]+)", kv["cond"])
        if not m:
            raise ValueError(f"{text!r}: cond=ALPHA@BETA")
        relax = ("cond", float(m[1]), float(m[2]))
    name = base + ("" if relax is None else f":fuzzy={relax[1]}@{relax[2]:g}" if relax[0] == "fuzzy"
                   else f":cond={relax[1]:g}@{relax[2]:g}")
    return {"name": name, "method": head, "k": k, "s": s, "relax": relax, "lossless": base}


def spec_kwargs(st: dict) -> dict:
    """SpecConfig keyword arguments of a parsed setting."""
    if st["method"] == "ar":
        return {"method": "none"}
    kw = {"method": "draft_model" if st["method"] == "dm" else "prompt_lookup"}
    if st["k"]:  # k=auto (0): the default policy (goodput) and bound
        kw.update(draft_length="fixed", num_draft_tokens=st["k"], max_draft_tokens=max(8, st["k"]))
    if st["method"] != "dm":
        kw["prompt_lookup"] = {"max_ngram": 6, "min_ngram": 1, "alignment_sampling": st["s"]}
    if st["relax"] and st["relax"][0] == "fuzzy":
        kw.update(verification="fuzzy", fuzzy={"divergence": st["relax"][1], "threshold": st["relax"][2]})
    elif st["relax"]:
        kw.update(verification="conditional", conditional={"alpha": st["relax"][1], "beta": st["relax"][2]})
    return kw


def sweep_of(st: dict) -> str | None:
    """Which threshold sweep a relaxed setting belongs to ("fuzzy=js", "cond"); None when lossless."""
    return None if st["relax"] is None else "cond" if st["relax"][0] == "cond" else f"fuzzy={st['relax'][1]}"


def spec_config(st: dict) -> SpecConfig:
    return SpecConfig(**spec_kwargs(st))


@torch.inference_mode()
def loglik(pair, prompt: list[int], out: list[int]) -> float:
    """Sum of the target's log-probabilities of `out` after `prompt` (one teacher-forced forward)."""
    if not out:
        return 0.0
    ids = torch.tensor([prompt + out], device=pair.device)
    logits = pair.target(input_ids=ids).logits[0, len(prompt) - 1: -1, : pair.vocab_size].float()
    lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(out, device=pair.device)[:, None])
    return float(lp.sum())


def task_prompts(task: str, n: int | None, tokenizer, heal: bool = False):
    """(token-id prompts, code items or None) of a task; `heal`: code prompts without their final newline."""
    if task == "code":
        items = code_prompts(n or 32)
        return [tokenizer(c["prompt"][:-1] if heal else c["prompt"], add_special_tokens=False)["input_ids"]
                for c in items], items
    return chat_ids(tokenizer, HELD_OUT[: n or len(HELD_OUT)]), None


def run_block(pair, settings, prompts, bs, args):
    """Timed runs of every setting at one batch size: {name: {"ratios", "tok_s", "results"}}."""
    def one(st):
        key = (st["method"], st["s"])  # relaxed settings verify what their counterpart drafts: the same costs
        eng = SpecEngine(pair, SamplingParams(max_new_tokens=args.max_new), spec_config(st), batch_size=bs,
                         profile=profiles.get(key))
        eng.measure_costs()  # goodput's start-up cost profile, once per worker (here per method): not in tok/s
        if eng.profile is not None:
            profiles.setdefault(key, eng.profile)
        sync(eng.device)
        t = time.perf_counter()
        res = eng.generate(prompts)
        sync(eng.device)
        wall = time.perf_counter() - t  # engine_speed.timed_generate's figure, keeping the results
        out = {"tok_s": sum(r.generated_tokens for r in res) / wall, "at": t + wall / 2}
        runs.setdefault(st["name"], {"ratios": [], "tok_s": [], "results": res})["tok_s"].append(out["tok_s"])
        return out

    ar = next(st for st in settings if st["name"] == "ar")
    others = [st for st in settings if st["name"] != "ar"]
    runs: dict[str, dict] = {}
    profiles: dict[tuple, object] = {}
    timed_generate(SpecEngine(pair, SamplingParams(max_new_tokens=args.max_new), spec_config(ar), batch_size=bs),
                   prompts[:bs])  # untimed: the first run at a batch size pays its warm-up
    baseline, timed = [one(ar)], []
    for rep in range(args.repeats):
        shift = rep % max(1, len(others))
        for st in others[shift:] + others[:shift]:
            timed.append((st["name"], rep, one(st)))
        baseline.append(one(ar))
    for a, mid, b in zip(baseline, baseline[1:], baseline[2:]):  # AR against itself: the drift left
        runs["ar"]["ratios"].append(mid["tok_s"] / interpolate(a, b, mid["at"]))
    for name, rep, r in timed:
        runs[name]["ratios"].append(r["tok_s"] / interpolate(baseline[rep], baseline[rep + 1], r["at"]))
    return runs


def figures(pair, task, bs, st, runs, prompts, items, ll_cache, heal=False) -> dict:
    res = runs[st["name"]]["results"]
    ref_name = st["lossless"] if st["relax"] and st["lossless"] in runs else "ar"
    outs = [r.token_ids for r in res]
    same = lambda other: sum(a == b.token_ids for a, b in zip(outs, runs[other]["results"])) / len(outs)  # noqa: E731
    for p, o in zip(prompts, outs):
        key = (tuple(p), tuple(o))
        if key not in ll_cache:
            ll_cache[key] = loglik(pair, p, o)
    gen = sum(len(o) for o in outs)
    same_ar = [float(o == r.token_ids) for o, r in zip(outs, runs["ar"]["results"])]
    drafted, rounds = sum(r.drafted_tokens for r in res), sum(r.rounds for r in res)
    ratios = runs[st["name"]]["ratios"] or [1.0]
    fig = {"task": task, "batch": bs, "setting": st["name"], "lossless_counterpart": st["lossless"],
           "lossless": st["relax"] is None, "relax": st["relax"], "sweep": sweep_of(st), "exact_ref": ref_name,
           "ratio": statistics.median(ratios), "ratios": ratios, "tok_s": runs[st["name"]]["tok_s"],
           "per_call": gen / rounds if rounds else None,
           "accept": sum(r.accepted_tokens for r in res) / drafted if drafted else None,
           "exact": same(ref_name), "exact_ar": same("ar"), "exact_ar_ci": bootstrap(mean_at(same_ar), len(outs)),
           "logliks": [ll_cache[(tuple(p), tuple(o))] / max(len(o), 1) for p, o in zip(prompts, outs)],
           "loglik": sum(ll_cache[(tuple(p), tuple(o))] for p, o in zip(prompts, outs)) / max(gen, 1),
           "verification": dict(Counter(str(getattr(r, "verification", None)) for r in res)),
           "edit_sim": None, "edit_sims": None, "edit_sim_ci": None, "parse_rate": None,
           "vs_lossless": None, "dquality": None, "dquality_ci": None}
    if items is not None:
        comps = [pair.tokenizer.decode(o, skip_special_tokens=True) for o in outs]
        if heal:  # the prompt ran without its final newline: score what follows the whole prompt
            comps = [full[len(it["prompt"]):] if (full := it["prompt"][:-1] + c).startswith(it["prompt"]) else c
                     for c, it in zip(comps, items)]
        fig["edit_sims"] = [edit_similarity(c, it["reference"]) for c, it in zip(comps, items)]
        fig["edit_sim"] = statistics.mean(fig["edit_sims"])
        fig["edit_sim_ci"] = bootstrap(mean_at(fig["edit_sims"]), len(comps))
        fig["parse_rate"] = statistics.mean(parses(it["prompt"], c) for c, it in zip(comps, items))
    return fig


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def bootstrap(stat, n: int, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of `stat(indices)` over `reps` resamples (with replacement) of range(n)."""
    rng = random.Random(seed)
    vals = sorted(stat([rng.randrange(n) for _ in range(n)]) for _ in range(reps))
    return vals[int(0.025 * reps)], vals[int(0.975 * reps) - 1]


def mean_at(xs: list[float]):
    """The statistic `mean of xs over the resampled indices`, for bootstrap."""
    return lambda idx: sum(xs[i] for i in idx) / len(idx)


def compare(fig: dict, base: dict, runs: dict) -> None:
    """Pair a relaxed setting's figures with its lossless counterpart's (same prompts, same repeats): speed
    ratio per repeat (median), and the quality change with a joint bootstrap over prompts."""
    a, b = runs[fig["setting"]]["ratios"], runs[base["setting"]]["ratios"]
    fig["vs_lossless"] = statistics.median(x / y for x, y in zip(a, b)) if a and b else None
    key = "edit_sims" if fig["edit_sims"] is not None else "logliks"
    x, y = fig[key], base[key]
    if key == "edit_sims":  # relative change of the mean, in percent
        stat = lambda idx: 100 * (sum(x[i] for i in idx) / max(sum(y[i] for i in idx), 1e-9) - 1)  # noqa: E731
    else:  # mean difference of per-prompt log-likelihood per token
        stat = lambda idx: sum(x[i] - y[i] for i in idx) / len(idx)  # noqa: E731
    fig["dquality"] = stat(range(len(x)))
    fig["dquality_ci"] = bootstrap(stat, len(x))


def plot(figs, path):
    """Speed ratio (x) against edit similarity (code) or log-likelihood (chat): a row per task, a panel per
    batch size; each sweep a line from its lossless counterpart (fuzzy by threshold, cond by speed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = sorted({f["task"] for f in figs}, key=lambda t: t != "code")
    batches = sorted({f["batch"] for f in figs})
    fig, axes = plt.subplots(len(tasks), len(batches), figsize=(6 * len(batches), 4.8 * len(tasks)), squeeze=False)
    for (row, task), (col, bs) in ((t, b) for t in enumerate(tasks) for b in enumerate(batches)):
        ax, ys = axes[row][col], "edit_sim" if task == "code" else "loglik"
        pts = {f["setting"]: f for f in figs if (f["task"], f["batch"]) == (task, bs)}
        sweeps: dict[tuple, list] = {}
        for f in pts.values():
            if not f["lossless"]:
                sweeps.setdefault((f["lossless_counterpart"], f["sweep"]), []).append(f)
        for i, ((base, kind), group) in enumerate(sorted(sweeps.items())):
            order = (lambda f: f["relax"][2] if f["relax"] else 0.0) if kind != "cond" else (lambda f: f["ratio"])
            line = sorted(group, key=order)
            line = ([pts[base]] if base in pts else []) + line
            ax.plot([f["ratio"] for f in line], [f[ys] for f in line], "o-", ms=5, color=f"C{i}", alpha=0.7,
                    label=f"{base} {kind}")
        for f in pts.values():
            if f["lossless"]:
                ax.plot(f["ratio"], f[ys], "s", ms=9, color="black", mfc="none")
            ax.annotate(f["setting"], (f["ratio"], f[ys]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set(xlabel="tokens/s ratio to autoregressive (paired median)",
               ylabel="edit similarity" if task == "code" else "target log-likelihood / token",
               title=f"{task}, batch {bs} (squares: lossless)")
        ax.grid(alpha=0.3)
        if sweeps:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="code,chat")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--settings", default=DEFAULT_SETTINGS, help="comma list (grammar above); ar is always run")
    ap.add_argument("--n", type=int, default=None, help="prompts per task (default 32; chat has 16 at most)")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--heal", action="store_true",
                    help="code: tokenize each prompt without its final newline and score what follows it (the "
                         "tokenizer merges a newline with the next line's indentation, so a bare final newline is "
                         "a token boundary the model rarely saw: it then often writes a column-0 comment)")
    ap.add_argument("--plot", help="PATH.png: the speed-quality curves (matplotlib)")
    ap.add_argument("--json", help="PATH: every figure")
    add_model_args(ap)
    args = ap.parse_args()
    tasks = args.tasks.split(",")
    if set(tasks) - {"code", "chat"}:
        ap.error("--tasks: code and/or chat")
    settings, errors = {}, []
    for text in ["ar"] + args.settings.split(","):
        try:
            st = parse_setting(text)
            spec_config(st)
            settings.setdefault(st["name"], st)
        except ValueError as exc:  # pydantic's ValidationError included
            errors.append(f"{text}: {exc}".replace("\n", "\n    "))
    if errors:
        ap.error("settings the engine does not take:\n  " + "\n  ".join(errors))
    settings = list(settings.values())
    pair = load_bench_pair(args)
    command = "python " + " ".join(sys.argv)
    print(f"# {command}\n# greedy, max_new_tokens={args.max_new}, {args.repeats} repeats, "
          f"{'healed' if args.heal else 'newline-ended'} code prompts, {describe(pair)}", flush=True)
    engine_run(pair, chat_ids(pair.tokenizer, HELD_OUT[:2]), "draft_model", 2, 2, 8)  # warm-up
    head = (f"{'task':4s} {'batch':>5s} {'setting':28s} {'ratio':>5s} {'range':>9s} {'tok/call':>8s} {'accept':>6s} "
            f"{'exact':>5s} {'=ar [95%]':>15s} {'loglik':>7s} {'editsim [95%]':>19s} {'parse':>5s} {'vs ll':>5s} "
            f"{'dsim% [95%]':>20s} verification")
    ci = lambda v, lo_hi, spec: "-" if v is None else f"{v:{spec}} [{lo_hi[0]:{spec}}-{lo_hi[1]:{spec}}]"  # noqa: E731
    figs, ll_cache = [], {}
    for task in tasks:
        prompts, items = task_prompts(task, args.n, pair.tokenizer, args.heal)
        if items is not None:
            ok = sum(parses(it["prompt"], it["reference"]) for it in items)
            print(f"# code: {len(items)} stdlib functions; prompt + reference itself parses {ok}/{len(items)}")
        for bs in (int(b) for b in args.batches.split(",")):
            t0 = time.perf_counter()
            runs = run_block(pair, settings, prompts, bs, args)
            print(f"# {task} batch {bs}: {len(prompts)} prompts, {time.perf_counter() - t0:.0f} s timed runs\n{head}")
            block = {st["name"]: figures(pair, task, bs, st, runs, prompts, items, ll_cache, args.heal)
                     for st in settings}
            for st in settings:
                f = block[st["name"]]
                if st["relax"] and st["lossless"] in block:
                    compare(f, block[st["lossless"]], runs)
                figs.append(f)
                rng = f"{min(f['ratios']):.2f}-{max(f['ratios']):.2f}"
                ver = ",".join(f"{v}:{c}" for v, c in f["verification"].items() if v != "None") or "-"
                dq = ci(f["dquality"], f["dquality_ci"], "+.1f" if items is not None else "+.3f")
                print(f"{task:4s} {bs:5d} {st['name']:28s} {f['ratio']:5.2f} {rng:>9s} {fmt(f['per_call']):>8s} "
                      f"{fmt(f['accept']):>6s} {f['exact']:5.2f} {ci(f['exact_ar'], f['exact_ar_ci'], '.2f'):>15s} "
                      f"{f['loglik']:7.3f} {ci(f['edit_sim'], f['edit_sim_ci'] or (0, 0), '.3f'):>19s} "
                      f"{fmt(f['parse_rate']):>5s} {fmt(f['vs_lossless']):>5s} {dq:>20s} {ver}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"command": command, "device": describe(pair), "max_new_tokens": args.max_new,
                       "repeats": args.repeats, "heal": args.heal, "figures": figs}, fh, indent=1)
    if args.plot:
        plot(figs, args.plot)


if __name__ == "__main__":
    main()
