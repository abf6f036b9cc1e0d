"""interventions.py: interchange interventions (activation patching): HOW a model solves recall.

Follows "Mechanistic evaluation of Transformers and state space models" (arXiv 2505.15105): the
clean / corrupted / patched runs and the attribution score of Sec. 3-4; the headline pair of Sec. 5,
the block input of layer 1 (the residual stream after layer 0) at the value (restored there:
induction, layer 0 wrote the association into the value token) and at the query (direct retrieval:
the association is already computed there); and the later version's Mamba follow-up (arXiv v3:
layer 0's short-conv output at the token after the value). The reference runs them with pyvene
(tinylang: experiment.py); here they are forward hooks on models.HookPoint sites. Where we differ
from the reference on purpose: README, differences 1, 6 and 17.

Beyond the paper (section "Circuits" below): attribution patching, the first-order estimate of
every interchange, and a run's minimal circuit, ACDC's search with every patch exact.

One interchange intervention: the base run is the corrupted document (one token, by default the
queried key in context, replaced by another token of its class), the source is the clean document.
At one (site, position) the whole activation vector is overwritten with the clean one, the rest of
the forward pass is recomputed from the corrupted input, and the readout is the softmax probability
of the clean answer at the query position. Attribution = (P̄_patched − P̄_corrupt) /
(P̄_clean − P̄_corrupt): 1 means the site restores the clean answer on its own, 0 that it
carries nothing the answer needs.

Shape letters (the README's glossary): b documents (the ones patched, a batch), l sequence length,
d d_model, v vocabulary, c an effective map's heads or channels, P positions patched at one site.
"""

import contextlib
import functools
import math
import time

import torch

from models import HookPoint, check_dataset
from tasks import ROLES

POSITIONS = ROLES            # the positions a table patches: every role of tasks.Dataset.positions
BLOCK_SITES = {  # name inside blocks.{i} -> table label, in forward order
    "hook_resid_pre": "block_in", "mixer.hook_in": "mixer_in", "mixer.hook_out": "mixer_out",
    "mlp.hook_in": "mlp_in", "mlp.hook_out": "mlp_out", "hook_resid_post": "block_out"}
READINGS = {"value": "induction", "query": "direct retrieval", "key": "held at the key"}
CUT = 0.5                    # verdict: the one headline position >= CUT names the mechanism
LOW_SIGNAL_GAP = 0.01        # P̄_clean − P̄_corrupt <= this -> "no signal" (the paper's filter)
CHUNK_ROWS = 128             # rows per forward: Mamba's scan tensors stay in cache (2x faster)


_real = lambda v, lo, hi: isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi
_whole = lambda v, lo=0, hi=2**63 - 1: isinstance(v, int) and _real(v, lo, hi)
ARGS = {  # what each public function's arguments of these names must be (NaN passes no test)
    "threshold": (lambda v: _real(v, 0, 1) and v < 1, "a number in [0, 1) (the P̄_clean − "
                  "P̄_corrupt gap at or below which there is no signal)"),
    "target": (lambda v: _real(v, 0, 1) and v > 0, "a recovery in (0, 1]"),
    "cut": (lambda v: _real(v, -math.inf, math.inf), "a finite number"),
    "seed": (_whole, "an int in [0, 2**63)"), "atp_above": (_whole, "a non-negative int"),
    "n_docs": (lambda v: _whole(v, 1), "a positive int (documents to patch)"),
    "strict": (lambda v: isinstance(v, bool), "True or False"),
    "model": (lambda v: isinstance(v, torch.nn.Module) and hasattr(v, "blocks"),
              "a model of models.build_model (or mechsm.load)")}


def _check(**args):
    """A one-line ValueError naming the first argument that is not what ARGS allows."""
    for name, value in args.items():
        ok, allowed = ARGS[name]
        if not ok(value):                   # a model or a tensor: its type (its repr has lines)
            shown = repr(value) if isinstance(value, (int, float, str, type(None))) else type(value)
            raise ValueError(f"{name} must be {allowed}; got {shown}.")


def _check_names(name, names, allowed):
    """names: a non-empty list or tuple of names in allowed (never a lone string: its letters)."""
    choices = ", ".join(list(allowed)[:6]) + ", ..." * (len(allowed) > 6)
    if not (isinstance(names, (list, tuple)) and names):
        raise ValueError(f"{name} must be a non-empty list of names among {choices}; "
                         f"got {names!r}.")
    for n in names:
        if not isinstance(n, str) or n not in allowed:
            raise ValueError(f"{name} must be among {choices}; got {n!r}.")


def hook_points(model):
    """{name: HookPoint} for every patchable site (HookPoint with a seq_dim), in module order."""
    _check(model=model)
    return {name: m for name, m in model.named_modules()
            if isinstance(m, HookPoint) and m.seq_dim is not None}


def site_layer(site):
    """'blocks.3.mixer.hook_u' -> 3 (None for sites outside the blocks)."""
    return int(site.split(".")[1]) if site.startswith("blocks.") else None


def site_label(site):
    """Short table label: block_in, mixer_in, ..., or the internal hook name without 'hook_'."""
    inner = site.split(".", 2)[2] if site_layer(site) is not None else site
    return BLOCK_SITES.get(inner) or inner.rsplit(".", 1)[-1].removeprefix("hook_")


def default_sites(model):
    """Block-level sites then the mixer's INTERNAL_SITES, layer by layer, skipping absent ones."""
    available = hook_points(model)
    return [f"blocks.{i}.{s}" for i, block in enumerate(model.blocks)
            for s in [*BLOCK_SITES, *("mixer." + name for name in type(block.mixer).INTERNAL_SITES)]
            if f"blocks.{i}.{s}" in available]


@contextlib.contextmanager
def patch(model, edits):
    """Within the block, site s outputs edits[s](activation); hooks are global state, removed on
    any exit."""
    _check(model=model)
    if not isinstance(edits, dict):
        raise ValueError(f"edits must be a dict {{site: function}}; got {edits!r}.")
    modules = dict(model.named_modules())
    handles = []

    def hook(site, fn, module, inputs, act):
        out = fn(act)
        if not isinstance(out, torch.Tensor) or out.shape != act.shape:   # None: left unchanged
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"edits[{site!r}] must return the activation to use, a tensor of "
                             f"its shape {tuple(act.shape)}; got {got}.")
        return out

    try:
        for site, fn in edits.items():
            if not isinstance(modules.get(site), HookPoint) or not callable(fn):
                raise ValueError(f"edits: {site!r} must be a HookPoint of this model (hook_points("
                                 f"model)) and its edit a function of the activation; got {fn!r}.")
            handles.append(modules[site].register_forward_hook(functools.partial(hook, site, fn)))
        yield model
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def record(model, tokens, sites, take=None):
    """{site: a clone of its activation (or take(site, activation))} from one forward on tokens."""
    if isinstance(sites, str) or not sites:        # each site is checked by patch
        raise ValueError(f"sites must be a non-empty list of HookPoint names; got {sites!r}.")
    store = {}

    def keep(site, act):
        store[site] = take(site, act) if take else act.detach().clone()
        return act

    with patch(model, {s: functools.partial(keep, s) for s in sites}):
        model(tokens)
    return store


def _answer_prob(logits, answers):
    """Softmax probability (float64) of answers (b,) under logits (b, v): exp(z_y - logsumexp z)."""
    log_norm = torch.logsumexp(logits, dim=-1)                                # (b,)
    return (logits.gather(1, answers[:, None])[:, 0] - log_norm).double().exp()


@torch.no_grad()
def answer_prob(model, tokens, answers, query):
    """Probability of answers (b,) at positions query (b,) in an unpatched forward, in chunks."""
    _check(model=model)
    chunks = [slice(a, a + CHUNK_ROWS) for a in range(0, len(tokens), CHUNK_ROWS)]
    return torch.cat([_answer_prob(model(tokens[c], readout=query[c]), answers[c]) for c in chunks])


def corrupt(dataset, role="key", seed=0, strict=False):
    """A corrupted copy of dataset.tokens (b, l): each document's token at positions[role] replaced
    by a uniformly drawn other token of its class (dataset.classes[role], [lo, hi); README
    difference 1); strict=True also excludes the document's own tokens (the corrupted key points to
    no other answer). One draw per document, reused by every site (README, difference 6)."""
    check_dataset(None, dataset)
    _check(seed=seed, strict=strict)
    if not isinstance(role, str) or role not in dataset.classes:
        raise ValueError(f"role must be among {', '.join(dataset.classes)}; got {role!r}.")
    lo, hi = dataset.classes[role]
    tokens = dataset.tokens.clone()
    pos = dataset.positions[role].to(tokens.device)
    rows = torch.arange(len(tokens), device=tokens.device)
    allowed = torch.ones(len(tokens), hi - lo, dtype=torch.float64)          # (b, hi-lo)
    if strict:
        r, c = ((tokens >= lo) & (tokens < hi)).nonzero(as_tuple=True)      # in-class entries
        allowed[r.cpu(), (tokens[r, c] - lo).cpu()] = 0.0
    allowed[rows.cpu(), (tokens[rows, pos] - lo).cpu()] = 0.0                # not the original
    if (allowed.sum(1) == 0).any():
        raise ValueError(f"no replacement left in class [{lo}, {hi}) for some document")
    draw = torch.multinomial(allowed, 1, generator=torch.Generator().manual_seed(seed))[:, 0] + lo
    tokens[rows, pos] = draw.to(tokens.device)
    return tokens


# --- One interchange intervention by definition, its score, the verdict; then the batched form.

@torch.no_grad()
def interchange_reference(model, clean_tokens, corrupt_tokens, site, pos, answers, query):
    """Slow, obviously correct twin of interchange for ONE position tensor pos (b,): record the
    whole clean activation, then patch document by document in a Python loop."""
    _check(model=model)
    model.eval()
    seq_dim = hook_points(model)[site].seq_dim
    clean = record(model, clean_tokens, [site])[site]

    def restore(act):
        out = act.clone()
        for r in range(out.shape[0]):
            out.select(0, r).select(seq_dim - 1, int(pos[r])).copy_(
                clean.select(0, r).select(seq_dim - 1, int(pos[r])))
        return out

    with patch(model, {site: restore}):
        return answer_prob(model, corrupt_tokens, answers, query)


def attribution(p_clean, p_corrupt, p_patched, threshold=LOW_SIGNAL_GAP):
    """Ratio of means over documents (as the paper's code), not a mean of per-document ratios:
        score = (P̄_patched − P̄_corrupt) / (P̄_clean − P̄_corrupt), on probabilities (b,).
    low_signal when the gap is <= threshold or not a number; score is None when the gap is 0 (or a
    probability is not a number), so that every result is JSON."""
    _check(threshold=threshold)
    clean, corrupted, patched = (float(p.double().mean()) for p in (p_clean, p_corrupt, p_patched))
    gap = clean - corrupted
    score = (patched - corrupted) / gap if gap != 0 else math.nan
    return {"score": score if math.isfinite(score) else None,
            "p_clean": clean, "p_corrupt": corrupted, "p_patched": patched, "gap": gap,
            "per_doc": (p_patched.double() - p_corrupt.double()).tolist(),  # Δ per document
            "low_signal": no_signal(gap, threshold)}


def no_signal(gap, threshold):
    """Whether a gap P̄_clean − P̄_corrupt is too small to attribute: at or below the threshold,
    or not a number (NaN probabilities; None in a JSON record)."""
    return not (isinstance(gap, (int, float)) and gap > threshold)


def verdict(attribs, low_signal, threshold=LOW_SIGNAL_GAP, cut=CUT):
    """(verdict, reason) from {"key", "value", "query"}: attributions at the headline site. The
    READINGS name of the one site at or above `cut` (the paper reads its box plots by eye: README,
    difference 16); "mixed" when none or several are; "no signal" when the gap is at or below the
    filter or an attribution is not a number."""
    _check(threshold=threshold, cut=cut)
    scores = [attribs[site] for site in READINGS]
    if low_signal or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in scores):
        return "no signal", f"P̄_clean − P̄_corrupt <= {threshold}: nothing to attribute"
    text = ", ".join(f"Attrib@{site.title()} {attribs[site]:.2f}" for site in READINGS)
    held = [site for site in READINGS if attribs[site] >= cut]
    if len(held) == 1:
        return READINGS[held[0]], f"{text}: only the {held[0]} restores >= {cut}"
    return "mixed", f"{text}: {'several sites restore' if held else 'no site restores'} >= {cut}"


@torch.no_grad()
def prepare(model, clean_tokens, corrupt_tokens, sites, positions, answers, query):
    """What interchange() reuses, from four forwards: p_corrupt, both runs' activations at each
    site and position ({site: (P, b, ...)}, positions {name: (b,)} in order), the corrupted
    residuals (resid[i]: block i's input, resid[L]: the output)."""
    L, modules = len(model.blocks), dict(model.named_modules())
    stream = [f"blocks.{i}.hook_resid_pre" for i in range(L)] + [f"blocks.{L - 1}.hook_resid_post"]
    pos = torch.stack(list(positions.values()))                              # (P, b)
    rows = torch.arange(clean_tokens.shape[0], device=clean_tokens.device)

    def gather(site, act):
        at = act.movedim(modules[site].seq_dim, 1)                           # (b, l, ...)
        return torch.stack([at[rows, p] for p in pos])                       # (P, b, ...)
    resid = record(model, corrupt_tokens, stream)
    return {"p_corrupt": answer_prob(model, corrupt_tokens, answers, query),
            "clean": record(model, clean_tokens, sites, gather),
            "corrupt": record(model, corrupt_tokens, sites, gather),
            "resid": [resid[name] for name in stream]}                       # L+1 x (b, l, d)


@torch.no_grad()
def interchange(model, clean_tokens, corrupt_tokens, site, positions, answers, query, *,
                cache=None, chunk_rows=CHUNK_ROWS):
    """Patch `site` at each position of `positions` ({name: (b,)}) one at a time, from the clean
    run into the corrupted one: {name: p_patched (b,)} of `answers` at `query`; cache: prepare's
    (built here when None). Row p*b + i is copy p of document i; its hook writes row i's clean
    vector at positions[p][i]. Exact shortcuts: rows whose clean vector equals the corrupted one bit
    for bit patch nothing (p_corrupt, no forward); the forward starts at the site's layer: the
    layers before see only the corrupted input (cached); block input i is block output i-1."""
    _check(model=model)
    model.eval()
    names = list(positions)
    P, b = len(names), corrupt_tokens.shape[0]
    if cache is None:
        cache = prepare(model, clean_tokens, corrupt_tokens, [site], positions, answers, query)
    seq_dim = dict(model.named_modules())[site].seq_dim
    on_residual = site.endswith((".hook_resid_pre", ".hook_resid_post"))  # the site IS a residual
    layer = int(site.split(".")[1]) + site.endswith(".hook_resid_post")   # the forward starts here
    clean, corrupted = cache["clean"][site], cache["corrupt"][site]          # (P, b, ...)
    todo = (clean != corrupted).flatten(2).any(-1).flatten().nonzero()[:, 0]  # rows that differ
    doc = todo % b                                                           # their documents
    todo_pos = torch.cat([positions[name] for name in names])[todo]          # (rows,)
    todo_clean = clean.flatten(0, 1)[todo]                                   # (rows, ...)
    chunk = {}  # "part": the current chunk, a slice of todo, read by restore

    def restore(act):
        out = act.clone()  # never write into a tensor the model may reuse elsewhere
        rows, part = torch.arange(out.shape[0], device=out.device), chunk["part"]
        out.movedim(seq_dim, 1)[rows, todo_pos[part]] = \
            todo_clean[part].to(out.dtype)                                   # (b, l, ...)
        return out

    probs = cache["p_corrupt"].repeat(P)                                     # (P*b,)
    with patch(model, {} if on_residual else {site: restore}):
        for a in range(0, len(todo), chunk_rows):
            part = chunk["part"] = slice(a, a + chunk_rows)
            resid = cache["resid"][layer][doc[part]]                         # (rows, l, d)
            resid = restore(resid) if on_residual else resid
            for block in model.blocks[layer:]:                               # the rest of the model
                resid = block(resid)                                         # (rows, l, d)
            probs[todo[part]] = _answer_prob(model.logits(resid, query[doc[part]]),
                                             answers[doc[part]])
    return dict(zip(names, probs.view(P, b)))


def headline_site(n_layers):
    """The headline pair's site: layer 1's block input; a one-layer model's layer-0 mixer output."""
    return "blocks.1.hook_resid_pre" if n_layers > 1 else "blocks.0.mixer.hook_out"


def _documents(model, dataset, n_docs, corrupt_role, seed, strict=False):
    """The first n_docs documents and, on the model's device, their clean and corrupted tokens
    (b, l), answers (b,) and query positions (b,)."""
    _check(model=model, n_docs=n_docs)
    check_dataset(model, dataset)
    if len(dataset) == 0:
        raise ValueError("dataset has no documents to patch (n_docs needs at least one).")
    device = next(model.parameters()).device
    data = dataset.subset(slice(0, n_docs)) if len(dataset) > n_docs else dataset
    return (data, data.tokens.to(device), corrupt(data, corrupt_role, seed, strict).to(device),
            data.answers.to(device), data.positions["query"].to(device))


def _attributions(model, dataset, n_docs, corrupt_role, seed, strict, sites, positions, threshold):
    """Patch each site at each of `positions` (role names) in the first n_docs documents: (documents
    patched, the clean run's own attribution (p_clean, gap, ...), {site: {name: attribution}})."""
    data, clean, corrupted, answers, query = _documents(model, dataset, n_docs, corrupt_role, seed,
                                                        strict)
    pos = {name: data.positions[name].to(clean.device) for name in positions}
    p_clean = answer_prob(model, clean, answers, query)
    cache = prepare(model, clean, corrupted, sites, pos, answers, query)
    base = attribution(p_clean, cache["p_corrupt"], p_clean, threshold)
    patched = {site: interchange(model, clean, corrupted, site, pos, answers, query, cache=cache)
               for site in sites}                                            # {site: {name: (b,)}}
    return len(data), base, {site: {name: attribution(p_clean, cache["p_corrupt"], p, threshold)
                                    for name, p in ps.items()} for site, ps in patched.items()}


def _table_rows(attribs):
    """{site: {position: attribution}} -> the table's rows: site, label, layer, scores,
    p_patched."""
    return [{"site": site, "label": site_label(site), "layer": site_layer(site),
             "scores": {name: x["score"] for name, x in a.items()},
             "p_patched": {name: x["p_patched"] for name, x in a.items()}}
            for site, a in attribs.items()]


@torch.no_grad()
def headline(model, dataset, *, n_docs=64, corrupt_role="key", seed=0, threshold=LOW_SIGNAL_GAP):
    """Only the headline pair, cheaply (mechsm.train's timeline): Attrib@Key/Value/Query at
    headline_site on the first n_docs documents, {"key", "value", "query", "gap", "low_signal"}."""
    _check(model=model, threshold=threshold)
    was_training = model.training
    model.eval()
    site = headline_site(len(model.blocks))
    _, base, scores = _attributions(model, dataset, n_docs, corrupt_role, seed, False, [site],
                                    ("key", "value", "query"), threshold)
    model.train(was_training)
    return {**{k: a["score"] for k, a in scores[site].items()}, "gap": base["gap"],
            "low_signal": base["low_signal"]}


@torch.no_grad()
def mechanism(model, dataset, *, n_docs=320, corrupt_role="key", seed=0, strict=False, sites=None,
              positions=POSITIONS, threshold=LOW_SIGNAL_GAP):
    """The full attribution table (sites x layers x positions) of one model and its verdict, a
    JSON-serialisable dict: arch, n_docs, corrupt_role, p_clean, p_corrupt, gap, low_signal, rows
    [{site, label, layer, scores {position: attribution}, p_patched {position: mean}}], headline
    {key, value, query}, verdict, verdict_reason, later_layers (3+ layers), mixer_out (1 layer),
    extra {name: attribution} (the layer-0 mixer's READS, e.g. Mamba's conv@next_key), seconds."""
    start = time.perf_counter()
    _check(model=model, n_docs=n_docs, seed=seed, strict=strict, threshold=threshold)
    _check_names("positions", positions, POSITIONS)
    if sites is not None:
        _check_names("sites", sites, list(hook_points(model)))
    model.eval()
    n_layers = len(model.blocks)
    # The sites and positions the summary needs are always measured, even when not asked for.
    reads = getattr(model.blocks[0].mixer, "READS", {})   # {name: (hook, position)}
    reads = {name: (f"blocks.0.mixer.{hook}", p) for name, (hook, p) in reads.items()}
    extra = [headline_site(n_layers)] + [f"blocks.{i}.hook_resid_pre" for i in range(2, n_layers)]
    sites = list(sites if sites is not None else default_sites(model))
    sites += [s for s in extra + [s for s, _ in reads.values()] if s not in sites]
    names = dict.fromkeys([*positions, "key", "value", "query", *(p for _, p in reads.values())])
    n, base, attribs = _attributions(model, dataset, n_docs, corrupt_role, seed, strict, sites,
                                     list(names), threshold)
    rows = _table_rows(attribs)
    score = {(r["site"], name): x for r in rows for name, x in r["scores"].items()}
    head = {name: score[extra[0], name] for name in ("key", "value", "query")}
    if n_layers == 1:
        summary = {"headline": None, "mixer_out": head, "verdict": "n/a (1 layer)",
                   "verdict_reason": "one layer has no layer-1 block input: induction and direct "
                                     "retrieval both end inside the same block; see mixer_out"}
    else:
        reading, reason = verdict(head, base["low_signal"], threshold)
        summary = {"headline": head, "verdict": reading, "verdict_reason": reason, "later_layers":
                   {s: {k: score[s, k] for k in ("value", "query")} for s in extra[1:]}}
    return {"arch": getattr(model, "build_args", {}).get("arch"),
            "build_args": getattr(model, "build_args", None),
            "n_docs": n, "corrupt_role": corrupt_role, "strict": strict, "seed": seed,
            "positions": list(positions), "threshold": threshold,
            **{k: base[k] for k in ("p_clean", "p_corrupt", "gap", "low_signal")}, "rows": rows,
            **summary,
            "extra": {name: score[site, p] for name, (site, p) in reads.items()},
            "seconds": time.perf_counter() - start}


# --- Circuits: attribution patching proposes, exact interchange verifies.

def _atp(model, clean_tokens, corrupt_tokens, sites, answers, query):
    """{site: (b, l)}: (a_clean − a_corrupt) · ∂p/∂a per document and token, the gradient of
    each document's answer probability p taken on the corrupted run (one clean forward, one
    corrupted forward, one backward), summed over the activation's other axes."""
    seq_dim = {site: m.seq_dim for site, m in hook_points(model).items()}
    clean, acts = record(model, clean_tokens, sites), {}
    keep = {s: lambda act, s=s: acts.setdefault(s, act) for s in sites}     # stored, passed on
    with torch.enable_grad(), patch(model, keep):
        p = _answer_prob(model(corrupt_tokens, readout=query), answers)      # (b,)
        grads = torch.autograd.grad(p.sum(), [acts[s] for s in sites])  # a document's p: its row
    return {s: ((clean[s] - acts[s].detach()) * g).movedim(seq_dim[s], 1).flatten(2).sum(-1)
            for s, g in zip(sites, grads)}                                   # (b, l, ...) -> (b, l)


def attribution_patching(model, dataset, *, sites=None, positions=POSITIONS, corrupt_role="key",
                         n_docs=320, seed=0):
    """mechanism's rows (site, label, layer, scores, p_patched), every interchange estimated to
    first order instead of run (attribution patching, AtP: Syed et al. 2023, arXiv 2310.10348;
    Kramár et al. 2024, arXiv 2403.00745), for the interchange of Sec. 3 of the paper:
        p_patched − p_corrupt ≈ (a_clean − a_corrupt) · ∂p/∂a, the gradient on the corrupted run.
    Exact where p is linear in a between a_corrupt and a_clean; AtP* (Kramár et al.) shows where it
    fails: a saturated softmax, effects that cancel. Its slow, exact twin: mechanism."""
    _check_names("positions", positions, POSITIONS)
    sites = list(sites if sites is not None else default_sites(model))
    _check_names("sites", sites, list(hook_points(model)))
    model.eval()
    data, clean, corrupted, answers, query = _documents(model, dataset, n_docs, corrupt_role, seed)
    p_clean, p_corrupt = (answer_prob(model, t, answers, query) for t in (clean, corrupted))
    rows = torch.arange(len(clean), device=clean.device)
    est = _atp(model, clean, corrupted, sites, answers, query)               # {site: (b, l)}
    return _table_rows({s: {name: attribution(p_clean, p_corrupt, p_corrupt + e[
        rows, data.positions[name].to(rows.device)]) for name in positions}
        for s, e in est.items()})


def role_masks(dataset):
    """{role: (b, l) bool}: each position up to the query in one role, the first of key, value,
    next_key, divider, query that names it, else other_<class> for a token of that corruption class
    alone (AR: other_key, other_value), else other (BOS; ATR's other terminals). The answer and what
    follows belong to no role: the readout at the query cannot see them. Roles nowhere: left out."""
    check_dataset(None, dataset)
    tokens, pos = dataset.tokens, dataset.positions
    where = torch.arange(tokens.shape[1])                                    # (l,)
    free = where <= pos["query"][:, None]                                    # (b, l)
    masks = {}
    for role in ROLES[:-1]:                                                  # all but the answer
        masks[role] = free & (where == pos[role][:, None])
        free &= ~masks[role]
    inside = {r: (tokens >= lo) & (tokens < hi) for r, (lo, hi) in dataset.classes.items()}
    alone = free & (sum(m.int() for m in inside.values()) == 1)              # in one class only
    masks.update({f"other_{r}": alone & m for r, m in inside.items()}, other=free & ~alone)
    return {r: m for r, m in masks.items() if m.any()}


def circuit_sites(model):
    """A circuit's sites, input to output: the embedding (block 0's input holds nothing else), then
    each block's mixer and MLP outputs; not the residual stream, which only sums them."""
    points = hook_points(model)
    return ["blocks.0.hook_resid_pre"] + [f"blocks.{i}.{s}" for i in range(len(model.blocks))
                                          for s in ("mixer.hook_out", "mlp.hook_out")
                                          if f"blocks.{i}.{s}" in points]


@torch.no_grad()
def _patched_probs(model, tokens, fill, masks, answers, query):
    """P̄ (mean answer probability) of each patch of masks, [{site: (b, l) bool}]: site s outputs
    fill[s] (b, l, d) where the mask is True, its own activation elsewhere. Patches run side by side
    (row k*b + i: document i under patch k), about CHUNK_ROWS rows a forward."""
    b, probs = len(tokens), []
    per = max(1, CHUNK_ROWS // b)                                           # patches a forward
    for a in range(0, len(masks), per):
        group = masks[a:a + per]
        k = len(group)
        where = {s: torch.cat([m[s] for m in group])[..., None] for s in fill}  # (k*b, l, 1)
        edits = {s: lambda act, s=s: torch.where(where[s], fill[s].repeat(k, 1, 1), act)
                 for s in fill}
        with patch(model, edits):
            p = _answer_prob(model(tokens.repeat(k, 1), readout=query.repeat(k)), answers.repeat(k))
        probs += p.view(k, b).mean(1).tolist()
    return probs


def _rank_correlation(x, y):
    """Spearman's rho of two lists (tied values share their mean rank); None when one is
    constant."""
    ranks = [(t[:, None] > t).sum(1) + ((t[:, None] == t).sum(1) - 1) / 2
             for t in map(torch.tensor, (x, y))]
    rho = float(torch.corrcoef(torch.stack(ranks).double())[0, 1])
    return rho if math.isfinite(rho) else None


@torch.no_grad()
def minimal_circuit(model, dataset, *, target=0.9, n_docs=320, corrupt_role="key", seed=0,
                    threshold=LOW_SIGNAL_GAP, atp_above=64):
    """The smallest set of nodes that carries the answer: ACDC's search (Conmy et al. 2023, arXiv
    2304.14997, Algorithm 1) with exact patches throughout (the paper's interchange, Sec. 3). A node
    is (site, role): a circuit_sites output at the positions of a role_masks role where it can
    change the readout: where it can differ between the runs (from the first corrupted token on;
    the embedding: at a corrupted token, at any depth) and, of the last block, at the query.
    Circuit S: run the clean documents with every node outside S set to its corrupted-run value,
    the nodes in S computed from what reaches them; its recovery, (P̄_S − P̄_corrupt) /
    (P̄_clean − P̄_corrupt) (the tables' ratio of means), is 1 for every node and 0 for none.
    From all nodes, each is dropped in turn, from the output back (ACDC's order; over atp_above
    nodes: the smallest by attribution patching first), when the recovery stays >= target; passes
    repeat until one drops nothing. Returns target, members [[site, role], ...] input to output,
    restored (its recovery: a circuit only if >= target), drop_one (the recovery without each
    member), atp_vs_exact (how attribution patching ranked and sized each node's own
    interchange: Spearman's rho, mean |error| in recoveries), patches (exact patched forwards over
    the documents); with no signal (mechanism's rule): no members, a reason."""
    _check(model=model, target=target, threshold=threshold, atp_above=atp_above)
    model.eval()
    data, clean, corrupted, answers, query = _documents(model, dataset, n_docs, corrupt_role, seed)
    p_clean, p_corrupt = (float(answer_prob(model, t, answers, query).mean())
                          for t in (clean, corrupted))
    gap, sites, patches = p_clean - p_corrupt, circuit_sites(model), 0
    if no_signal(gap, threshold):
        return {"target": target, "members": [], "patches": 0,
                "reason": f"P̄_clean − P̄_corrupt <= {threshold}: nothing to recover"}
    roles = {r: m.to(clean.device) for r, m in role_masks(data).items()}     # {role: (b, l)}
    matter = {s: (clean != corrupted).cumsum(1) > 0 for s in sites}        # (b, l), causality
    matter[sites[0]] = clean != corrupted                                   # the embedding
    for s in [s for s in sites[1:] if site_layer(s) == len(model.blocks) - 1]:  # the last
        matter[s] = matter[s] & roles["query"]              # block's outputs: only the query read
    nodes = [(s, r) for s in sites for r in roles
             if (roles[r] & matter[s]).any()]                               # input to output
    none = torch.zeros_like(clean, dtype=torch.bool)

    def recovery(run, fill, masks):
        nonlocal patches
        patches += len(masks)
        return [(p - p_corrupt) / gap
                for p in _patched_probs(model, run, fill, masks, answers, query)]

    def outside(S):                   # {site: (b, l)}: where circuit S takes the corrupted values
        return {s: ~functools.reduce(torch.logical_or, [roles[r] for t, r in S if t == s], none)
                for s in sites}

    # Each node's own interchange (its clean value into the corrupted run) exactly, and AtP's guess.
    clean_acts, corrupt_acts = (record(model, t, sites) for t in (clean, corrupted))
    exact = recovery(corrupted, clean_acts, [{s: roles[r] if s == site else none for s in sites}
                                             for site, r in nodes])
    est = _atp(model, clean, corrupted, sites, answers, query)               # {site: (b, l)}
    atp = [float(est[s][roles[r]].sum()) / len(clean) / gap for s, r in nodes]
    order = nodes[::-1] if len(nodes) <= atp_above else \
        [nodes[i] for i in sorted(range(len(nodes)), key=lambda i: abs(atp[i]))]
    members, dropped = list(nodes), True
    while dropped:                    # passes until one drops nothing
        dropped = False
        for node in order:            # greedy, one exact patch per member tried
            rest = [n for n in members if n != node]
            if node in members and recovery(clean, corrupt_acts, [outside(rest)])[0] >= target:
                members, dropped = rest, True
    restored, *drop_one = recovery(clean, corrupt_acts, [outside(members)] + [
        outside([n for n in members if n != m]) for m in members])          # one batch
    return {"target": target, "members": [list(n) for n in members], "restored": restored,
            "drop_one": drop_one, "patches": patches, "atp_vs_exact": {
                "spearman": _rank_correlation(atp, exact),
                "mean_abs_error": sum(abs(a - e) for a, e in zip(atp, exact)) / len(nodes)}}


# --- Effective attention: where each position reads, from each mixer's own exact map.

@torch.no_grad()
def effective_attention(model, tokens):
    """For each layer, (b, l, l): how much output position t reads input position s (0 for s > t):
    the mean of |M| over the heads or channels of the mixer's own exact map M (b, c, l, l)
    (Mixer.effective_map). Lost: signs (channels that cancel both count), which channel reads
    where, and the size of the value read (a position whose value is ~0 still counts)."""
    _check(model=model)
    hooks = [f"blocks.{i}.mixer.hook_in" for i in range(len(model.blocks))]
    inputs = record(model, tokens, hooks)
    maps = [block.mixer.effective_map(inputs[h]) for block, h in zip(model.blocks, hooks)]
    return [M.abs().mean(1) for M, _ in maps]                                 # layers x (b, l, l)


def effective_record(model, dataset, doc=None,
                     roles=("key", "value", "next_key", "divider", "query")):
    """JSON-safe maps of one document for a run's record: {"positions": {role: t}, "query": [layer
    i's row at the query, positions 0..query], "value": [layer 0's row at the value, 0..value]};
    doc None: the first whose queried pair is neither the first nor the last, so each role has its
    own token."""
    check_dataset(model, dataset)
    _check_names("roles", roles, list(dataset.positions))
    if not (doc is None or _whole(doc) and doc < len(dataset)):
        raise ValueError(f"doc must be None or a document of dataset, 0..{len(dataset) - 1}; "
                         f"got {doc!r}.")
    p = dataset.positions
    if doc is None:
        doc = int(((p["key"] > 1) & (p["next_key"] < p["divider"])).int().argmax())
    tokens = dataset.tokens[doc:doc + 1].to(next(model.parameters()).device)
    maps = effective_attention(model, tokens)                                 # layers x (1, l, l)
    at = {role: int(dataset.positions[role][doc]) for role in roles}
    return {"positions": at, "query": [m[0, at["query"], :at["query"] + 1].tolist() for m in maps],
            "value": maps[0][0, at["value"], :at["value"] + 1].tolist()}


SHADES = " ░▒▓█"  # attribution 0 .. 1 in five steps, so structure shows without colour


def render_heatmap(result, *, sites=None):
    """Terminal heatmap (the PNG figures are run.py's): rows 'L{layer} {label}' (sites: names or
    labels to keep), cells score*100."""
    if not (isinstance(result, dict) and {"positions", "rows", "verdict"} <= result.keys()):
        raise ValueError(f"result must be a table of mechanism(); got {type(result).__name__}.")
    positions = result["positions"]
    if sites is not None:
        known = dict.fromkeys(name for r in result["rows"] for name in (r["site"], r["label"]))
        _check_names("sites", sites, list(known))
    rows = [r for r in result["rows"] if sites is None or r["site"] in sites or r["label"] in sites]
    names = [f"L{r['layer']} {r['label']}" for r in rows]
    width = max([len(n) for n in names] + [4])
    prob = lambda k: "nan" if result[k] is None else f"{result[k]:.3f}"      # NaN in JSON: None
    lines = [f"{result.get('arch')}: "
             + "  ".join(f"{k} {prob(k)}" for k in ("p_clean", "p_corrupt", "gap"))
             + ("  (LOW SIGNAL)" if result["low_signal"] else ""),
             " " * width + "".join(f"{p[:8]:>9}" for p in positions)]
    pct = lambda x: "--" if x is None else round(100 * x)
    shade = lambda x: "?" if x is None else SHADES[max(0, min(4, int(x * 5)))]   # 5 shades
    for name, r in zip(names, rows):
        xs = [r["scores"].get(p) for p in positions]
        lines.append(f"{name:<{width}}" + "".join(f"{pct(x):>7} {shade(x)}" for x in xs))
    if result.get("headline"):
        lines.append("headline, L1 block_in: "
                     + "  ".join(f"{k} {pct(v)}" for k, v in result["headline"].items()))
    lines.append(f"verdict: {result['verdict']} ({result['verdict_reason']})")
    lines += [f"{name} (layer 0): {pct(x)}" for name, x in (result.get("extra") or {}).items()]
    return "\n".join(lines)
