"""mechsm.py: the experiment: config, the paper's training recipe, evaluation, sweeps, checkpoints.

Follows "Mechanistic evaluation of Transformers and state space models" (Arora et al. 2025,
arXiv 2505.15105), Sec. 4-5 and App. C, and the reference training loop (tinylang: experiment.py):
  * a fixed pre-generated training set of 100,032 documents, walked in the same order every epoch
    (no shuffling), batch 32; 320 fresh evaluation documents;
  * AdamW (0.9, 0.999, eps 1e-8, no weight decay), 10% linear warmup from 0, then cosine decay to 0
    (HuggingFace's schedule), cross-entropy on the answer token only, float32, no clipping, no dropout;
  * evaluation every eval_every steps, step 0 included; accuracy = argmax over the full vocabulary at
    the query position, and the mean probability of the answer;
  * sweeps over widths and learning rates, reporting the best run per (arch, width).

Where we differ from the reference on purpose (README, differences 7, 8, 11, 18): the final model is
evaluated (the reference never evaluates its last 16-32 updates); ATR accuracy is also reported on the
evaluation documents that do not appear verbatim in the training set ("novel_acc"); the
generalisation runs decay with a cosine, as the paper says (its configs decay linearly).

Shape glossary: b batch, l sequence length, d d_model, v vocabulary, n documents, r members of a
group (runs that differ only in lr and seed, trained as one batched model: Ensemble, train_group),
P parameters of one model.

Using it from Python:
    import mechsm
    cfg = mechsm.Config(arch="attention", num_keys=16, num_values=16, num_pairs=4, d_model=32,
                        train_size=8000, epochs=1, lr=3e-3)
    result, model = mechsm.train(cfg)            # result["final"]["acc"], result["history"], ...
    mechsm.save(model, cfg, "attn.pt"); model, cfg = mechsm.load("attn.pt")
    pairs = mechsm.train_group([dataclasses.replace(cfg, lr=lr) for lr in (1e-3, 3e-3)])  # [(result, model)]
"""

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import sys
import threading
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

ALL_ARCHS = list(models.BUILT_IN_ARCHS)
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
# quick grids reject sentences over 64 terminals (1.5% at L_max 5, 21% at L_max 10: README, difference 14) and
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
               _quick(QUICK_AR, _archs("attention"), widths=(16, 32, 64)),   # CPU budget: attention only
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
               _quick(QUICK_AR, [dict(arch="mamba", d_conv=k) for k in (0, None)]),   # CPU budget: 0 and 4
               _paper(PAPER_AR, [dict(arch="mamba", d_conv=k) for k in (0, 1, 2, 3, None)], lrs=LR7)),
    Experiment("based-ablation", "Sec. 5.4", "Based with long convs only, and short kernels 1-4",
               {"based (default conv)": "99.06%; induction"},
               _quick(QUICK_AR, _archs("based", long_only=True) + [dict(arch="based", d_conv=k) for k in (1, None)]),
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
# 37 tokens), from `python run.py bench` on an otherwise idle 2-core x86-64 machine (torch 2.13,
# 2026-11-29; a loaded machine runs 2-3x slower). estimate_seconds scales them by tokens, width,
# layers and batch: a rough guide for planning, not a promise.
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


def catalogue(jobs=2):
    """`run.py --list`: every experiment, its claim and the paper's numbers, with the runs of each preset
    and their expected time on a 2-core CPU with `jobs` jobs (estimate_seconds)."""
    lines = []
    for name, exp in EXPERIMENTS.items():
        times = [f"{preset}: {len(configs)} runs, ~{fmt_hours(estimate_seconds(configs, jobs))}"
                 for preset in PRESET_NAMES for configs in [experiment_configs(name, preset)]]
        lines += [f"{name:<19} {exp.section}: {exp.tests}",
                  f"{'':<19} paper: " + ("; ".join(f"{k} {v}" for k, v in exp.paper.items()) or "no number quoted"),
                  f"{'':<19} " + " | ".join(times) + f" (2 CPU cores, {jobs} jobs)"]
    return "\n".join(lines)


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


DEFAULT_EPOCHS = {"ar": 16, "atr": 32}       # the paper: 50,016 AR steps, 100,032 ATR steps
TASKS = ("ar", "atr")
SCHEDULES = ("cosine", "linear")
DEVICES = ("auto", "cpu", "cuda")


# ----------------------------------------------------------------------------------------------
# Config: every knob of one run, flat, with the paper's values as defaults.
# ----------------------------------------------------------------------------------------------

@dataclass
class Config:
    # task (tasks.py); data_seed fixes the language and its documents, so every model of a sweep
    # trains on the same documents
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
    # training (the paper's recipe)
    lr: float = 1e-3                 # peak learning rate
    batch_size: int = 32
    train_size: int = 100_032        # documents in the fixed training set (3126 batches of 32)
    epochs: int | None = None        # passes over the training set; None = 16 for AR, 32 for ATR
    steps: int | None = None         # total optimizer steps; overrides epochs (the set is walked cyclically)
    warmup_frac: float = 0.1         # linear warmup over int(warmup_frac * total) steps
    schedule: str = "cosine"         # decay to 0 after warmup: "cosine" | "linear" (README, difference 11)
    seed: int = 42                   # model init seed (torch)
    device: str = "auto"             # "auto" (cuda if available) | "cpu" | "cuda"
    # evaluation and output
    eval_every: int = 200            # steps between evaluations; the last step is always evaluated
    eval_size: int = 320             # evaluation documents per split (the paper: 320)
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

    def file_name(self):
        """name() plus 8 hex digits of the run's identity, for its checkpoint and mechanism files: runs
        that differ only in fields name() leaves out (d_conv, pos_emb, ...) must not share a file."""
        return f"{self.name()}_{run_hash(run_key(asdict(self.resolved())))[:8]}"


# Where and on what a run happens, and whether its checkpoint is kept, do not change what it is: a rerun
# that differs only in these finds the run done. Every other field changes the trained model or what
# its record reports (a field a record lacks, e.g. one added to Config later, makes it a different run).
KEY_EXCLUDED = ("out_dir", "device", "save_checkpoint")


def run_key(config_dict):
    """Canonical JSON of a (resolved) config dict, without KEY_EXCLUDED: the identity of a run."""
    return json.dumps({k: v for k, v in sorted(config_dict.items()) if k not in KEY_EXCLUDED}, sort_keys=True)


def run_hash(key):
    """A short file-name-safe digest of a run_key (16 hex digits), e.g. for the run's claim file."""
    return hashlib.sha1(key.encode()).hexdigest()[:16]


def resolve_device(device):
    """The device to use: "auto" -> "cuda" if available, else "cpu". A CUDA device on a machine without
    one is a ValueError (one line) here, before a model or a benchmark touches it."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device: got {device!r}, but torch.cuda.is_available() is False here; "
                             "use cpu or auto")
        index = str(device).partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise ValueError(f"device: got {device!r}, but this machine has {torch.cuda.device_count()} "
                             "CUDA device(s)")
    return device


# ----------------------------------------------------------------------------------------------
# Data: the fixed training set and the evaluation set(s) of one config.
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
    try:
        train, dev = make(train_size, "train"), make(eval_size, "dev")
        test = make(eval_size, "test") if holdout > 0 else None
    except (RuntimeError, MemoryError) as e:    # e.g. the (keys, values) held-out matrix of a huge vocabulary
        if not (isinstance(e, MemoryError) or "alloc" in str(e).lower()):
            raise
        raise ValueError(f"{task} task {params} with {train_size} training documents: too large to "
                         f"allocate ({' '.join(str(e).split())[:120]})") from None
    return Data(train, dev, test, train.vocab_size)


def make_data(cfg):
    """The Data of cfg, cached in-process (a sweep's runs share their documents)."""
    return _make_data(_data_key(cfg))


def probe_task(cfg):
    """Generate a few documents of cfg's task (raises tasks' ValueError if it cannot be generated);
    returns the vocabulary size. Cheap: use it to validate input before a long sweep."""
    return _make_data(_data_key(replace(cfg, train_size=4, eval_size=4))).vocab_size


def check_length(cfg, data=None):
    """Raise ValueError (one line) when cfg's documents are longer than its model accepts
    (models.position_limit: learned positions, Hyena's filter), so that this fails before training,
    not at the first step of a run or in a worker. AR documents all have 2 * num_pairs + 5 tokens;
    ATR documents vary, so unless max_terminals + 5 fits, the longest one of `data` is read (cfg's
    documents are generated when data is None, and cached for the run that follows)."""
    cfg = cfg.resolved()
    limit = models.position_limit(cfg.arch, cfg.pos_emb, cfg.n_positions)
    if limit is None:
        return
    if cfg.task == "ar":
        length = 2 * cfg.num_pairs + 5
    elif cfg.max_terminals + 5 <= limit:
        return
    else:
        data = data or make_data(cfg)
        length = max(d.tokens.shape[1] for d in (data.train, data.eval, data.test) if d is not None)
    if length > limit:
        what = "learned positions" if cfg.pos_emb else "implicit filter positions"
        raise ValueError(f"n_positions: documents of up to {length} tokens, but {cfg.arch}'s model has "
                         f"{limit} {what}; raise n_positions or shorten the documents")


def novel_mask(train, dataset):
    """(n,) bool: which documents of `dataset` do not appear verbatim in `train` (README, difference 8).
    Each document is hashed as its unpadded token row."""
    seen = {row[:n].tobytes() for row, n in zip(train.tokens.numpy(), train.lengths.tolist())}
    return torch.tensor([row[:n].tobytes() not in seen
                         for row, n in zip(dataset.tokens.numpy(), dataset.lengths.tolist())], dtype=torch.bool)


def novel_masks(cfg, data):
    """ATR: {"eval": novel_mask of the eval documents, "test": of the test documents (with a held-out
    split)}, which evaluate_all reports as novel_*; None for AR."""
    if cfg.task != "atr":
        return None
    novel = {"eval": novel_mask(data.train, data.eval)}
    if data.test is not None:
        novel["test"] = novel_mask(data.train, data.test)
    return novel


# ----------------------------------------------------------------------------------------------
# The recipe: learning-rate schedule, loss, evaluation.
# ----------------------------------------------------------------------------------------------

def lr_at(step, total, warmup_frac=0.1, schedule="cosine", peak=1.0):
    """The learning rate used for optimizer step `step` (0-based) of `total` (HuggingFace's schedule).

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
    The head is applied to the query rows alone, so no other position can enter the loss. Computed in
    float32 at least (a float64 model keeps float64). `model` may be any callable model(tokens, readout=)."""
    logits = model(tokens, readout=queries)                 # (b, l) -> (b, v)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), answers)


@torch.no_grad()
def evaluate(model, dataset, batch_size=64):
    """{"acc", "prob", "loss", "n"} on `dataset`: argmax over the full vocabulary at the query position
    == answer; mean softmax probability of the answer; mean cross-entropy."""
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
    check_length(cfg, data)                # documents the model cannot take: before step 0, not at it
    t_start = time.time()
    torch.manual_seed(cfg.seed)            # the init comes from cfg.seed alone (on a CPU: the same run)
    model = build(cfg, data.vocab_size).to(device)
    n_params, total, S = models.count_parameters(model), cfg.total_steps(), cfg.steps_per_epoch()
    optimizer = adamw(model, cfg.lr)
    batches, history = training_batches(cfg, data, device), _History(cfg, data, novel_masks(cfg, data))
    log(f"{n_params:,} parameters on {device} | {total} steps ({S} batches of {cfg.batch_size}, "
        f"{total / S:g} epoch{'s' * (total != S)}) | {cfg.name()}")
    t_loop = time.time()
    steps_done, error = _train_steps(model, optimizer, batches, history, cfg, log)
    wall, rate = time.time() - t_start, steps_done / max(1e-9, time.time() - t_loop)
    return _result(model, cfg, error, n_params, device, history, steps_done, wall, rate), model


def adamw(model, lr):
    """The paper's optimizer for `model`: AdamW (0.9, 0.999), eps 1e-8, no weight decay. Fused (one kernel
    over all parameters) where torch has it for their device and dtype: on a CPU, one thread, the default
    for-loop form took 2.2 ms a step for attention's 690k parameters (3.3 ms, H3's 1.08M), the fused one 0.54
    (0.9); the same update up to float rounding (test_fused_adamw_agrees_with_the_for_loop_form)."""
    params = list(model.parameters())
    fused = all(p.device.type in _fused_devices() and p.dtype.is_floating_point for p in params) or None
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=fused)


def _fused_devices():
    """The device types torch's fused optimizers run on (cpu and cuda among them; a private torch helper)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return ("cpu", "cuda")
    return _get_fused_kernels_supported_devices()


def training_batches(cfg, data, device):
    """The fixed training set on `device`, walked in order as the reference walks it: batch(step) is
    (tokens, queries, answers) of rows [s*B, s*B + B) with s = step mod S (S = steps_per_epoch: a last
    partial batch is dropped), the tokens trimmed to the batch's longest document."""
    B, S = cfg.batch_size, cfg.steps_per_epoch()
    tokens = data.train.tokens[: S * B].to(device)                  # (S*B, l)
    queries = data.train.positions["query"][: S * B].to(device)     # (S*B,)
    answers = data.train.answers[: S * B].to(device)                # (S*B,)
    widths = data.train.lengths[: S * B].view(S, B).max(1).values.tolist()

    def batch(step):
        s = step % S
        rows = slice(s * B, s * B + B)
        return tokens[rows, :widths[s]], queries[rows], answers[rows]
    return batch


class _History:
    """The evaluations of one run as it trains: its history entries (history_entry) and the time the
    attribution timeline took in them."""

    def __init__(self, cfg, data, novel=None):
        self.cfg, self.data, self.novel = cfg, data, novel
        self.entries, self.timeline_s = [], 0.0

    def add(self, model, step, train_loss):
        entry = history_entry(model, self.data, self.cfg, step, train_loss, self.novel)
        self.timeline_s += entry.pop("timeline_s", 0.0)
        self.entries.append(entry)
        return entry


def _train_steps(model, optimizer, batches, history, cfg, log):
    """train()'s loop: AdamW at lr_at(step) on batches(step), evaluated (history) every eval_every
    steps and after the last one. Returns (steps done, error): a NaN/inf loss stops the run at that
    step, and error says so (None when the run finished)."""
    total, since, device = cfg.total_steps(), time.time(), next(model.parameters()).device
    loss_sum, loss_count = torch.zeros((), device=device), 0

    def record(step):
        nonlocal loss_sum, loss_count
        train_loss = (loss_sum / loss_count).item() if loss_count else None
        entry = history.add(model, step, train_loss)
        loss_sum, loss_count = torch.zeros((), device=device), 0
        rate, eta = _speed(step, total, since)
        log(f"step {step}/{total} | loss {'-' if train_loss is None else f'{train_loss:.3f}'} | "
            f"acc {entry['acc']:.3f}" + (f" | test {entry['test_acc']:.3f}" if "test_acc" in entry else "")
            + (f" | attrib V {fmt_attrib(entry, 'attrib_value')} Q {fmt_attrib(entry, 'attrib_query')}"
               if "attrib_value" in entry else "") + f" | {rate:.1f} steps/s | ETA {eta}")

    model.train()
    for step in range(total):
        if step % cfg.eval_every == 0:
            record(step)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total, cfg.warmup_frac, cfg.schedule, cfg.lr)
        loss = answer_loss(model, *batches(step))
        # a NaN/inf loss would silently poison every later step: stop the run here. Checking every step
        # costs one host sync; it is cheap next to the step and keeps the failure message exact.
        if not torch.isfinite(loss).item():
            error = f"loss is {loss.item()} at step {step} (lr {cfg.lr:g}); run stopped"
            log(f"FAILED: {error}")
            return step, error
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum, loss_count = loss_sum + loss.detach(), loss_count + 1
    record(total)   # the final model is always evaluated (the reference skips it: README, difference 7)
    return total, None


def _speed(step, total, since):
    """(steps per second since `since`, the time left at that rate as text) for a log line."""
    elapsed = time.time() - since
    rate = step / elapsed if elapsed > 0 and step else 0.0
    return rate, _fmt_time((total - step) / rate) if rate else "?"


def _result(model, cfg, error, n_params, device, history, steps_done, wall, rate, **extra):
    """The record of one trained run (train, train_group), after saving its final model under
    out_dir/ckpt/ when cfg asks for a checkpoint and the run finished (error None)."""
    checkpoint = None
    if cfg.save_checkpoint and cfg.out_dir and error is None:
        checkpoint = save(model, cfg, os.path.join(cfg.out_dir, "ckpt", cfg.file_name() + ".pt"))
    final = {k: v for k, v in (history.entries[-1] if history.entries else {}).items() if k != "lr"}
    return _json_safe({"config": asdict(cfg), "name": cfg.name(), "status": "ok" if error is None else "failed",
                       "error": error, "n_params": n_params, "device": device, "final": final,
                       "history": history.entries, "wall_s": round(wall, 2), "steps_done": steps_done,
                       "total_steps": cfg.total_steps(), "steps_per_s": round(rate, 2), "checkpoint": checkpoint,
                       "timeline_s": round(history.timeline_s, 3), **extra})


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


def parameter_counts(configs, vocab_size):
    """{row label: parameter count of its first config's model}, in order (row_label, count_parameters)."""
    labels = {}
    for cfg in configs:
        labels.setdefault(row_label(cfg, configs), cfg)
    return {label: count_parameters(cfg, vocab_size) for label, cfg in labels.items()}


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
# Groups: runs that differ only in learning rate and seed, trained as one batched model. Runs this
# small are bound by kernel launches on a GPU; r members in one model make every kernel do r times
# the work for about the launch cost of one (`run.py bench`, part 5).
# ----------------------------------------------------------------------------------------------

class Ensemble:
    """r models of one architecture and shape trained as one (shape glossary: r members).

    The parameters of the members are rows of ONE (r, P) leaf; every member's loss comes from
    torch.func.vmap over torch.func.functional_call of one base module, its row split back into
    named parameters (the PyTorch docs' model-ensembling tutorial, with the stack kept flat); and one
    AdamW step updates all rows at once, a handful of ops whatever r and however many parameter
    tensors (torch.optim.AdamW on a CPU loops over them in Python).

    The update is torch.optim.AdamW's single-tensor step (betas 0.9/0.999, eps 1e-8, no weight
    decay) op for op, with one learning rate per member, so each member follows the run it would
    have had alone, to rounding. The members' losses are summed before backward: they share no
    parameter, so each row gets exactly its member's gradient. A member whose loss is not finite is
    dead from that step on: its gradient row is masked (torch.where) and its step size is 0, so its
    weights stay those at the step that failed (where a lone run stops), and no NaN reaches the
    others. A parameter that never gets a gradient (frozen, or unused) gets zeros here instead of
    None, and AdamW moves it by exactly 0, as torch's skips it.
    """

    BETAS, EPS = (0.9, 0.999), 1e-8

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
            flat = torch.stack([torch.cat([p.reshape(-1) for p in m.parameters()]) for m in self.modules])
        self.flat = flat.requires_grad_()                               # (r, P): the one trainable leaf
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(flat), torch.zeros_like(flat)   # (r, P) each
        self.n_steps, r = 0, len(self.modules)
        self.alive = torch.ones(r, dtype=torch.bool, device=flat.device)
        self.failed_step = torch.full((r,), -1, dtype=torch.long, device=flat.device)  # -1: not failed
        self.failed_loss = torch.zeros(r, dtype=flat.dtype, device=flat.device)

    def losses(self, flat, tokens, queries, answers):
        """Every member's answer_loss on the same batch: flat (r, P), tokens (b, l) -> (r,)."""
        return torch.func.vmap(self._member_loss, in_dims=(0, None, None, None))(flat, tokens, queries, answers)

    def params(self, row):
        """One member's named parameters, views of its row (P,) of the stacked leaf."""
        pieces = row.split(self.sizes)
        return {n: (x.detach() if n in self.frozen else x).view(shape)
                for n, shape, x in zip(self.names, self.shapes, pieces)}

    def _member_loss(self, row, tokens, queries, answers):
        params = self.params(row)
        model = lambda t, readout: torch.func.functional_call(self.base, params, (t,), {"readout": readout})
        return answer_loss(model, tokens, queries, answers)

    def step(self, tokens, queries, answers, lrs, step):
        """One AdamW step of every live member on the same batch, member i with learning rate lrs[i]
        (this step's value; a list, or a float64 tensor (r,) already on the device, which keeps the
        step free of host-to-device copies). Returns the losses (r,), detached. No host sync: a
        member whose loss is not finite is recorded in failed_step / failed_loss, read when the
        caller next looks."""
        self.flat.grad = None
        losses = self.losses(self.flat, tokens, queries, answers)         # (r,)
        finite = torch.isfinite(losses.detach())
        newly = self.alive & ~finite
        self.failed_step = torch.where(newly, step, self.failed_step)
        self.failed_loss = torch.where(newly, losses.detach(), self.failed_loss)
        self.alive = self.alive & finite
        losses.sum().backward()
        beta1, beta2 = self.BETAS
        self.n_steps += 1
        bias1, bias2 = 1 - beta1 ** self.n_steps, 1 - beta2 ** self.n_steps
        with torch.no_grad():
            grad = torch.where(self.alive[:, None], self.flat.grad, 0.0)  # (r, P): dead rows get 0
            lrs = torch.as_tensor(lrs, dtype=torch.float64, device=self.flat.device)   # (r,)
            neg_step = ((-lrs / bias1).to(self.flat.dtype) * self.alive)[:, None]     # (r, 1): 0 when dead
            self.exp_avg.lerp_(grad, 1 - beta1)
            self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (self.exp_avg_sq.sqrt() / bias2 ** 0.5).add_(self.EPS)
            self.flat.addcdiv_(self.exp_avg * neg_step, denom)           # p -= lr / bias1 * m / denom
        self.flat.grad = None
        return losses.detach()

    def member(self, i):
        """Member i as an ordinary module: its row of the stacked leaf copied into its own parameters."""
        with torch.no_grad():
            for p, x in zip(self.modules[i].parameters(), self.flat[i].split(self.sizes)):
                p.copy_(x.view_as(p))
        return self.modules[i]


def group_key(cfg):
    """What the runs of one group share: every Config field but lr and seed."""
    return json.dumps({k: v for k, v in sorted(asdict(cfg.resolved()).items()) if k not in ("lr", "seed")})


def make_groups(configs, group_size=None):
    """configs -> lists of configs that differ only in lr and seed (in order of first appearance), at
    most group_size each (None: a whole (arch, width, ...) cell per group)."""
    if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"group_size: got {group_size!r}, expected a positive integer")
    cells = {}
    for cfg in configs:
        cells.setdefault(group_key(cfg), []).append(cfg)
    size = lambda cell: group_size or len(cell)
    return [cell[i:i + size(cell)] for cell in cells.values() for i in range(0, len(cell), size(cell))]


def default_group_size(device):
    """1 (every run alone, in worker processes) on a CPU, where groups do not pay (`run.py bench`,
    part 5); None (one group per cell) elsewhere."""
    return 1 if resolve_device(device) == "cpu" else None


def _group_of(configs):
    """The resolved, checked configs of one group; ValueError unless they differ only in lr and seed."""
    cfgs = [c.resolved().check() for c in configs]
    if not cfgs:
        raise ValueError("train_group: no configs")
    if len({group_key(c) for c in cfgs}) > 1:
        raise ValueError("train_group: the configs of a group must differ only in lr and seed")
    if len({(c.lr, c.seed) for c in cfgs}) < len(cfgs):
        raise ValueError("train_group: two configs of the group have the same lr and seed")
    return cfgs


def train_group(configs, *, data=None, log=None):
    """Train configs that differ only in lr and seed as one batched model (Ensemble).

    Returns [(result, model)], one per config in order, each what train(cfg) returns for it: the
    same record keys (plus "group": {"size", "index"}), its history entries from history_entry at the
    same steps, its own checkpoint; wall_s and steps_per_s are the group's. A member whose loss goes
    NaN/inf is "failed" at that step, with train()'s error message and its weights of that step, and
    the others go on undisturbed. Raises ValueError if the configs differ in anything else.
    """
    cfgs = _group_of(configs)
    cfg, r = cfgs[0], len(cfgs)
    log = log or stderr_log(f"[{cfg.arch} d{cfg.d_model} x{r}] ")
    device = resolve_device(cfg.device)
    data = data or make_data(cfg)
    t_start = time.time()
    ens = Ensemble([build(c, data.vocab_size).to(device) for c in cfgs])   # each from its own seed
    n_params, total, novel = models.count_parameters(ens.base), cfg.total_steps(), novel_masks(cfg, data)
    histories = [_History(c, data, novel) for c in cfgs]
    log(f"{r} runs as one batched model, {n_params:,} parameters each, on {device} | {total} steps | "
        f"lr {','.join(f'{c.lr:g}' for c in cfgs)} | seeds {','.join(str(c.seed) for c in cfgs)}")
    t_loop = time.time()
    step, errors, steps_done = _group_steps(ens, cfgs, training_batches(cfg, data, device), histories, log)
    wall, rate = time.time() - t_start, step / max(1e-9, time.time() - t_loop)
    out = []
    for i, c in enumerate(cfgs):
        model = ens.member(i)
        out.append((_result(model, c, errors[i], n_params, device, histories[i], steps_done[i], wall, rate,
                            group={"size": r, "index": i}), model))
    return out


def _group_steps(ens, cfgs, batches, histories, log):
    """train_group()'s loop, train()'s for every member at once: one Ensemble step per batch, member
    i at lr_at(step) of its own lr, every live member evaluated every eval_every steps and after the
    last one. Returns (steps done, errors, steps done per member): a member whose loss went NaN/inf
    gets train()'s error and the step it failed at, read at the next evaluation (Ensemble.step never
    waits for the device); the loop stops early once every member has failed."""
    cfg, r, total, since = cfgs[0], len(cfgs), cfgs[0].total_steps(), time.time()
    errors, steps_done, device = [None] * r, [total] * r, ens.flat.device
    lr_table = torch.tensor([[lr_at(step, total, cfg.warmup_frac, cfg.schedule, c.lr) for c in cfgs]
                             for step in range(total)], dtype=torch.float64).to(device)   # (steps, r), one copy
    loss_sum, loss_count = torch.zeros(r, device=device), 0

    def record(step):
        nonlocal loss_sum, loss_count
        for i, (s, loss) in enumerate(zip(ens.failed_step.tolist(), ens.failed_loss.tolist())):
            if s >= 0 and errors[i] is None:
                steps_done[i], errors[i] = s, f"loss is {loss} at step {s} (lr {cfgs[i].lr:g}); run stopped"
                log(f"FAILED: {cfgs[i].name()}: {errors[i]}")
        train_loss = (loss_sum / loss_count).tolist() if loss_count else [None] * r
        for i in range(r):
            if errors[i] is None:
                histories[i].add(ens.member(i), step, train_loss[i])
        loss_sum, loss_count = torch.zeros(r, device=device), 0
        rate, eta = _speed(step, total, since)
        accs = " ".join("failed" if e else f"{h.entries[-1]['acc']:.3f}" for h, e in zip(histories, errors))
        log(f"step {step}/{total} | acc {accs} | {rate:.1f} steps/s ({r * rate:.1f} model-steps/s) | ETA {eta}")

    for m in ens.modules:
        m.train()
    for step in range(total):
        if step % cfg.eval_every == 0:
            record(step)
            if all(errors):
                return step, errors, steps_done
        loss_sum = loss_sum + ens.step(*batches(step), lr_table[step], step)
        loss_count += 1
    record(total)   # the final models are always evaluated, as in train()
    return total, errors, steps_done


def make_step(model, tokens, queries, answers, lr, forward=None):
    """A closure doing one training step of `model` on one batch as train() steps (answer_loss, then
    adamw); it returns the loss. forward(tokens, readout=), if given, stands in for model in the loss
    (`run.py bench` times a naive full-vocabulary head that way)."""
    optimizer = adamw(model, lr)

    def step():
        loss = answer_loss(forward or model, tokens, queries, answers)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss
    return step


def time_group(configs, steps=20):
    """(seconds per training step, seconds per evaluation of one member) of `configs` trained as one
    group on their device (one config: stepped as train() steps it), timed over `steps` steps after
    two untimed ones, and one history_entry. For planning: the models are thrown away."""
    cfgs = _group_of(configs)
    cfg, device = cfgs[0], resolve_device(cfgs[0].device)
    data = make_data(cfg)
    x, q, y = training_batches(cfg, data, device)(0)
    if len(cfgs) == 1:
        model = build(cfg, data.vocab_size).to(device)
        step = make_step(model, x, q, y, cfg.lr)
    else:
        ensemble = Ensemble([build(c, data.vocab_size).to(device) for c in cfgs])
        model, step = ensemble.base, lambda: ensemble.step(x, q, y, [c.lr for c in cfgs], 1)
    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    float(loss.detach().sum())                            # waits for the device
    per_step = (time.perf_counter() - start) / steps
    start = time.perf_counter()
    history_entry(model, data, cfg, 0, None)
    return per_step, time.perf_counter() - start


def plan(configs, group_size=None, jobs=1, warmup_steps=0):
    """How a sweep of `configs` would run: {"runs", "groups", "largest" (members of the largest
    group), "seconds"}, the groups being make_groups(configs, group_size). With warmup_steps > 0,
    "seconds" is the expected wall time on the configs' device: one group per architecture (its widest
    cell, its largest group) is timed (time_group, with jobs > 1 on one thread, as a worker runs),
    every group of that architecture is assumed to cost as much per step and per evaluation, and the
    total is shared by min(jobs, groups) jobs. An estimate (narrower cells cost less), not a promise."""
    groups = make_groups(configs, group_size)
    out = {"runs": len(configs), "groups": len(groups), "largest": max(map(len, groups), default=0), "seconds": None}
    if not (warmup_steps and groups):
        return out
    threads = torch.get_num_threads()
    try:
        if jobs > 1:
            torch.set_num_threads(1)
        timed = {}
        for arch in dict.fromkeys(g[0].arch for g in groups):
            widest = max((g for g in groups if g[0].arch == arch), key=lambda g: (g[0].d_model * g[0].n_layers, len(g)))
            timed[arch] = time_group(widest, warmup_steps)
    finally:
        torch.set_num_threads(threads)
    total = 0.0
    for g in groups:
        per_step, per_eval = timed[g[0].arch]
        steps = g[0].total_steps()
        total += steps * per_step + (steps // g[0].eval_every + 1) * len(g) * per_eval
    out["seconds"] = total / min(jobs, len(groups))
    return out


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
    # the model must read the documents of its own config: a vocabulary smaller than the task's would
    # meet ids it has no embedding for, a larger one would be scored on data it was not trained on
    try:
        task_vocab = probe_task(cfg)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: its task cannot be generated ({' '.join(str(e).split())})") from None
    if model.embed.num_embeddings != task_vocab:
        raise CheckpointError(f"checkpoint {path}: its model has a vocabulary of {model.embed.num_embeddings} "
                              f"tokens but its {cfg.task} task ({cfg.name()}) has {task_vocab}; the config "
                              "does not describe the data this model was trained on")
    return model.to(resolve_device(device)), cfg


# ----------------------------------------------------------------------------------------------
# Sweeps: a grid of runs, one JSON line per finished run, resumable.
# ----------------------------------------------------------------------------------------------

def grid_configs(base_cfg, archs, widths, lrs, seeds):
    """The configs of the grid, in order arch -> width -> lr -> seed."""
    return [replace(base_cfg, arch=arch, d_model=width, lr=float(lr), seed=seed)
            for arch in archs for width in widths for lr in lrs for seed in seeds]


RECORD_CONFIG_KEYS = ("arch", "d_model", "lr", "seed")   # what best_by_lr reads from every record's config


def is_record(x):
    """Whether a parsed results line has the shape of a run record: a dict whose config names its
    arch, width, lr and seed, with status "ok" or "failed" and a parameter count. Valid JSON of
    another shape ({}, null, a list, a line someone else wrote) must not fail the sweep reading it."""
    return (isinstance(x, dict) and isinstance(x.get("config"), dict)
            and all(k in x["config"] for k in RECORD_CONFIG_KEYS)
            and isinstance(x["config"]["lr"], (int, float)) and x.get("status") in ("ok", "failed")
            and isinstance(x.get("n_params"), int))


def read_results(path, warn=True):
    """The run records in a results.jsonl file ([] if absent), in file order (a later record of the
    same run supersedes an earlier one). A line that is not a whole record (a torn line from a crash
    mid-write, garbage, valid JSON of another shape) is skipped with one warning naming the file and
    the line number (none when warn is False)."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record, why = json.loads(line), "valid JSON but not a run record"
            except json.JSONDecodeError:
                record, why = None, "not valid JSON (a torn or corrupt line)"
            if is_record(record):
                records.append(record)
            elif warn:
                print(f"warning: {path}:{i}: {why}; skipped", file=sys.stderr)
    return records


@contextlib.contextmanager
def _file_lock(fd):
    """An exclusive lock on an open file while the block runs (fcntl.flock: processes on this machine,
    and on NFS where the lock manager runs); no lock where fcntl does not exist (Windows)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def append_result(path, record):
    """Append one JSON line, then fsync, so a crash or Ctrl-C leaves either the whole line or nothing
    (plus, at worst, a torn last line that read_results skips). The line always starts on a new line:
    after a torn line or a last line without its newline, a bare append would glue the new record
    onto it and lose both. The check and the write hold the file's lock, so processes sharing the
    file cannot interleave them."""
    line = (json.dumps(_json_safe(record), sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        with _file_lock(fd):
            size = os.fstat(fd).st_size
            if size:
                os.lseek(fd, size - 1, os.SEEK_SET)
                if os.read(fd, 1) != b"\n":
                    line = b"\n" + line
            while line:                       # O_APPEND: every write lands at the end
                line = line[os.write(fd, line):]
            os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------
# Claims: which process trains which run, so that processes sharing one results file (a second
# `run.py` on the same --out, or machines sharing the folder) never train the same run twice.
# A run is claimed by the file <results folder>/claims/<run_hash>.claim, JSON {host, pid, start, name,
# since}, created just before the run starts and removed once its record is in results.jsonl. A claim
# of a process that is gone (same host; the pid is dead, a zombie, or reused by a process that started
# later) is stale and taken over. A claim from another host is trusted until its file is deleted: its
# pid cannot be checked from here.
# ----------------------------------------------------------------------------------------------

CLAIMS = "claims"


def claim_path(results_path, key):
    """The claim file of run `key` of the sweep writing results_path."""
    return os.path.join(os.path.dirname(os.path.abspath(results_path)), CLAIMS, run_hash(key) + ".claim")


def _proc_stat(pid):
    """(state letter, start time in clock ticks since boot) of process pid from /proc, or None where
    /proc cannot tell (no such process, not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields_ = f.read().rsplit(")", 1)[1].split()     # fields 3 ... of proc(5): state, ppid, ...
        return fields_[0], int(fields_[19])                   # field 3 state, field 22 starttime
    except (OSError, ValueError, IndexError):
        return None


def _process_alive(pid, start=None):
    """Whether process pid on this host still runs (a zombie does not), and is the same process
    when its start time is known."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                                   # another user's process: it exists
    except OSError:
        return False
    stat = _proc_stat(pid)
    if stat is None:
        return True
    return stat[0] != "Z" and (start is None or stat[1] == start)


def claim_alive(holder):
    """Whether a claim still belongs to a running process: one on this host that is alive, or any
    claim from another host (trusted; see above)."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = holder.get("pid")
    return isinstance(pid, int) and _process_alive(pid, holder.get("start"))


def _read_claim(path):
    """The claim at path as a dict, or None when there is none or it is unreadable (then stale)."""
    try:
        with open(path) as f:
            holder = json.load(f)
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


@contextlib.contextmanager
def _claims_locked(results_path):
    """The claims folder's lock (claims/.lock) while the block runs: a check and the write that acts on
    it are one step for every process sharing the folder."""
    folder = os.path.dirname(claim_path(results_path, ""))
    os.makedirs(folder, exist_ok=True)
    fd = os.open(os.path.join(folder, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with _file_lock(fd):
            yield
    finally:
        os.close(fd)


def claim(results_path, key, name):
    """Claim run `key` for this process. Returns None when it is now this process's (the claim file
    names this host and pid), or the claim of the live process that holds it (a dict: host, pid,
    name, since). A stale claim is taken over."""
    path = claim_path(results_path, key)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "start": (_proc_stat(os.getpid()) or (None, None))[1],
          "name": name, "since": round(time.time(), 3)}
    with _claims_locked(results_path):
        holder = _read_claim(path)
        if holder is not None and claim_alive(holder) and (holder.get("host"), holder.get("pid")) != (me["host"], me["pid"]):
            return holder
        write_json(path, me)
    return None


def release(results_path, key):
    """Remove run `key`'s claim if it is this process's (never another process's)."""
    path = claim_path(results_path, key)
    with _claims_locked(results_path):
        holder = _read_claim(path)
        if holder is not None and (holder.get("host"), holder.get("pid")) == (socket.gethostname(), os.getpid()):
            os.remove(path)


def drop_stale_claims(results_path):
    """Remove every stale claim of this host (its process is gone), e.g. those of workers just stopped;
    returns how many. Claims of live processes and of other hosts stay."""
    folder = os.path.dirname(claim_path(results_path, ""))
    if not os.path.isdir(folder):
        return 0
    dropped = 0
    with _claims_locked(results_path):
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if name.endswith(".claim"):
                holder = _read_claim(path)
                if holder is None or not claim_alive(holder):
                    os.remove(path)
                    dropped += 1
    return dropped


def is_complete(record, requires=()):
    """Whether a recorded run has everything now asked for: a finished ("ok") run must carry every key
    of `requires` (e.g. "mechanism" when interventions are wanted); a failed run has nothing to add."""
    return record.get("status") != "ok" or all(record.get(k) is not None for k in requires)


def sweep(base_cfg, archs=None, widths=None, lrs=None, seeds=None, *, results_path, jobs=1, after=None,
          log=None, group_size="auto"):
    """Train every (arch, width, lr, seed) of the grid not already in results_path; return the grid's
    records (old and new) in grid order. base_cfg may also be the list of Configs to run (an
    experiment's grid, experiment_configs), and then the grid arguments are not used.

    Each finished run is appended to results_path at once as one JSON line (by the process that trained
    it), so Ctrl-C or SIGTERM loses only the runs in flight. Resume: a run already there (same run_key,
    see KEY_EXCLUDED) is skipped only when its record has everything now asked for: when `after`
    declares the record keys it adds (after.adds, e.g. ("mechanism",)), a finished run recorded
    without them is patched from its checkpoint, or trained again when there is none, and the log
    says so. The same run twice in the grid is done and returned once.

    Several processes may share results_path: each run is claimed just before it starts (claim(); a
    file under claims/ next to results_path), a run claimed by another live process is skipped and
    reported, and records that other processes wrote meanwhile are picked up at the end.

    jobs > 1 trains in that many worker processes ("spawn", one thread each); stopping the sweep stops
    them (no orphans) and drops their claims. after(model, data, cfg, result) -> dict, if given, runs
    in the worker on each successful run and its dict is merged into the record before it is written
    (run.py uses it for the interventions); it must be a module-level function so that it can be
    sent to a worker.

    group_size: runs that differ only in lr and seed are trained as one batched model (train_group)
    in groups of at most group_size (make_groups; None: one group per cell; "auto": 1 on a CPU, where
    every run trains alone, one group per cell elsewhere). A group's records are written when the
    group finishes; `jobs` groups run at once.
    """
    log = log or stderr_log()
    configs = list(base_cfg) if isinstance(base_cfg, (list, tuple)) else \
        grid_configs(base_cfg, archs, widths, lrs, seeds)
    check_runs(configs)                        # bad input fails here, before any training
    requires = tuple(getattr(after, "adds", ())) if after is not None else ()
    os.makedirs(os.path.dirname(os.path.abspath(results_path)), exist_ok=True)
    done, unique, todo = _pending(configs, results_path, requires, log)
    size = default_group_size(configs[0].device) if group_size == "auto" else group_size
    by_key = {key: (key, cfg, previous) for key, cfg, previous in todo}
    groups = [[by_key[run_key(asdict(c.resolved()))] for c in g] for g in make_groups([c for _, c, _ in todo], size)]
    new = _run_groups(groups, after, jobs, results_path, requires)
    _pick_up_claimed(new, unique, results_path, requires, log)
    return [new.get(k) or done[k] for k in unique if k in new or k in done]


def check_runs(configs):
    """Raise ValueError (one line) for the first bad run of `configs`: a bad field (Config.check), a task
    that cannot be generated (probe_task, once per task) or documents longer than the model takes
    (check_length). Cheap: call it before a long sweep. Returns the first run's vocabulary size."""
    for cfg in configs:
        cfg.check()
    vocab = {}
    for cfg in configs:
        if _data_key(cfg) not in vocab:
            vocab[_data_key(cfg)] = probe_task(cfg)
        check_length(cfg)
    return vocab[_data_key(configs[0])] if configs else None


def _pending(configs, results_path, requires, log):
    """(done, unique, todo) of a sweep: the latest record of every run in results_path, by run_key; the
    grid's runs by run_key, each once, in grid order; and (key, config, previous record or None) of
    every run still to do: not recorded, or recorded without what `requires` asks."""
    done = {run_key(record["config"]): record for record in read_results(results_path)}   # later ones win
    unique = {}
    for cfg in configs:
        unique.setdefault(run_key(asdict(cfg.resolved())), cfg)
    if len(unique) < len(configs):
        log(f"sweep: {len(configs) - len(unique)} repeated run(s) in the grid collapsed (same config twice)")
    todo = [(k, cfg, done.get(k)) for k, cfg in unique.items() if not (k in done and is_complete(done[k], requires))]
    if len(todo) < len(unique):
        log(f"sweep: {len(unique) - len(todo)} of {len(unique)} runs already in {results_path}; skipped")
    lacking = [previous for _, _, previous in todo if previous is not None]
    if lacking:
        saved = sum(1 for prev in lacking if prev.get("checkpoint") and os.path.isfile(prev["checkpoint"]))
        log(f"sweep: {len(lacking)} run(s) in {results_path} were recorded without {', '.join(requires)}: "
            f"{saved} will be patched from their checkpoints, {len(lacking) - saved} trained again")
    return done, unique, todo


def _run_groups(groups, after, jobs, results_path, requires):
    """Run a sweep's groups (each a list of (key, config, previous)) here or, with jobs > 1, in that many
    worker processes; {run_key: record}. Stopping the sweep stops the workers and drops their claims."""
    new = {}
    if jobs <= 1 or len(groups) <= 1:
        for group in groups:
            new.update(zip([key for key, _, _ in group], _run_group(group, after, results_path, requires)))
        return new
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool
    _make_data.cache_clear()   # the workers generate their own documents: free the parent's copy
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(groups)), initializer=_worker_init,
                               initargs=(os.getpid(),), mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = {pool.submit(_run_group, group, after, results_path, requires): [key for key, _, _ in group]
                   for group in groups}
        for future in as_completed(futures):
            new.update(zip(futures[future], future.result()))
    except BrokenProcessPool:  # a worker was killed: stop the others, keep what is written
        _stop_workers(pool, results_path)
        raise WorkerLost(f"a worker process died (killed by a signal, or out of memory); finished runs "
                         f"are kept in {results_path}; rerun to continue") from None
    except BaseException:      # Ctrl-C, SIGTERM (run.py raises it as KeyboardInterrupt), a crash
        _stop_workers(pool, results_path)
        raise
    pool.shutdown(wait=True)
    return new


def _pick_up_claimed(new, unique, results_path, requires, log):
    """Replace each "claimed" record of `new` (a run another process held) by the record that process
    has written since; a run it has not finished yet is dropped from `new`, and the log says so."""
    claimed = [key for key in unique if key in new and new[key]["status"] == "claimed"]
    if not claimed:
        return
    latest = {run_key(r["config"]): r for r in read_results(results_path, warn=False)}
    for key in claimed:
        holder = new.pop(key)["claimed_by"]
        if key in latest and is_complete(latest[key], requires):
            new[key] = latest[key]
        else:
            log(f"sweep: {unique[key].name()} is being trained by {holder.get('host')} pid "
                f"{holder.get('pid')}; not done here (rerun once it has finished to include it)")


def _run_group(group, after, results_path, requires):
    """The runs of one group of a sweep, [(key, config, previous record or None)] of configs that differ
    only in lr and seed, in this process or a worker. Each run is claimed (one another live process
    holds comes back as a "claimed" record, untrained) and looked up again (one another process has
    recorded since the sweep read the file comes back as that record); a run recorded without what
    `requires` asks is patched from its checkpoint; the rest train together (train_group; one alone:
    train). `after` is applied, each record appended to results_path, and the claims released: a
    record is written before its claim goes, so no other process sees a run neither claimed nor
    recorded. Returns the records in order. Never raises on a bad run: a crash gives status "error"
    (not saved, so a rerun retries)."""
    records, held, fresh = [None] * len(group), [], []

    def keep(i, record):
        records[i] = record
        if record["status"] != "error":
            append_result(results_path, record)

    try:
        for i, (key, cfg, previous) in enumerate(group):
            holder = claim(results_path, key, cfg.name())
            if holder is not None:
                records[i] = _stub(cfg, "claimed", claimed_by=holder)
                continue
            held.append(key)
            latest = [r for r in read_results(results_path, warn=False) if run_key(r["config"]) == key]
            previous = latest[-1] if latest else previous
            if previous is not None and is_complete(previous, requires):   # recorded meanwhile elsewhere
                records[i] = previous
            elif previous is not None:
                keep(i, _patch(cfg, after, previous) or _train_all([cfg], after)[0])
            else:
                fresh.append(i)
        for i, record in zip(fresh, _train_all([group[i][1] for i in fresh], after)):
            keep(i, record)
    finally:
        for key in held:
            release(results_path, key)
    return records


def _train_all(cfgs, after):
    """The records of runs trained together (train_group; one run: train), `after` applied to each.
    A crash gives each run a record with status "error" (never written, so a rerun retries)."""
    if not cfgs:
        return []
    try:
        pairs = [train(cfgs[0])] if len(cfgs) == 1 else train_group(cfgs)
    except Exception as e:
        traceback.print_exc()
        return [_stub(cfg, "error", error=f"{type(e).__name__}: {e}") for cfg in cfgs]
    return [_apply_after(after, model, cfg, result) for cfg, (result, model) in zip(cfgs, pairs)]


def _patch(cfg, after, previous):
    """previous (a finished run's record that lacks what `after` adds) with `after` applied to the model
    of its checkpoint; None when no checkpoint of this very run is at hand (no file, unreadable, or a
    file of another run with the same name), and then the run is trained again."""
    path = previous.get("checkpoint")
    log = stderr_log(f"[{cfg.name()}] ")
    if after is None or not path or not os.path.isfile(path):
        return None
    try:
        model, saved = load(path, device=resolve_device(cfg.device))
    except (CheckpointError, OSError) as e:
        log(f"checkpoint unusable ({' '.join(str(e).split())}); training the run again")
        return None
    if run_key(asdict(saved.resolved())) != run_key(previous["config"]):
        log(f"{path} holds another run with the same name; training the run again")
        return None
    log(f"recorded without {', '.join(getattr(after, 'adds', ('what is now asked',)))}: patching its saved model {path}")
    return _apply_after(after, model, cfg, {k: v for k, v in previous.items() if k != "after_error"})


def _apply_after(after, model, cfg, record):
    """record (JSON-safe) with after(model, data, cfg, record)'s dict merged in when the run finished;
    an exception in `after` is printed and kept as "after_error" (the training is still worth keeping)."""
    if after is not None and record["status"] == "ok":
        try:
            record.update(after(model, make_data(cfg), cfg.resolved(), record) or {})
        except Exception as e:
            traceback.print_exc()
            record["after_error"] = f"{type(e).__name__}: {e}"
    return _json_safe(record)


def _stub(cfg, status, **fields):
    """The record of a run that has no result: status "error" (it crashed) or "claimed" (another process
    trains it). Neither is ever written to results.jsonl."""
    return {"config": asdict(cfg.resolved()), "name": cfg.name(), "status": status, **fields}


def _worker_init(parent=None):
    """Set up a sweep worker: one torch thread; SIGINT ignored (Ctrl-C reaches the whole process group,
    and the parent, which handles it, stops the workers itself; a worker interrupted on its own would
    only print a traceback); and, given the parent's pid, a watchdog thread that ends the worker when
    its parent is gone (killed with SIGKILL, say), so that no orphan keeps training."""
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent is not None:
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()


def _exit_with_parent(parent, interval=1.0):
    """Poll the parent pid; once this process has been re-parented (its parent died), exit at once."""
    while os.getppid() == parent:
        time.sleep(interval)
    os._exit(1)


def _stop_workers(pool, results_path):
    """Stop a sweep's worker processes now (Ctrl-C, SIGTERM, a crash): SIGTERM each, wait, SIGKILL any
    left, then drop the claims they held. Further SIGINT/SIGTERM are held back meanwhile, so that a
    second signal cannot cut the clean-up short and leave a worker training."""
    processes = list((getattr(pool, "_processes", None) or {}).values())   # no public API before 3.14
    blocked = {signal.SIGINT, signal.SIGTERM}
    masking = hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread()
    if masking:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        for process in processes:
            process.terminate()
        deadline = time.time() + 5
        for process in processes:
            process.join(max(0.0, deadline - time.time()))
            if process.is_alive():
                process.kill()
                process.join(5)
        pool.shutdown(wait=False, cancel_futures=True)
        drop_stale_claims(results_path)
    finally:
        if masking:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class WorkerLost(RuntimeError):
    """A sweep worker process died under the sweep (killed by a signal, or by the out-of-memory killer)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what timeout, SLURM, systemd and kill send) raised in the main thread by
    sigterm_as_interrupt. A KeyboardInterrupt, so that it takes Ctrl-C's path everywhere: a sweep stops
    its workers and drops their claims, finished runs stay in results.jsonl, and a rerun resumes."""


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While the block runs, SIGTERM raises Terminated in the main thread (Python's default for SIGTERM
    is to die at once, leaving a sweep's workers training as orphans); the previous handler comes
    back after. Outside the main thread (no signal handlers there) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def best_by_lr(results, metric="acc"):
    """Per group of runs that differ only in lr and seed (in practice: per (arch, width)), the lr with
    the best mean final `metric` over seeds (the paper: max over learning rates). Returns one row per group:
    arch, d_model, best_lr, mean, std, n_seeds, values (per seed), per_lr {lr: mean}, and the chosen
    run records (`runs`). With a held-out split the choice uses dev accuracy ("acc") and the row also
    carries test_mean (generalisation). Only records with status "ok" or "failed" count
    ("error", "claimed" are not results), and each run once (its last record, e.g. when a results file
    holds it twice). "failed" runs (loss NaN/inf) count with their last metrics (None -> 0) but never
    win: an lr with fewer failed runs always ranks first, so the chosen lr is one whose runs all
    finished whenever one exists, whatever a failed run's last evaluation said."""
    latest = {}
    for r in results:
        if r is not None and r.get("status") in ("ok", "failed"):
            latest[run_key(r["config"])] = r
    groups = {}
    for r in latest.values():
        c = r["config"]
        gkey = run_key({k: v for k, v in c.items() if k not in ("lr", "seed")})
        groups.setdefault(gkey, {}).setdefault(c["lr"], []).append(r)
    rows = []
    for per_lr in groups.values():
        def score(r, m=metric):
            v = (r.get("final") or {}).get(m)
            return v if v is not None else 0.0
        means = {lr: sum(map(score, runs)) / len(runs) for lr, runs in per_lr.items()}
        failed = {lr: sum(r["status"] != "ok" for r in runs) for lr, runs in per_lr.items()}
        best = max(means, key=lambda lr: (-failed[lr], means[lr], -lr))   # ties: the smaller lr
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
# The summary table (run.py prints it for a sweep, and for one --checkpoint).
# ----------------------------------------------------------------------------------------------

def markdown_table(rows, paper=None):
    """The summary table in markdown, one line per row of best_by_lr (plus its "label"): the row's best
    run, as the paper reports the best learning rate, with its mechanism summary; the spread over seeds
    at the chosen learning rate (when some row has several); and the paper's number for the row from
    `paper` ({row label or arch: text}). Test and novel accuracy columns appear when some row has them."""
    lines = []
    for row in rows:
        best = row["best"]
        final, mech = best.get("final") or {}, best.get("mechanism") or {}
        cells = {"architecture": row.get("label", row["arch"]), "parameters": f"{best['n_params']:,}",
                 "accuracy": "failed (NaN)" if best["status"] == "failed" else fmt_pct(final.get("acc"))}
        if any(r["n_seeds"] > 1 for r in rows):
            cells["over seeds"] = fmt_pct(row["mean"], row["std"], row["n_seeds"]) + f" ({row['n_seeds']})"
        if "test_acc" in final:
            cells["test accuracy"] = fmt_pct(final["test_acc"])
        if "novel_acc" in final:
            cells["novel accuracy"] = fmt_pct(final["novel_acc"])
        for name, key in (("Attrib@Key", "attrib_key"), ("Attrib@Value", "attrib_value"), ("Attrib@Query", "attrib_query")):
            cells[name] = fmt_num(mech.get(key))
        if any((r["best"].get("mechanism") or {}).get("conv_next_key") is not None for r in rows):
            cells["conv@next_key"] = fmt_num(mech.get("conv_next_key"))
        cells["verdict"] = mech.get("verdict") or "-"
        if paper is not None:
            cells["paper"] = paper.get(cells["architecture"], paper.get(row["arch"], "-"))
        lines.append(cells)
    columns = list(dict.fromkeys(c for cells in lines for c in cells))   # optional columns of any row
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
                     + ["| " + " | ".join(cells.get(c, "-") for c in columns) + " |" for cells in lines])


def report(records, configs, name, preset, out):
    """The summary of a sweep: the rows of best_by_lr, labelled (row_label), and the text run.py
    prints: the table (markdown_table), a note on what it shows and the timeline (timeline_text), also
    written to out/results_<name>.md; each row's full mechanism copied to out/mechanism_<name>_<row>.json."""
    rows = best_by_lr(records)
    if not rows:
        raise ValueError("no run finished; nothing to report")
    for row in rows:
        row["label"] = row_label(Config(**row["best"]["config"]), configs)
    exp = EXPERIMENTS[name]
    table = markdown_table(rows, exp.paper)
    chosen = ", ".join(f"{row['label']} {row['best']['config']['lr']:g}" for row in rows)
    note = (f"accuracy: final model on {configs[0].eval_size} fresh documents, the best run of the row's grid "
            f"(learning rate: {chosen}); over seeds: mean ± std at that learning rate; Attrib@X: the best "
            f"run's restoration of the clean answer probability (block input of layer 1); paper: "
            f"{exp.section}, its largest width unless it says otherwise.")
    timelines = "\n".join(timeline_text(row) for row in rows)
    with open(os.path.join(out, f"results_{name}.md"), "w") as f:
        f.write(f"# mechsm results: experiment {name}, preset {preset}\n\n{table}\n\n{note}\n\n{timelines}\n")
    for row in rows:
        path = row["best"].get("mechanism_path")
        if path and os.path.exists(path):
            slug = row["label"].replace(" ", "_").replace("(", "").replace(")", "").replace(",", "")
            shutil.copyfile(path, os.path.join(out, f"mechanism_{name}_{slug}.json"))
    return rows, (f"{table}\n{note}\n\ntimeline (step: accuracy, Attrib@Value / Attrib@Query on the first "
                  f"{configs[0].timeline_docs} eval documents; '-' = too little signal to read):\n{timelines}")


def fmt_pct(mean, std=None, n=1):
    """'98.4%', or '50.7% ± 43.9' over n > 1 seeds; '-' when missing."""
    if mean is None:
        return "-"
    return f"{100 * mean:.1f}%" + (f" ± {100 * std:.1f}" if n > 1 else "")


def fmt_num(x):
    return "-" if x is None else f"{x:.2f}"


def timeline_text(row, max_rows=6):
    """The best run's history as one line: 'mamba: 0: 0% -/-; 2000: 45% 0.01/0.97; ...' with at most
    max_rows evaluations (evenly spaced, the last one always kept): accuracy, Attrib@Value/Attrib@Query."""
    history = row["best"].get("history") or []
    keep = sorted({round(i * (len(history) - 1) / max(1, max_rows - 1)) for i in range(max_rows)}) if history else []
    steps = [f"{h['step']}: {fmt_pct(h.get('acc'))} {fmt_attrib(h, 'attrib_value')}/{fmt_attrib(h, 'attrib_query')}"
             for h in (history[i] for i in keep)]
    return f"  {row.get('label', row['arch'])}: " + "; ".join(steps)


def pick_heatmap_row(rows):
    """The row whose heatmap run.py prints: Mamba when it was trained and patched (the paper's central
    contrast: it retrieves directly at the query, and its short conv carries the key forward, which
    its internal sites show), otherwise the most accurate non-attention model, otherwise attention."""
    candidates = [row for row in rows if row["best"].get("mechanism_path")]
    mamba = [row for row in candidates if row["arch"] == "mamba"]
    others = mamba or [row for row in candidates if row["arch"] != "attention"] or candidates
    return max(others, key=lambda row: (row["best"].get("final") or {}).get("acc") or 0) if others else None


# ----------------------------------------------------------------------------------------------
# Interventions after training (run.py's default pipeline), as a sweep `after` hook.
# ----------------------------------------------------------------------------------------------

def run_interventions(model, data, cfg, result):
    """The sweep's `after` hook: patch_model, the full result written to
    <out_dir>/mechanism/<file name>.json when cfg has an out_dir."""
    path = os.path.join(cfg.out_dir, "mechanism", cfg.file_name() + ".json") if cfg.out_dir else None
    return patch_model(model, data, cfg, path)


run_interventions.adds = ("mechanism",)   # what a record must carry to count as patched (sweep's resume)


def patch_model(model, data, cfg, path=None):
    """Run interventions.mechanism on the eval set of a trained model; write the full result to `path`
    (if given) and return {"mechanism": its summary, "mechanism_path": path}."""
    import interventions
    mech = interventions.mechanism(model, data.eval, threshold=cfg.gap_filter)
    if path is not None:
        write_json(path, mech)
    return {"mechanism": mechanism_summary(mech), "mechanism_path": path}


def evaluate_saved(model, cfg, checkpoint, folder, device, eval_size=None, patch=True):
    """The record of a saved model (model, cfg = load(checkpoint, device)) evaluated on its own task as a
    sweep records a run: config, status, n_params, final metrics (eval_size documents; None keeps the
    run's), checkpoint, and with patch its mechanism (patch_model, the full result in
    folder/mechanism.json). The record is written to folder/result.json."""
    cfg = replace(cfg, out_dir=None, device=device, save_checkpoint=False, eval_size=eval_size or cfg.eval_size).check()
    data = make_data(cfg)
    record = {"config": asdict(cfg), "name": cfg.name(), "status": "ok", "n_params": models.count_parameters(model),
              "final": evaluate_all(model, data, novel_masks(cfg, data)), "checkpoint": os.path.abspath(checkpoint)}
    if patch:
        record.update(patch_model(model, data, cfg, os.path.join(folder, "mechanism.json")))
    write_json(os.path.join(folder, "result.json"), record)
    return record


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

