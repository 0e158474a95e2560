"""SpecDec++ acceptance head: predicts P(accept) of a drafted token from the draft's hidden state.

Architecture (Huang et al., SpecDec++): L residual blocks x + SiLU(Linear_dxd(x)), then Linear_dx2;
P(accept) = softmax(.)[1]. It reads the draft's last hidden state after the drafted token was fed
(h_i for token x_i), so a round can stop once 1 - prod_i P_acc(i) exceeds the threshold.

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

import torch
from torch import nn

from . import sampling
from .config import SamplingParams


@dataclass
class HeadConfig:
    hidden_size: int
    num_layers: int = 3
    threshold: float = 0.3  # stop when P(at least one rejection in this round) exceeds it
    mix: float = 0.15
    w_rej: float = 6.0


class AcceptanceHead(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(cfg.num_layers))
        self.out = nn.Linear(cfg.hidden_size, 2)
        for b in self.blocks:  # start as identity-ish residual blocks
            nn.init.zeros_(b.weight)
            nn.init.zeros_(b.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [..., 2] (index 1 = accept)."""
        x = h.float()
        for b in self.blocks:
            x = x + nn.functional.silu(b(x))
        return self.out(x)

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
                   mix: float, generator: torch.Generator, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [m, d] and labels [m] for one (prompt, target response) pair."""
    seq = torch.tensor([prompt_ids + response_ids])
    n_p, n_r = len(prompt_ids), len(response_ids)
    sl = slice(n_p - 1, n_p - 1 + n_r)  # positions whose next token is a response token
    if sp.greedy:  # greedy verification accepts Z = argmax q exactly when it is argmax p
        lt, ld = target(seq).logits[0, sl, :vocab], draft(seq).logits[0, sl, :vocab]
        z = ld.argmax(-1)
        y = (lt.argmax(-1) == z).float()
    else:
        p = sampling.probs(target(seq).logits[0, sl, :vocab], sp)  # [n_r, V]
        q = sampling.probs(draft(seq).logits[0, sl, :vocab], sp)
        z = sampling.sample(q, torch.rand(n_r, generator=generator))  # Z_t ~ q_t
        pz, qz = p.gather(1, z[:, None])[:, 0], q.gather(1, z[:, None])[:, 0]
        y = (pz / qz.clamp_min(1e-12)).clamp(max=1.0)  # P(accept Z_t) under the lossless rule
    keep_target = torch.rand(n_r, generator=generator) < mix
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


def train_head(h: torch.Tensor, y: torch.Tensor, cfg: HeadConfig, epochs: int = 3, lr: float = 5e-3,
               batch: int = 256, seed: int = 0, holdout: float = 0.1, progress=None) -> tuple[AcceptanceHead, dict]:
    """Train on (hidden, label) pairs; returns the head and a report with held-out loss and calibration."""
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
        }
    return head, report
