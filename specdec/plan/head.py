"""SpecDec++ acceptance head: predicts P(accept) of a drafted token from the draft's hidden state.

Architecture (Huang et al., SpecDec++): L residual blocks x + SiLU(Linear_dxd(x)), then Linear_dx2;
P(accept) = softmax(.)[1]. A round stops once 1 - prod_i P_acc(i) exceeds the threshold.

Which state it reads (`HeadConfig.reads`):
- "fed" (the paper's): the draft's last hidden state after the drafted token x_i was fed back. Deciding
  on x_i then costs one draft forward more per round than a fixed length (the forward that would only
  be needed to draft x_{i+1}).
- "proposing": the state that proposed x_i (the one whose logits gave q_i), plus q_i(x_i) and
  log q_i(x_i); input width d + 2. The stop decision is made as soon as x_i is drawn, so a round costs
  exactly the draft forwards of its length. Its training data needs no token mixing: the decision on
  x_i only matters when x_1..x_{i-1} were accepted, and then the context is the target's own tokens,
  which is exactly the teacher-forced sequence.

Training data (`build_examples`): the target's responses to prompts; along them the draft samples
Z_t ~ q_t (teacher-forced on the target's tokens) and the label is y_t = min(1, p_t(Z_t) / q_t(Z_t));
for greedy decoding Z_t = argmax q_t and y_t = 1 when it equals argmax p_t (what greedy verification does).
Token mixing: the head's input sequence holds Z_t, except with probability `mix` the target's token
(those positions carry no loss). Loss: soft-label BCE with the rejected class weighted `w_rej`:
sum[w_rej (1-y)(-log P0) + y(-log P1)] / sum[w_rej (1-y) + y]. The draft stays frozen.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..spec import sampling

if TYPE_CHECKING:
    from ..config import SamplingParams


@dataclass
class HeadConfig:
    hidden_size: int
    num_layers: int = 3
    threshold: float = 0.3  # stop when P(at least one rejection in this round) exceeds it
    mix: float = 0.15
    w_rej: float = 6.0
    reads: str = "fed"  # "fed" | "proposing" (see the module docstring)

    READS = ("fed", "proposing")

    @property
    def in_features(self) -> int:
        return self.hidden_size + (2 if self.reads == "proposing" else 0)


def proposing_features(h: torch.Tensor, token_prob: torch.Tensor) -> torch.Tensor:
    """Input of a "proposing" head: the proposing state and q(x), log q(x) of the token it drew."""
    q = token_prob.float().clamp_min(1e-12)[..., None]
    return torch.cat([h.float(), q, q.log()], dim=-1)


class AcceptanceHead(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        if cfg.reads not in HeadConfig.READS:
            raise ValueError(f"acceptance head reads {cfg.reads!r}; expected one of {HeadConfig.READS}")
        self.cfg = cfg
        d = cfg.in_features
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(cfg.num_layers))
        self.out = nn.Linear(d, 2)
        for b in self.blocks:  # start as identity-ish residual blocks
            nn.init.zeros_(b.weight)
            nn.init.zeros_(b.bias)
        if cfg.reads == "proposing":
            # start from the draft's own confidence: logit(P accept) = log q(x), no weight on the state.
            # Trained from a random output layer, the head ranked accepted against rejected tokens worse
            # than q(x) alone on prompts unlike its training prompts (AUC 0.80 vs 0.84, shared pair)
            nn.init.zeros_(self.out.weight)
            nn.init.zeros_(self.out.bias)
            with torch.no_grad():
                self.out.weight[1, -1] = 1.0  # the last input feature is log q(x)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [..., 2] (index 1 = accept)."""
        x = h.float()
        for b in self.blocks:
            x = x + nn.functional.silu(b(x))
        return self.out(x)

    def features(self, h: torch.Tensor, token_prob: torch.Tensor | None) -> torch.Tensor:
        """The head's input from the draft state it reads and q(token) (used by "proposing" heads only)."""
        return proposing_features(h, token_prob) if self.cfg.reads == "proposing" else h

    def p_accept(self, h: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self(h), dim=-1)[..., 1]

    def save(self, folder: str, extra: dict | None = None) -> None:
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, os.path.join(folder, "head.safetensors"))
        with open(os.path.join(folder, "head.json"), "w") as f:
            json.dump({**asdict(self.cfg), **(extra or {})}, f, indent=2)

    @classmethod
    def load(cls, folder: str, device="cpu") -> "AcceptanceHead":
        from safetensors.torch import load_file

        with open(os.path.join(folder, "head.json")) as f:
            meta = json.load(f)
        fields = {k: meta[k] for k in HeadConfig.__dataclass_fields__ if k in meta}
        head = cls(HeadConfig(**fields))
        head.load_state_dict(load_file(os.path.join(folder, "head.safetensors")))
        return head.to(device).eval().requires_grad_(False)


def weighted_bce(logits: torch.Tensor, y: torch.Tensor, w_rej: float) -> torch.Tensor:
    """SpecDec++ loss over labelled positions. logits [N, 2], y [N] soft labels in [0, 1]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    num = (w_rej * (1 - y) * -logp[:, 0] + y * -logp[:, 1]).sum()
    den = (w_rej * (1 - y) + y).sum().clamp_min(1e-8)
    return num / den


@torch.inference_mode()
def build_examples(target, draft, prompt_ids: list[int], response_ids: list[int], sp: SamplingParams,
                   cfg: HeadConfig, generator: torch.Generator, vocab: int,
                   draft_vocab: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Head inputs [m, in_features] and labels [m] for one (prompt, target response) pair.

    `draft_vocab` > 0: the draft scores only its first `draft_vocab` ids, as the engine's
    `speculation.draft_vocab` does, so the head learns on the tokens the engine will propose."""
    seq = torch.tensor([prompt_ids + response_ids])
    n_p, n_r = len(prompt_ids), len(response_ids)
    sl = slice(n_p - 1, n_p - 1 + n_r)  # positions whose next token is a response token
    dv = min(draft_vocab or vocab, vocab)
    hd = draft.get_decoder()(input_ids=seq).last_hidden_state[0, sl]  # the state that draws each q_t
    lt, ld = target(seq).logits[0, sl, :vocab], draft.get_output_embeddings()(hd)[:, :dv]
    rows = sampling.Rows.of(sp, ld.device)
    q = sampling.probs(ld, rows)  # [n_r, dv]
    if sp.greedy:  # greedy verification accepts Z = argmax q exactly when it is argmax p
        z = ld.argmax(-1)
        y = (lt.argmax(-1) == z).float()
    else:
        p = sampling.probs(lt, rows)  # [n_r, V]
        z = sampling.sample(q, torch.rand(n_r, generator=generator))  # Z_t ~ q_t
        pz, qz = p.gather(1, z[:, None])[:, 0], q.gather(1, z[:, None])[:, 0]
        y = (pz / qz.clamp_min(1e-12)).clamp(max=1.0)  # P(accept Z_t) under the lossless rule
    if cfg.reads == "proposing":  # the teacher-forced state that drew Z_t, and q_t(Z_t)
        return proposing_features(hd, q.gather(1, z[:, None])[:, 0]), y.float()
    keep_target = torch.rand(n_r, generator=generator) < cfg.mix
    resp = torch.tensor(response_ids)
    mixed = torch.where(keep_target, resp, z)
    h = draft.get_decoder()(input_ids=torch.cat([seq[0, :n_p], mixed])[None]).last_hidden_state[0, n_p:]
    labelled = ~keep_target
    return h[labelled].float(), y[labelled].float()


def calibration(p_pred: torch.Tensor, y: torch.Tensor, bins: int = 5) -> list[dict]:
    """Predicted vs observed acceptance per bin of predicted probability."""
    out = []
    edges = torch.linspace(0, 1, bins + 1)
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (p_pred >= lo) & ((p_pred < hi) if hi < 1 else (p_pred <= hi))
        if m.any():
            out.append({"bin": f"{lo:.1f}-{hi:.1f}", "n": int(m.sum()), "predicted": float(p_pred[m].mean()),
                        "observed": float(y[m].mean())})
    return out


def auc(score: torch.Tensor, y: torch.Tensor) -> float:
    """How well `score` ranks accepted above rejected tokens: the probability that an accepted token
    scores higher than a rejected one (ties count half). A soft label y counts as y of an accepted
    token and 1 - y of a rejected one. 0.5 is chance; a stop rule can only be as good as its ranking."""
    s, order = torch.sort(score.double())
    pos, neg = y.double()[order], 1 - y.double()[order]
    _, group = torch.unique_consecutive(s, return_inverse=True)
    pos_g = torch.zeros(int(group.max()) + 1, dtype=torch.float64).index_add_(0, group, pos)
    neg_g = torch.zeros_like(pos_g).index_add_(0, group, neg)
    below = torch.cumsum(neg_g, 0) - neg_g  # rejected weight scoring strictly lower
    return float((pos_g * (below + 0.5 * neg_g)).sum() / (pos.sum() * neg.sum()).clamp_min(1e-12))


def train_head(h: torch.Tensor, y: torch.Tensor, cfg: HeadConfig, epochs: int = 3, lr: float | None = None,
               batch: int = 256, seed: int = 0, holdout: float = 0.1, progress=None) -> tuple[AcceptanceHead, dict]:
    """Train on (hidden, label) pairs; returns the head and a report with held-out loss and calibration.

    lr defaults to 1e-3 for a "proposing" head (it starts from log q(x) and refines it; at 5e-3 it
    drifted further from q's ranking on unseen prompts) and 5e-3 for a "fed" one (from scratch; 1e-3
    under-fit in 3 epochs)."""
    if lr is None:
        lr = 1e-3 if cfg.reads == "proposing" else 5e-3
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(y), generator=g)
    n_val = max(1, int(len(y) * holdout))
    val, tr = perm[:n_val], perm[n_val:]
    with torch.random.fork_rng():  # a reproducible init that leaves the caller's RNG alone
        torch.manual_seed(seed)
        head = AcceptanceHead(cfg)
    opt = torch.optim.AdamW(head.parameters(), lr=lr)
    steps = epochs * math.ceil(len(tr) / batch)
    for epoch in range(epochs):
        order = tr[torch.randperm(len(tr), generator=g)]
        for i in range(0, len(order), batch):
            idx = order[i : i + batch]
            loss = weighted_bce(head(h[idx]), y[idx], cfg.w_rej)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if progress:
                progress(1, loss.item())
    head.eval().requires_grad_(False)
    with torch.no_grad():
        logits = head(h[val])
        pred = torch.softmax(logits, -1)[:, 1]
        report = {
            "train_examples": len(tr), "heldout_examples": n_val, "steps": steps,
            "heldout_loss": float(weighted_bce(logits, y[val], cfg.w_rej)),
            "heldout_mean_label": float(y[val].mean()), "heldout_mean_predicted": float(pred.mean()),
            "calibration": calibration(pred, y[val]),
            "heldout_auc": auc(pred, y[val]),
        }
        if cfg.reads == "proposing":  # what the draft's own confidence ranks alone (its last feature: log q)
            report["heldout_auc_q"] = auc(h[val][:, -1], y[val])
    return head, report
