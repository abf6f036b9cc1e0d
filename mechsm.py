"""mechsm.py: the recipe of one experiment: config, data, the paper's training loop, checkpoints.

Follows "Mechanistic evaluation of Transformers and state space models" (Arora et al. 2025, arXiv
2505.15105), Sec. 4-5 and App. C, and the reference loop (tinylang: experiment.py): a fixed training
set of 100,032 documents walked in order every epoch, batch 32; AdamW (0.9, 0.999, eps 1e-8, no
weight decay), 10% linear warmup from 0, then cosine decay to 0; cross-entropy on the answer token
only, float32; accuracy (argmax over the vocabulary at the query position) and the answer's mean
probability on 320 fresh documents every eval_every steps, step 0 included. On purpose unlike it
(README, differences 7, 8, 11): the final model is evaluated, ATR accuracy is also reported on the
evaluation documents not seen in training ("novel_acc"), generalisation runs decay by a cosine.

Read in order: Config -> make_data -> lr_at, answer_loss, evaluate -> train, its loop written out
-> history_entry, one evaluation (what the driver's on_eval adds: run.py's timeline) -> save/load.
Below a marked line, and skippable: train_group, runs that differ only in lr and seed trained as
one batched model (the Ensemble). Sweeps, reports and the timeline's patching: run.py.

Shape letters (the README's glossary): b documents (of a batch or a Dataset), l sequence length,
v vocabulary, r runs trained as one model (an Ensemble).

Using it from Python:
    import mechsm
    cfg = mechsm.Config(arch="attention", num_keys=16, num_values=16, num_pairs=4, d_model=32,
                        train_size=8000, epochs=1, lr=3e-3)
    result, model = mechsm.train(cfg)            # result["final"]["acc"], result["history"], ...
    # run.py's timeline: mechsm.train(cfg, on_eval=run.timeline) adds Attrib@Value/Query per eval
    mechsm.save(model, cfg, "attn.pt"); model, cfg = mechsm.load("attn.pt")
"""

import hashlib
import io
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

import models
import tasks

DEFAULT_EPOCHS = {"ar": 16, "atr": 32}       # the paper: 50,016 AR steps, 100,032 ATR steps
TASKS = ("ar", "atr")
SCHEDULES = ("cosine", "linear")
DEVICES = ("auto", "cpu", "cuda")
FAILED = "loss is {} at step {} (lr {:g}); run stopped"   # a failed run's error, lone or a member


# --- Config: every knob of one run, flat, with the paper's values as defaults.

def knob(default, help):
    """A Config field: its default and, once, what it means (run.py's --help prints it)."""
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # task (tasks.py); data_seed fixes the language and its documents (shared by a sweep's models)
    task: str = knob("ar", "ar or atr")
    num_keys: int = knob(4096, "AR: key vocabulary")
    num_values: int = knob(4096, "AR: value vocabulary")
    num_pairs: int = knob(16, "AR: key-value pairs per document")
    num_terminals: int = knob(20, "ATR: terminals |Σ| (paper: 20 or 8192)")
    num_nonterminals: int = knob(40, "ATR: nonterminals |N|")
    max_rhs_len: int = knob(5, "ATR: L_max, children per constituent, head included (paper: 5, 10)")
    max_rules: int = knob(5, "ATR: R_max, rules per nonterminal")
    max_depth: int = knob(10, "ATR: d_max")
    terminal_weight: int = knob(20, "ATR: r_Σ, a terminal's weight against a nonterminal's 1")
    max_terminals: int = knob(1024, "ATR: longer sentences are rejected (paper: 1024)")
    holdout: float = knob(0.0, "fraction of (key, value) / (parent, child) pairs held out for a "
                          "test split (paper: 0.2)")
    data_seed: int = knob(42, "the language seed: grammar, held-out pairs, documents")
    # model (models.build_model)
    arch: str = knob("attention", "one of models.ARCHS")
    d_model: int = knob(64, "width")
    n_layers: int = knob(2, "number of blocks")
    n_heads: int = knob(1, "attention heads")
    pos_emb: bool | None = knob(None, "learned positions; None (auto): the paper's, attention only")
    n_positions: int = knob(1024, "size of the position table (the paper's l_max)")
    d_conv: int | None = knob(None, "short-conv size of the archs that have one (mamba: 0 "
                              "removes it; based/base_conv: its kernel)")
    long_only: bool = knob(False, "based/base_conv: implicit long conv instead of the short conv")
    freeze_features: bool = knob(False, "base_conv: its features Z frozen (README difference 13)")
    kernels: str = knob("fast", "fast or reference (slow loop scan, direct convolutions)")
    # training (the paper's recipe)
    lr: float = knob(1e-3, "peak learning rate")
    batch_size: int = knob(32, "batch size")
    train_size: int = knob(100_032, "documents in the fixed training set (3126 batches of 32)")
    epochs: int | None = knob(None, "passes over the training set; None: 16 for AR, 32 for ATR")
    steps: int | None = knob(None, "optimizer steps; beats epochs (the training set cycles)")
    warmup_frac: float = knob(0.1, "linear warmup over int(warmup_frac * total) steps")
    schedule: str = knob("cosine", "decay to 0: cosine or linear (README, difference 11)")
    seed: int = knob(42, "model init seed (torch)")
    device: str = knob("auto", "auto (cuda if available), cpu or cuda")
    # evaluation
    eval_every: int = knob(200, "steps between evaluations; the last step is always evaluated")
    eval_size: int = knob(320, "evaluation documents per split (paper: 320)")
    timeline_docs: int = knob(64, "Attrib@Value/Query during training on this many eval "
                              "documents (0: off)")
    gap_filter: float = knob(0.01, "p_clean - p_corrupt <= this: no signal (ATR box plots: 0.1)")

    def check(self, name="cfg"):
        """Raise ValueError with one line naming the field and what is allowed. Returns self.
        Config.check(x, name) refuses anything but a Config (a dict of its fields too), naming `name`."""
        if not isinstance(self, Config):
            raise ValueError(f"{name} must be a mechsm.Config; got {type(self).__name__}")
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
        pos_emb = models.MIXER_CLASSES[self.arch].POS_EMB if self.pos_emb is None else self.pos_emb
        return replace(self, epochs=epochs, pos_emb=pos_emb)

    def total_steps(self):              # steps (never 0 once checked), else epochs of full batches
        return self.steps or self.train_size // self.batch_size * self.resolved().epochs

    def name(self):
        """A short human name, its suffix 8 hex digits of every field but device: runs that differ
        differ in name, e.g. 'ar_attention_d64_L2_lr0.001_s42_1c3a0f9e'."""
        identity = json.dumps({k: v for k, v in asdict(self.resolved()).items() if k != "device"},
                              sort_keys=True)
        digest = hashlib.sha1(identity.encode()).hexdigest()[:8]
        return (f"{self.task}_{self.arch}_d{self.d_model}_L{self.n_layers}_lr{self.lr:g}"
                f"_s{self.seed}_{digest}")


def resolve_device(device):
    """"auto" -> "cuda" if available, else "cpu". A CUDA device this machine lacks: a ValueError."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not str(device).startswith("cuda"):
        return device
    index, count = str(device).partition(":")[2], torch.cuda.device_count()
    if not torch.cuda.is_available() or index and (not index.isdigit() or int(index) >= count):
        raise ValueError(f"device: got {device!r}, but this machine has {count} usable CUDA "
                         "device(s); use cpu or auto")
    return device


# --- Data: the fixed training set and the evaluation set(s) of one config.

@dataclass
class Data:
    train: "tasks.Dataset"     # train_size documents, split "train"
    eval: "tasks.Dataset"      # eval_size fresh documents, split "dev" (a different seed stream)
    test: "tasks.Dataset"      # eval_size documents querying held-out pairs; None if holdout == 0
    vocab_size: int
    novel: dict = None         # ATR: split -> (b,) bool, its documents not seen verbatim in train
    key: tuple = ()            # the data_key it was made from


AR_FIELDS = ("num_keys", "num_values", "num_pairs")              # tasks.make_ar's settings
PCFG_FIELDS = ("num_terminals", "num_nonterminals", "max_rhs_len", "max_rules", "max_depth",
               "terminal_weight")                                # tasks.PCFG's settings


def data_key(cfg):
    """((field, value), ...): what makes cfg's documents. Runs with equal keys share their Data."""
    task_fields = AR_FIELDS if cfg.task == "ar" else (*PCFG_FIELDS, "max_terminals")
    return tuple((name, getattr(cfg, name)) for name in
                 ("task", *task_fields, "holdout", "data_seed", "train_size", "eval_size"))


@lru_cache(maxsize=2)
def make_documents(key):
    """The Data of a data_key (the last two are cached: a sweep's runs share theirs)."""
    c = dict(key)
    if c["task"] == "ar":
        make = lambda n, split: tasks.make_ar(n, **{k: c[k] for k in AR_FIELDS},
                                              seed=c["data_seed"], split=split,
                                              holdout=c["holdout"])
    else:
        grammar = tasks.PCFG(**{k: c[k] for k in PCFG_FIELDS}, seed=c["data_seed"])
        make = lambda n, split: tasks.make_atr(n, grammar, split=split, holdout=c["holdout"],
                                               seed=c["data_seed"],
                                               max_terminals=c["max_terminals"])
    # the SAME seed for every split: tasks.py mixes the split name into the document stream
    try:
        train, dev = make(c["train_size"], "train"), make(c["eval_size"], "dev")
        test = make(c["eval_size"], "test") if c["holdout"] > 0 else None
    except (RuntimeError, MemoryError) as e:    # e.g. the held-out matrix of a huge vocabulary
        if not (isinstance(e, MemoryError) or "alloc" in str(e).lower()):
            raise
        raise ValueError(f"{c['task']} task with {c['train_size']} training documents: too "
                         f"large to allocate ({' '.join(str(e).split())[:120]})") from None
    text = lambda ds: [row[:n].tobytes() for row, n in zip(ds.tokens.numpy(), ds.lengths)]
    novel = None
    if c["task"] == "atr":                      # README, difference 8: documents unseen in training
        seen = set(text(train))
        novel = {name: torch.tensor([doc not in seen for doc in text(ds)])
                 for name, ds in [("eval", dev), ("test", test)] if ds}
    return Data(train, dev, test, train.vocab_size, novel, key)


def make_data(cfg, data=None):
    """cfg's Data (made once per data_key), or `data`, which must be cfg's (its record will say so);
    either way cfg must pass Config.check and its documents fit its model (learned positions,
    filters of fixed length)."""
    key = data_key(Config.check(cfg))
    data = make_documents(key) if data is None else data
    made = dict(data.key) if isinstance(data, Data) else {}
    wrong = [name for name, value in key if made.get(name) != value]
    if wrong:
        raise ValueError(f"data was made with {wrong[0]}={made.get(wrong[0])!r}, but cfg has "
                         f"{wrong[0]}={getattr(cfg, wrong[0])!r}: pass make_data(cfg) or no data.")
    cfg = cfg.resolved()
    if cfg.pos_emb or models.MIXER_CLASSES[cfg.arch].FIXED_LENGTH:
        length = max(d.tokens.shape[1] for d in (data.train, data.eval, data.test) if d is not None)
        if length > cfg.n_positions:
            what = "learned positions" if cfg.pos_emb else "implicit filter positions"
            raise ValueError(f"n_positions: documents of up to {length} tokens, but {cfg.arch}'s "
                             f"model has {cfg.n_positions} {what}; raise n_positions or shorten "
                             "the documents")
    return data


def probe_task(cfg):
    """The vocabulary of cfg's task, from 4 uncached documents (tasks' ValueError if impossible)."""
    return make_documents.__wrapped__(data_key(replace(cfg, train_size=4, eval_size=4))).vocab_size


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
    over the batch, in float32 at least."""
    logits = model(tokens, readout=queries)         # (b, l) -> (b, v)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), answers)


@torch.no_grad()
def evaluate(model, dataset, batch_size=64):
    """{"acc": argmax over the vocabulary == answer, "prob": mean P(answer), "loss": its CE, n}
    (None for an empty dataset)."""
    models.check_dataset(model, dataset)
    n = len(dataset)
    if n == 0:
        return {"acc": None, "prob": None, "loss": None, "n": 0}
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


def build(cfg, vocab_size):
    """The model of a config on its device, initialised from cfg.seed alone (models.build_model)."""
    cfg = cfg.resolved()
    model = models.build_model(cfg.arch, vocab_size, cfg.d_model, cfg.n_layers, pos_emb=cfg.pos_emb,
                               n_positions=cfg.n_positions, n_heads=cfg.n_heads, d_conv=cfg.d_conv,
                               long_only=cfg.long_only, freeze_features=cfg.freeze_features,
                               kernels=cfg.kernels, seed=cfg.seed)
    model.task = cfg.task                   # models.check_dataset refuses another task's documents
    return model.to(resolve_device(cfg.device))


def adamw(model, lr):
    """The paper's AdamW (0.9, 0.999), eps 1e-8, no weight decay; fused (one kernel, 4x faster on a
    CPU; the same update up to rounding) when every parameter is floating-point on cpu or cuda."""
    params = list(model.parameters())
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                             fused=fused or None)


def training_batches(cfg, data):
    """batch(step): (tokens, queries, answers) of the training rows of batch step mod n_batches
    (the fixed training set walked in order, the partial last batch dropped)."""
    size, device = cfg.batch_size, resolve_device(cfg.device)
    n_batches = cfg.train_size // size
    used = n_batches * size
    tokens = data.train.tokens[:used].to(device)                    # (b, l): every batch's rows
    queries = data.train.positions["query"][:used].to(device)       # (b,)
    answers = data.train.answers[:used].to(device)                  # (b,)
    widths = data.train.lengths[:used].view(n_batches, size).max(1).values.tolist()

    def batch(step):
        i = step % n_batches
        rows = slice(i * size, i * size + size)
        return tokens[rows, :widths[i]], queries[rows], answers[rows]
    return batch


# --- One training run: the loop, written out (as nanoGPT's train.py writes it).

def train(cfg, *, data=None, log=None, on_eval=None):
    """Train one model with the paper's recipe. Returns (result, model); result: config, name,
    status ("ok", or "failed": a NaN/inf loss stops the run), error, n_params, device, final (the
    final model's metrics), history (one entry per evaluation), wall_s, steps_done...
    on_eval(model, data, cfg, step) -> dict: what the driver adds to each evaluation's entry
    (run.py passes its timeline, the attribution pair); its seconds are summed in timeline_s."""
    cfg = Config.check(cfg).resolved()
    data = make_data(cfg, data)            # documents cfg's model cannot take fail here
    prefix = f"[{cfg.arch} d{cfg.d_model} lr{cfg.lr:g} s{cfg.seed}] "
    log = log or (lambda msg: print(prefix + msg, file=sys.stderr, flush=True))
    torch.manual_seed(cfg.seed)            # the init comes from cfg.seed alone
    model = build(cfg, data.vocab_size)    # on cfg's device
    optimizer = adamw(model, cfg.lr)
    batch = training_batches(cfg, data)
    total, start = cfg.total_steps(), time.time()
    history, loss_sum, n_losses, error = [], 0.0, 0, None
    model.train()
    for step in range(total + 1):
        if step % cfg.eval_every == 0 or step == total:     # evaluate, step 0 and the last included
            train_loss = (loss_sum / n_losses).item() if n_losses else None
            entry = history_entry(model, data, cfg, step, train_loss, on_eval)
            history.append(entry)
            rate = step / max(time.time() - start, 1e-9)    # steps per second
            eta = f"{(total - step) / rate / 60:.1f} min" if step else "?"
            loss_text = "-" if train_loss is None else f"{train_loss:.3f}"
            if "attrib_value" not in entry:                 # no timeline (on_eval) given
                attrib = ""
            elif entry["attrib_low_signal"]:
                attrib = " | attrib -"
            else:
                attrib = f" | attrib V {entry['attrib_value']:.2f} Q {entry['attrib_query']:.2f}"
            log(f"step {step}/{total} | loss {loss_text} | acc {entry['acc']:.3f}{attrib} | "
                f"{rate:.1f} steps/s | ETA {eta}")
            loss_sum, n_losses = 0.0, 0
        if step == total:
            break
        for group in optimizer.param_groups:                # the schedule
            group["lr"] = lr_at(step, total, cfg.warmup_frac, cfg.schedule, cfg.lr)
        loss = answer_loss(model, *batch(step))             # forward
        if not torch.isfinite(loss):                        # a NaN/inf poisons every later step
            error = FAILED.format(loss.item(), step, cfg.lr)
            log(f"FAILED: {error}")
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()                                     # backward
        optimizer.step()                                    # AdamW
        loss_sum, n_losses = loss_sum + loss.detach(), n_losses + 1
    return run_record(cfg, model, history, step, error, time.time() - start), model


def run_record(cfg, model, history, steps_done, error, wall):
    """A run's result (train's or a group member's); a failed one's history ends at its failure."""
    history = [dict(h) for h in history if h["step"] <= steps_done]
    timeline_s = sum(h.pop("timeline_s", 0.0) for h in history)
    final = {k: v for k, v in (history[-1] if history else {}).items() if k != "lr"}
    return {"config": asdict(cfg), "name": cfg.name(),
            "status": "ok" if error is None else "failed", "error": error,
            "n_params": sum(p.numel() for p in model.parameters()),
            "device": resolve_device(cfg.device), "final": final, "history": history,
            "wall_s": round(wall, 2), "steps_done": steps_done, "total_steps": cfg.total_steps(),
            "steps_per_s": round(steps_done / max(wall, 1e-9), 2),
            "timeline_s": round(timeline_s, 3)}


# --- One evaluation during training: the history's entry.

def history_entry(model, data, cfg, step, train_loss, on_eval=None):
    """{step, lr, train_loss, acc, prob, loss (+ test_*, novel_*)}, then what
    on_eval(model, data, cfg, step) returns (run.py: attrib_value/query/gap/low_signal, paper
    Sec. 4) and the seconds it took, timeline_s."""
    lr = lr_at(step, cfg.total_steps(), cfg.warmup_frac, cfg.schedule, cfg.lr)
    entry = {"step": step, "lr": lr, "train_loss": train_loss, **evaluate_all(model, data)}
    if on_eval is not None:
        start = time.time()
        timeline = on_eval(model, data, cfg, step)
        entry.update(timeline, timeline_s=time.time() - start)
    return entry


def evaluate_all(model, data):
    """evaluate()'s on data.eval, plus test_* (held-out split) and novel_* (ATR: data.novel)."""
    if not isinstance(data, Data):
        raise ValueError(f"data must be a mechsm.Data (make_data(cfg)); got {type(data).__name__}.")
    metrics = {k: v for k, v in evaluate(model, data.eval).items() if k != "n"}
    if data.test is not None:
        metrics.update({f"test_{k}": v for k, v in evaluate(model, data.test).items() if k != "n"})
    for split, mask in (data.novel or {}).items():
        prefix, ds = ("", data.eval) if split == "eval" else ("test_", data.test)
        metrics[f"{prefix}novel_acc"] = evaluate(model, ds.subset(mask.nonzero().squeeze(1)))["acc"]
        metrics[f"{prefix}novel_frac"] = mask.float().mean().item()
    return metrics


# --- Checkpoints: the state_dict plus everything needed to rebuild the exact model.

CHECKPOINT_FORMAT = "mechsm-v1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match the model it describes."""


def _rebuild(blob, device, fail):
    """(model, cfg) of a checkpoint's dict on `device`: its config (exactly Config's fields, valid)
    builds a model of its build_args (seed aside) taking its state_dict strictly; else fail(why)."""
    try:
        config = blob.get("config")
        cfg = replace(Config(**config), device=device)  # an unknown field: a TypeError naming it
        missing = [f.name for f in fields(Config) if f.name not in config]
        if missing:
            raise ValueError(f"its config lacks the field {missing[0]!r}")
        cfg.check()
        model = build(cfg, probe_task(cfg))
        ours, theirs = model.build_args, dict(blob.get("build_args") or {})
        for k in dict.fromkeys([*ours, *theirs]):           # an option one side lacks: None
            a, b = ours.get(k), theirs.get(k)                   # (or False: off)
            if k != "seed" and a != b and not all(v is None or v is False for v in (a, b)):
                raise ValueError(f"the config builds {k}={a!r}, the weights were built with "
                                 f"{k}={b!r}")
        weights = blob["state_dict"].values()
        if any(torch.is_tensor(v) and v.dtype == torch.float64 for v in weights):
            model.double()                                  # a float64 model comes back float64
        model.load_state_dict(blob["state_dict"])           # strict: the same keys and shapes
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError) as e:
        raise fail(" ".join(str(e).split())[:300]) from None
    return model, cfg.resolved()


def save(model, cfg, path):
    """torch.save {format, config, build_args, state_dict} to path whole (write_whole);
    cfg must describe the model (its task's vocabulary, its build), else a ValueError naming cfg."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    blob = {"format": CHECKPOINT_FORMAT, "config": asdict(Config.check(cfg)),
            "build_args": dict(getattr(model, "build_args", {})),
            "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()}}
    checked = _rebuild(blob, "cpu", lambda why: ValueError(f"cfg does not fit the model: {why}"))[1]
    blob["config"] = asdict(replace(checked, device=cfg.device))        # resolved: "auto" explicit
    torch.save(blob, buffer := io.BytesIO())
    return write_whole(path, buffer.getvalue())


def write_whole(path, data):
    """Write bytes to path whole: a temporary file beside it, synced, then os.replace, so that a
    kill or a full disk leaves the old file (a full disk: no temporary one; an OSError naming path);
    bytes it already holds: no write. A link is followed, as every tool follows it: the file it
    names is the one replaced."""
    target = os.path.realpath(path)
    if os.path.isfile(target) and Path(target).read_bytes() == data:
        return path
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.{os.getpid()}-{os.urandom(4).hex()}.tmp"   # unique per write: a killed one's
    try:                                                        # leftover never blocks the next
        with open(tmp, "xb") as f:            # "x": a new file of its own
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), path) from None
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)
    return path


def load(path, device="cpu"):
    """(model, cfg) from a checkpoint of save(), built from its config (exactly Config's fields,
    valid) that must agree with its build_args and weights; else a one-line CheckpointError. The
    model and cfg.device are `device`'s, wherever it was trained (a GPU's checkpoint on a
    laptop)."""
    Config(device=device).check()                       # a bad device: a ValueError naming it
    fail = lambda what: CheckpointError(f"checkpoint {path}: {what}")
    if not os.path.isfile(path):
        raise fail("no such file")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:   # truncated zip, garbage bytes, pickle errors: "not a checkpoint"
        raise fail(f"unreadable ({type(e).__name__}); is it a mechsm checkpoint?") from None
    if not isinstance(blob, dict) or blob.get("format") != CHECKPOINT_FORMAT:
        raise fail(f"not a {CHECKPOINT_FORMAT} checkpoint")
    return _rebuild(blob, device, lambda why: fail(f"does not rebuild its model ({why})"))


# ==================================================================================================
# Below: many runs at once, a learner can skip it. Runs that differ only in lr and seed train as one
# batched model (r times the work per kernel launch: results/bench.txt, part 4), each as train()
# trains it alone, to rounding; test_all.py compares every member with its lone run.
# ==================================================================================================

def group_key(cfg):
    """What the runs of one group share: every Config field but lr and seed (set to 0 here)."""
    return json.dumps(asdict(replace(cfg.resolved(), lr=0, seed=0)), sort_keys=True)


class Ensemble:
    """r models of one arch and shape trained as one (PyTorch's model-ensembling tutorial): their
    parameters are the rows of ONE (r, n_params) leaf, their logits a vmap of functional_call on one
    base module, the summed loss gives each row its member's gradient, and train_step applies
    torch.optim.AdamW's single-tensor update (0.9, 0.999, eps 1e-8, no weight decay) op for op, an
    lr per member. A member whose loss is not finite fails at that step: its row steps by 0 from
    then on (so does a frozen or unused parameter, as torch's AdamW skips it)."""

    def __init__(self, modules):
        self.modules, self.base = list(modules), modules[0]
        named = list(self.base.named_parameters())                      # the tied head counted once
        self.shapes, self.sizes = {n: p.shape for n, p in named}, [p.numel() for _, p in named]
        self.frozen = {n for n, p in named if not p.requires_grad}
        if any([n for n, _ in m.named_parameters()] != list(self.shapes) or not all(
                map(torch.equal, m.buffers(), self.base.buffers())) for m in self.modules[1:]):
            raise ValueError("Ensemble: the members must share their parameter names and buffers")
        self.flat = torch.stack([torch.cat([p.detach().reshape(-1) for p in m.parameters()])
                                 for m in self.modules]).requires_grad_()   # (r, n_params) leaf
        self.failed_step = self.flat.new_full((len(self.flat),), -1, dtype=torch.long)  # -1: alive
        self.failed_loss = self.flat.new_zeros(len(self.flat))      # (r,): a failed member's loss
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.flat), torch.zeros_like(self.flat)
        self.n_steps = 0

    def losses(self, tokens, queries, answers, done=None):
        """Every member's answer_loss (r,), its logits a vmap over the leaf's rows; a failed
        member's 0, a non-finite one fails its member at step `done` (default self.n_steps)."""
        def member_logits(row):         # row (n_params,): one member's parameters, as views of it
            params = {n: (x.detach() if n in self.frozen else x).view(shape)
                      for (n, shape), x in zip(self.shapes.items(), row.split(self.sizes))}
            return torch.func.functional_call(self.base, params, (tokens,), {"readout": queries})
        logits = torch.func.vmap(member_logits)(self.flat)                      # (r, b, v)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        losses = F.cross_entropy(logits.transpose(1, 2), answers.expand(len(logits), -1),
                                 reduction="none").mean(1)                      # (r,)
        newly = (self.failed_step < 0) & ~torch.isfinite(losses.detach())    # in place: a CUDA
        self.failed_step.copy_(torch.where(newly, self.n_steps if done is None else done,  # graph
                                           self.failed_step))                 # replays these
        self.failed_loss.copy_(torch.where(newly, losses.detach(), self.failed_loss))
        return torch.where(self.failed_step < 0, losses, 0.0)

    def train_step(self, tokens, queries, answers, lrs, n=None):
        """One AdamW step of every member on one batch at its lr (lrs[i]: a list, or a float64
        tensor on the device: no copy from the host); returns losses() (r,). n: None counts the
        steps in self.n_steps; a long tensor on the device counts them there, stepped in place
        (CapturedStep: a replayed graph cannot read a Python number that changes)."""
        losses = self.losses(tokens, queries, answers, None if n is None else n.clone())
        grad, = torch.autograd.grad(losses.sum(), self.flat)               # (r, n_params)
        with torch.no_grad():
            flat, alive, (beta1, beta2) = self.flat, self.failed_step < 0, (0.9, 0.999)
            if n is None:
                self.n_steps += 1
            t = self.n_steps if n is None else n.add_(1).double()
            bias1, bias2 = 1 - beta1 ** t, 1 - beta2 ** t
            grad = torch.where(alive[:, None], grad, 0.0)                   # a failed member's: 0
            lrs = torch.as_tensor(lrs, dtype=torch.float64).to(flat.device)
            neg_step = ((-lrs / bias1).to(flat.dtype) * alive)[:, None]    # (r, 1): 0 when failed
            self.exp_avg.lerp_(grad, 1 - beta1)
            self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (self.exp_avg_sq.sqrt() / bias2 ** 0.5).add_(1e-8)
            flat.addcdiv_(self.exp_avg * neg_step, denom)          # p -= lr / bias1 * m / denom
        return losses

    def members(self):
        """The members as ordinary modules, each row of the stacked leaf copied into its own."""
        with torch.no_grad():
            for m, row in zip(self.modules, self.flat):
                for p, x in zip(m.parameters(), row.split(self.sizes)):
                    p.copy_(x.view_as(p))
        return self.modules


class CapturedStep:
    """Ensemble.train_step recorded in a CUDA graph and replayed: a step is then one launch, not the
    hundreds of operators (each a kernel launch and a Python dispatch) that bound a small model's
    step on a GPU. One graph per batch shape, recorded after 3 eager warm-up steps on a side stream;
    each call copies the batch and lrs into the graph's static inputs; the step count lives on the
    GPU. test_all.py checks it against train_step in float64 (on a GPU); off by default (README)."""

    def __init__(self, ens):
        self.ens, self.graphs, self.pool = ens, {}, torch.cuda.graph_pool_handle()
        self.side = torch.cuda.Stream()                     # warm-ups run there, as capture needs
        self.n = torch.zeros((), dtype=torch.long, device=ens.flat.device)   # steps done

    def __call__(self, *inputs):                            # tokens, queries, answers, lrs
        key = tuple(x.shape for x in inputs)
        entry = self.graphs.setdefault(key, dict(warm=0, static=[x.clone() for x in inputs]))
        for static, x in zip(entry["static"], inputs):
            static.copy_(x)
        if entry["warm"] < 3:                               # eager, as the graph will replay it
            entry["warm"] += 1
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                losses = self.ens.train_step(*entry["static"], n=self.n)
            torch.cuda.current_stream().wait_stream(self.side)
            return losses
        if "graph" not in entry:                            # recorded, not run: replayed below
            entry["graph"] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(entry["graph"], pool=self.pool):
                entry["losses"] = self.ens.train_step(*entry["static"], n=self.n)
        entry["graph"].replay()
        return entry["losses"]


def train_group(configs, *, data=None, log=None, on_eval=None, captured=False):
    """Train configs that differ only in lr and seed as one Ensemble, in a loop like train()'s:
    [(result, model)], each what train(cfg, on_eval=on_eval) returns (to rounding) plus "group":
    {"size", "index"}; wall_s is the group's. A member whose loss goes NaN/inf fails there; the
    others go on. Between evaluations nothing waits for the device (the lrs of every step are on it
    from the start). captured: on CUDA, each step a replayed CUDA graph (CapturedStep)."""
    cfgs = [Config.check(c, "configs").resolved() for c in configs]
    if len({group_key(c) for c in cfgs}) != 1 or len({(c.lr, c.seed) for c in cfgs}) < len(cfgs):
        raise ValueError("train_group: configs: expected one or more runs that differ only in lr "
                         "and seed, no two alike")
    if captured not in (True, False) or captured and resolve_device(cfgs[0].device)[:4] != "cuda":
        raise ValueError(f"train_group: captured: got {captured!r}, expected False, or True on a "
                         "CUDA device")
    cfg, r = cfgs[0], len(cfgs)
    data = make_data(cfg, data)
    prefix = f"[{cfg.arch} d{cfg.d_model} x{r}] "
    log = log or (lambda msg: print(prefix + msg, file=sys.stderr, flush=True))
    ens = Ensemble([build(c, data.vocab_size) for c in cfgs])  # own seeds
    log(f"{r} runs as one batched model | lr {','.join(f'{c.lr:g}' for c in cfgs)} | "
        f"seeds {','.join(str(c.seed) for c in cfgs)}")
    batch, total, start = training_batches(cfg, data), cfg.total_steps(), time.time()
    lrs = torch.tensor([[lr_at(s, total, c.warmup_frac, c.schedule, c.lr) for c in cfgs]  # (steps,
                        for s in range(total)], dtype=torch.float64).to(ens.flat.device)  # r)
    train_step = CapturedStep(ens) if captured else ens.train_step
    histories, loss_sum, n_losses = [[] for _ in cfgs], 0.0, 0      # the members: in train mode
    for step in range(total + 1):
        if step % cfg.eval_every == 0 or step == total:
            losses = (loss_sum / n_losses).tolist() if n_losses else [None] * r
            for c, member, history, loss in zip(cfgs, ens.members(), histories, losses):
                history.append(history_entry(member, data, c, step, loss, on_eval))
            rate, accs = step / max(time.time() - start, 1e-9), [h[-1]["acc"] for h in histories]
            log(f"step {step}/{total} | acc {' '.join(f'{a:.3f}' for a in accs)} | "
                f"{rate:.1f} steps/s ({r * rate:.1f} model-steps/s)")
            loss_sum, n_losses = 0.0, 0
        if step == total:
            break
        loss_sum, n_losses = loss_sum + train_step(*batch(step), lrs[step]).detach(), n_losses + 1
    wall, pairs = time.time() - start, []
    failed = zip(ens.failed_step.tolist(), ens.failed_loss.tolist())    # step -1: never failed
    for i, (c, model, history, (s, loss)) in enumerate(zip(cfgs, ens.members(), histories, failed)):
        steps_done, error = (total, None) if s < 0 else (s, FAILED.format(loss, s, c.lr))
        record = run_record(c, model, history, steps_done, error, wall)
        pairs.append(({**record, "group": {"size": r, "index": i}}, model))
    return pairs
