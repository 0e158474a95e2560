"""The report's plots (PNG bytes) and its self-contained HTML page (jobs/report.py makes the figures)."""

from __future__ import annotations

import base64
import html
import io
import re

SPECULATIVE, CONTROL = "#4c72b0", "#c44e52"


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def plots(acc: dict, parts: list[dict], worker_hours: dict[str, float]) -> dict[str, bytes]:
    """The report's figures as PNG bytes, by file name: tokens/s per worker and $ per 1M output tokens by part
    (`parts`, in shard order: {tokens_per_s, usd_per_m (None without a price), control}; the cost plot only
    where every part has a price), worker-hours by device, and the acceptance plots (`acc`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, bytes] = {}

    def save(name: str, fig) -> None:
        out[name] = _png(fig)
        plt.close(fig)

    def bars(name: str, shares: list[float], xlabel: str, ylabel: str, title: str, color: str) -> None:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.bar(range(len(shares)), [100 * h for h in shares], color=color)
        ax.set_xticks(range(len(shares)))
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        save(name, fig)

    def by_part(name: str, key: str, ylabel: str, title: str) -> None:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for control, color, label in ((False, SPECULATIVE, "speculative"), (True, CONTROL, "control (no drafts)")):
            points = [(i, p[key]) for i, p in enumerate(parts) if p["control"] == control and p[key] is not None]
            if points:
                ax.scatter([i for i, _ in points], [v for _, v in points], s=12, color=color, label=label)
        ax.set(xlabel="part (shard order)", ylabel=ylabel, title=title, ylim=(0, None))
        ax.legend(fontsize="small")
        save(name, fig)

    by_part("throughput.png", "tokens_per_s", "output tokens/s per worker", "Tokens/s per worker, by part")
    if parts and all(p["usd_per_m"] is not None for p in parts if p["tokens_per_s"]):
        by_part("cost.png", "usd_per_m", "USD per 1M output tokens", "Cost per 1M output tokens, by part")
    top = max(worker_hours.values(), default=0.0)
    unit, per_hour = ("hours", 1) if top >= 1 else ("minutes", 60) if top >= 1 / 60 else ("seconds", 3600)
    fig, ax = plt.subplots(figsize=(5, 1.2 + 0.4 * len(worker_hours)))
    bars_ = ax.barh(list(worker_hours), [h * per_hour for h in worker_hours.values()], color="#8172b3")
    ax.bar_label(bars_, fmt="%.3g", padding=3)
    ax.margins(x=0.2)
    ax.set(xlabel=f"worker-{unit}", title="Worker time by device")
    save("worker_hours.png", fig)
    bars("accept_lengths.png", acc["accept_hist"], "drafted tokens accepted in a round (tokens)",
         "share of drafting rounds (%)", "Accept lengths", SPECULATIVE)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    pos = acc["by_position"]
    ax.plot([j for j, _ in pos], [100 * r for _, r in pos], marker="o", color="#dd8452")
    ax.set_xticks([j for j, _ in pos])
    ax.set(xlabel="position in the draft (token)", ylabel="accepted, of rounds drafting that far (%)",
           ylim=(0, 100), title="Acceptance by draft position")
    save("acceptance_by_position.png", fig)
    total = max(1, sum(acc["draft_hist"]))
    bars("draft_lengths.png", [h / total for h in acc["draft_hist"]],
         "tokens drafted in a round (tokens; 0 = plain decoding)", "share of rounds (%)",
         "Draft lengths the policy chose", "#55a868")
    return out


def to_html(markdown: str, images: dict[str, bytes]) -> str:
    """A self-contained page of the report: headings, paragraphs, tables, and the images inline."""

    def inline(text: str) -> str:
        text = html.escape(text)
        text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", text)
        text = re.sub(r"`(.+?)`", r"<code>\1</code>", text)

        def img(m):
            data = base64.b64encode(images[m.group(2)]).decode()
            return f'<img alt="{m.group(1)}" src="data:image/png;base64,{data}">'
        return re.sub(r"!\[(.*?)\]\((.*?)\)", img, text)

    out, table = [], []
    for line in markdown.splitlines() + [""]:
        if line.startswith("|"):
            if not set(line.replace("|", "").strip()) <= {"-"}:
                cells = [c.strip() for c in line.strip("|").split("|")]
                tag = "th" if not table else "td"
                table.append("<tr>" + "".join(f"<{tag}>{inline(c)}</{tag}>" for c in cells) + "</tr>")
            continue
        if table:
            out.append("<table>" + "".join(table) + "</table>")
            table = []
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{inline(line.lstrip('#').strip())}</h{level}>")
        elif line.strip():
            out.append(f"<p>{inline(line)}</p>")
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:left}img{max-width:32%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>specbatch report</title>"
            f"<style>{style}</style></head><body>{''.join(out)}</body></html>")
