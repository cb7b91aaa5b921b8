"""RETEXO's accuracy gap, checked outside hpcgnn: a plain single-process PyTorch rewrite of the
stage-wise training (no hpcgnn import), full training beside it, and the authors' two choices of
normalisation (aashishkolluri/retexo-distributed trains DGL GraphConv, norm='both', without self
loops, on in-subgraphs of the train / val / test nodes, so a source's degree counts only its edges
into that set).

    python bench/retexo_reference.py cora 5        # a shipped dataset (hpcgnn/datasets) or a path, seeds
    python bench/retexo_reference.py cora 5 random kipf    # the authors' "cora_torch" split, one norm
    python bench/retexo_reference.py citeseer 2:3 public kipf    # seed 2 only (run seeds apart)

Split (third argument): ``public`` (default; the file's train / val / test, Planetoid's public
split on Cora: 140 / 500 / 1000) or ``random``, the split of the authors' ``cora_torch`` /
``citeseer_torch`` datasets: PyG ``Planetoid(split="random")`` with 86 (Cora) or 178 (Citeseer)
training nodes per class, 300 / 357 validation and 1806 / 2146 test nodes, drawn again for each
seed here (theirs is drawn once and saved). Norms (fourth argument, comma-separated): default all.

Settings are the authors' Cora ones: 2 layers, 256 hidden, dropout 0.3, Adam lr 0.003, weight
decay 5e-4, 200 rounds per layer (400 epochs for full training), the best validation state of
each stage. Norms: kipf = D^-1/2 (A + I) D^-1/2 (hpcgnn's GCN); dgl = D^-1/2 A D^-1/2;
dglsub = dgl on the in-subgraph of the trained / evaluated nodes (the authors' code).
One line per (method, norm): mean test accuracy at the best validation epoch over the seeds.
"""
import sys, copy
from pathlib import Path
import warnings
warnings.filterwarnings("ignore", message="Sparse")
import numpy as np, torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)
path = Path(sys.argv[1])
if not path.suffix:
    path = Path(__file__).resolve().parents[1] / "hpcgnn" / "datasets" / f"{sys.argv[1]}.npz"
d = np.load(path)
n = int(d['num_nodes'])
indptr, indices = d['adj_indptr'], d['adj_indices']
rows = np.repeat(np.arange(n), np.diff(indptr))           # row i = dst, indices = src (symmetric)
X = torch.sparse_csr_tensor(  # noqa: E501
    torch.tensor(d['feat_indptr']), torch.tensor(d['feat_indices']), torch.tensor(d['feat_data']), size=tuple(d['feat_shape'])).to_dense()
X = X / X.sum(1, keepdim=True).clamp(min=1)
y = torch.tensor(d['labels']); tr, va, te = (torch.tensor(d[k]) for k in ('train_idx', 'val_idx', 'test_idx'))
C = int(y.max()) + 1
dst, src = torch.tensor(rows), torch.tensor(indices)

def adj(norm, targets=None):
    """sparse (n x n) operator. norm: 'kipf' (A+I, sym, global deg) | 'dgl' (A, sym, global deg, no self)
    | 'dglsub' (A restricted to edges into targets; src deg counted in that subgraph, dst = full in-degree)"""
    s, t = src, dst
    if norm == 'kipf':
        s = torch.cat([s, torch.arange(n)]); t = torch.cat([t, torch.arange(n)])
        deg = torch.bincount(t, minlength=n).float()
        w = deg[s].rsqrt() * deg[t].rsqrt()
    else:
        if targets is not None and norm == 'dglsub':
            m = torch.zeros(n, dtype=torch.bool); m[targets] = True
            keep = m[t]; s, t = s[keep], t[keep]
        outd = torch.bincount(s, minlength=n).float().clamp(min=1)
        ind = torch.bincount(t, minlength=n).float().clamp(min=1)
        w = outd[s].rsqrt() * ind[t].rsqrt()
    return torch.sparse_coo_tensor(torch.stack([t, s]), w, (n, n)).coalesce()

class Conv(nn.Module):
    def __init__(s, a, b): super().__init__(); s.lin = nn.Linear(a, b)
    def forward(s, A, x):   # aggregate then transform (DGL when in>out: mult first; same math)
        return torch.sparse.mm(A, x) @ s.lin.weight.T + s.lin.bias

def acc(logits, idx): return (logits[idx].argmax(1) == y[idx]).float().mean().item()

def retexo(norm, seed, hidden=256, drop=0.3, lr=0.003, wd=5e-4, rounds=200):
    torch.manual_seed(seed)
    A = adj(norm); Atr = adj(norm, tr) if norm == 'dglsub' else A
    Ava = adj(norm, va) if norm == 'dglsub' else A; Ate = adj(norm, te) if norm == 'dglsub' else A
    dims = [X.shape[1], hidden, C]
    convs = [Conv(a, b) for a, b in zip(dims[:-1], dims[1:])]
    x = X
    for l, conv in enumerate(convs):
        last = l == len(convs) - 1
        head = nn.Sequential() if last else nn.Sequential(nn.LayerNorm(hidden), nn.ReLU(), nn.Linear(hidden, C))
        params = list(conv.parameters()) + list(head.parameters())
        opt = torch.optim.Adam(params, lr=lr, weight_decay=wd)
        f = lambda A_, train: head(conv(A_, F.dropout(x, drop, training=train)))
        best, state = -1, None
        for r in range(rounds):
            opt.zero_grad(); F.cross_entropy(f(Atr, True)[tr], y[tr]).backward(); opt.step()
            with torch.no_grad():
                v = acc(f(Ava, False), va)
            if v > best: best, state = v, copy.deepcopy((conv.state_dict(), head.state_dict()))
        conv.load_state_dict(state[0]); head.load_state_dict(state[1])
        with torch.no_grad():
            if last: return acc(f(Ate, False), te), best
            x = F.relu(head[0](conv(A, x)))            # embedding: eval, on all nodes

def full(norm, seed, hidden=256, drop=0.3, lr=0.003, wd=5e-4, epochs=400):
    torch.manual_seed(seed)
    A = adj('kipf' if norm == 'kipf' else 'dgl')
    c1, c2 = Conv(X.shape[1], hidden), Conv(hidden, C)
    opt = torch.optim.Adam(list(c1.parameters()) + list(c2.parameters()), lr=lr, weight_decay=wd)
    f = lambda t: c2(A, F.dropout(F.relu(c1(A, F.dropout(X, drop, training=t))), drop, training=t))
    best, bt = -1, 0
    for e in range(epochs):
        opt.zero_grad(); F.cross_entropy(f(True)[tr], y[tr]).backward(); opt.step()
        with torch.no_grad():
            o = f(False); v = acc(o, va)
        if v > best: best, bt = v, acc(o, te)
    return bt, best

RANDOM_SPLIT = {'cora': (86, 300, 1806), 'citeseer': (178, 357, 2146)}   # the authors' num_split


def set_split(kind, seed):
    """PyG Planetoid(split='random'): per class num_train_per_class nodes, then num_val and
    num_test from the rest, in a random order."""
    global tr, va, te
    if kind == 'public':
        return
    per, nv, nt = RANDOM_SPLIT[path.stem]
    g = torch.Generator().manual_seed(1000 + seed)
    train = torch.cat([(y == c).nonzero().view(-1)[torch.randperm(int((y == c).sum()), generator=g)[:per]]
                       for c in range(C)])
    mask = torch.ones(n, dtype=torch.bool); mask[train] = False
    rest = mask.nonzero().view(-1); rest = rest[torch.randperm(len(rest), generator=g)]
    tr, va, te = train, rest[:nv], rest[nv:nv + nt]


_sd = (sys.argv[2] if len(sys.argv) > 2 else "5").split(":")     # "5" = seeds 0-4; "3:5" = 3, 4
seeds = range(int(_sd[0])) if len(_sd) == 1 else range(int(_sd[0]), int(_sd[1]))
split = sys.argv[3] if len(sys.argv) > 3 else 'public'
norms = sys.argv[4].split(',') if len(sys.argv) > 4 else ['kipf', 'dgl', 'dglsub']
for name, fn, norm in [('full', full, 'kipf'), ('full', full, 'dgl'), ('retexo', retexo, 'kipf'), ('retexo', retexo, 'dgl'), ('retexo', retexo, 'dglsub')]:
    if norm not in norms:
        continue
    r = []
    for s in seeds:
        set_split(split, s); r.append(fn(norm, s))
    t = np.array([a for a, _ in r]) * 100
    print(f"{sys.argv[1]} {split} {name:7s} {norm:7s} test {t.mean():.2f} (sd {t.std():.2f}) val {np.mean([b for _, b in r])*100:.2f}  {np.round(t,1).tolist()}", flush=True)
