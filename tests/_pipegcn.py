"""An independent whole-graph computation of PipeGCN's bounded staleness (Wan et al., ICLR 2022;
GATECH-EIC/PipeGCN ``module/model.py``, ``helper/feature_buffer.py``), written for the tests.

Every part ``q`` sees, at epoch ``t``, the rows of its own nodes as they are and the rows of
every other node as they were *posted* ``s`` epochs ago: each layer's input (before dropout),
so the layer applies dropout and its current weights to both. The gradient of the loss with
respect to those stale rows is sent back to the owners, who add it into the gradient of their
rows' input ``s`` epochs later. The first layer's input is the constant feature matrix, so its
"stale" rows are the features themselves. Epochs ``t < s`` are synchronous. Smoothing ``m``:
``avg <- m * avg + (1 - m) * received`` for rows and gradients, starting at the first received
value. Dropout keeps an element with the counter-based mask of (seed, epoch, layer, node id,
channel) (hpcgnn's ``keep_mask`` is the random source; which mask applies where is written
here). GCN, SAGE (mean) and GAT (dense attention, attention dropout) on whole-graph
matrices; Adam with coupled weight decay; mean cross-entropy on the training nodes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F


@dataclass
class Model:
    arch: str                  # gcn | sage | gat
    layers: int
    dropout: float = 0.0
    attn_dropout: float = 0.0
    heads: tuple = ()          # gat: heads of every layer (the last averaged)
    seed: int = 0


def graph_ops(g):
    """(A_hat (GCN), mean operator (SAGE), adjacency with self-loops (GAT, bool, dense)): the
    two operators as sparse COO tensors (a dense N x N product, and above all its transposed
    backward, cost seconds per epoch at N = 3000 on one core; the values are the same)."""
    a = sp.csr_matrix((np.ones(g.num_edges), g.indices, g.indptr), shape=(g.num_nodes,) * 2)
    a.sum_duplicates()
    a.data[:] = 1.0
    n = g.num_nodes
    d = 1.0 / np.sqrt(np.asarray(a.sum(1)).ravel() + 1.0)
    gcn = sp.diags(d) @ (a + sp.eye(n)) @ sp.diags(d)
    mean = sp.diags(1.0 / np.maximum(np.asarray(a.sum(1)).ravel(), 1.0)) @ a
    adj = torch.from_numpy(a.toarray() > 0) | torch.eye(n, dtype=torch.bool)
    return torch_sparse(gcn), torch_sparse(mean), adj


def torch_sparse(m) -> torch.Tensor:
    """A scipy sparse (or dense) matrix as a coalesced fp32 COO tensor."""
    m = sp.coo_matrix(m)
    idx = torch.from_numpy(np.vstack([m.row, m.col]).astype(np.int64))
    return torch.sparse_coo_tensor(idx, torch.from_numpy(m.data).float(), m.shape,
                                   check_invariants=True).coalesce()


def adam_step(opt: torch.optim.Optimizer, loss: torch.Tensor) -> float:
    """One step of a whole-graph reference: the gradients of ``loss``, then ``opt``'s step;
    returns the loss."""
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


class Sent(torch.autograd.Function):
    """``rows`` (what a codec delivered of ``h``) in the forward; ``back(grad)`` (what it
    returns of the gradient) in the backward."""

    @staticmethod
    def forward(ctx, h, rows, back):
        ctx.back = back
        return rows.clone()

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad), None, None


def keep(n: int, width: int, p: float, seed: int, epoch: int, layer: int) -> torch.Tensor:
    from hpcgnn.nn.dropout import keep_mask
    return keep_mask(torch.arange(n), width, p, seed, epoch, layer).float() / (1.0 - p)


def gat_layer(x, p, layer, heads, last, adj, model: Model, epoch):
    from hpcgnn.nn.dropout import edge_keep_mask
    n = x.shape[0]
    h = (x @ p[f"layers.{layer}.weight"]).view(n, heads, -1)
    s = (h * p[f"layers.{layer}.att_src"]).sum(-1)
    d = (h * p[f"layers.{layer}.att_dst"]).sum(-1)
    e = F.leaky_relu(d[:, None, :] + s[None, :, :], 0.2)
    alpha = torch.softmax(e.masked_fill(~adj[:, :, None], float("-inf")), dim=1)
    if model.attn_dropout:
        i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        k = edge_keep_mask(i.reshape(-1), j.reshape(-1), heads, model.attn_dropout, model.seed,
                           epoch, layer).view(n, n, heads)
        alpha = alpha * k / (1.0 - model.attn_dropout)
    out = torch.einsum("ijh,jhc->ihc", alpha, h)
    return (out.mean(1) if last else out.flatten(1)) + p[f"layers.{layer}.bias"]


def layer_fn(x, p, layer, model: Model, ops, epoch):
    """Layer ``layer`` on the whole-graph input ``x`` (already dropped out): ``(N, F_out)``."""
    gcn, mean, adj = ops
    last = layer == model.layers - 1
    w, b = p.get(f"layers.{layer}.weight"), p.get(f"layers.{layer}.bias")
    if model.arch == "gcn":
        return torch.sparse.mm(gcn, x @ w) + b
    if model.arch == "sage":
        out = w.shape[1] // 2
        return x @ w[:, :out] + torch.sparse.mm(mean, x @ w[:, out:]) + b
    return gat_layer(x, p, layer, model.heads[layer], last, adj, model, epoch)


def pipegcn_losses(g, parts: np.ndarray, init: dict, model: Model, s: int, m: float,
                   epochs: int, lr: float = 0.01, weight_decay: float = 5e-4,
                   received=None, returned=None, after_step=None,
                   params: dict | None = None) -> list[float]:
    """Per-epoch training losses of PipeGCN with staleness ``s`` (0: synchronous) over the
    node partition ``parts`` (``part[v]``), from the parameters ``init``. ``received(layer,
    epoch, h, q)``: the rows of ``h`` (``(N, F)``, each layer's input after the first) that part
    ``q`` gets when they are sent at ``epoch`` (a codec's values, e.g. Sylvie's quantisation;
    rows of nodes that are not ``q``'s halo are not read). ``returned(layer, epoch, grad, q)``:
    what the owners get of the gradient ``grad`` (``(N, F)``) of the halo rows part ``q`` used
    at ``epoch`` (only ``q``'s halo rows; the owners add up what every part returns). Defaults:
    the rows and the gradients themselves (fp32). ``after_step(epoch, params)``: called after
    every epoch's step with the parameters (e.g. to evaluate them). ``params``: a dict to fill
    with the trained parameters."""
    recv_of = received or (lambda layer, epoch, h, q: h)
    back_of = returned or (lambda layer, epoch, grad, q: grad)
    ops = graph_ops(g)
    x0, y = torch.from_numpy(g.dense_features()).float(), torch.from_numpy(g.labels)
    train = torch.from_numpy(g.train_idx)
    n = g.num_nodes
    part = torch.from_numpy(parts)
    own = [(part == q)[:, None] for q in range(int(part.max()) + 1)]
    p = {k: v.clone().float().requires_grad_(True) for k, v in init.items()}
    opt = torch.optim.Adam(p.values(), lr=lr, weight_decay=weight_decay)
    act = F.elu if model.arch == "gat" else torch.relu
    posted = [dict() for _ in range(model.layers)]     # layer -> epoch -> rows it posted
    sent_grads = [dict() for _ in range(model.layers)]  # layer -> epoch -> halo gradient posted
    avg_x = [[None] * len(own) for _ in range(model.layers)]   # per receiving part
    avg_g = [None] * model.layers
    losses = []
    for t in range(epochs):
        h, leaves = x0, {}
        for layer in range(model.layers):
            stale = s > 0 and layer > 0 and t >= s
            if layer > 0 and s > 0:
                posted[layer][t] = h.detach().clone()
                back = sent_grads[layer].pop(t - s, None)      # posted s epochs ago
                if back is not None:
                    avg_g[layer] = back if (m == 0 or avg_g[layer] is None) else \
                        m * avg_g[layer] + (1 - m) * back
                    h.register_hook(lambda grad, add=avg_g[layer]: grad + add)   # grad[boundary] += recv
            if stale:
                posted_h = posted[layer].pop(t - s)
                for q in range(len(own)):
                    recv = recv_of(layer, t - s, posted_h, q)
                    avg_x[layer][q] = recv if (m == 0 or avg_x[layer][q] is None) else \
                        m * avg_x[layer][q] + (1 - m) * recv
                leaves[layer] = [a.clone().requires_grad_(True) for a in avg_x[layer]]
            mask = keep(n, h.shape[1], model.dropout, model.seed, t, layer) if model.dropout else 1.0
            out = 0.0
            for q, rows in enumerate(own):
                if stale:
                    seen = torch.where(rows, h, leaves[layer][q])
                elif layer > 0 and (received or returned):    # synchronous, through the codec
                    sent = Sent.apply(h, recv_of(layer, t, h.detach(), q),
                                      lambda g, layer=layer, q=q: back_of(layer, t, g, q))
                    seen = torch.where(rows, h, sent)
                else:
                    seen = h
                out = out + rows * layer_fn(seen * mask, p, layer, model, ops, t)
            h = act(out) if layer < model.layers - 1 else out
        loss = F.cross_entropy(h[train], y[train])
        opt.zero_grad()
        loss.backward()
        for layer, parts_leaves in leaves.items():       # each owner's rows, summed over peers
            sent_grads[layer][t] = sum(back_of(layer, t, leaf.grad, q)
                                       for q, leaf in enumerate(parts_leaves))
        opt.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(t, {k: v.detach() for k, v in p.items()})
    if params is not None:
        params.update({k: v.detach() for k, v in p.items()})
    return losses
