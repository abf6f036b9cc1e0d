"""mechsm.py: the experiment: config, the paper's training recipe, evaluation, sweeps, checkpoints.

Follows "Mechanistic evaluation of Transformers and state space models" (Arora et al. 2025,
arXiv 2505.15105), Sec. 4-5 and App. C, as specified from the reference code in PROTOCOL.md:
  [1] PROTOCOL.md §4    fixed pre-generated training set, walked in order (no shuffling), 320 eval docs
  [2] PROTOCOL.md §5.1  AdamW (0.9, 0.999, eps 1e-8, no weight decay), 10% linear warmup, cosine to 0,
                        cross-entropy on the answer token only, fp32, no clipping, no dropout
  [3] PROTOCOL.md §5.3  evaluation cadence (every eval_every steps, step 0 included)
  [4] PROTOCOL.md §6    accuracy = argmax over the full vocabulary; likelihood = mean p(answer)
  [5] PROTOCOL.md §8    the sweeps (widths x learning rates), best learning rate per (arch, width)
  [6] PROTOCOL.md §10   items 9 (eval/train overlap), 11 (schedule), 12 (no shuffling), 13 (the final
                        step is evaluated here, unlike the reference)

Where we differ from the reference on purpose:
  * the final checkpoint IS evaluated (the reference evaluates every 200 steps and never the last
    16-32 updates, PROTOCOL §10.13); the reported metrics are those of the final model;
  * ATR accuracy is also reported on the evaluation documents that do not appear verbatim in the
    training set ("novel_acc", PROTOCOL §10.9);
  * with a held-out split, "test" really holds out pairs (tasks.py fixes PROTOCOL §10.2).

Shape glossary: b batch, l sequence length, d d_model, v vocabulary, n documents.

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
import traceback
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache

import torch
import torch.nn.functional as F

import models
import tasks

# ----------------------------------------------------------------------------------------------
# The experiments: one entry per result of the paper, each with a "quick" grid that runs in at most
# 15 minutes on a 2-core CPU and the "paper" grid (the paper's widths, learning rates and steps).
# A grid is {"config": Config fields shared by its runs, "runs": one dict of Config fields per family
# of runs (each names its arch), "widths", "lrs": {arch: [...]}, "seeds": {arch: [...]}} where the
# arch "*" is the default; quick grids also give each arch its step count ("steps").
# ----------------------------------------------------------------------------------------------

ALL_ARCHS = ["attention", "base_conv", "based", "h3", "hyena", "mamba", "deltanet"]
PAPER_ARCHS = ALL_ARCHS[:6]                  # the paper's six; DeltaNet came in its later version
LR5 = [3e-5, 1e-4, 3e-4, 1e-3, 3e-3]
LR7 = LR5 + [1e-2, 3e-2]

# quick: the paper's AR vocabulary (4,096 keys, 4,096 values) and recipe (a fixed 100,032-document
# training set walked in order, batch 32, 10% warmup, cosine decay), but 8 pairs instead of 16 (21
# tokens: every step ~1.7x cheaper), width 64, one learning rate per architecture and 4k-16k steps
# instead of 50k. The learning rates and step counts come from short probe runs made before any
# table (README, "How the quick grids were chosen"). Attention gets the most steps: it sits on the
# "copy any value in the context" plateau for ~9k steps before induction forms.
QUICK_AR = dict(task="ar", num_keys=4096, num_values=4096, num_pairs=8, d_model=64, n_layers=2,
                train_size=100_032, steps=6000, eval_every=1000)
# quick ATR: a few sentences of hundreds of terminals make every batch that long (batches are
# padded to their longest document), and Mamba's time loop then ran at 1.5-6 steps/s on a CPU, so the
# quick grids reject sentences over 64 terminals (1.5% of them at L_max 5; README, difference 14) and
# take fewer steps: every ATR grid must fit 15 minutes on 2 cores.
QUICK_ATR = dict(task="atr", num_terminals=20, max_rhs_len=5, data_seed=125, d_model=64, n_layers=2,
                 train_size=100_032, steps=4000, eval_every=1000, gap_filter=0.1, max_terminals=64)
QUICK_ATR_STEPS = {"attention": 10_000, "mamba": 4000, "based": 6000, "h3": 2500}   # the others: 4,000
QUICK_STEPS = {"attention": 16_000, "mamba": 8000, "based": 8000, "h3": 4000}   # the others: 6,000
QUICK_LRS = {"attention": [5e-4], "base_conv": [3e-3], "based": [3e-3], "h3": [1e-3], "hyena": [1e-3],
             "mamba": [1e-2], "deltanet": [1e-3]}
PAPER_AR = dict(task="ar", num_keys=4096, num_values=4096, num_pairs=16, n_layers=2, batch_size=32,
                train_size=100_032, epochs=16, eval_every=200)
PAPER_ATR = dict(task="atr", num_terminals=20, max_rhs_len=5, max_depth=10, n_layers=2, batch_size=32,
                 data_seed=125, train_size=100_032, epochs=32, eval_every=200, gap_filter=0.1)
ATR_MEDIUM = dict(max_rhs_len=10, data_seed=124)          # grammar seed 124: lengths near the reference's


def _quick(config, runs, widths=(64,), seeds=None, steps=None, **extra):
    return dict(config={**config, **extra}, runs=runs, widths=list(widths), lrs=QUICK_LRS,
                seeds=seeds or {"*": [0]}, steps=steps or QUICK_STEPS)


def _paper(config, runs, widths=(16, 32, 64, 128, 256), lrs=LR5, **extra):
    return dict(config={**config, **extra}, runs=runs, widths=list(widths), lrs={"*": lrs}, seeds={"*": [42]})


def _archs(*archs, **fields):
    return [dict(arch=a, **fields) for a in archs]


@dataclass(frozen=True)
class Experiment:
    name: str
    section: str        # where the paper reports it
    tests: str          # the claim, in one line
    paper: dict         # table row label (or arch) -> the paper's number / finding for that row
    quick: dict         # the quick grid
    full: dict          # the paper's grid (preset "paper")


# Longest runs first in each list, so that two parallel jobs finish together.
EXPERIMENTS = {e.name: e for e in [
    Experiment("ar", "Sec. 5.1", "AR accuracy and mechanism of every architecture at one width",
               {"attention": "100% (every d >= 32); induction", "based": "99.06% (best); induction",
                "mamba": "91.25% (d 256); direct retrieval", "hyena": "~30%; direct retrieval",
                "h3": "direct retrieval"},
               _quick(QUICK_AR, _archs("mamba", "attention", "h3", "deltanet", "hyena", "based", "base_conv"),
                      seeds={"mamba": [0, 1, 2], "*": [0]}),
               _paper(PAPER_AR, _archs(*ALL_ARCHS), lrs=LR7)),
    Experiment("ar-widths", "Sec. 5.1", "AR accuracy against width d",
               {"attention": "100% at every d >= 32", "mamba": "rises with d: 91.25% at d 256"},
               _quick(QUICK_AR, _archs("mamba", "attention"), widths=(16, 32, 64)),
               _paper(PAPER_AR, _archs(*ALL_ARCHS), lrs=LR7)),
    Experiment("ar-nope", "Sec. 5.1", "attention without position embeddings fails AR",
               {"attention (NoPE)": "5.62% (d 256)", "attention (PE)": "100%"},
               _quick(QUICK_AR, _archs("attention", pos_emb=False) + _archs("attention", pos_emb=True)),
               _paper(PAPER_AR, _archs("attention", pos_emb=False) + _archs("attention", pos_emb=True))),
    Experiment("ar-layers", "App. D.2, D.3", "AR with 1 and 3 layers (1-layer Mamba still learns it)",
               {"mamba (1 layer)": "96.25%"},
               _quick(QUICK_AR, _archs("mamba", "attention", n_layers=1) + _archs("mamba", "attention")),
               _paper(PAPER_AR, _archs(*PAPER_ARCHS, n_layers=1) + _archs(*PAPER_ARCHS, n_layers=3), lrs=LR7)),
    Experiment("mamba-conv", "Sec. 5.4", "Mamba with short-conv sizes 0-4: it needs the conv for AR",
               {"mamba (d_conv 0)": "fails without the conv", "mamba (default conv)": "91.25% (d 256; conv 4)"},
               _quick(QUICK_AR, [dict(arch="mamba", d_conv=k) for k in (0, 2, None)]),
               _paper(PAPER_AR, [dict(arch="mamba", d_conv=k) for k in (0, 1, 2, 3, None)], lrs=LR7)),
    Experiment("based-ablation", "Sec. 5.4", "Based with long convs only, and short kernels 1-4",
               {"based (default conv)": "99.06%; induction"},
               _quick(QUICK_AR, _archs("based", long_only=True) + [dict(arch="based", d_conv=k) for k in (1, 2, None)]),
               _paper(PAPER_AR, _archs("based", "base_conv", long_only=True)
                      + [dict(arch="based", d_conv=k) for k in (1, 2, None, 4)])),
    Experiment("atr", "Sec. 5.2", "ATR (L_max 5, |Sigma| 20): accuracy and the same mechanism split as AR",
               {"attention": "induction-like: the parent's token holds the association",
                "mamba": "direct retrieval at the query", "h3": "direct retrieval", "hyena": "direct retrieval",
                "based": "induction-like"},
               _quick(QUICK_ATR, _archs("mamba", "attention", "h3", "hyena", "based", "base_conv"),
                      steps=QUICK_ATR_STEPS),
               _paper(PAPER_ATR, _archs(*PAPER_ARCHS))),
    Experiment("atr-medium", "Sec. 5.2", "ATR with L_max 10: Mamba beats attention",
               {"mamba": "92.19% (d 256)", "attention": "80.94% (d 256)"},
               _quick(QUICK_ATR, _archs("mamba", "attention"), steps=QUICK_ATR_STEPS, **ATR_MEDIUM),
               _paper(PAPER_ATR, _archs("attention", "base_conv", "based", "hyena", "mamba"), **ATR_MEDIUM)),
    Experiment("atr-8192", "Sec. 5.2", "ATR over 8,192 terminals (attention)", {},
               _quick(QUICK_ATR, _archs("attention"), steps=QUICK_ATR_STEPS, num_terminals=8192),
               _paper(PAPER_ATR, _archs("attention"), num_terminals=8192)),
    Experiment("atr-generalisation", "Sec. 5.3", "ATR on held-out (parent, child) label pairs: dev against test",
               {"attention": "95.62% dev / 68.12% test (d 256)"},
               _quick(QUICK_ATR, _archs("attention"), steps=QUICK_ATR_STEPS, holdout=0.2, gap_filter=0.01),
               _paper(PAPER_ATR, _archs("attention"), holdout=0.2, gap_filter=0.01)),
    Experiment("ar-generalisation", "the paper's notebook (not in its text)",
               "AR on held-out (key, value) pairs: dev against test", {},
               _quick(QUICK_AR, _archs("attention"), holdout=0.2),
               _paper(PAPER_AR, _archs("attention"), holdout=0.2, epochs=32)),
    Experiment("atr-mamba-conv", "arXiv v3", "Mamba without its short conv learns attention-like induction on ATR",
               {"mamba (d_conv 0)": "induction (high Attrib@Value)", "mamba (default conv)": "direct retrieval"},
               _quick(QUICK_ATR, [dict(arch="mamba", d_conv=0), dict(arch="mamba")], steps=QUICK_ATR_STEPS),
               _paper(PAPER_ATR, [dict(arch="mamba", d_conv=k) for k in (0, None)])),
]}
PRESET_NAMES = ("quick", "paper")
LABEL_FIELDS = ("d_model", "n_layers", "pos_emb", "d_conv", "long_only", "holdout", "freeze_features")


def experiment_configs(name, preset="quick", *, archs=None, widths=None, lrs=None, seeds=None, **fields):
    """The Configs of one experiment's grid, runs -> widths -> lrs -> seeds, with `fields` (Config
    fields, e.g. device, out_dir, steps) set on every run. archs / widths / lrs / seeds narrow or
    replace the grid's: archs keeps the grid's runs of those archs and adds a plain run for an arch
    the grid lacks (with the grid's learning rate and steps for it). An unknown name or preset is a
    ValueError naming the choices."""
    if name not in EXPERIMENTS:
        raise ValueError(f"experiment: got {name!r}, expected one of {', '.join(EXPERIMENTS)}")
    if preset not in PRESET_NAMES:
        raise ValueError(f"preset: got {preset!r}, expected one of {', '.join(PRESET_NAMES)}")
    exp = EXPERIMENTS[name]
    grid = exp.quick if preset == "quick" else exp.full
    runs = grid["runs"]
    if archs is not None:
        runs = [r for r in runs if r["arch"] in archs] + [dict(arch=a) for a in archs
                                                          if a not in {r["arch"] for r in runs}]
    pick = lambda table, arch: table.get(arch, table.get("*", [1e-3] if table is grid["lrs"] else None))
    configs = []
    for run in runs:
        steps = pick(grid.get("steps", {}), run["arch"])
        base = Config(**{**grid["config"], **({"steps": steps} if steps else {}), **run, **fields})
        for width in widths or grid["widths"]:
            for lr in lrs or pick(grid["lrs"], run["arch"]):
                for seed in seeds or pick(grid["seeds"], run["arch"]):
                    configs.append(replace(base, d_model=width, lr=float(lr), seed=seed))
    return configs


def _describe(name, value):
    """A LABEL_FIELDS value in words: 'd 32', '1 layer', 'NoPE', 'd_conv 0', 'default conv', ..."""
    if name == "d_model":
        return f"d {value}"
    if name == "n_layers":
        return f"{value} layer{'s' * (value != 1)}"
    if name == "pos_emb":
        return "PE" if value else "NoPE"
    if name == "d_conv":
        return "default conv" if value is None else f"d_conv {value}"
    if name == "long_only":
        return "long convs only" if value else None
    if name == "holdout":
        return f"holdout {value:g}"
    return f"{name} {value}"


# Training steps per second of one CPU thread at the paper's AR shape (width 64, 2 layers, batch 32,
# 37 tokens), from `python run.py bench` on a 2-core x86-64 machine (torch 2.13). estimate_seconds
# scales them by tokens, width, layers and batch: a rough guide for planning, not a promise.
CPU_STEPS_PER_S = {"attention": 43.4, "base_conv": 35.7, "based": 39.4, "h3": 8.2, "hyena": 22.0,
                   "mamba": 12.1, "deltanet": 22.8}


@lru_cache(maxsize=16)
def _mean_batch_width(data_key):
    """Mean over batches of 32 of the longest document (batches are padded to it), from 320 docs."""
    data = _make_data(data_key)
    lengths = data.eval.lengths[: len(data.eval) // 32 * 32].view(-1, 32)
    return float(lengths.max(1).values.float().mean())


def estimate_seconds(configs, jobs=1):
    """Rough CPU wall time of training `configs` with `jobs` one-thread workers (see CPU_STEPS_PER_S)."""
    total = 0.0
    for cfg in configs:
        cfg = cfg.resolved()
        tokens = _mean_batch_width(_data_key(replace(cfg, train_size=32, eval_size=320)))
        rate = (CPU_STEPS_PER_S.get(cfg.arch, 20.0) * 37 / tokens / max(1.0, cfg.d_model / 64)
                * 2 / cfg.n_layers * 32 / cfg.batch_size)
        total += cfg.total_steps() / rate
    return total / max(1, min(jobs, len(configs)))


def fmt_hours(seconds):
    """'14 min' or '3.2 h'."""
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def row_label(cfg, configs):
    """A table label for cfg: its arch, plus every LABEL_FIELDS value that differs between the
    configs of the same arch in `configs`, e.g. 'mamba', 'mamba (d_conv 0)', 'attention (NoPE)'."""
    cfg = cfg.resolved()
    same_arch = [c.resolved() for c in configs if c.arch == cfg.arch]
    parts = []
    for name in LABEL_FIELDS:
        if len({getattr(c, name) for c in same_arch}) > 1:
            if not (name == "d_conv" and cfg.long_only):      # long_only has no short conv to size
                parts.append(_describe(name, getattr(cfg, name)))
    parts = [p for p in parts if p]
    return cfg.arch + (f" ({', '.join(parts)})" if parts else "")


DEFAULT_EPOCHS = {"ar": 16, "atr": 32}       # PROTOCOL §5.1
TASKS = ("ar", "atr")
SCHEDULES = ("cosine", "linear")
DEVICES = ("auto", "cpu", "cuda")


# ----------------------------------------------------------------------------------------------
# Config: every knob of one run, flat, with the paper's values as defaults.
# ----------------------------------------------------------------------------------------------

@dataclass
class Config:
    # task (tasks.py); data_seed fixes the language and its documents, so every model of a sweep
    # trains on the same documents (PROTOCOL §4)
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
    holdout: float = 0.0             # fraction of (key, value) / (parent, child) pairs held out for "test"
    data_seed: int = 42              # the language seed (grammar, held-out pairs, documents)
    # model (models.build_model)
    arch: str = "attention"          # one of models.ARCHS
    d_model: int = 64                # width
    n_layers: int = 2
    n_heads: int = 1
    pos_emb: bool | None = None      # learned positions; None = the paper's convention: attention only
    n_positions: int = 1024          # size of the position table (the paper's l_max)
    d_conv: int | None = None        # mamba short-conv size (0 removes it); based/base_conv short kernel
    long_only: bool = False          # based/base_conv: implicit long conv instead of the short conv
    freeze_features: bool = False    # base_conv's long conv: keep its positional features Z frozen
                                     # (zoology's form; the paper's runs trained them, README difference 13)
    kernels: str = "fast"            # "fast" | "reference" (slow loop scan / direct convolutions)
    # training (PROTOCOL §5.1)
    lr: float = 1e-3                 # peak learning rate
    batch_size: int = 32
    train_size: int = 100_032        # documents in the fixed training set (3126 batches of 32)
    epochs: int | None = None        # passes over the training set; None = 16 for AR, 32 for ATR
    steps: int | None = None         # total optimizer steps; overrides epochs (the set is walked cyclically)
    warmup_frac: float = 0.1         # linear warmup over int(warmup_frac * total) steps
    schedule: str = "cosine"         # decay to 0 after warmup: "cosine" | "linear" (PROTOCOL §10.11)
    seed: int = 42                   # model init seed (torch)
    device: str = "auto"             # "auto" (cuda if available) | "cpu" | "cuda"
    # evaluation and output
    eval_every: int = 200            # steps between evaluations (PROTOCOL §5.3); the last step is always evaluated
    eval_size: int = 320             # evaluation documents per split (PROTOCOL §4)
    timeline_docs: int = 64          # at every evaluation, Attrib@Value/Query on this many eval docs (0: off)
    gap_filter: float = 0.01         # p_clean - p_corrupt at or below this: "no signal" (the paper: 0.01
                                     # for AR, 0.1 for the ATR box plots)
    out_dir: str | None = None       # where checkpoints go; None = nowhere
    save_checkpoint: bool = False    # save the final model under out_dir/ckpt/

    def check(self):
        """Raise ValueError with one line naming the field and what is allowed. Returns self."""
        def bad(name, allowed):
            raise ValueError(f"{name}: got {getattr(self, name)!r}, expected {allowed}")

        def positive_int(name, allow_none=False):
            v = getattr(self, name)
            if allow_none and v is None:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(name, "a positive integer" + (" or None" if allow_none else ""))

        if self.task not in TASKS:
            bad("task", " or ".join(TASKS))
        if self.arch not in models.ARCHS:
            bad("arch", "one of " + ", ".join(models.ARCHS))
        if not isinstance(self.timeline_docs, int) or isinstance(self.timeline_docs, bool) or self.timeline_docs < 0:
            bad("timeline_docs", "a non-negative integer (0 turns the timeline off)")
        if not isinstance(self.gap_filter, (int, float)) or not 0 <= self.gap_filter < 1:
            bad("gap_filter", "a number in [0, 1)")
        for name in ("num_keys", "num_values", "num_pairs", "num_terminals", "num_nonterminals", "max_terminals",
                     "max_rules", "max_depth", "d_model", "n_layers", "n_heads", "n_positions",
                     "batch_size", "train_size", "eval_every", "eval_size"):
            positive_int(name)
        positive_int("epochs", allow_none=True)
        positive_int("steps", allow_none=True)
        if self.d_model % self.n_heads:
            bad("n_heads", f"a divisor of d_model={self.d_model}")
        if not isinstance(self.lr, (int, float)) or not math.isfinite(self.lr) or self.lr <= 0:
            bad("lr", "a positive finite number")
        if self.train_size < self.batch_size:
            bad("train_size", f"at least batch_size={self.batch_size}")
        if not 0 <= self.warmup_frac < 1:
            bad("warmup_frac", "a number in [0, 1)")
        if not 0 <= self.holdout < 1:
            bad("holdout", "a number in [0, 1)")
        if self.schedule not in SCHEDULES:
            bad("schedule", " or ".join(SCHEDULES))
        if self.kernels not in ("fast", "reference"):
            bad("kernels", "fast or reference")
        if self.pos_emb not in (None, True, False):
            bad("pos_emb", "True, False or None (auto: attention only)")
        if self.d_conv is not None and (not isinstance(self.d_conv, int) or self.d_conv < 0):
            bad("d_conv", "None or a non-negative integer")
        if not isinstance(self.seed, int) or self.seed < 0 or not isinstance(self.data_seed, int) or self.data_seed < 0:
            raise ValueError(f"seed/data_seed: got {self.seed!r}/{self.data_seed!r}, expected non-negative integers")
        if self.device not in DEVICES and not str(self.device).startswith("cuda:"):
            bad("device", " or ".join(DEVICES))
        if str(self.device).startswith("cuda") and not torch.cuda.is_available():
            bad("device", "cpu or auto (torch.cuda.is_available() is False here)")
        return self

    def resolved(self):
        """The same run with every "auto" made explicit (epochs, pos_emb), so equal runs compare equal."""
        return replace(self,
                       epochs=self.epochs if self.epochs is not None else DEFAULT_EPOCHS.get(self.task, 16),
                       pos_emb=self.pos_emb if self.pos_emb is not None else self.arch == "attention")

    def steps_per_epoch(self):
        return self.train_size // self.batch_size    # a last partial batch is dropped

    def total_steps(self):
        return self.steps if self.steps is not None else self.steps_per_epoch() * self.resolved().epochs

    def name(self):
        """A short human name for logs and files, e.g. 'ar_attention_d64_L2_lr0.001_s42'."""
        return f"{self.task}_{self.arch}_d{self.d_model}_L{self.n_layers}_lr{self.lr:g}_s{self.seed}"


KEY_EXCLUDED = ("out_dir", "device")   # where and on what a run happens does not change what it is


def run_key(config_dict):
    """Canonical JSON of a (resolved) config dict, without out_dir/device: the identity of a run."""
    return json.dumps({k: v for k, v in sorted(config_dict.items()) if k not in KEY_EXCLUDED}, sort_keys=True)


def resolve_device(device):
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def set_threads_for_jobs(jobs):
    """One BLAS/OpenMP thread per job, so that `jobs` parallel runs do not fight over the cores."""
    if jobs > 1:
        torch.set_num_threads(1)


# ----------------------------------------------------------------------------------------------
# Data: the fixed training set and the evaluation set(s) of one config (PROTOCOL §4).
# ----------------------------------------------------------------------------------------------

@dataclass
class Data:
    train: "tasks.Dataset"     # train_size documents, split "train"
    eval: "tasks.Dataset"      # eval_size fresh documents, split "dev" (a different seed stream)
    test: "tasks.Dataset"      # eval_size documents that query held-out pairs; None when holdout == 0
    vocab_size: int


def _data_key(cfg):
    if cfg.task == "ar":
        params = (cfg.num_keys, cfg.num_values, cfg.num_pairs)
    else:
        params = (cfg.num_terminals, cfg.num_nonterminals, cfg.max_rhs_len, cfg.max_rules, cfg.max_depth,
                  cfg.terminal_weight, cfg.max_terminals)
    return (cfg.task, params, cfg.holdout, cfg.data_seed, cfg.train_size, cfg.eval_size)


@lru_cache(maxsize=2)
def _make_data(key):
    task, params, holdout, seed, train_size, eval_size = key
    if task == "ar":
        k, v, m = params
        make = lambda n, split: tasks.make_ar(n, num_keys=k, num_values=v, num_pairs=m, seed=seed,
                                              split=split, holdout=holdout)
    else:
        s, nt, rhs, rules, depth, weight, longest = params
        grammar = tasks.PCFG(num_terminals=s, num_nonterminals=nt, max_rhs_len=rhs, max_rules=rules,
                             max_depth=depth, terminal_weight=weight, seed=seed)
        make = lambda n, split: tasks.make_atr(n, grammar, split=split, holdout=holdout, seed=seed,
                                               max_terminals=longest)
    # the SAME seed for every split: tasks.py mixes the split name into the document stream, and the
    # held-out pairs depend on the seed only, so train/dev/test share the language
    train, dev = make(train_size, "train"), make(eval_size, "dev")
    test = make(eval_size, "test") if holdout > 0 else None
    return Data(train, dev, test, train.vocab_size)


def make_data(cfg):
    """The Data of cfg, cached in-process (a sweep's runs share their documents)."""
    return _make_data(_data_key(cfg))


def probe_task(cfg):
    """Generate a few documents of cfg's task (raises tasks' ValueError if it cannot be generated);
    returns the vocabulary size. Cheap: use it to validate input before a long sweep."""
    return _make_data(_data_key(replace(cfg, train_size=4, eval_size=4))).vocab_size


def novel_mask(train, dataset):
    """(n,) bool: which documents of `dataset` do not appear verbatim in `train` (PROTOCOL §10.9).
    Each document is hashed as its unpadded token row."""
    seen = {row[:n].tobytes() for row, n in zip(train.tokens.numpy(), train.lengths.tolist())}
    return torch.tensor([row[:n].tobytes() not in seen
                         for row, n in zip(dataset.tokens.numpy(), dataset.lengths.tolist())], dtype=torch.bool)


# ----------------------------------------------------------------------------------------------
# The recipe: learning-rate schedule, loss, evaluation.
# ----------------------------------------------------------------------------------------------

def lr_at(step, total, warmup_frac=0.1, schedule="cosine", peak=1.0):
    """The learning rate used for optimizer step `step` (0-based) of `total` (HF-style, PROTOCOL §5.1).

    Linear warmup from 0 over w = int(warmup_frac * total) steps (step 0 uses lr 0, as in the
    reference), then cosine (or linear) decay that reaches 0 at step == total.
    """
    warmup = int(warmup_frac * total)
    if step < warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return peak * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak * (1.0 - progress)


def answer_loss(model, tokens, queries, answers):
    """Cross-entropy of the answer token only, read at the query position (mean over the batch).
    The head is applied to the query rows alone, so no other position can enter the loss."""
    logits = model(tokens, readout=queries)                 # (b, l) -> (b, v)
    return F.cross_entropy(logits.float(), answers)


@torch.no_grad()
def evaluate(model, dataset, batch_size=64):
    """{"acc", "prob", "loss", "n"} on `dataset`: argmax over the full vocabulary at the query position
    == answer; mean softmax probability of the answer; mean cross-entropy (PROTOCOL §6)."""
    n = len(dataset)
    if n == 0:
        return {"acc": float("nan"), "prob": float("nan"), "loss": float("nan"), "n": 0}
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct, prob, loss = 0, 0.0, 0.0
    for i in range(0, n, batch_size):
        rows = slice(i, i + batch_size)
        width = int(dataset.lengths[rows].max())            # causal models: trailing padding is irrelevant
        tokens = dataset.tokens[rows, :width].to(device)    # (b, l)
        answers = dataset.answers[rows].to(device)          # (b,)
        logits = model(tokens, readout=dataset.positions["query"][rows].to(device)).float()  # (b, v)
        logp = logits.log_softmax(-1).gather(1, answers[:, None]).squeeze(1)                  # (b,)
        correct += (logits.argmax(-1) == answers).sum().item()
        prob += logp.exp().sum().item()
        loss -= logp.sum().item()
    model.train(was_training)
    return {"acc": correct / n, "prob": prob / n, "loss": loss / n, "n": n}


def evaluate_all(model, data, novel=None):
    """Flat metrics over the eval (dev) set, plus test_* with a held-out split and novel_* for the
    documents not seen verbatim in training (novel = dict split -> bool mask, ATR only)."""
    metrics = {k: v for k, v in evaluate(model, data.eval).items() if k != "n"}
    if data.test is not None:
        metrics.update({f"test_{k}": v for k, v in evaluate(model, data.test).items() if k != "n"})
    for split, mask in (novel or {}).items():
        ds = data.eval if split == "eval" else data.test
        prefix = "" if split == "eval" else "test_"
        metrics[f"{prefix}novel_acc"] = evaluate(model, ds.subset(mask.nonzero().squeeze(1)))["acc"]
        metrics[f"{prefix}novel_frac"] = mask.float().mean().item()
    return metrics


# ----------------------------------------------------------------------------------------------
# One training run.
# ----------------------------------------------------------------------------------------------

def stderr_log(prefix=""):
    """A log function printing one line to stderr, prefixed (e.g. by the arch when jobs run in parallel)."""
    def log(msg):
        print(f"{prefix}{msg}", file=sys.stderr, flush=True)
    return log


def _fmt_time(seconds):
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else f"{seconds // 60}:{seconds % 60:02d}"


def train(cfg, *, data=None, log=None):
    """Train one model with the paper's recipe. Returns (result, model).

    result is JSON-serialisable: config (resolved), status ("ok" | "failed"), error, n_params, device,
    final metrics (of the final model; "failed" runs keep their last evaluated metrics), history (one
    entry per evaluation), wall_s, steps_per_s, steps_done, total_steps, checkpoint (path or None).
    A NaN/inf loss stops the run (status "failed"); anything else wrong raises.
    """
    cfg = cfg.resolved().check()
    log = log or stderr_log(f"[{cfg.arch} d{cfg.d_model} lr{cfg.lr:g} s{cfg.seed}] ")
    device = resolve_device(cfg.device)
    data = data or make_data(cfg)
    t_start = time.time()

    # model: seeded from cfg.seed alone, so the same seed gives the same init (and on CPU, the same run)
    torch.manual_seed(cfg.seed)
    model = build(cfg, data.vocab_size).to(device)
    n_params = models.count_parameters(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    # the fixed training set, walked in order: batch s is rows [(s mod S)*B, (s mod S)*B + B) (§4, §10.12)
    B, S, total = cfg.batch_size, cfg.steps_per_epoch(), cfg.total_steps()
    train_tokens = data.train.tokens[: S * B].to(device)                  # (S*B, l)
    train_queries = data.train.positions["query"][: S * B].to(device)     # (S*B,)
    train_answers = data.train.answers[: S * B].to(device)                # (S*B,)
    batch_width = data.train.lengths[: S * B].view(S, B).max(1).values.tolist()  # trim padding per batch
    novel = None
    if cfg.task == "atr":
        novel = {"eval": novel_mask(data.train, data.eval)}
        if data.test is not None:
            novel["test"] = novel_mask(data.train, data.test)

    log(f"{n_params:,} parameters on {device} | {total} steps ({S} batches of {B}, "
        f"{total / S:g} epoch{'s' * (total != S)}) | {cfg.name()}")
    history, status, error = [], "ok", None
    loss_sum, loss_count = torch.zeros((), device=device), 0
    t_loop, step, timeline_s = time.time(), 0, 0.0

    def record(step):
        nonlocal loss_sum, loss_count, timeline_s
        train_loss = (loss_sum / loss_count).item() if loss_count else None
        entry = history_entry(model, data, cfg, step, train_loss, novel)
        timeline_s += entry.pop("timeline_s", 0.0)
        history.append(entry)
        loss_sum, loss_count = torch.zeros((), device=device), 0
        elapsed = time.time() - t_loop
        rate = step / elapsed if elapsed > 0 and step else 0.0
        eta = (total - step) / rate if rate else float("nan")
        log(f"step {step}/{total} | loss {'-' if train_loss is None else f'{train_loss:.3f}'} | "
            f"acc {entry['acc']:.3f}" + (f" | test {entry['test_acc']:.3f}" if "test_acc" in entry else "")
            + (f" | attrib V {fmt_attrib(entry, 'attrib_value')} Q {fmt_attrib(entry, 'attrib_query')}"
               if "attrib_value" in entry else "")
            + f" | {rate:.1f} steps/s | ETA {_fmt_time(eta) if rate else '?'}")

    model.train()
    for step in range(total):
        if step % cfg.eval_every == 0:
            record(step)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total, cfg.warmup_frac, cfg.schedule, cfg.lr)
        s = step % S
        rows, width = slice(s * B, s * B + B), batch_width[s]
        loss = answer_loss(model, train_tokens[rows, :width], train_queries[rows], train_answers[rows])
        # a NaN/inf loss would silently poison every later step: stop the run here. Checking every step
        # costs one host sync; it is cheap next to the step and keeps the failure message exact.
        if not torch.isfinite(loss).item():
            status = "failed"
            error = f"loss is {loss.item()} at step {step} (lr {cfg.lr:g}); run stopped"
            log(f"FAILED: {error}")
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum, loss_count = loss_sum + loss.detach(), loss_count + 1
    else:
        step = total
        record(total)   # the final model is always evaluated (the reference skips it, §10.13)

    wall = time.time() - t_start
    checkpoint = None
    if cfg.save_checkpoint and cfg.out_dir and status == "ok":
        checkpoint = os.path.join(cfg.out_dir, "ckpt", cfg.name() + ".pt")
        save(model, cfg, checkpoint)
    final = {k: v for k, v in (history[-1] if history else {}).items() if k not in ("lr",)}
    result = {"config": asdict(cfg), "name": cfg.name(), "status": status, "error": error,
              "n_params": n_params, "device": device, "final": final, "history": history,
              "wall_s": round(wall, 2), "steps_done": step, "total_steps": total,
              "steps_per_s": round(step / max(1e-9, time.time() - t_loop), 2), "checkpoint": checkpoint,
              "timeline_s": round(timeline_s, 3)}
    return _json_safe(result), model


def fmt_attrib(entry, key):
    """An attribution of a history entry for a log line or a table: '0.98', or '-' when missing or
    when the entry had too little signal to read (attrib_low_signal)."""
    value = entry.get(key)
    return "-" if value is None or entry.get("attrib_low_signal") else f"{value:.2f}"


def build(cfg, vocab_size):
    """The model of a config, initialised from cfg.seed alone (models.build_model)."""
    cfg = cfg.resolved()
    return models.build_model(cfg.arch, vocab_size, cfg.d_model, cfg.n_layers, pos_emb=cfg.pos_emb,
                              n_positions=cfg.n_positions, n_heads=cfg.n_heads, d_conv=cfg.d_conv,
                              long_only=cfg.long_only, freeze_features=cfg.freeze_features,
                              kernels=cfg.kernels, seed=cfg.seed)


def count_parameters(cfg, vocab_size):
    """The parameter count of cfg's model (the tied head counted once)."""
    return models.count_parameters(build(cfg, vocab_size))


def history_entry(model, data, cfg, step, train_loss, novel=None):
    """One evaluation of `model` during training: the history entry train() records.

    {step, lr, train_loss, acc, prob, loss (+ test_*, novel_*)} and, when cfg.timeline_docs > 0, the
    headline pair on the first timeline_docs evaluation documents: attrib_value, attrib_query (the
    block input of layer 1 at the value and at the query, as interventions.mechanism reports them),
    attrib_gap (p_clean - p_corrupt) and attrib_low_signal (gap <= cfg.gap_filter: too little signal
    to read). The entry's timeline_s is the time the timeline took (train() sums and removes it).
    """
    total = cfg.total_steps()
    entry = {"step": step, "lr": lr_at(step, total, cfg.warmup_frac, cfg.schedule, cfg.lr),
             "train_loss": train_loss, **evaluate_all(model, data, novel)}
    if cfg.timeline_docs:
        import interventions
        start = time.time()
        head = interventions.headline(model, data.eval, n_docs=cfg.timeline_docs, threshold=cfg.gap_filter)
        entry.update(attrib_value=head["value"], attrib_query=head["query"], attrib_gap=head["gap"],
                     attrib_low_signal=head["low_signal"], timeline_s=time.time() - start)
    return entry


def _json_safe(x):
    """Replace non-finite floats by None (strict JSON has no NaN) recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


# ----------------------------------------------------------------------------------------------
# Checkpoints: the state_dict plus everything needed to rebuild the exact model.
# ----------------------------------------------------------------------------------------------

CHECKPOINT_FORMAT = "mechsm-v1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match the model it describes."""


def save(model, cfg, path):
    """torch.save {format, config, build_args, state_dict} to path, atomically (temp file + os.replace)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    blob = {"format": CHECKPOINT_FORMAT, "config": asdict(cfg), "build_args": dict(model.build_args),
            "state_dict": state}
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(blob, tmp)
    os.replace(tmp, path)
    return path


def load(path, device="cpu"):
    """(model, cfg) from a checkpoint written by save(). Raises CheckpointError (a ValueError) with
    a one-line message for a truncated, corrupt or mismatched file; OSError if it cannot be opened."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path}: no such file")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:   # truncated zip, garbage bytes, pickle errors: all mean "not a checkpoint"
        raise CheckpointError(f"checkpoint {path}: unreadable ({type(e).__name__}); is it a mechsm checkpoint?") from None
    if not isinstance(blob, dict) or blob.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {path}: not a {CHECKPOINT_FORMAT} checkpoint")
    try:
        known = {f.name for f in fields(Config)}
        cfg = Config(**{k: v for k, v in blob["config"].items() if k in known})
        model = models.build_model(**blob["build_args"])
        model.load_state_dict(blob["state_dict"])   # strict: missing/unexpected/mis-shaped -> RuntimeError
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        msg = " ".join(str(e).split())[:200]
        raise CheckpointError(f"checkpoint {path}: does not rebuild its model ({type(e).__name__}: {msg})") from None
    return model.to(device), cfg


# ----------------------------------------------------------------------------------------------
# Sweeps: a grid of runs, one JSON line per finished run, resumable.
# ----------------------------------------------------------------------------------------------

def grid_configs(base_cfg, archs, widths, lrs, seeds, per_arch=None):
    """The configs of the grid, in order arch -> width -> lr -> seed. lrs: list, or dict arch -> list.
    per_arch: optional dict arch -> Config overrides for that architecture (e.g. its step count)."""
    configs = []
    for arch in archs:
        arch_lrs = lrs[arch] if isinstance(lrs, dict) else lrs
        arch_cfg = replace(base_cfg, **(per_arch or {}).get(arch, {}))
        for width in widths:
            for lr in arch_lrs:
                for seed in seeds:
                    configs.append(replace(arch_cfg, arch=arch, d_model=width, lr=float(lr), seed=seed))
    return configs


def read_results(path):
    """The run records in a results.jsonl file ([] if absent). A torn last line (a crash mid-write)
    is skipped with a warning rather than failing the whole file."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    print(f"warning: {path}:{i} is not valid JSON; ignored", file=sys.stderr)
    return records


def append_result(path, record):
    """Append one JSON line with a single write, then flush and fsync, so a crash or Ctrl-C leaves
    either the whole line or nothing (plus, at worst, a torn last line that read_results skips)."""
    line = (json.dumps(_json_safe(record), sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def _run_one(cfg, after, jobs):
    """Train one config (in this process or a worker) and apply `after`. Never raises on a bad run:
    returns a record with status "error" (not saved, so a rerun retries) if training crashed."""
    if jobs > 1:
        torch.set_num_threads(1)
    try:
        result, model = train(cfg)
    except KeyboardInterrupt:
        raise
    except Exception as e:
        traceback.print_exc()
        return {"config": asdict(cfg.resolved()), "name": cfg.name(), "status": "error",
                "error": f"{type(e).__name__}: {e}"}
    if after is not None and result["status"] == "ok":
        try:
            result.update(after(model, make_data(cfg), cfg.resolved(), result) or {})
        except Exception as e:   # the training result is still worth keeping
            traceback.print_exc()
            result["after_error"] = f"{type(e).__name__}: {e}"
    return _json_safe(result)


def _worker_init():
    torch.set_num_threads(1)


def sweep(base_cfg, archs=None, widths=None, lrs=None, seeds=None, *, results_path, jobs=1, after=None,
          log=None, per_arch=None):
    """Train every (arch, width, lr, seed) of the grid not already in results_path; return the grid's
    records (old and new) in grid order. base_cfg may also be the list of Configs to run (an
    experiment's grid, experiment_configs), and then the grid arguments are not used.

    Each finished run is appended to results_path at once as one JSON line; runs already there (same
    run_key) are skipped, so rerunning a finished sweep trains nothing and Ctrl-C loses only the runs
    in flight. jobs > 1 trains in that many worker processes ("spawn", one thread each). after(model,
    data, cfg, result) -> dict, if given, runs in the worker on each successful run and its dict is
    merged into the record before it is written (run.py uses it for the interventions); it must be a
    module-level function so that it can be sent to a worker.
    """
    log = log or stderr_log()
    configs = list(base_cfg) if isinstance(base_cfg, (list, tuple)) else \
        grid_configs(base_cfg, archs, widths, lrs, seeds, per_arch)
    for cfg in configs:                        # bad input fails here, before any training
        cfg.check()
    for key in {_data_key(c) for c in configs}:
        probe_task(next(c for c in configs if _data_key(c) == key))
    os.makedirs(os.path.dirname(os.path.abspath(results_path)), exist_ok=True)
    done = {}
    for record in read_results(results_path):
        done[run_key(record["config"])] = record
    keys = [run_key(asdict(c.resolved())) for c in configs]
    todo = [(k, c) for k, c in zip(keys, configs) if k not in done]
    if len(todo) < len(configs):
        log(f"sweep: {len(configs) - len(todo)} of {len(configs)} runs already in {results_path}; skipped")
    new = {}

    def finish(key, record):
        if record["status"] != "error":
            append_result(results_path, record)
        new[key] = record

    if jobs <= 1 or len(todo) <= 1:
        for key, cfg in todo:
            finish(key, _run_one(cfg, after, 1))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed
        pool = ProcessPoolExecutor(max_workers=min(jobs, len(todo)), initializer=_worker_init,
                                   mp_context=multiprocessing.get_context("spawn"))
        try:
            futures = {pool.submit(_run_one, cfg, after, jobs): key for key, cfg in todo}
            for future in as_completed(futures):
                finish(futures[future], future.result())
        except BaseException:      # Ctrl-C (or a crash): keep what is written, stop the runs in flight
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.terminate()  # no public API for this before Python 3.14 (terminate_workers)
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
    return [new.get(k) or done[k] for k in keys if k in new or k in done]


def best_by_lr(results, metric="acc"):
    """Per group of runs that differ only in lr and seed (in practice: per (arch, width)), the lr with
    the best mean final `metric` over seeds (PROTOCOL §6: max over LR). Returns one row per group:
    arch, d_model, best_lr, mean, std, n_seeds, values (per seed), per_lr {lr: mean}, and the chosen
    run records (`runs`). With a held-out split the choice uses dev accuracy ("acc") and the row also
    carries test_mean (PROTOCOL §6, generalisation). Runs with status "error" are ignored; "failed"
    runs count with their last metrics (None -> 0)."""
    groups = {}
    for r in results:
        if r is None or r.get("status") == "error":
            continue
        c = r["config"]
        gkey = run_key({k: v for k, v in c.items() if k not in ("lr", "seed")})
        groups.setdefault(gkey, {}).setdefault(c["lr"], []).append(r)
    rows = []
    for per_lr in groups.values():
        def score(r, m=metric):
            v = (r.get("final") or {}).get(m)
            return v if v is not None else 0.0
        means = {lr: sum(map(score, runs)) / len(runs) for lr, runs in per_lr.items()}
        best = max(means, key=lambda lr: (means[lr], -lr))   # ties: the smaller lr
        runs = per_lr[best]
        values = [score(r) for r in runs]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        row = {"arch": runs[0]["config"]["arch"], "d_model": runs[0]["config"]["d_model"], "best_lr": best,
               "mean": mean, "std": std, "n_seeds": len(values), "values": values,
               "per_lr": dict(sorted(means.items())), "runs": runs}
        if any("test_acc" in (r.get("final") or {}) for r in runs):
            row["test_mean"] = sum(score(r, "test_acc") for r in runs) / len(runs)
        # the best run of the group, over every lr and seed (the paper: max over learning rates);
        # a run that finished beats one that failed, whatever the failed one's last evaluation said
        row["best"] = max((r for runs_ in per_lr.values() for r in runs_),
                          key=lambda r: (r.get("status") == "ok", score(r), -r["config"]["lr"], -r["config"]["seed"]))
        rows.append(row)
    order = {a: i for i, a in enumerate(ALL_ARCHS)}
    return sorted(rows, key=lambda row: (order.get(row["arch"], len(order)), row["arch"], row["d_model"]))


# ----------------------------------------------------------------------------------------------
# Interventions after training (run.py's default pipeline), as a sweep `after` hook.
# ----------------------------------------------------------------------------------------------

def run_interventions(model, data, cfg, result):
    """Run interventions.mechanism on the eval set of a trained model; write the full result to
    <out_dir>/mechanism/<run name>.json and return {"mechanism": summary, "mechanism_path": path}."""
    import interventions
    mech = interventions.mechanism(model, data.eval, threshold=cfg.gap_filter)
    path = None
    if cfg.out_dir:
        path = os.path.join(cfg.out_dir, "mechanism", cfg.name() + ".json")
        write_json(path, mech)
    return {"mechanism": mechanism_summary(mech), "mechanism_path": path}


def mechanism_summary(mech):
    """The few numbers the summary table shows: Attrib@Key/Value/Query (the block input of layer 1,
    the paper's headline site; the layer-0 mixer output for 1-layer models) and the verdict."""
    head = mech.get("headline") or mech.get("mixer_out") or {}
    return _json_safe({"attrib_key": head.get("key"), "attrib_value": head.get("value"),
                       "attrib_query": head.get("query"), "verdict": mech.get("verdict"),
                       "p_clean": mech.get("p_clean"), "p_corrupt": mech.get("p_corrupt"),
                       "low_signal": mech.get("low_signal"), "conv_next_key": mech.get("conv_next_key")})


def write_json(path, obj):
    """Write obj as JSON atomically (temp file + os.replace)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(_json_safe(obj), f, indent=1)
    os.replace(tmp, path)
    return path
