"""tasks.py: the two retrieval tasks, Associative Recall (AR) and Associative Treecall (ATR).

Follows "Mechanistic evaluation of Transformers and state space models" (Arora et al. 2025, arXiv
2505.15105), Sec. 3 (the tasks) and Sec. 5.3 (held-out pairs), and tinylang's generators
(github.com/aryamanarora/tinylang: language/ar.py, language/pcfg.py) with their conventions: PAD 0,
BOS 1, EOS 2, content ids from 3, one query per document; two bugs fixed (README, differences 2, 3).

Every document is BOS <context> EOS <query> <answer> EOS, right-padded with PAD. The model's
prediction at positions["query"] (= answer position - 1) is scored against `answers`.

AR worked example (2 pairs instead of 16; k = key ids, v = value ids):
    BOS k5 v9 k2 v7 EOS k2 v7 EOS
    positions: key 3, value 4, next_key 5 (= the divider, since the queried pair is last),
    divider 5, query 6, answer 7. The logits at position 6 must put their argmax on v7.
ATR worked example (the root X -> (a, Y) with head h, Y -> (b, c) with head g):
    sentence  a b c g h   parents a->h, b->g, c->g, g->h, h is the root
    query "parent of b":  BOS a b c g h EOS b g EOS
    positions: key 2 (b), value 4 (g), next_key 5, divider 6, query 7, answer 8.

Shape letters (the README's glossary): b documents, l padded document length, m AR pairs per
document, K keys, V values (AR), N nonterminals |N|, S terminals |Σ| (ATR).
"""

import bisect
import collections
from dataclasses import dataclass, field, replace

import numpy as np
import torch

PAD, BOS, EOS = 0, 1, 2
FIRST = 3                      # first content id: AR keys, ATR terminals
MAX_TERMINALS = 1024           # the reference rejects sentences of more than 1024 terminals
MAX_TRIES = 1000               # consecutive rejections before we call a setting impossible
SPLITS = {None: 0, "train": 1, "dev": 2, "test": 3}
_DOCS, _HELDOUT = 0, 1         # RNG stream tags: documents vs the held-out-pair matrix
# an int, not "8", 8.0 or True
_is_int = lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _seed(*parts):
    """A 63-bit seed derived from integers; different tuples give independent streams."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1, np.uint64)[0] >> 1)


def _check(ok, name, allowed):
    """Bad input: a one-line ValueError "{name} must be {allowed}"."""
    if not ok:
        raise ValueError(f"{name} must be {allowed}")


def _check_documents(n, split, holdout, seed):
    """make_ar's and make_atr's shared arguments (n an int, never True or 2.0; a split, never a
    list)."""
    _check(_is_int(n) and n > 0, "n", f"a positive int, got {n!r}")
    _check(split in [*SPLITS], "split", f"one of None, 'train', 'dev', 'test', got {split!r}")
    _check(isinstance(holdout, (int, float)) and 0 <= holdout < 1, "holdout",
           f"in [0, 1), got {holdout!r}")
    _check(holdout == 0 or split is not None, "split", "'train', 'dev' or 'test' when holdout > 0")
    _check(_is_int(seed) and seed >= 0, "seed", f"a non-negative int, got {seed!r}")


ROLES = ("key", "value", "next_key", "divider", "query", "answer")


@dataclass
class Dataset:
    """One container for both tasks: documents, their answers, and where each role sits."""
    task: str                        # "ar" | "atr"
    tokens: torch.Tensor             # (b, l) long, right-padded with PAD
    answers: torch.Tensor            # (b,) the token the model must predict at positions["query"]
    positions: dict                  # role -> (b,) long; roles in ROLES
    vocab_size: int
    classes: dict                    # role -> [lo, hi) ids a corruption of that role draws from
    lengths: torch.Tensor            # (b,) true length before padding
    meta: dict = field(default_factory=dict)   # settings; meta["per_doc"] holds per-document lists

    def __len__(self):
        return self.tokens.shape[0]

    def subset(self, idx):
        """Documents idx (slice or index tensor/list), padding trimmed to the longest one kept."""
        if not isinstance(idx, slice):
            idx = torch.as_tensor(idx, dtype=torch.long)
        lengths = self.lengths[idx]
        width = int(lengths.max()) if len(lengths) else 0
        meta = dict(self.meta)
        if "per_doc" in meta:
            rows = range(len(self))[idx] if isinstance(idx, slice) else idx.tolist()
            meta["per_doc"] = {k: [v[i] for i in rows] for k, v in meta["per_doc"].items()}
        return replace(self, tokens=self.tokens[idx, :width], answers=self.answers[idx], meta=meta,
                       lengths=lengths, positions={k: v[idx] for k, v in self.positions.items()})

    def token_name(self, tok):
        if tok in (PAD, BOS, EOS):
            return ("<pad>", "<bos>", "<eos>")[tok]
        lo, hi = self.classes["key"]      # AR's values start at hi; ATR's q*: unused query-type ids
        below, above = ("k", "v") if self.task == "ar" else ("t", "q")
        return f"{below}{tok - lo}" if tok < hi else f"{above}{tok - hi}"

    def describe(self, i):
        """Document i as text, the queried key in [brackets], its value in {braces}, then the query:
        e.g. '<bos> k5 v9 [k2] {v7} <eos> | k2 -> v7'."""
        toks = self.tokens[i, : int(self.lengths[i])].tolist()
        key, value = int(self.positions["key"][i]), int(self.positions["value"][i])
        words = [self.token_name(t) for t in toks[: int(self.positions["divider"][i]) + 1]]
        words[key], words[value] = f"[{words[key]}]", f"{{{words[value]}}}"
        q, a = toks[int(self.positions["query"][i])], int(self.answers[i])
        return " ".join(words) + f" | {self.token_name(q)} -> {self.token_name(a)}"


# --- AR: vectorised over documents.

def sample_distinct_slow(rows, m, size, gen):
    """Reference: each row is the first m entries of a fresh random permutation of range(size)."""
    if rows == 0:
        return torch.zeros(0, m, dtype=torch.long)
    return torch.stack([torch.randperm(size, generator=gen)[:m] for _ in range(rows)])


def sample_distinct(rows, m, size, gen):
    """(rows, m) long: per row, m distinct ints from range(size) in uniformly random order. Floyd's
    algorithm on all rows at once: at step j = size-m .. size-1 draw t in [0, j], take t, or j if
    the row has t already (a uniform m-subset, O(rows m^2) work, no (rows, size) tensor); a random
    argsort of the columns gives a uniform order. Equal in distribution to sample_distinct_slow."""
    out = torch.empty(rows, m, dtype=torch.long)
    for step, j in enumerate(range(size - m, size)):
        t = torch.randint(0, j + 1, (rows,), generator=gen)
        taken = (out[:, :step] == t[:, None]).any(dim=1)
        out[:, step] = torch.where(taken, torch.full_like(t, j), t)
    return out.gather(1, torch.rand(rows, m, generator=gen).argsort(dim=1))  # (rows, m)


def make_ar(n, *, num_keys=4096, num_values=4096, num_pairs=16, seed=0, split=None, holdout=0.0):
    """n AR documents  BOS k v ... k v EOS q a EOS  (2*num_pairs + 5 tokens each). Keys are ids
    3 .. 3+K-1, values the next V ids; a document's keys are distinct, and so are its values; the
    query is a uniformly chosen pair. The split name is mixed into the document seed: use the SAME
    seed for all splits. With holdout > 0 each (key, value) pair is held out with that probability
    (one matrix per (seed, K, V), never per split; a larger holdout holds out more); train/dev query
    only pairs not held out, test only held-out ones, redrawing documents with none (the reference
    excludes held-out pairs everywhere, so its "test" tests nothing new: README 2)."""
    _check_documents(n, split, holdout, seed)
    sizes = (("num_keys", num_keys), ("num_values", num_values), ("num_pairs", num_pairs))
    for name, value in sizes:       # "8" or 8.0 would fail later, or size a float task
        _check(_is_int(value), name, f"an int, got {value!r}")
    _check(num_pairs >= 1, "num_pairs", f">= 1, got {num_pairs}")
    K, V, m = num_keys, num_values, num_pairs
    for name, size in (("num_keys", K), ("num_values", V)):
        _check(size >= max(2, m), name, f">= max(2, num_pairs) = {max(2, m)} (a document's "
               f"{name[4:]} are distinct, and one token leaves nothing to retrieve or corrupt), "
               f"got {name}={size} with num_pairs={m}")
    gen = torch.Generator().manual_seed(_seed(seed, _DOCS, SPLITS[split]))
    hgen = torch.Generator().manual_seed(_seed(seed, _HELDOUT, K, V))
    heldout = torch.rand(K, V, generator=hgen) < holdout if holdout > 0 else None  # (K, V)

    keys, values = torch.empty(2, n, m, dtype=torch.long)
    q, todo = torch.empty(n, dtype=torch.long), torch.arange(n)
    for _ in range(MAX_TRIES):
        k, v = sample_distinct(len(todo), m, K, gen), sample_distinct(len(todo), m, V, gen)
        eligible = (torch.ones_like(k, dtype=torch.bool) if heldout is None   # (rows, m)
                    else heldout[k, v] == (split == "test"))  # argmax of score: uniform among them
        score = torch.rand(len(todo), m, generator=gen).masked_fill(~eligible, -1.0)
        ok = eligible.any(dim=1)
        keys[todo[ok]], values[todo[ok]], q[todo[ok]] = k[ok], v[ok], score[ok].argmax(dim=1)
        todo = todo[~ok]
        if len(todo) == 0:
            break
    else:
        raise ValueError(f"holdout={holdout}: no document with an eligible query pair for "
                         f"split={split!r} after {MAX_TRIES} rounds; use holdout in (0, 1) large "
                         "enough for test")

    rows = torch.arange(n)
    pairs = torch.stack([keys + FIRST, values + FIRST + K], dim=2)   # (b, m, 2): key, value
    bos, eos = (torch.full((n, 1), t, dtype=torch.long) for t in (BOS, EOS))
    tokens = torch.cat([bos, pairs.flatten(1), eos, pairs[rows, q], eos], 1)  # (b, 2m + 5)
    divider = torch.full((n,), 2 * m + 1)
    positions = dict(key=2 * q + 1, value=2 * q + 2, next_key=2 * q + 3,
                     divider=divider, query=divider + 1, answer=divider + 2)
    # vocab_size: the ids in use (8195 by default; the reference reports 8196: README, difference 9)
    return Dataset("ar", tokens, pairs[rows, q, 1], positions, FIRST + K + V,
                   {"key": (FIRST, FIRST + K), "value": (FIRST + K, FIRST + K + V)},
                   torch.full((n,), 2 * m + 5),
                   dict(split=split, holdout=holdout, seed=seed, num_keys=K, num_values=V,
                        num_pairs=m, heldout=heldout))


# --- ATR: the grammar, one sentence, one query, then the dataset.

def uniforms(rng, block=1 << 16):
    """A draw() of U[0,1) floats from numpy Generator rng, in blocks (per-call rng is slow)."""
    def stream():
        while True:
            yield from rng.random(block).tolist()
    return stream().__next__


class PCFG:
    """A random right-headed PCFG in the reference's RNG order (tinylang's pcfg.py). Nonterminal
    A is int A in [0, N), terminal t is N + t; rules[A]: RHS tuples of non-head symbols. shortest,
    longest: the exact range of a sentence's terminal counts (every rule has p > 0)."""

    def __init__(self, num_terminals=20, num_nonterminals=40, max_rhs_len=5, max_rules=5,
                 max_depth=10, terminal_weight=20, head="right", seed=0):
        self.params = {k: v for k, v in locals().items() if k != "self"}  # the arguments, in order
        least = dict(num_terminals=1, num_nonterminals=1, max_rhs_len=2, max_rules=1, max_depth=1)
        for name, low in least.items():
            value = self.params[name]
            why = " (head + at least one dependent)" if name == "max_rhs_len" else ""
            _check(_is_int(value), name, f"an int, got {value!r}")
            _check(value >= low, name, f">= {low}{why}, got {value}")
        _check(isinstance(terminal_weight, (int, float)) and not isinstance(terminal_weight, bool)
               and terminal_weight > 0, "terminal_weight", f"a number > 0, got {terminal_weight!r}")
        _check(head == "right", "head",
               f"'right' (the only head position the paper uses), got {head!r}")
        _check(_is_int(seed) and seed >= 0, "seed", f"a non-negative int, got {seed!r}")
        self.num_terminals, self.num_nonterminals, self.seed = num_terminals, num_nonterminals, seed
        N, S, slot = num_nonterminals, num_terminals, -1   # slot: TERMINAL placeholder
        rng = np.random.default_rng(seed)
        # 1. depth scores in {1..d_max}; children score strictly higher: acyclic, depth <= d_max
        self.depth = rng.integers(1, max_depth + 1, size=N).tolist()
        # 2. rules: 1..R_max per nonterminal, of 1..L_max-1 non-head symbols (README, difference 4)
        #    from deeper nonterminals (weight 1) and a TERMINAL slot (r_Σ; README, difference 5).
        self.rules = []
        for a in range(N):
            deeper = [b for b in range(N) if self.depth[b] > self.depth[a]]
            p = np.array([1.0] * len(deeper) + [terminal_weight])
            options, p = np.array(deeper + [slot]), p / p.sum()
            self.rules.append([rng.choice(options, size=rng.integers(1, max_rhs_len), p=p).tolist()
                               for _ in range(rng.integers(1, max_rules + 1))])
        # 3. fill the slots in a second pass, so terminals do not shift the rule structure's stream.
        self.rules = [[tuple(N + int(rng.integers(S)) if s == slot else s for s in rhs)
                       for rhs in rules] for rules in self.rules]
        # 4-5. Dirichlet(1,..,1) over each nonterminal's rules, and over the terminals for its head.
        cum = lambda p: np.concatenate([np.cumsum(p)[:-1], [1.0]]).tolist()  # last 1.0 exactly
        self.rule_cum = [cum(rng.dirichlet(np.ones(len(r)))) for r in self.rules]
        self.head_cum = [cum(rng.dirichlet(np.ones(S))) for _ in range(N)]
        # 6. each sentence starts from a uniformly random nonterminal (no dedicated S).
        self.start_cum = cum(np.full(N, 1.0 / N))
        # terminal counts of each nonterminal's sentences, the deepest first:
        # 1 (its head) + its children's
        low, high = {}, {}
        for a in sorted(range(N), key=lambda a: -self.depth[a]):
            sizes = [[(1, 1) if s >= N else (low[s], high[s]) for s in r] for r in self.rules[a]]
            low[a] = 1 + min(sum(lo for lo, _ in rhs) for rhs in sizes)
            high[a] = 1 + max(sum(hi for _, hi in rhs) for rhs in sizes)
        self.shortest, self.longest = min(low.values()), max(high.values())

    def sample_sentence(self, draw, max_terminals=MAX_TERMINALS):
        """One sentence (labels, parents: each terminal's parent position, -1: the root head), or
        None past max_terminals; depth-first, left to right, each head after its dependents."""
        N, labels, parents, stack = self.num_nonterminals, [], [], []
        todo = bisect.bisect_right(self.start_cum, draw())      # the nonterminal to expand next
        while todo is not None or stack:
            if todo is not None:   # expand it: a frame [rhs, next index, head terminal, dependents]
                rhs = self.rules[todo][bisect.bisect_right(self.rule_cum[todo], draw())]
                stack.append([rhs, 0, bisect.bisect_right(self.head_cum[todo], draw()), []])
                todo = None
            rhs, i, head, dependents = frame = stack[-1]
            if i < len(rhs):
                frame[1] = i + 1
                if rhs[i] >= N:            # terminal dependent: its parent is this frame's head
                    dependents.append(len(labels))
                    labels.append(rhs[i] - N)
                    parents.append(-1)
                else:
                    todo = rhs[i]
            else:                          # all dependents emitted: emit the head, point them at it
                stack.pop()
                head_pos = len(labels)
                for c in dependents:
                    parents[c] = head_pos
                labels.append(head)
                parents.append(-1)
                if stack:
                    stack[-1][3].append(head_pos)
            if len(labels) > max_terminals:
                return None
        return labels, parents

    def sample_sentence_slow(self, draw):
        """sample_sentence as the reference's recursion: the same draws give the same sentence."""
        emitted = []                                   # (label, own id or None, parent id)

        def expand(a, parent_id):
            h_id = object()
            rhs = self.rules[a][bisect.bisect_right(self.rule_cum[a], draw())]
            head = bisect.bisect_right(self.head_cum[a], draw())
            for sym in rhs:
                if sym >= self.num_nonterminals:
                    emitted.append((sym - self.num_nonterminals, None, h_id))
                else:
                    expand(sym, h_id)
            emitted.append((head, h_id, parent_id))

        expand(bisect.bisect_right(self.start_cum, draw()), None)
        where = {own: pos for pos, (_, own, _) in enumerate(emitted) if own is not None}
        return [lab for lab, _, _ in emitted], [where.get(par, -1) for _, _, par in emitted]


def eligible_queries(labels, parents, allowed=None):
    """{parent position: [child positions]}, the queries a sentence allows: children that are
    rightmost of their label, with a parent, and (if given) allowed[parent label][child label]."""
    rightmost = {lab: pos for pos, lab in enumerate(labels)}
    groups = {}
    for c in sorted(rightmost.values()):
        p = parents[c]
        if p >= 0 and (allowed is None or allowed[labels[p]][labels[c]]):
            groups.setdefault(p, []).append(c)
    return groups


def sample_query(groups, draw):
    """(child, parent): a parent position uniformly among those with an eligible child, then one of
    its eligible children uniformly, so P(c, p) = 1 / (#parents * #eligible children of p)."""
    pick = lambda xs: xs[min(int(draw() * len(xs)), len(xs) - 1)]
    p = pick(sorted(groups))
    return pick(groups[p]), p


def atr_document(labels, child, parent):
    """BOS t_1 .. t_s EOS child parent EOS as token ids (terminal t -> id t + 3)."""
    sentence = [x + FIRST for x in labels]
    return [BOS, *sentence, EOS, labels[child] + FIRST, labels[parent] + FIRST, EOS]


def make_atr(n, grammar, *, split=None, holdout=0.0, seed=0, max_terminals=MAX_TERMINALS):
    """n ATR documents  BOS t_1 .. t_s EOS child parent EOS  from `grammar`. Rejects sentences
    over max_terminals or under 3 terminals, and those without an eligible query. The (parent
    label, child label) matrix of held-out pairs (each with probability holdout) is seeded by
    grammar.seed alone: the language's, the same for every split (the reference draws it before
    the grammar, so its split language is another PCFG: README, difference 3). train/dev query
    only allowed pairs, test only held-out ones; contexts may hold any. Use the same seed for all
    splits (as make_ar)."""
    _check_documents(n, split, holdout, seed)
    _check(isinstance(grammar, PCFG), "grammar", f"a tasks.PCFG, got {type(grammar).__name__}")
    _check(_is_int(max_terminals) and max_terminals >= 3, "max_terminals",
           f"an int >= 3 (shorter ones are rejected), got {max_terminals!r}")
    S, given = grammar.num_terminals, grammar.params
    shortest, longest = grammar.shortest, grammar.longest
    _check(S >= 2, "num_terminals", f">= 2 (with one label there is no eligible query: its "
           f"rightmost instance is always the root head), got {S}")
    _check(longest >= 3, "max_rhs_len/max_depth", "large enough for sentences of >= 3 terminals: "
           f"every sentence has at most {longest} with max_rhs_len={given['max_rhs_len']}, "
           f"max_depth={given['max_depth']} (expected max_rhs_len >= 3 or a larger max_depth)")
    _check(shortest <= max_terminals, "max_terminals", f">= {shortest} (the shortest sentence of "
           f"this grammar), got {max_terminals}: every sentence is longer, so none is kept")
    hrng = np.random.default_rng(_seed(grammar.seed, _HELDOUT, S))
    heldout = torch.from_numpy(hrng.random((S, S)) < holdout) if holdout > 0 else None  # (S, S)
    allowed = None if heldout is None else (heldout if split == "test" else ~heldout).tolist()
    draw = uniforms(np.random.default_rng(_seed(seed, _DOCS, SPLITS[split])))
    docs, per_doc = [], dict(parents=[])
    misses = collections.Counter()                # why the current streak's sentences were rejected
    while len(docs) < n:
        sent = grammar.sample_sentence(draw, max_terminals)
        miss = "long" if sent is None else "short" if len(sent[0]) < 3 else None
        groups = None if miss else eligible_queries(*sent, allowed)
        if not groups:
            misses[miss or "query"] += 1
            if misses.total() >= MAX_TRIES:   # name the parameter behind the most rejections
                name = {"long": "max_terminals", "short": "max_rhs_len/max_depth",
                        "query": "grammar/holdout"}[max(misses, key=misses.get)]
                raise ValueError(f"{name}: {MAX_TRIES} sentences in a row rejected: "
                                 f"{misses['long']} over max_terminals={max_terminals}, "
                                 f"{misses['short']} under 3 terminals ({shortest} to {longest} "
                                 f"in this grammar), {misses['query']} with no eligible query "
                                 f"(split={split!r}, "
                                 f"holdout={holdout})")
            continue
        misses.clear()
        docs.append((sent[0], *sample_query(groups, draw)))
        per_doc["parents"].append(sent[1])

    lengths = np.array([len(lab) + 5 for lab, _, _ in docs])
    tokens = np.zeros((n, lengths.max()), dtype=np.int64)        # (b, l) PAD-filled
    child, parent = np.array([d[1:] for d in docs]).T
    for i, (labels, c, p) in enumerate(docs):
        tokens[i, : len(labels) + 5] = atr_document(labels, c, p)
    t = lambda x: torch.as_tensor(x, dtype=torch.long)
    s = t(lengths - 5)
    positions = dict(key=t(child + 1), value=t(parent + 1), next_key=t(parent + 2),
                     divider=s + 1, query=s + 2, answer=s + 3)
    # vocab: PAD, BOS, EOS, S terminals, the reference's 3 unused query-type ids; answers: doc[-2]
    return Dataset("atr", torch.from_numpy(tokens), t(tokens[range(n), lengths - 2]), positions,
                   S + 6, {"key": (FIRST, FIRST + S), "value": (FIRST, FIRST + S)}, t(lengths),
                   dict(split=split, holdout=holdout, seed=seed, max_terminals=max_terminals,
                        grammar=dict(grammar.params), heldout=heldout, per_doc=per_doc))

