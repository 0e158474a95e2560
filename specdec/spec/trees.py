"""Token trees in a ragged batch: the attention mask that verifies them in one target forward, and the
rule that picks each row's longest accepted path.

A row's draft is a tree of nodes 1..T (padded to the batch's largest T); node 0 is the pending token
(the root). `parent[i, j-1]` is node j's parent (an earlier node), `depth` its distance from the root;
a chain is the tree whose node j has parent j - 1. In the forward, node j sits at cache slot
`base + j` (base = the row's cached length) and at position `base + depth(j)`; it attends to the
row's cache below `base` and to its own ancestors. After verification only the accepted path's keys
and values are kept: they move to slots `base + 1 .. base + a` (`RaggedKVCache.move_slots`).

Verification (`verify_tree`) walks every row's tree at once. At each node the target's choice `y` is
its argmax (greedy) or a sample from p at that node with the row's uniform for that depth; a child
passes when it is `y` (strict: lossless, since every emitted token is a draw from p) or, where the
child is `relaxed` and `conditional` is set, when p(child) >= min(alpha * H(p) + beta, max p) (AASD's
conditional verification). A node is accepted when it and all its ancestors pass; the deepest wins
(among equals, the more probable). The row emits its path and then `y` at the path's last node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import sampling
from .sampling import Rows


@dataclass
class TreeVerdict:
    accepted: torch.Tensor  # [n] depth of the accepted path (0..D)
    path: torch.Tensor  # [n, D] node index (1..T) at depth 1..D of the path; stale past `accepted`
    next_token: torch.Tensor  # [n] the target's token after the path


def chain(n: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """parent and depth [n, k] of chains of k nodes."""
    ar = torch.arange(k, device=device)[None, :].expand(n, k)
    return ar, ar + 1


def with_root(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(x, (1, 0))  # node 0: parent 0, depth 0


def ancestors(parent: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[n, T+1, T+1] bool: anc[i, j, a] is true when node a is node j itself or one of its ancestors."""
    par = with_root(parent)
    n, t1 = par.shape
    anc = torch.eye(t1, dtype=torch.bool, device=par.device)[None].repeat(n, 1, 1)
    cur = torch.arange(t1, device=par.device)[None, :].expand(n, t1)
    for _ in range(max_depth):
        cur = par.gather(1, cur)
        anc.scatter_(2, cur[:, :, None], True)
    return anc


def tree_inputs(parent: torch.Tensor, depth: torch.Tensor, base: torch.Tensor, kv_len: int, max_depth: int,
                before: int = 0):
    """Positions, cache slots [n, before + T+1] and the attention mask [n, 1, before + T+1, kv_len] of a tree
    forward over [root, nodes 1..T] whose root sits at slot `base` [n], after `before` tokens the target has not
    read yet (at slots base - before .. base - 1, clamped at 0, each seeing the row up to itself)."""
    n, t = parent.shape
    ar = torch.arange(t + 1, device=parent.device)
    positions = base[:, None] + with_root(depth)
    slots = base[:, None] + ar[None, :]
    rel = torch.arange(kv_len, device=parent.device)[None, :] - base[:, None]  # [n, kv_len]: slot - base
    inside = (rel >= 0) & (rel <= t)
    anc = ancestors(parent, max_depth)  # [n, T+1, T+1]
    tree = anc.gather(2, rel.clamp(0, t)[:, None, :].expand(n, t + 1, kv_len))
    mask = (rel < 0)[:, None, :] | (inside[:, None, :] & tree)
    if before:
        lead = (base[:, None] + torch.arange(-before, 0, device=parent.device)[None, :]).clamp(min=0)  # [n, before]
        lead_mask = torch.arange(kv_len, device=parent.device)[None, None, :] <= lead[:, :, None]
        positions, slots = torch.cat([lead, positions], 1), torch.cat([lead, slots], 1)
        mask = torch.cat([lead_mask, mask], 1)
    return positions, slots, mask[:, None]


def conditional_pass(dist: torch.Tensor, tokens: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """AASD's rule: p(x) >= min(alpha * H(p) + beta, max p), p = dist [..., vocab] (nats), x = tokens [...]."""
    entropy = -torch.special.xlogy(dist, dist).sum(-1)
    delta = torch.minimum(alpha * entropy + beta, dist.max(-1).values)
    return dist.gather(-1, tokens[..., None]).squeeze(-1) >= delta


def verify_tree(logits: torch.Tensor, tokens: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor,
                lengths: torch.Tensor, max_depth: int, rows: Rows, u: torch.Tensor | None,
                relaxed: torch.Tensor | None = None, conditional: tuple[float, float] | None = None,
                best: torch.Tensor | None = None) -> TreeVerdict:
    """logits [n, T+1, vocab] at the root and nodes 1..T; tokens, parent, depth [n, T]; lengths [n] valid
    nodes per row; u [n, max_depth + 1] uniforms by depth (None when greedy); relaxed [n, T] nodes the
    conditional rule (alpha, beta) may pass; best [n, T+1]: the logits' argmax, when the caller has it."""
    n, t = tokens.shape
    dev = logits.device
    d = max_depth
    par, dep = with_root(parent), with_root(depth)
    if rows.any_greedy:
        best = logits.argmax(-1) if best is None else best  # [n, T+1]
    if rows.greedy:
        y = best
        dist = torch.softmax(logits.float(), -1) if conditional else None
    else:  # a draw from p at every node (greedy rows of a mixed batch: their argmax)
        dist = sampling.probs(logits, rows)
        y = sampling.sample(dist.flatten(0, 1), u.gather(1, dep).flatten()).view(n, t + 1)
        if rows.any_greedy:
            y = sampling.per_row(rows, best, y)
    valid = torch.arange(t, device=dev)[None, :] < lengths[:, None]
    ok = valid & (tokens == y.gather(1, parent))
    if conditional is not None and relaxed is not None and t:
        at_parent = dist.gather(1, parent[:, :, None].expand(n, t, dist.shape[-1]))
        ok |= valid & relaxed & conditional_pass(at_parent, tokens, *conditional)
    path_ok = with_root(ok)
    path_ok[:, 0] = True
    for _ in range(d - 1):  # a node passes when it and its parent's path pass
        path_ok = path_ok & path_ok.gather(1, par)
    if dist is not None and t:
        prob = with_root(dist.gather(1, parent[:, :, None].expand(n, t, dist.shape[-1]))
                          .gather(2, tokens[:, :, None]).squeeze(-1))
    else:
        prob = torch.zeros((n, t + 1), device=dev)
    score = torch.where(path_ok, dep.to(prob.dtype) * 2 + prob, torch.full_like(prob, -1.0))
    best = score.argmax(1)  # [n]: the deepest accepted node (the root if none)
    accepted = dep.gather(1, best[:, None]).squeeze(1)
    path = torch.zeros((n, d + 1), dtype=torch.int64, device=dev)
    cur = best[:, None]
    for _ in range(d):  # walk up from the best node, writing each node at its depth (column 0 collects the root)
        path.scatter_(1, dep.gather(1, cur), cur)
        cur = par.gather(1, cur)
    return TreeVerdict(accepted, path[:, 1:], y.gather(1, best[:, None]).squeeze(1))
