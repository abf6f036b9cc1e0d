"""mechsm.py: the recipe of one experiment: config, data, the paper's training loop, checkpoints.

Follows "Mechanistic evaluation of Transformers and state space models" (Arora et al. 2025, arXiv
2505.15105), Sec. 4-5 and App. C, and the reference loop (tinylang: experiment.py): a fixed training
set of 100,032 documents walked in order every epoch, batch 32; AdamW (0.9, 0.999, eps 1e-8, no
weight decay), 10% linear warmup from 0, then cosine decay to 0; cross-entropy on the answer token
only, float32; accuracy (argmax over the vocabulary at the query position) and the answer's mean
probability on 320 fresh documents every eval_every steps, step 0 included. On purpose unlike it
(README, differences 7, 8, 11): the final model is evaluated, ATR accuracy is also reported on the
evaluation documents not seen in training ("novel_acc"), generalisation runs decay by a cosine.

Read in order: Config -> Data -> lr_at, answer_loss, evaluate -> train (its loop: fit) -> the
timeline entry -> save/load; then the batched Ensemble (train_group). Sweeps and reports: run.py.

Shape glossary: b batch, l sequence length, d d_model, v vocabulary, n documents, r members of an
Ensemble (runs differing only in lr and seed, trained as one batched model), P a model's parameters.

Using it from Python:
    import mechsm
    cfg = mechsm.Config(arch="attention", num_keys=16, num_values=16, num_pairs=4, d_model=32,
                        train_size=8000, epochs=1, lr=3e-3)
    result, model = mechsm.train(cfg)            # result["final"]["acc"], result["history"], ...
    mechsm.save(model, cfg, "attn.pt"); model, cfg = mechsm.load("attn.pt")
"""

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache

import torch
import torch.nn.functional as F

import interventions
import models
import tasks

DEFAULT_EPOCHS = {"ar": 16, "atr": 32}       # the paper: 50,016 AR steps, 100,032 ATR steps
TASKS = ("ar", "atr")
SCHEDULES = ("cosine", "linear")
DEVICES = ("auto", "cpu", "cuda")
FAILED = "loss is {} at step {} (lr {:g}); run stopped"   # a failed run's error, lone or a member


# --- Config: every knob of one run, flat, with the paper's values as defaults.

@dataclass
class Config:
    # task (tasks.py); data_seed fixes the language and its documents (shared by a sweep's models)
    task: str = "ar"                 # "ar" | "atr"
    num_keys: int = 4096             # AR: key vocabulary
    num_values: int = 4096           # AR: value vocabulary
    num_pairs: int = 16              # AR: key-value pairs per document
    num_terminals: int = 20          # ATR: |Σ|
    num_nonterminals: int = 40       # ATR: |N|
    max_rhs_len: int = 5             # ATR: L_max (children per constituent, head included)
    max_rules: int = 5               # ATR: R_max
    max_depth: int = 10              # ATR: d_max
    terminal_weight: int = 20        # ATR: r_Σ
    max_terminals: int = 1024        # ATR: longer sentences are rejected (the paper: 1024)
    holdout: float = 0.0             # fraction of (key, value) / (parent, child) pairs held out
    data_seed: int = 42              # the language seed (grammar, held-out pairs, documents)
    # model (models.build_model)
    arch: str = "attention"          # one of models.ARCHS
    d_model: int = 64                # width
    n_layers: int = 2
    n_heads: int = 1
    pos_emb: bool | None = None      # learned positions; None: the paper's (attention only)
    n_positions: int = 1024          # size of the position table (the paper's l_max)
    d_conv: int | None = None        # mamba's short conv (0 removes it); based/base_conv's kernel
    long_only: bool = False          # based/base_conv: implicit long conv instead of the short conv
    freeze_features: bool = False    # base_conv: its features Z frozen (README difference 13)
    kernels: str = "fast"            # "fast" | "reference" (slow loop scan / direct convolutions)
    # training (the paper's recipe)
    lr: float = 1e-3                 # peak learning rate
    batch_size: int = 32
    train_size: int = 100_032        # documents in the fixed training set (3126 batches of 32)
    epochs: int | None = None        # passes over the training set; None = 16 for AR, 32 for ATR
    steps: int | None = None         # optimizer steps; overrides epochs (walked cyclically)
    warmup_frac: float = 0.1         # linear warmup over int(warmup_frac * total) steps
    schedule: str = "cosine"         # decay to 0: "cosine" | "linear" (README, difference 11)
    seed: int = 42                   # model init seed (torch)
    device: str = "auto"             # "auto" (cuda if available) | "cpu" | "cuda"
    # evaluation
    eval_every: int = 200            # steps between evaluations; the last step is always evaluated
    eval_size: int = 320             # evaluation documents per split (the paper: 320)
    timeline_docs: int = 64          # Attrib@Value/Query on this many eval docs (0: off)
    gap_filter: float = 0.01         # p_clean - p_corrupt <= this: "no signal" (ATR box plots: 0.1)

    def check(self):
        """Raise ValueError with one line naming the field and what is allowed. Returns self."""
        def whole(low, high=2**31):     # sizes: a larger one overflows deep inside torch
            return lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v < high

        def real(low, high):            # a real number (not a bool, not a string), finite
            return lambda v: (isinstance(v, (int, float)) and not isinstance(v, bool)
                              and math.isfinite(v) and low <= v < high)

        size, SIZE = whole(1), "a positive integer below 2**31"
        fraction, FRACTION = real(0, 1), "a number in [0, 1)"
        rules = [         # (fields, test, what is allowed), checked in this order
            ("task", lambda v: v in TASKS, " or ".join(TASKS)),
            ("arch", lambda v: isinstance(v, str) and v in models.ARCHS,     # a list is unhashable
             "one of " + ", ".join(models.ARCHS)),
            ("timeline_docs", whole(0), "a non-negative integer (0 turns the timeline off)"),
            ("gap_filter", fraction, FRACTION),
            ("num_keys num_values num_pairs num_terminals num_nonterminals max_terminals max_rules "
             "max_depth terminal_weight d_model n_layers n_heads n_positions batch_size train_size "
             "eval_every eval_size", size, SIZE),
            ("max_rhs_len", whole(2), "an integer in [2, 2**31) (head + at least one dependent)"),
            ("epochs steps", lambda v: v is None or size(v), SIZE + " or None"),
            ("n_heads", lambda v: self.d_model % v == 0, f"a divisor of d_model={self.d_model}"),
            ("lr", lambda v: real(0, math.inf)(v) and v != 0, "a positive finite number"),
            ("train_size", lambda v: v >= self.batch_size,
             f"at least batch_size={self.batch_size}"),
            ("warmup_frac holdout", fraction, FRACTION),
            ("schedule", lambda v: v in SCHEDULES, " or ".join(SCHEDULES)),
            ("kernels", lambda v: v in ("fast", "reference"), "fast or reference"),
            ("pos_emb", lambda v: v is None or isinstance(v, bool),
             "True, False or None (auto: attention only)"),
            ("long_only freeze_features", lambda v: isinstance(v, bool), "True or False"),
            ("d_conv", lambda v: v is None or whole(0)(v),
             "a non-negative integer below 2**31 or None"),
            ("seed data_seed", whole(0, 2**63), "a non-negative integer below 2**63"),
            ("device", lambda v: (v in DEVICES or str(v).startswith("cuda:")) and resolve_device(v),
             " or ".join(DEVICES))]     # resolve_device: its own line for a missing CUDA device
        for names, ok, allowed in rules:
            for name in names.split():
                if not ok(getattr(self, name)):
                    raise ValueError(f"{name}: got {getattr(self, name)!r}, expected {allowed}")
        return self

    def resolved(self):
        """The same run with "auto" made explicit (epochs, pos_emb): equal runs compare equal."""
        epochs = DEFAULT_EPOCHS.get(self.task, 16) if self.epochs is None else self.epochs
        pos_emb = models._pos_emb_or_default(self.arch, self.pos_emb)
        return replace(self, epochs=epochs, pos_emb=pos_emb)

    def total_steps(self):
        if self.steps is not None:
            return self.steps
        return self.train_size // self.batch_size * self.resolved().epochs   # partial batch dropped

    def name(self):
        """A short human name for logs and files, e.g. 'ar_attention_d64_L2_lr0.001_s42'."""
        return f"{self.task}_{self.arch}_d{self.d_model}_L{self.n_layers}_lr{self.lr:g}_s{self.seed}"


def resolve_device(device):
    """"auto" -> "cuda" if available, else "cpu". A CUDA device this machine lacks: a ValueError."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not str(device).startswith("cuda"):
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device: got {device!r}, but torch.cuda.is_available() is False here; "
                         "use cpu or auto")
    index, count = str(device).partition(":")[2], torch.cuda.device_count()
    if index and (not index.isdigit() or int(index) >= count):
        raise ValueError(f"device: got {device!r}, but this machine has {count} CUDA device(s)")
    return device


# --- Data: the fixed training set and the evaluation set(s) of one config.

@dataclass
class Data:
    train: "tasks.Dataset"     # train_size documents, split "train"
    eval: "tasks.Dataset"      # eval_size fresh documents, split "dev" (a different seed stream)
    test: "tasks.Dataset"      # eval_size documents querying held-out pairs; None if holdout == 0
    vocab_size: int
    novel: dict = None         # ATR: split -> bool mask of its documents not seen verbatim in train


AR_FIELDS = ("num_keys", "num_values", "num_pairs")              # tasks.make_ar's settings
PCFG_FIELDS = ("num_terminals", "num_nonterminals", "max_rhs_len", "max_rules", "max_depth",
               "terminal_weight")                                # tasks.PCFG's settings


def _data_key(cfg):
    names = AR_FIELDS if cfg.task == "ar" else (*PCFG_FIELDS, "max_terminals")
    params = tuple(getattr(cfg, name) for name in names)
    return (cfg.task, params, cfg.holdout, cfg.data_seed, cfg.train_size, cfg.eval_size)


@lru_cache(maxsize=2)
def _make_data(key):
    task, params, holdout, seed, train_size, eval_size = key
    if task == "ar":
        make = lambda n, split: tasks.make_ar(n, **dict(zip(AR_FIELDS, params)), seed=seed,
                                              split=split, holdout=holdout)
    else:
        grammar = tasks.PCFG(**dict(zip(PCFG_FIELDS, params)), seed=seed)
        make = lambda n, split: tasks.make_atr(n, grammar, split=split, holdout=holdout, seed=seed,
                                               max_terminals=params[-1])
    # the SAME seed for every split: tasks.py mixes the split name into the document stream
    try:
        train, dev = make(train_size, "train"), make(eval_size, "dev")
        test = make(eval_size, "test") if holdout > 0 else None
    except (RuntimeError, MemoryError) as e:    # e.g. the held-out matrix of a huge vocabulary
        if not (isinstance(e, MemoryError) or "alloc" in str(e).lower()):
            raise
        raise ValueError(f"{task} task {params} with {train_size} training documents: too large to "
                         f"allocate ({' '.join(str(e).split())[:120]})") from None
    novel = None if task == "ar" else {      # README, difference 8: documents unseen in training
        name: novel_mask(train, ds) for name, ds in [("eval", dev), ("test", test)] if ds}
    return Data(train, dev, test, train.vocab_size, novel)


def make_data(cfg, data=None):
    """cfg's Data (cached: a sweep's runs share it) or `data` checked to be cfg's and to fit."""
    if data is not None:
        check_data(cfg, data)      # data passed in must be cfg's task: its record will say so
    data = data or _make_data(_data_key(cfg))
    check_length(cfg, data)
    return data


# --- The recipe: learning-rate schedule, loss, evaluation.

def lr_at(step, total, warmup_frac=0.1, schedule="cosine", peak=1.0):
    """The lr of step `step` (0-based) of `total`, HuggingFace's schedule: linear warmup from 0
    (step 0: lr 0) over int(warmup_frac * total) steps, then cosine (or linear) decay to 0."""
    warmup = int(warmup_frac * total)
    if step < warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return peak * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak * (1.0 - progress)


def answer_loss(model, tokens, queries, answers):
    """Cross-entropy of the answer at the query position (the head reads those rows alone), mean
    over the batch, float32 at least. An Ensemble's: one per member (r,), its failed ones 0."""
    logits = model(tokens, readout=queries)         # (b, l) -> (b, v); an Ensemble's: (r, b, v)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if logits.dim() == 3:
        losses = F.cross_entropy(logits.transpose(1, 2), answers.expand(len(logits), -1),
                                 reduction="none")                               # (r, b)
        return model.drop_failed(losses.mean(1))
    return F.cross_entropy(logits, answers)


@torch.no_grad()
def evaluate(model, dataset, batch_size=64):
    """{"acc": argmax over the vocabulary == answer, "prob": mean P(answer), "loss": its CE, n}."""
    models.check_dataset(model, dataset)
    n = len(dataset)
    if n == 0:
        return {"acc": float("nan"), "prob": float("nan"), "loss": float("nan"), "n": 0}
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct, prob, loss = 0, 0.0, 0.0
    for i in range(0, n, batch_size):
        rows = slice(i, i + batch_size)
        width = int(dataset.lengths[rows].max())            # causal: trailing padding is irrelevant
        tokens = dataset.tokens[rows, :width].to(device)    # (b, l)
        answers = dataset.answers[rows].to(device)          # (b,)
        logits = model(tokens, readout=dataset.positions["query"][rows].to(device)).float()
        logp = logits.log_softmax(-1).gather(1, answers[:, None]).squeeze(1)             # (b,)
        correct += (logits.argmax(-1) == answers).sum().item()
        prob += logp.exp().sum().item()
        loss -= logp.sum().item()
    model.train(was_training)
    return {"acc": correct / n, "prob": prob / n, "loss": loss / n, "n": n}


# --- One training run: the loop, written out (as nanoGPT's train.py writes it).

def train(cfg, *, data=None, log=None):
    """Train one model with the paper's recipe. Returns (result, model); result (JSON-safe):
    config, status ("ok", or "failed": a NaN/inf loss stops the run), error, n_params, device,
    final (the final model's metrics), history (one entry per evaluation), wall_s, steps_done..."""
    [cfg], data = setup([cfg], data)       # documents cfg's model cannot take fail here
    log = log or stderr_log(f"[{cfg.arch} d{cfg.d_model} lr{cfg.lr:g} s{cfg.seed}] ")
    torch.manual_seed(cfg.seed)            # the init comes from cfg.seed alone
    model = build(cfg, data.vocab_size)    # on cfg's device
    return fit([cfg], model, adamw(model, cfg.lr), data, log)[0]


def fit(cfgs, model, optimizer, data, log):
    """train()'s loop: AdamW at lr_at(step) on batch(step), evaluated every eval_every steps and at
    the end. cfgs: [cfg], or an Ensemble's (then the loss is (r,)). [(result, model)] per config."""
    cfg, total, start = cfgs[0], cfgs[0].total_steps(), time.time()
    batch = training_batches(cfg, data)
    histories, loss_sum, n_losses, error = [[] for _ in cfgs], 0.0, 0, None
    model.train()
    for step in range(total + 1):
        if step % cfg.eval_every == 0 or step == total:             # evaluate
            mean_loss = loss_sum / n_losses if n_losses else None
            log(record_evaluation(model, cfgs, data, step, mean_loss, histories, start))
            loss_sum, n_losses = 0.0, 0
        if step == total:
            break
        for group, c in zip(optimizer.param_groups, cfgs):          # the schedule, per member
            group["lr"] = lr_at(step, total, c.warmup_frac, c.schedule, c.lr)
        loss = answer_loss(model, *batch(step))                     # forward: () or (r,)
        if not torch.isfinite(loss).all():          # a NaN/inf would poison every later step
            error = FAILED.format(loss.item(), step, cfg.lr)
            log(f"FAILED: {error}")
            break
        optimizer.zero_grad(set_to_none=True)
        loss.sum().backward()                                       # backward
        optimizer.step()                                            # AdamW
        loss_sum, n_losses = loss_sum + loss.detach(), n_losses + 1
    return run_results(model, cfgs, histories, step, error, time.time() - start)


def setup(configs, data=None):
    """(configs resolved and checked, their Data); several must differ only in lr and seed."""
    cfgs = [c.resolved().check() for c in configs]
    if not cfgs or len({group_key(c) for c in cfgs}) > 1:
        raise ValueError("train_group: configs: expected one or more that differ only in lr and seed")
    if len({(c.lr, c.seed) for c in cfgs}) < len(cfgs):
        raise ValueError("train_group: configs: two have the same lr and seed")
    return cfgs, make_data(cfgs[0], data)


def adamw(model, lr):
    """The paper's AdamW (0.9, 0.999), eps 1e-8, no weight decay; fused (one kernel, 4x faster on a
    CPU; the same update up to rounding) when every parameter is floating-point on cpu or cuda."""
    params = list(model.parameters())
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                             fused=fused or None)


def training_batches(cfg, data):
    """batch(step): (tokens, queries, answers) of training rows [s*B, s*B + B), s = step mod S."""
    B, S, device = cfg.batch_size, cfg.train_size // cfg.batch_size, resolve_device(cfg.device)
    tokens = data.train.tokens[: S * B].to(device)                  # (S*B, l)
    queries = data.train.positions["query"][: S * B].to(device)     # (S*B,)
    answers = data.train.answers[: S * B].to(device)                # (S*B,)
    widths = data.train.lengths[: S * B].view(S, B).max(1).values.tolist()

    def batch(step):
        s = step % S
        rows = slice(s * B, s * B + B)
        return tokens[rows, :widths[s]], queries[rows], answers[rows]
    return batch


def build(cfg, vocab_size):
    """The model of a config on its device, initialised from cfg.seed alone (models.build_model)."""
    cfg = cfg.resolved()
    model = models.build_model(cfg.arch, vocab_size, cfg.d_model, cfg.n_layers, pos_emb=cfg.pos_emb,
                               n_positions=cfg.n_positions, n_heads=cfg.n_heads, d_conv=cfg.d_conv,
                               long_only=cfg.long_only, freeze_features=cfg.freeze_features,
                               kernels=cfg.kernels, seed=cfg.seed)
    model.task = cfg.task                   # models.check_dataset refuses another task's documents
    return model.to(resolve_device(cfg.device))


def record_evaluation(model, cfgs, data, step, train_loss, histories, start):
    """Append each member's history_entry at `step`; returns the log line 'step 200/6000 | ...'."""
    members = model.members() if isinstance(model, Ensemble) else [model]
    losses = train_loss.reshape(-1).tolist() if train_loss is not None else [None] * len(cfgs)
    for cfg, member, history, loss in zip(cfgs, members, histories, losses):
        history.append(history_entry(member, data, cfg, step, loss))
    total, rate = cfgs[0].total_steps(), step / max(time.time() - start, 1e-9)
    s = int(max(0, (total - step) / rate)) if step else 0               # seconds left
    h, m = divmod(s // 60, 60)
    eta = (f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}") if step else "?"
    if len(histories) > 1:
        accs = " ".join(f"{h[-1]['acc']:.3f}" for h in histories)
        return (f"step {step}/{total} | acc {accs} | {rate:.1f} steps/s "
                f"({len(histories) * rate:.1f} model-steps/s) | ETA {eta}")
    entry = histories[0][-1]
    loss = "-" if entry["train_loss"] is None else f"{entry['train_loss']:.3f}"
    value, query = fmt_attrib(entry, "attrib_value"), fmt_attrib(entry, "attrib_query")
    return (f"step {step}/{total} | loss {loss} | acc {entry['acc']:.3f}"
            + (f" | test {entry['test_acc']:.3f}" if "test_acc" in entry else "")
            + (f" | attrib V {value} Q {query}" if "attrib_value" in entry else "")
            + f" | {rate:.1f} steps/s | ETA {eta}")


def run_results(model, cfgs, histories, step, error, wall):
    """[(record, model)] of fit's runs; a failed one keeps its history up to its failed step."""
    lone = [(step, error) if error else None]
    members = model.members() if isinstance(model, Ensemble) else [model]
    failures = model.failures(cfgs) if isinstance(model, Ensemble) else lone
    out = []
    for cfg, member, history, failure in zip(cfgs, members, histories, failures):
        steps_done, error = failure or (cfg.total_steps(), None)
        history = [dict(h) for h in history if h["step"] <= steps_done]
        timeline_s = sum(h.pop("timeline_s", 0.0) for h in history)
        final = {k: v for k, v in (history[-1] if history else {}).items() if k != "lr"}
        out.append((json_safe({
            "config": asdict(cfg), "name": cfg.name(), "status": "ok" if error is None else "failed",
            "error": error, "n_params": models.count_parameters(member),
            "device": resolve_device(cfg.device), "final": final, "history": history,
            "wall_s": round(wall, 2), "steps_done": steps_done, "total_steps": cfg.total_steps(),
            "steps_per_s": round(steps_done / max(wall, 1e-9), 2),
            "timeline_s": round(timeline_s, 3)}), member))
    return out


def stderr_log(prefix=""):
    """A log function: one line to stderr, prefixed (e.g. by the arch when jobs run in parallel)."""
    return lambda msg: print(f"{prefix}{msg}", file=sys.stderr, flush=True)


def fmt_attrib(entry, key):
    """An attribution of a history entry as '0.98', or '-' when missing or attrib_low_signal."""
    value = entry.get(key)
    return "-" if value is None or entry.get("attrib_low_signal") else f"{value:.2f}"


# --- The timeline entry: one evaluation during training, with the attribution pair (paper Sec. 4).

def history_entry(model, data, cfg, step, train_loss):
    """{step, lr, train_loss, acc, prob, loss (+ test_*, novel_*)}; if cfg.timeline_docs, the
    headline pair on that many eval docs: attrib_value/query/gap/low_signal, timeline_s."""
    total = cfg.total_steps()
    entry = {"step": step, "lr": lr_at(step, total, cfg.warmup_frac, cfg.schedule, cfg.lr),
             "train_loss": train_loss, **evaluate_all(model, data)}
    if cfg.timeline_docs:
        start = time.time()
        head = interventions.headline(model, data.eval, n_docs=cfg.timeline_docs,
                                      threshold=cfg.gap_filter)
        entry.update(attrib_value=head["value"], attrib_query=head["query"], attrib_gap=head["gap"],
                     attrib_low_signal=head["low_signal"], timeline_s=time.time() - start)
    return entry


def evaluate_all(model, data):
    """evaluate()'s on data.eval, plus test_* (held-out split) and novel_* (ATR: data.novel)."""
    _check_is_data(data)
    metrics = {k: v for k, v in evaluate(model, data.eval).items() if k != "n"}
    if data.test is not None:
        metrics.update({f"test_{k}": v for k, v in evaluate(model, data.test).items() if k != "n"})
    for split, mask in (data.novel or {}).items():
        prefix, ds = ("", data.eval) if split == "eval" else ("test_", data.test)
        metrics[f"{prefix}novel_acc"] = evaluate(model, ds.subset(mask.nonzero().squeeze(1)))["acc"]
        metrics[f"{prefix}novel_frac"] = mask.float().mean().item()
    return metrics


# --- Checks of a run's data, before any training.

def _check_is_data(data):
    if not isinstance(data, Data):
        raise ValueError(f"data must be a mechsm.Data (make_data(cfg)); got {type(data).__name__}.")


def check_data(cfg, data):
    """One-line ValueError unless data holds cfg's task (else its model is recorded as cfg's)."""
    _check_is_data(data)
    meta = data.train.meta
    if data.train.task != cfg.task:
        raise ValueError(f"data holds {data.train.task} documents, but cfg.task is {cfg.task!r}.")
    if cfg.task == "ar":
        made = {k: meta.get(k) for k in AR_FIELDS}
    else:
        grammar = meta.get("grammar") or {}
        made = {k: grammar.get(k) for k in PCFG_FIELDS}
        made.update(data_seed=grammar.get("seed"), max_terminals=meta.get("max_terminals"))
    made["holdout"] = meta.get("holdout")
    for name, value in made.items():
        if value != getattr(cfg, name):
            raise ValueError(f"data was made with {name}={value!r}, but cfg has "
                             f"{name}={getattr(cfg, name)!r}: the data is not cfg's {cfg.task} task.")


def check_length(cfg, data=None):
    """One-line ValueError, before training, when cfg's documents exceed models.position_limit."""
    cfg = cfg.resolved()
    limit = models.position_limit(cfg.arch, cfg.pos_emb, cfg.n_positions)
    if limit is None or cfg.task != "ar" and cfg.max_terminals + 5 <= limit:
        return
    if cfg.task == "ar":
        length = 2 * cfg.num_pairs + 5
    else:
        data = data or _make_data(_data_key(cfg))
        length = max(d.tokens.shape[1] for d in (data.train, data.eval, data.test) if d is not None)
    if length > limit:
        what = "learned positions" if cfg.pos_emb else "implicit filter positions"
        raise ValueError(f"n_positions: documents of up to {length} tokens, but {cfg.arch}'s model has "
                         f"{limit} {what}; raise n_positions or shorten the documents")


def probe_task(cfg):
    """The vocabulary size of cfg's task, from a few documents (tasks' ValueError if impossible)."""
    return _make_data(_data_key(replace(cfg, train_size=4, eval_size=4))).vocab_size


def novel_mask(train, dataset):
    """(n,) bool: the documents of `dataset` not verbatim in `train` (README, difference 8)."""
    seen = {row[:n].tobytes() for row, n in zip(train.tokens.numpy(), train.lengths.tolist())}
    return torch.tensor([row[:n].tobytes() not in seen for row, n in
                         zip(dataset.tokens.numpy(), dataset.lengths.tolist())], dtype=torch.bool)


# --- Checkpoints: the state_dict plus everything needed to rebuild the exact model.

CHECKPOINT_FORMAT = "mechsm-v1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match the model it describes."""


def _mismatch(built, build_args, state):
    """How (build_args but the seed, state_dict's keys and shapes) differ from `built`, or None."""
    if not isinstance(build_args, dict) or not isinstance(state, dict):
        return "its build_args or state_dict is not a dict"
    ours = built.build_args
    for k in dict.fromkeys([*ours, *build_args]):
        a, b = ours.get(k), build_args.get(k)       # an option one side lacks: None or False
        if (k == "seed" or a == b or (k not in ours and b in (None, False))
                or (k not in build_args and a in (None, False))):
            continue
        return f"the config builds {k}={a!r}, the weights were built with {k}={b!r}"
    expected = built.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        return (f"{len(missing)} weights missing (e.g. {missing[:1]}), {len(unexpected)} unexpected (e.g. "
                f"{unexpected[:1]}) for the config's {ours['arch']} model")
    for k, v in expected.items():
        if not isinstance(state[k], torch.Tensor) or state[k].shape != v.shape:
            shape = tuple(state[k].shape) if isinstance(state[k], torch.Tensor) else type(state[k]).__name__
            return f"{k} is {shape}, the config's model has {tuple(v.shape)}"


def save(model, cfg, path):
    """torch.save {format, config, build_args, state_dict} to path atomically (temp + os.replace);
    cfg must describe the model (its task's vocabulary, its build), else a ValueError naming cfg."""
    if not isinstance(cfg, Config):
        raise ValueError(f"cfg must be a mechsm.Config; got {type(cfg).__name__}")
    replace(cfg, device="cpu").check()                  # saved where its device is absent: valid
    vocab = getattr(model, "build_args", {}).get("vocab_size")
    probe = _make_data.__wrapped__(_data_key(replace(cfg, train_size=4, eval_size=4, holdout=0.0)))
    if vocab != probe.vocab_size:
        raise ValueError(f"cfg: its {cfg.task} task has a vocabulary of {probe.vocab_size} tokens, but the "
                         f"model's has {vocab}; cfg does not describe this model")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    what = _mismatch(build(replace(cfg, device="cpu"), vocab), dict(model.build_args), state)
    if what:
        raise ValueError(f"cfg does not describe this model: {what}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    blob = {"format": CHECKPOINT_FORMAT, "config": asdict(cfg.resolved()),
            "build_args": dict(model.build_args), "state_dict": state}
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(blob, tmp)
        os.replace(tmp, path)
    finally:                    # a failed write (a full disk) leaves no temporary file behind
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def load(path, device="cpu"):
    """(model, cfg) from a checkpoint of save(), built from its config (exactly Config's fields,
    valid) that must agree with its build_args and weights; else a one-line CheckpointError. The
    model and cfg.device are `device`'s, wherever it was trained (a GPU's checkpoint on a laptop)."""
    Config(device=device).check()                       # a bad device: a ValueError naming it
    fail = lambda what: CheckpointError(f"checkpoint {path}: {what}")
    oneline = lambda e: " ".join(str(e).split())
    if not os.path.isfile(path):
        raise fail("no such file")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:   # truncated zip, garbage bytes, pickle errors: "not a checkpoint"
        raise fail(f"unreadable ({type(e).__name__}); is it a mechsm checkpoint?") from None
    if not isinstance(blob, dict) or blob.get("format") != CHECKPOINT_FORMAT:
        raise fail(f"not a {CHECKPOINT_FORMAT} checkpoint")
    config, known = blob.get("config"), [f.name for f in fields(Config)]
    if not isinstance(config, dict):
        raise fail("its config is not a dict")
    missing, unknown = [k for k in known if k not in config], [k for k in config if k not in known]
    if missing or unknown:
        raise fail("its config " + (f"lacks the field {missing[0]!r}" if missing else
                                    f"has an unknown field {unknown[0]!r}")
                   + "; expected exactly mechsm.Config's fields")
    try:
        cfg = replace(Config(**config), device=device).check()
    except ValueError as e:
        raise fail(f"its config is invalid ({oneline(e)})") from None
    # the model must read its own config's documents (no unknown ids, no data it was not trained on)
    try:
        task_vocab = probe_task(cfg)
    except ValueError as e:
        raise fail(f"its task cannot be generated ({oneline(e)})") from None
    build_args = blob.get("build_args") if isinstance(blob.get("build_args"), dict) else {}
    if build_args.get("vocab_size") != task_vocab:
        raise fail(f"its model has a vocabulary of {build_args.get('vocab_size')} tokens but its "
                   f"{cfg.task} task ({cfg.name()}) has {task_vocab}; the config does not describe "
                   "the data this model was trained on")
    try:
        model = build(cfg, task_vocab)
        what = _mismatch(model, blob.get("build_args"), blob.get("state_dict"))
        if what is None:
            model.load_state_dict(blob["state_dict"])   # strict; keys and shapes agree
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        what = f"{type(e).__name__}: {oneline(e)[:200]}"
    if what:
        raise fail(f"does not rebuild its model ({what})")
    model.task = cfg.task                               # check_dataset refuses other tasks' data
    return model, cfg


# === The batched Ensemble: r runs as one model, r times the work per kernel launch (run.py bench).

class Ensemble:
    """r models of one arch and shape trained as one (PyTorch's model-ensembling tutorial): their
    parameters are the rows of ONE (r, P) leaf, their logits a vmap of functional_call on one base
    module, the summed loss gives each row its member's gradient, one StackedAdamW step for all. A
    member whose loss is not finite is dead from that step on, its weights those of that step."""

    def __init__(self, modules):
        self.modules, self.base = list(modules), modules[0]
        named = list(self.base.named_parameters())                      # the tied head counted once
        self.names, self.shapes = [n for n, _ in named], [p.shape for _, p in named]
        self.sizes = [p.numel() for _, p in named]
        self.frozen = {n for n, p in named if not p.requires_grad}
        for m in self.modules[1:]:
            if [n for n, _ in m.named_parameters()] != self.names or \
                    not all(torch.equal(b, b0) for b, b0 in zip(m.buffers(), self.base.buffers())):
                raise ValueError("Ensemble: the members must share their parameter names and buffers")
        with torch.no_grad():
            flat = torch.stack([torch.cat([p.reshape(-1) for p in m.parameters()])
                                for m in self.modules])
        self.flat = flat.requires_grad_()                               # (r, P): the trainable leaf
        r = len(self.modules)
        self.alive = torch.ones(r, dtype=torch.bool, device=flat.device)
        self.failed_step = torch.full((r,), -1, dtype=torch.long, device=flat.device)  # -1: alive
        self.failed_loss = torch.zeros(r, dtype=flat.dtype, device=flat.device)
        self.optimizer = StackedAdamW(self)

    def __call__(self, tokens, readout):
        """Every member's logits on the same batch: tokens (b, l), readout (b,) -> (r, b, v)."""
        def logits(row):                # row (P,): one member's parameters, as views of it
            params = {n: (x.detach() if n in self.frozen else x).view(shape)
                      for n, shape, x in zip(self.names, self.shapes, row.split(self.sizes))}
            return torch.func.functional_call(self.base, params, (tokens,), {"readout": readout})
        return torch.func.vmap(logits)(self.flat)

    def drop_failed(self, losses):
        """losses (r,), failed members' 0; a non-finite loss fails its member (no host sync)."""
        step, finite = self.optimizer.n_steps, torch.isfinite(losses.detach())
        newly = self.alive & ~finite
        self.failed_step = torch.where(newly, step, self.failed_step)
        self.failed_loss = torch.where(newly, losses.detach(), self.failed_loss)
        self.alive = self.alive & finite
        return torch.where(self.alive, losses, 0.0)

    def failures(self, cfgs):
        """Per member (its config in cfgs): None, or (step, error) as a lone run reports it."""
        return [None if s < 0 else (s, FAILED.format(loss, s, c.lr))
                for s, loss, c in zip(self.failed_step.tolist(), self.failed_loss.tolist(), cfgs)]

    def train(self):
        self.base.train()

    def members(self):
        """The members as ordinary modules, each row of the stacked leaf copied into its own."""
        with torch.no_grad():
            for m, row in zip(self.modules, self.flat):
                for p, x in zip(m.parameters(), row.split(self.sizes)):
                    p.copy_(x.view_as(p))
        return self.modules


class StackedAdamW:
    """torch.optim.AdamW's single-tensor step (0.9, 0.999, eps 1e-8, no weight decay), op for op, on
    an Ensemble's (r, P) leaf, a param group (lr) per member: each follows its lone run to rounding.
    A dead member's row steps by 0; so does a frozen or unused parameter (torch's skips it)."""

    BETAS, EPS = (0.9, 0.999), 1e-8

    def __init__(self, ensemble):
        self.ensemble, flat = ensemble, ensemble.flat
        self.param_groups = [{"lr": 0.0} for _ in ensemble.modules]
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(flat), torch.zeros_like(flat)
        self.n_steps = 0

    def zero_grad(self, set_to_none=True):
        self.ensemble.flat.grad = None

    @torch.no_grad()
    def step(self):
        flat, alive, (beta1, beta2) = self.ensemble.flat, self.ensemble.alive, self.BETAS
        self.n_steps += 1
        bias1, bias2 = 1 - beta1 ** self.n_steps, 1 - beta2 ** self.n_steps
        grad = torch.where(alive[:, None], flat.grad, 0.0)              # (r, P): dead rows get 0
        lrs = torch.tensor([g["lr"] for g in self.param_groups], dtype=torch.float64).to(flat.device)
        neg_step = ((-lrs / bias1).to(flat.dtype) * alive)[:, None]    # (r, 1): 0 when dead
        self.exp_avg.lerp_(grad, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (self.exp_avg_sq.sqrt() / bias2 ** 0.5).add_(self.EPS)
        flat.addcdiv_(self.exp_avg * neg_step, denom)                  # p -= lr / bias1 * m / denom


def group_key(cfg):
    """What the runs of one group share: every Config field but lr and seed."""
    shared = {k: v for k, v in asdict(cfg.resolved()).items() if k not in ("lr", "seed")}
    return json.dumps(shared, sort_keys=True)


def train_group(configs, *, data=None, log=None):
    """Train configs that differ only in lr and seed as one Ensemble with train()'s loop:
    [(result, model)], each what train(cfg) returns (to rounding) plus "group": {"size", "index"};
    wall_s is the group's. A member whose loss goes NaN/inf fails there; the others go on."""
    cfgs, data = setup(configs, data)
    cfg, r = cfgs[0], len(cfgs)
    log = log or stderr_log(f"[{cfg.arch} d{cfg.d_model} x{r}] ")
    ens = Ensemble([build(c, data.vocab_size) for c in cfgs])  # own seeds
    log(f"{r} runs as one batched model | lr {','.join(f'{c.lr:g}' for c in cfgs)} | "
        f"seeds {','.join(str(c.seed) for c in cfgs)}")
    pairs = fit(cfgs, ens, ens.optimizer, data, log)
    for i, (result, _) in enumerate(pairs):
        result["group"] = {"size": r, "index": i}
    return pairs


def json_safe(x):
    """Replace non-finite floats by None (strict JSON has no NaN) recursively."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x
