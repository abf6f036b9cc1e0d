"""run.py: train the architectures of one experiment of the paper, patch them, report.

Replicates "Mechanistic evaluation of Transformers and state space models" (Arora et al. 2025,
arXiv 2505.15105): accuracy alone does not tell how a model retrieves; interchange interventions
do (attention, Based: induction through the value token; Mamba: direct retrieval at the query).

What `python run.py` does, in the order of this file's first half:
  1. EXPERIMENTS: the experiment's grid, each cell (a row at one width) at its chosen learning
     rate (CHOSEN), seed 0 (--replicates: every seed, as results/ holds);
  2. one_run: each run trained (mechsm.py, paper Sec. 4), patched (interventions.py, Sec. 3), saved;
  3. the report: a row per cell, every seed counted, beside the paper's numbers;
  4. main: flags -> the grid -> sweep (one_run per run not yet in --out) -> report_grid.
Below the line `# ===== Below` is the engine (command line, records on disk, the sweep's workers
and shards, the READMEs' tables, figures, the benchmark): nothing above needs it to be read.

  python run.py                                    # quick `ar`: attention, Based, Mamba, H3; a job per core
  python run.py --experiment atr-medium            # one result of the paper; --list shows them all
  python run.py --arch attention,mamba --d-model 32,64 --lr 1e-3,3e-3 --seeds 0-2
  python run.py --shard 0/4                        # every 4th run of the grid
  python run.py --checkpoint out/ckpt/<run>.pt     # evaluate + patch a saved model
  python run.py --report results; --figures results   # re-render a results folder from its records
  python run.py --device cuda --preset paper       # the paper's grid on a GPU, a cell batched
  python run.py --device cuda --preset paper --dry-run   # its groups and time, from measured rates
  OMP_WAIT_POLICY=PASSIVE python run.py bench      # batched groups, fast kernels: against references

Shape letters: b batch, l sequence length, d d_model, e Mamba's inner width, n SSM state size,
r runs trained as one batched model. Outputs under --out (default out/): results.jsonl (a JSON line
per run; reruns skip what is there), <experiment>.jsonl (added to, never rewritten), .md, _*.png,
ckpt/. Bad input: one line "error: ..." (exit 2); Ctrl-C (130), SIGTERM (143) keep finished runs.
"""

import argparse
import collections
import contextlib
import difflib
import functools
import glob
import errno
import fcntl
import hashlib
import io
import json
import math
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
import typing
from concurrent.futures import BrokenExecutor, ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, fields, replace
from multiprocessing import get_context
from pathlib import Path

# Before torch's first allocation: the CPU allocator then backs tensors of 2 MB and more with huge
# pages (filling fresh 4 KB pages cost a Mamba scan more than its arithmetic). 0 turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402  (after the allocator setting above)

import interventions  # noqa: E402
import mechsm  # noqa: E402
import models  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


# ===== The experiments
# One per result of the paper, each with a "quick" grid (sized for a 2-core CPU, aiming at 30
# minutes) and a "paper" grid. A grid is {"config": Config fields shared by its runs, "runs": Config
# fields per family of runs (each names its arch), "widths", "lrs", "seeds", "steps"}, the last
# three {arch: ...} where the arch "*" is the default.

ALL_ARCHS = list(models.BUILT_IN_ARCHS)
arch_rank = lambda a: ALL_ARCHS.index(a) if a in ALL_ARCHS else len(ALL_ARCHS)   # tables' order
PAPER_ARCHS = ALL_ARCHS[:6]                  # the paper's six; DeltaNet came in its later version
LR5 = [3e-5, 1e-4, 3e-4, 1e-3, 3e-3]
LR7 = LR5 + [1e-2, 3e-2]

# quick AR: the paper's recipe, but 8 pairs (21 tokens), width 64, one lr per arch, 4k-32k steps
# and QUICK_VOCAB keys and values (README, difference 19; the probes `ar-vocab`). Attention gets the
# most steps: it sits on a "copy any value" plateau for thousands of steps before induction forms.
QUICK_VOCAB = 1024
# The paper's numbers: its text, and at our width (d 64) read from its figure files (tinylang's
# notebooks/figs/: ar_32.pdf, pos_embed.pdf, ar_32_layers_with_3.pdf, mamba_ar_32.pdf, based_ar_32.pdf,
# atr.pdf, atr_gen.pdf; "box": the medians of atr_box.pdf). The PDFs are vector drawings, so these
# are the plotted values (accuracies on 320 documents; the paper's AR: README, difference 19).
WIDTHS = (16, 32, 64, 128, 256)   # the paper's widths d, of WIDTHS_PAPER's numbers
WIDTHS_PAPER = {"attention": "6.56 / 100 / 100 / 100 / 100%", "base_conv": "0 / 0.94 / 3.75 / "
                "6.56 / 9.69%", "based": "24.38 / 93.12 / 99.06 / 98.75 / 99.06%", "h3": "0.94 / "
                "0.62 / 1.88 / 2.50 / 1.56%", "hyena": "0.62 / 0.94 / 2.81 / 13.75 / 29.69%",
                "mamba": "10.00 / 76.88 / 80.62 / 89.69 / 91.25%"}
LATER = {a: "not in the paper's figures (its later version)" for a in ("deltanet", "gated_deltanet")}
QUICK_AR = dict(task="ar", num_keys=QUICK_VOCAB, num_values=QUICK_VOCAB, num_pairs=8, d_model=64,
                n_layers=2, train_size=100_032, steps=6000, eval_every=1000)
QUICK_STEPS = {"attention": 32_000, "mamba": 8000, "based": 8000, "h3": 4000}   # others: 6,000
QUICK_LRS = {"attention": [5e-4], "base_conv": [3e-3], "based": [3e-3], "h3": [1e-3],
             "hyena": [3e-3], "mamba": [1e-2], "deltanet": [1e-3], "gated_deltanet": [1e-3]}
# Each cell (a grid row at one width) has its own rate, chosen as the paper chooses: seed 0 trains at
# the grid's rate x 3^k, k = -1, 0, 1 (2 significant digits), one step more when the best sits at an
# end; the cell's rate is seed 0's best accuracy (ties: the rate nearest the grid's), its other seeds
# train there (README, difference 18).
# What the quick grids train: {experiment: {cell: its chosen rate}} for the cells whose rate is not
# the grid's (every other cell trains at QUICK_LRS'). A test recomputes each from results/ and names
# the entry to change when the records choose otherwise. (A cell's value may grow into a tuple.)
CHOSEN = {
    "ar-widths": {"attention (d 16)": (0.0015, 50_016), "attention (d 128)": 0.00017,
                  "base_conv (d 16)": 0.009, "based (d 16)": (0.027, 32_000),
                  "based (d 32)": 0.009, "based (d 64)": 0.001, "based (d 128)": 0.001,
                  "h3 (d 32)": (0.00099, 32_000), "hyena (d 16)": 0.001, "hyena (d 64)": 0.001,
                  "hyena (d 128)": (0.003, 24_000), "mamba (d 32)": (0.01, 50_016),
                  "mamba (d 16)": (0.01, 16_000), "mamba (d 64)": (0.0033, 50_016), "mamba (d 128)": 0.0033,
                  "deltanet (d 16)": 0.009, "deltanet (d 32)": 0.009},
    "mamba-conv": {"mamba (d_conv 0, d 64)": (0.0011, 16_000), "mamba (d_conv 1, d 64)": (0.0011, 16_000),
                   "mamba (d_conv 2, d 64)": (0.0011, 16_000), "mamba (d_conv 3, d 64)": (0.01, 16_000),
                   "mamba (default conv, d 64)": (0.0033, 50_016)},
    "based-ablation": {"based (long convs only, d 64)": 0.001,
                       "based (d_conv 1, d 64)": (0.001, 16_000),
                       "based (default conv, d 64)": 0.001, "based (d_conv 4, d 64)": 0.001},
    "ar-layers": {"mamba (1 layer, d 64)": (0.0033, 32_000), "attention (1 layer, d 64)": 0.00017,
                  "mamba (2 layers, d 64)": (0.0033, 50_016),
                  "mamba (3 layers, d 64)": (0.01, 32_000)},
    "atr": {"mamba (d 64)": (0.0033, 16_000), "h3 (d 64)": (0.001, 15_000),
            "based (d 64)": (0.009, 36_000), "base_conv (d 64)": (0.009, 16_000),
            "hyena (d 64)": (0.003, 16_000), "gated_deltanet (d 64)": (0.001, 8000)},
    "atr-medium": {"attention (d 64)": (0.00017, 100_032), "mamba (d 64)": (0.01, 16_000)},
    "atr-mamba-conv": {"mamba (d_conv 0, d 64)": (0.0011, 16_000),
                       "mamba (default conv, d 64)": (0.0033, 16_000)},
    "ar": {"mamba (d 64)": (0.0033, 50_016), "gated_deltanet (d 64)": 0.00033,
           "hyena (d 64)": 0.001, "based (d 64)": 0.001,
           "mamba (256 keys, d 64)": (0.0033, 32_000), "hyena (256 keys, d 64)": (0.003, 50_016)},
}
rung = lambda lr, k: float(f"{lr * 3.0 ** k:.2g}")
CAP_STEPS = {"ar": 50_016, "atr": 100_032}   # the paper's budgets: the last rung of a budget ladder
run_score = lambda record: (record["status"] == "ok", record["final"].get("acc") or 0.0)   # a failed run never wins


def within_noise(a, b):
    """Whether two finished runs' accuracies differ by less than two standard errors over their
    evaluation documents (a tie that seed 0 alone cannot decide)."""
    if "ok" != a["status"] or "ok" != b["status"]:
        return False
    pa, pb = (r["final"].get("acc") or 0.0 for r in (a, b))
    return abs(pa - pb) < 2 * math.sqrt((pa * (1 - pa) + pb * (1 - pb)) / a["config"]["eval_size"])


def rate_scores(first, second):
    """({lr: its score}, the tied rates still without a second seed) of {lr: seed 0's record} and
    {lr: seed 1's}: seed 0's (finished, accuracy); where rates tie with seed 0's best (within_noise)
    and each has a seed 1, those rank first, by the mean accuracy of seeds 0 and 1."""
    top = max(first.values(), key=run_score)
    tied = [lr for lr, r in first.items() if within_noise(r, top)]
    missing = [lr for lr in tied if lr not in second] if len(tied) > 1 else []
    decided = lambda lr: len(tied) > 1 and not missing and lr in tied
    mean = lambda lr: statistics.mean(run_score(r)[1] for r in (first[lr], second[lr]))
    return {lr: (run_score(r)[0], decided(lr), mean(lr) if decided(lr) else run_score(r)[1])
            for lr, r in first.items()}, missing


def chosen_lr(lr, seed0, seed1=None):
    """(a cell's rate, the (rate, seed) still to train) from {lr: its seed-0 record}, {lr: its seed-1
    record} and the grid's rate `lr`: the best of x3^k, k = -1, 0, 1 (one step more past a best end),
    None while seed 0 has a rung to train; where rates tie within noise (rate_scores), seed 0's best
    until seed 1 has trained at each, then the best mean of the two."""
    missing = [rung(lr, k) for k in (-1, 0, 1) if rung(lr, k) not in seed0]
    if missing:
        return None, [(r, 0) for r in missing]
    tried = [k for k in (-2, -1, 0, 1, 2) if rung(lr, k) in seed0]
    scores, untied = rate_scores({rung(lr, k): seed0[rung(lr, k)] for k in tried}, seed1 or {})
    best = max(tried, key=lambda k: (*scores[rung(lr, k)], -abs(k)))
    if abs(best) == 1 and 2 * best not in tried:
        return None, [(rung(lr, 2 * best), 0)]
    return rung(lr, best), [(r, 1) for r in untied]


doubled = lambda steps, cap: cap if 2.5 * steps > cap else 2 * steps   # a budget ladder's next rung


def paid(short, long):
    """Whether seed 0's run at twice the steps gained on the shorter one: 2 points of accuracy, or
    5% of evaluation loss; a run that failed or memorised did not."""
    if long["status"] != "ok" or diagnose(long) == "memorised":
        return False
    gain = (long["final"].get("acc") or 0.0) - (short["final"].get("acc") or 0.0)
    return gain >= 0.02 or long["final"]["loss"] <= 0.95 * short["final"]["loss"]


# quick ATR: batches are padded to their longest document, so the quick grids reject sentences over
# 64 terminals (README, difference 14). Step budgets per arch from the probes `atr-budget`.
QUICK_ATR = dict(task="atr", num_terminals=20, max_rhs_len=5, data_seed=125, d_model=64, n_layers=2,
                 train_size=100_032, steps=4000, eval_every=1000, gap_filter=0.1, max_terminals=64)
QUICK_ATR_STEPS = {"attention": 30_000, "mamba": 4000, "based": 18_000, "h3": 7500}  # others: 4000
ATR_BUDGETS = {"attention": (10_000, 30_000), "based": (6000, 18_000), "h3": (2500, 7500)}
PAPER_AR = dict(task="ar", num_keys=4096, num_values=4096, num_pairs=16, n_layers=2, batch_size=32,
                train_size=100_032, epochs=16, eval_every=200)
PAPER_ATR = dict(task="atr", num_terminals=20, max_rhs_len=5, max_depth=10, n_layers=2,
                 batch_size=32, data_seed=125, train_size=100_032, epochs=32, eval_every=200,
                 gap_filter=0.1)
ATR_MEDIUM = dict(max_rhs_len=10, data_seed=124)   # grammar seed 124: lengths near the reference's


# Seeds: a finding is read from a distribution of runs, at least 3 seeds per row, 5 where one run
# is close to a coin toss at CPU scale (Mamba, H3 and Hyena on AR).
SEEDS3, SEEDS5 = [0, 1, 2], [0, 1, 2, 3, 4]
FIRST = ("attention", "based", "mamba", "h3")   # `python run.py` alone: the paper's headline (README),
                                                # at QUICK_VOCAB keys (a run each, 30 minutes on 2 cores)
SEEDS_SENSITIVE = {"mamba": SEEDS5, "h3": SEEDS5, "hyena": SEEDS5, "*": SEEDS3}


def quick(config, runs, widths=(64,), seeds=None, steps=None, **extra):
    steps = steps or (QUICK_ATR_STEPS if config["task"] == "atr" else QUICK_STEPS)
    return dict(config={**config, **extra}, runs=runs, widths=list(widths), lrs=QUICK_LRS,
                seeds=seeds or {"*": SEEDS3}, steps=steps)


def paper(config, runs, widths=WIDTHS, lrs=LR5, **extra):
    return dict(config={**config, **extra}, runs=runs, widths=list(widths), lrs={"*": lrs},
                seeds={"*": [42]})


each = lambda *names, **fields_: [dict(arch=a, **fields_) for a in names]   # a run family per arch
convs = lambda arch, sizes: [dict(arch=arch, d_conv=k) for k in sizes]      # ... per conv size
NOPE_PE = each("attention", pos_emb=False) + each("attention", pos_emb=True)
# ar-vocab: every arch at 512 and 1,024 keys and values, then attention, Based and Mamba probes
VOCAB_RUNS = ([dict(arch=a, num_keys=v, num_values=v) for v in (512, 1024) for a in ALL_ARCHS]
              + each("attention", lr=5e-4, steps=32_000, num_keys=1024, num_values=1024)
              + [dict(arch=a, num_keys=256, num_values=256, **f) for a, f in [
                  ("attention", dict(lr=5e-4)), ("attention", dict(lr=1e-3)),
                  ("attention", dict(lr=5e-4, steps=32_000)), ("based", dict(steps=16_000)),
                  ("mamba", {})]])


@dataclass(frozen=True)
class Experiment:
    name: str
    section: str         # where the paper reports it
    finding: str         # the paper's claim, in one line
    paper_numbers: dict  # table row label (or arch) -> the paper's number / finding for that row
    quick: dict          # the quick grid
    paper: dict          # the paper's grid (preset "paper"; None for a probe: its quick grid)
    probe: bool = False  # a probe that chose a quick setting: its report lists every run


# Longest runs first in each list, so that parallel jobs finish together.
EXPERIMENTS = {e.name: e for e in [
    Experiment("ar", "Sec. 5.1", "AR accuracy and mechanism of every architecture at one width",
               {"attention": "d 64: 100% (d 256: 100%); induction", "base_conv": "d 64: 3.75%",
                "based": "d 64: 99.06% (d 256: 99.06%); induction",
                "mamba": "d 64: 80.62% (d 256: 91.25%); direct retrieval",
                "hyena": "d 64: 2.81% (d 256: 29.69%); direct retrieval",
                "h3": "d 64: 1.88%; direct retrieval", **LATER},
               quick(QUICK_AR, each(*"mamba attention h3 deltanet gated_deltanet hyena based "
                                     "base_conv".split())
                     + each("mamba", "h3", "hyena", num_keys=256, num_values=256),  # difference 19
                     seeds=SEEDS_SENSITIVE),
               paper(PAPER_AR, each(*ALL_ARCHS), lrs=LR7)),
    Experiment("ar-widths", "Sec. 5.1", "AR accuracy against width d",
               {a: f"d 16-256: {v}" for a, v in WIDTHS_PAPER.items()},
               quick(QUICK_AR, each(*PAPER_ARCHS, "deltanet"), widths=(16, 32, 64, 128)),
               paper(PAPER_AR, each(*ALL_ARCHS), lrs=LR7)),
    Experiment("ar-nope", "Sec. 5.1", "attention without position embeddings fails AR",
               {"attention (NoPE)": "d 64: 9.1% (d 256: 5.62%)", "attention (PE)": "d 64: 100%"},
               quick(QUICK_AR, NOPE_PE), paper(PAPER_AR, NOPE_PE)),
    Experiment("ar-layers", "App. D.2, D.3",
               "AR with 1 and 3 layers (1-layer Mamba still learns it)",
               {"mamba (1 layer)": "d 64: 83.12% (d 256: 96.25%)", "mamba (2 layers)": "d 64: 80.62%",
                "mamba (3 layers)": "d 64: 76.56%", "attention (1 layer)": "d 64: 9.06%",
                "attention (2 layers)": "d 64: 100%", "attention (3 layers)": "d 64: 100%"},
               quick(QUICK_AR, [dict(arch=a, n_layers=n) for n in (1, 2, 3)
                                for a in ("mamba", "attention")]),
               paper(PAPER_AR, each(*PAPER_ARCHS, n_layers=1) + each(*PAPER_ARCHS, n_layers=3),
                     lrs=LR7)),
    Experiment("mamba-conv", "Sec. 5.4",
               "Mamba with short-conv sizes 0-4: it needs the conv for AR",
               {"mamba (d_conv 0)": "d 64: 2.81%: fails without the conv", "mamba (d_conv 1)":
                "d 64: 2.19%", "mamba (d_conv 2)": "d 64: 90.94%", "mamba (d_conv 3)": "d 64: 90.94%",
                "mamba (default conv)": "d 64: 80.62% (conv 4); direct retrieval"},
               quick(QUICK_AR, convs("mamba", (0, 1, 2, 3, None))),
               paper(PAPER_AR, convs("mamba", (0, 1, 2, 3, None)), lrs=LR7)),
    Experiment("based-ablation", "Sec. 5.4", "Based with long convs only, and short kernels 1-4",
               {"based (long convs only)": "d 64: 3.75%", "based (d_conv 1)": "d 64: 3.44%",
                "based (d_conv 2)": "d 64: 98.75%", "based (default conv)": "d 64: 99.06% (conv 3); "
                "induction", "based (d_conv 4)": "d 64: 97.19%"},
               quick(QUICK_AR, each("based", long_only=True) + convs("based", (1, 2, None, 4))),
               paper(PAPER_AR, each("based", "base_conv", long_only=True)
                     + convs("based", (1, 2, None, 4)))),
    Experiment("atr", "Sec. 5.2",
               "ATR (L_max 5, |Sigma| 20): accuracy and the same mechanism split as AR",
               {"attention": "d 64: 93.75%; box K .06 V 1.03 Q .05: induction",
                "base_conv": "d 64: 82.50%; box K .50 V .42 Q 0", "based": "d 64: 91.88%; box K .15 "
                "V .93 Q 0: induction", "h3": "d 64: 90.00%; box K .44 V .02 Q .52: direct retrieval",
                "hyena": "d 64: 85.31%; box K .48 V .08 Q .50: direct retrieval (Q .495)",
                "mamba": "d 64: 96.25%; box K .55 V .03 Q .29: held at the key (Sec. 5.2's text: "
                "retrieval at the query)", "gated_deltanet": LATER["gated_deltanet"]},
               quick(QUICK_ATR, each("mamba", "attention", "h3", "hyena", "based", "base_conv",
                                      "gated_deltanet"), seeds={"mamba": SEEDS5, "*": SEEDS3}),
               paper(PAPER_ATR, each(*PAPER_ARCHS))),
    Experiment("atr-medium", "Sec. 5.2", "ATR with L_max 10: Mamba beats attention",
               {"mamba": "d 64: 86.25% (d 256: 92.19%); box K .29 V .03 Q .45",
                "attention": "d 64: 75.62% (d 256: 80.94%); box K .02 V 1.11 Q -.10: induction"},
               quick(QUICK_ATR, each("mamba", "attention"), **ATR_MEDIUM),
               paper(PAPER_ATR, each("attention", "base_conv", "based", "hyena", "mamba"),
                     **ATR_MEDIUM)),
    Experiment("atr-8192", "Sec. 5.2", "ATR over 8,192 terminals (attention)",
               {"attention": "d 64: 89.38%; box K .36 V .90 Q 0: induction"},
               quick(QUICK_ATR, each("attention"), num_terminals=8192),
               paper(PAPER_ATR, each("attention"), num_terminals=8192)),
    Experiment("atr-generalisation", "Sec. 5.3",
               "ATR on held-out (parent, child) label pairs: dev against test",
               {"attention": "d 64: dev 95.00%, test 60.00% (d 256: 95.62%, 68.12%)"},
               quick(QUICK_ATR, each("attention"), holdout=0.2, gap_filter=0.01),
               paper(PAPER_ATR, each("attention"), holdout=0.2, gap_filter=0.01)),
    Experiment("ar-generalisation", "the paper's notebook (not in its text)",
               "AR on held-out (key, value) pairs: dev against test",
               {"attention": "dev 100%, test 100% (ar_gen_dev_test.pdf, width not shown)"},
               quick(QUICK_AR, each("attention"), holdout=0.2),
               paper(PAPER_AR, each("attention"), holdout=0.2, epochs=32)),
    Experiment("atr-mamba-conv", "arXiv v3",
               "Mamba with and without its short conv on ATR (v3: without it, induction)",
               {"mamba (d_conv 0)": "induction (high Attrib@Value)",
                "mamba (default conv)": "atr box K .55 V .03 Q .29: held at the key"},
               quick(QUICK_ATR, convs("mamba", (0, None)), seeds={"*": SEEDS5}),
               paper(PAPER_ATR, convs("mamba", (0, None)))),
    # The probes that chose the quick settings (README, difference 19): run before any table.
    Experiment("ar-vocab", "probe",
               "the quick AR grid at 256, 512 and 1,024 keys and values (which vocabulary?)", {},
               dict(quick(QUICK_AR, VOCAB_RUNS, seeds={"mamba": [0, 1], "*": [0]},
                          steps={**QUICK_STEPS, "attention": 16_000}),
                    lrs={**QUICK_LRS, "attention": [5e-4, 1e-3, 2e-3], "hyena": [1e-3, 3e-3]}),
               None, probe=True),
    Experiment("atr-budget", "probe",
               "the quick ATR grid's step budgets, the first quick grid's against longer", {},
               quick(QUICK_ATR, [dict(arch=a, steps=n) for a, s in ATR_BUDGETS.items() for n in s],
                     seeds={"*": [0]}), None, probe=True),
]}
PRESETS = ("quick", "paper")


def experiment_configs(name, preset="quick", *, archs=None, widths=None, lrs=None, seeds=None,
                       chosen_lrs=True, **fields_):
    """The Configs of an experiment's grid (runs -> widths -> lrs -> seeds), `fields_` set on every
    run; archs / widths / lrs / seeds narrow or replace the grid's (a new arch: a plain run). The
    quick grids train each cell at its CHOSEN rate and steps (lrs: its steps at those rates;
    chosen_lrs=False: the grid's rate and steps)."""
    for param, value, allowed in (("experiment", name, EXPERIMENTS), ("preset", preset, PRESETS)):
        if value not in [*allowed]:                      # a list: unhashable
            raise ValueError(f"{param}: got {value!r}, expected one of {', '.join(allowed)}")
    for param, values in (("archs", archs), ("widths", widths), ("lrs", lrs), ("seeds", seeds)):
        if values is not None and not (isinstance(values, (list, tuple, range)) and values):
            raise ValueError(f"{param}: got {values!r}, expected a non-empty list (None: the grid's)")
    by_list = {"arch": "archs", "d_model": "widths", "lr": "lrs", "seed": "seeds"}
    for field in fields_:
        if field in by_list or field not in {f.name for f in fields(mechsm.Config)}:
            raise ValueError(f"{field}: " + (f"set by {by_list[field]}=[...]" if field in by_list
                                             else "not a mechsm.Config field"))
    spec = getattr(EXPERIMENTS[name], preset) or EXPERIMENTS[name].quick   # a probe: quick
    runs = spec["runs"] if archs is None else [r for r in spec["runs"] if r["arch"] in archs] + [
        dict(arch=a) for a in archs if a not in {r["arch"] for r in spec["runs"]}]
    pick = lambda table, arch, default=None: table.get(arch, table.get("*", default))
    chosen = CHOSEN.get(name, {}) if preset == "quick" and chosen_lrs else {}   # lrs: its steps
    configs = []
    for family in runs:
        arch = family["arch"]
        steps = pick(spec.get("steps", {}), arch)
        base = {**spec["config"], **({"steps": steps} if steps else {}), **family, **fields_}
        family_lrs = lrs or ([family["lr"]] if "lr" in family else pick(spec["lrs"], arch, [1e-3]))
        for width in widths or spec["widths"]:
            for lr in family_lrs:
                choice = chosen.get(cell_name(family, width), lr)     # a rate, or (rate, steps)
                pick_lr, steps = choice if isinstance(choice, tuple) else (choice,
                                                                          base.get("steps"))
                lr = lr if lrs else pick_lr
                configs += [mechsm.Config(**{**base, "d_model": width, "seed": seed, "steps": steps,
                                             "lr": float(lr) if isinstance(lr, (int, float)) else lr})
                            for seed in seeds or pick(spec["seeds"], arch)]
    for cfg in configs:                 # as Config.check, naming the list that set a bad field
        try:
            cfg.check()
        except ValueError as e:
            field = str(e).split(":")[0]
            raise ValueError(f"{by_list.get(field, field)}: {e}" if field in by_list else str(e)) from None
    return configs


# ===== One run: train, patch, record

def timeline(model, data, cfg, step):
    """mechsm.train's on_eval: at each evaluation the headline pair (paper Sec. 4) on
    cfg.timeline_docs eval documents (0: none), so a record shows when its mechanism formed."""
    if not cfg.timeline_docs:
        return {}
    head = interventions.headline(model, data.eval, n_docs=cfg.timeline_docs, threshold=cfg.gap_filter)
    pair = "-" if head["low_signal"] else f"V {fmt_num(head['value'])} Q {fmt_num(head['query'])}"
    print(f"[{cfg.arch} d{cfg.d_model} lr{cfg.lr:g} s{cfg.seed}] step {step} | attrib {pair}",
          file=sys.stderr, flush=True)                      # beside train's line of the step
    return {"attrib_value": head["value"], "attrib_query": head["query"], "attrib_gap": head["gap"],
            "attrib_low_signal": head["low_signal"]}


def patched(model, cfg, dataset):
    """A record's patching fields: the mechanism table, its summary, the minimal circuit, the
    effective attention."""
    table = interventions.mechanism(model, dataset, threshold=cfg.gap_filter)
    maps = all(type(b.mixer).effective_map is not models.Mixer.effective_map for b in model.blocks)  # optional
    head = table.get("headline") or table.get("mixer_out") or {}
    summary = {**{f"attrib_{k}": head.get(k) for k in ATTRIBS},
               **{k: table.get(k) for k in ("verdict", "p_clean", "p_corrupt", "low_signal")},
               **table.get("extra", {})}
    return json_safe({"mechanism": summary, "mechanism_table": table,
                      "circuit": interventions.minimal_circuit(model, dataset, threshold=cfg.gap_filter),
                      "effective": interventions.effective_record(model, dataset) if maps else None})


def one_run(cfg, out, patch, save):
    """One run: train `cfg` (mechsm.train, paper Sec. 4), patch the trained model (Sec. 3) and save
    it under OUT/ckpt/: its record, one JSON line of OUT/results.jsonl."""
    record, model = mechsm.train(cfg, on_eval=timeline)
    return finish(record, model, out, patch, save)


def finish(record, model, out, patch, save):
    """A trained run's record, patched and saved; a part that fails (a full disk) costs that part."""
    cfg, ok = config_of(record), record["status"] == "ok"
    if ok and patch and not record.get("mechanism_table"):
        try:
            record.update(patched(model, cfg, mechsm.make_data(cfg).eval))
        except Exception as e:
            recorded_without(cfg, "not patched (a rerun patches it from its checkpoint)", e)
    if ok and save and not record.get("checkpoint"):
        path = os.path.join("ckpt", cfg.name() + ".pt")      # unique per run
        try:
            mechsm.save(model, cfg, out_path(out, path))
            record["checkpoint"] = path
        except Exception as e:
            recorded_without(cfg, "checkpoint not saved", e)
    record.setdefault("checkpoint", None)
    record.setdefault("provenance", provenance())
    return json_safe(record)


# ===== The report
# The best run per row (the paper reports the best learning rate) beside the paper's numbers.

budget_of = lambda record: record.get("total_steps") or record["config"].get("steps") or 0   # its steps


def best_by_lr(records, ladder=True, choices=None):
    """A row per cell (runs differing only in lr, seed and, with `ladder`, steps) at its chosen
    (rate, budget) in `choices` ({cell_key with steps None: (lr, steps)}, ladder_choices) where
    the records hold it; else at the steps with the most seeds (ties: the shorter), there at the
    lr whose first seed is the most accurate (as chosen_lr, rate_scores; a failed run never wins;
    ties: the lr with the most seeds, then, as chosen_lr, the one nearest the ladder's middle, then
    the smaller):
    arch, d_model, best_lr, runs (best_lr's seeds), best (of them), label, first ({lr: the first
    seed's record}), budgets ({steps: the first seed's best record}), ladder ({steps: the first
    seed's record at best_lr})."""
    groups, configs = {}, [config_of(r) for r in records]
    for r in latest(records):
        groups.setdefault(cell_key({**r["config"], "steps": None} if ladder else r["config"]), []).append(r)
    rows = []
    for key, runs in groups.items():
        seed = min(r["config"]["seed"] for r in runs)
        firsts = [r for r in runs if r["config"]["seed"] == seed]
        budgets = {s: max((r for r in firsts if budget_of(r) == s), key=run_score)
                   for s in sorted(set(map(budget_of, firsts)))}
        seeds_at = {s: len({r["config"]["seed"] for r in runs if budget_of(r) == s}) for s in budgets}
        choice = (choices or {}).get(key)
        if choice not in {(r["config"]["lr"], budget_of(r)) for r in runs}:     # not trained there
            choice = None
        budget = choice[1] if choice else min(s for s, n in seeds_at.items() if n == max(seeds_at.values()))
        per_lr = {}
        for r in runs:
            if budget_of(r) == budget:
                per_lr.setdefault(r["config"]["lr"], []).append(r)
        first, second = ({lr: r for lr, rs in sorted(per_lr.items()) for r in rs if r["config"]["seed"] == s}
                         for s in (seed, seed + 1))
        scores = rate_scores(first, second)[0] if first else {}
        mid = statistics.mean(math.log(lr) for lr in per_lr)    # as chosen_lr: nearest the grid's
        near = lambda lr: -round(abs(math.log(lr) - mid) / math.log(3), 1)
        rank = lambda lr: (scores.get(lr, (False, False, -1.0)), len(per_lr[lr]), near(lr), -lr)
        best_lr = choice[0] if choice else max(per_lr, key=rank)
        best = max(per_lr[best_lr], key=lambda r: (run_score(r), -r["config"]["seed"]))
        rows.append({"arch": best["config"]["arch"], "d_model": best["config"]["d_model"],
                     "best_lr": best_lr, "runs": per_lr[best_lr], "best": best, "first": first,
                     "budget": budget, "budgets": budgets, "records": sum(map(len, per_lr.values())),
                     "ladder": {budget_of(r): r for r in firsts if r["config"]["lr"] == best_lr},
                     "label": row_label(config_of(best), configs, ladder)})
    return sorted(rows, key=lambda r: (arch_rank(r["arch"]), r["arch"], r["d_model"]))


def ladder_choices(name, records):
    """{cell_key with steps None: (rate, steps)}: what the ladders (cell_choice) chose from `records`
    for each cell of experiment `name`'s quick grid (the grid's own where they chose nothing); {} for
    a probe."""
    done, choices = by_run(records), {}
    for base in [] if EXPERIMENTS[name].probe else experiment_configs(name, seeds=[0], chosen_lrs=False):
        choice = cell_choice(base, done)[0] or (base.lr, base.steps)
        choices[cell_key({**asdict(base.resolved()), "steps": None})] = choice
    return choices


rows_of = lambda name, records: best_by_lr(records, not EXPERIMENTS[name].probe,   # the report's rows
                                           ladder_choices(name, records))
fmt_pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"
fmt_num = lambda x: "-" if x is None else f"{x:.2f}"
fmt_rung = lambda r: fmt_pct(r["final"].get("acc")) if r["status"] == "ok" else r["status"]   # seed 0 at a rate
# a spread's (below) accuracies: '50.0% (0.9-84.4)'; verdicts, most frequent first, with where the
# no-signal runs lean: 'induction 4/5, no signal 1/5, leans query 1/5'; diagnoses: 'learned 5/5'
fmt_acc = lambda s: fmt_pct(statistics.median(s["acc"])) + (
    f" ({100 * s['acc'][0]:.1f}-{100 * s['acc'][-1]:.1f})" if len(s["acc"]) > 1 else " (1 seed)")
tally = lambda counts, n, pre="": ", ".join(f"{pre}{k} {v}/{n}" for k, v in counts.most_common())
fmt_counts = lambda s: ", ".join(filter(None, (tally(s["verdicts"], s["n"]),
                                               tally(s["leans"], s["n"], "leans "))))
# a row's training: what its budget ladder found (climb), then each seed's history (diagnose)
fmt_training = lambda row, s: "; ".join(filter(None, (climb(row) or "one budget",
                                                      tally(s["diagnoses"], s["n"]))))
laddered = lambda row: len(row.get("budgets") or ()) > 1       # seed 0 trained at several budgets
# a cell's budget ladder, seed 0's best at each budget, what it read and (Mamba) its extra sites:
# '8,000: 69.1%, direct retrieval, conv@next_key 0.98, still learning · **16,000**: ...'
extras = lambda r: [f"{k} {fmt_num(v)}" for k, v in (r.get("mechanism") or {}).items() if "@" in k]
fmt_budgets = lambda row: " · ".join((f"**{s:,}**" if s == row["budget"] else f"{s:,}") + ": " + ", ".join(
    filter(None, [fmt_rung(r), verdict_of(r), *extras(r), diagnose(r)])) for s, r in row["budgets"].items())


# a record's attrib_key / _value / _query: their names in the tables and colours in the figures
ATTRIBS = {"key": ("Attrib@Key", "tab:green"), "value": ("Attrib@Value", "tab:red"),
           "query": ("Attrib@Query", "tab:blue")}
UNREADABLE = ("no signal", "failed", "n/a (1 layer)", "-")   # verdicts that give no attribution


def lean(record):
    """Where a run with no signal points (the site of its largest attribution), or None where its gap
    P̄_clean − P̄_corrupt (signed: a negative one never leans) is within a bound on its standard
    error over the documents: noise (a mean of values in [0, 1] with mean p has standard deviation
    at most sqrt(p (1 - p))). Twice the bound could never be passed by a gap under the 0.01 filter
    at 320 documents (it is at least 4/320)."""
    table = record["mechanism_table"]
    if None in (table.get("gap"), table.get("p_clean"), table.get("p_corrupt"), *table["headline"].values()):
        return None                                   # a run whose weights went NaN
    sd = lambda p: math.sqrt(max(p * (1 - p), 0.0))
    noise = (sd(table["p_clean"]) + sd(table["p_corrupt"])) / math.sqrt(table["n_docs"])
    return max(ATTRIBS, key=table["headline"].get) if table["gap"] > noise else None


def verdict_of(record):
    """A record's verdict by today's rule from its stored table; None if unpatched."""
    table = record.get("mechanism_table")
    if record["status"] != "ok":
        return "failed"
    if not table:
        return None
    if not table.get("headline"):
        return "n/a (1 layer)"                       # no layer-1 block input to read
    low = interventions.no_signal(table.get("gap"), table["threshold"])
    return interventions.verdict(table["headline"], low, table["threshold"])[0]


def spread(row):
    """A row's distribution over its seeds: n, accuracies, verdicts, where the runs with no signal
    lean (the site of the largest attribution), diagnoses, the readable ones' medians."""
    runs = row["runs"]
    verdicts = [verdict_of(r) or "-" for r in runs]
    readable = [r for r, v in zip(runs, verdicts) if v not in UNREADABLE]
    heads = [r["mechanism_table"]["headline"] for r in readable]
    return {"n": len(runs), "acc": sorted(r["final"].get("acc") or 0.0 for r in runs),
            "verdicts": collections.Counter(verdicts), "readable": len(readable),
            "leans": collections.Counter(filter(None, (lean(r) for r, v in zip(runs, verdicts)
                                                        if v == "no signal"))),
            "diagnoses": collections.Counter(filter(None, map(diagnose, runs))), "median": {
                k: statistics.median(h[k] for h in heads) if heads else None for k in ATTRIBS}}


def result_table(rows, experiment=None):
    """best_by_lr's rows: each one's seeds' distribution and (given `experiment`) the paper's."""
    cells = []
    for row in rows:
        best, s = row["best"], spread(row)
        tried = row.get("first") or {best["config"]["lr"]: best}     # {lr: its first seed's record}
        c = {"architecture": row["label"], "parameters": f"{best['n_params']:,}", "lr": " · ".join(
            (f"**{lr:g}**" if lr == best["config"]["lr"] else f"{lr:g}") + f": {fmt_rung(r)}" * (len(tried) > 1)
            for lr, r in tried.items()),
             "steps": fmt_budgets(row) if laddered(row) else f"{budget_of(best):,}",
             "seeds": s["n"], "accuracy: median (range)": fmt_acc(s)}
        c.update({k.replace("_acc", " accuracy"): fmt_pct(statistics.median(r["final"].get(k) or 0.0
                  for r in row["runs"])) for k in ("test_acc", "novel_acc") if k in best["final"]})
        c.update({name: "n/a" if best["config"]["n_layers"] == 1 else fmt_num(s["median"][k])
                  for k, (name, _) in ATTRIBS.items()})
        mechs = [r.get("mechanism") or {} for r in row["runs"]]
        for name in [k for k in best.get("mechanism") or {} if "@" in k]:  # the mixer's extras
            c[name] = " / ".join("-" if m.get("low_signal") else fmt_num(m.get(name)) for m in mechs)
        c["verdicts"], c["training"] = fmt_counts(s), fmt_training(row, s)
        if any(r.get("circuit") for row in rows for r in row["runs"]):     # else no column
            found = row_circuit(row)
            c["circuit (the median seed's; seeds sharing it)"] = \
                f"{circuit_words(found[0])} ({found[1]}/{found[2]})" if found else "-"
        if experiment is not None:
            c["paper"] = paper_text(experiment, row) or "-"
        cells.append(c)
    return markdown(cells)


def paper_cell(name, row):
    """The paper's number for a row at its width, and its reading: '80.62%; direct retrieval'."""
    text = paper_text(name, row) or ""
    if text.startswith("d 16-256"):                            # WIDTHS_PAPER: one number a width
        number = text[10:-1].split(" / ")[WIDTHS.index(row["d_model"])] + "%"
    else:
        number = next(iter(re.findall(r"[\d.]+%", text)), "")
    reading = next((r for r in interventions.READINGS.values() if r in text),
                   "fails" * ("fails" in text))
    return "; ".join(filter(None, (number, reading))) or "-"


def short_table(rows, name):
    """The one short table, a row per cell (`python run.py` prints it, the READMEs and each .md
    open with it): its rate and budget, every seed's accuracy, the median attributions, the
    verdicts, the paper's number and reading, and whether ours bears that out (holds)."""
    cells = []
    for row in rows:
        s, one = spread(row), row["best"]["config"]["n_layers"] == 1
        c = {"architecture": row["label"], "lr": f"{row['best_lr']:g}",
             "steps": f"{budget_of(row['best']):,}", "accuracy: median (range)": fmt_acc(s)}
        if "test_acc" in row["best"]["final"]:
            c["test accuracy"] = fmt_pct(statistics.median(r["final"].get("test_acc") or 0.0
                                                           for r in row["runs"]))
        c.update({label: "n/a" if one else fmt_num(s["median"][k])
                  for k, (label, _) in ATTRIBS.items()})
        c["verdicts"] = tally(s["verdicts"], s["n"])
        c["paper"] = paper_cell(name, row)
        c["holds?"] = holds(paper_text(name, row) or "", s)
        cells.append(c)
    return markdown(cells)


def circuit_words(circuit, restored=True):
    """interventions.minimal_circuit's members in words, input to output, and what they restore:
    'embed@key > L0 mixer@value > L1 mixer@query: 93%'; 'none' when it has none (its reason);
    'none reaches 90% (best: ...: 0%)' when its nodes fall short of its target."""
    name = lambda site: "embed" if site == "blocks.0.hook_resid_pre" else \
        f"L{interventions.site_layer(site)} {site.split('.')[2]}"
    words = " > ".join(f"{name(site)}@{role}" for site, role in circuit["members"]) or "none"
    if circuit["members"] and circuit["restored"] < circuit["target"]:
        return (f"none reaches {100 * circuit['target']:.0f}% (best: {words}: "
                f"{100 * circuit['restored']:.0f}%)")
    return words + (f": {100 * circuit['restored']:.0f}%" if restored and circuit["members"] else "")


def row_circuit(row):
    """(the circuit of a row's median-accuracy seed among its seeds with one, how many of those
    share its members, how many there are); None when none has one."""
    runs = sorted((r for r in row["runs"] if r.get("circuit")), key=lambda r: r["final"].get("acc") or 0)
    if runs:
        mid = runs[(len(runs) - 1) // 2]["circuit"]
        return mid, sum(r["circuit"]["members"] == mid["members"] for r in runs), len(runs)


# ===== main: the story of `python run.py`

def report_grid(name, preset, records, out):
    """Add the records not already in OUT/<name>.jsonl (never rewritten); of all its runs draw the
    figures, write OUT/<name>.md, print its table, timeline and a heatmap."""
    path = out_path(out, f"{name}.jsonl")
    with locked(out):                    # another command's records, added meanwhile, are seen
        kept = by_run(read_results(path))
        for record in records:
            if kept.get(run_key(record["config"])) != record:
                append_result(path, record)
    rows, text = render(name, preset, read_results(path, warn=False), out)
    if draw_figures(rows, name, out) is None:
        print(FIGURES_HINT, file=sys.stderr)
    mechsm.write_whole(out_path(out, f"{name}.md"), text.encode())
    print(short_table(rows, name)
          + f"\n\ndetails (every rate tried, circuits, timelines): {name}.md")
    print_heatmap(rows)   # of the most accurate run with an extra site, else the most accurate


def main(argv=None):
    """`python run.py [flags]`: train an experiment's grid, patch each run, report it beside the
    paper. Exit status: 0 ok, 1 a run crashed or a worker died, 2 bad input, 130 Ctrl-C, 143 SIGTERM."""
    with exit_status() as status:          # bad input: one line; Ctrl-C, SIGTERM: finished runs kept
        args = build_parser().parse_args(argv)
        if other_command(args):                  # bench, --list, --figures, --report, --checkpoint
            return 0
        status.training = True
        t0, name, out = time.time(), args.experiment or args.task or "ar", args.out or "out"
        device = mechsm.resolve_device(args.device or "auto")
        configs, notes = grid_runs(args, name, device)    # the catalogue's grid, narrowed by flags
        check_runs(configs)                               # bad input: one line, before any training
        jobs, shard, group_size = sweep_plan(args, name, configs, device, notes, out)   # printed
        if shard[0] >= len(set(map(config_key, configs))):
            print(f"shard {shard[0]}/{shard[1]}: the grid's runs are all other shards'; nothing "
                  "to do", file=sys.stderr)
            return 0
        before = by_run(read_results(out, warn=False))
        options = dict(jobs=jobs, shard=shard, patch=not args.no_interventions,
                       save=not args.no_save, group_size=group_size, captured=bool(args.cuda_graph))
        if args.choose_lr:              # in rounds: each cell's rates at seed 0, then its seeds
            configs = choose_lrs(configs, out, **options)
        records = sweep(configs, out, **options)          # one_run per run not yet in out
        if not records:
            raise ValueError("no run finished; nothing to report")
        trained = sum(before.get(run_key(r["config"])) != r for r in records)
        if trained:                                       # OUT/<name>.command.json: how to redo it
            record_command(argv, out, name, trained, jobs, time.time() - t0)
        report_grid(name, args.preset or "quick", records, out)
        missing = len(set(map(config_key, configs))) - sum(   # or to patch
            args.no_interventions or r["status"] != "ok" or bool(r.get("mechanism_table")) for r in records)
        print(f"\n{len(records)} runs in {out}/ ({name}.md, results*.jsonl)" + (
            f"; {missing} still to train or patch (other shards, or runs that crashed)" if missing else "")
            + f" | total wall time {time.time() - t0:.1f}s", file=sys.stderr)
        return 1 if missing and shard[1] == 1 else 0
    return status.code


# ===== Below: machinery a learner can skip (workers, shards, README, figures, benchmark) =====


# --- The grid's helpers

def cell_choice(cfg, done):
    """((rate, steps) chosen so far, or None; the (rate, steps, seed) still to train) of cfg's cell
    (cfg at the grid's rate and steps) from its records in `done` ({run_key: record}): the rate
    ladder (chosen_lr) at the grid's steps; then the budget ladder: seed 0 at that rate trains at 2x,
    4x, ... the steps, up to the paper's (CAP_STEPS), while the doubled run (or a longer one
    recorded) gains (paid), or until it is at 98%; where the budget grew 4x or more, the rate ladder
    runs again there and the budget climbs on from it; where the doubled run never left the start,
    the rate ladder runs at that budget, and a rate that beats the choice (paid) climbs on from it
    (README, difference 18)."""
    at = lambda lr, steps, seed=0: done.get(config_key(replace(cfg, lr=lr, steps=steps, seed=seed)))
    cap, lr, steps, choice, ties, floor = CAP_STEPS[cfg.task], cfg.lr, cfg.steps, None, [], None
    while True:
        ladder = lambda seed: {rung(lr, k): r for k in (-2, -1, 0, 1, 2)
                               if (r := at(rung(lr, k), steps, seed))}
        lr, untried = chosen_lr(lr, ladder(0), ladder(1))
        if lr is None:
            return choice, ties + [(r, steps, seed) for r, seed in untried]
        ties += [(r, steps, seed) for r, seed in untried]     # seed 1 to break a tie: lr provisional
        if floor and not paid(floor, at(lr, steps)):         # no rate beat the choice where it stalled
            return choice, ties
        choice, start, floor, stalled = (lr, steps), steps, None, False
        while steps < cap and run_score(now := at(lr, steps)) < (True, 0.98):
            rungs = [doubled(steps, cap)]          # the doubled run, then any longer one recorded
            while rungs[-1] < cap:
                rungs.append(doubled(rungs[-1], cap))
            if at(lr, rungs[0]) is None:
                return choice, ties + [(lr, rungs[0], 0)]
            paying = [s for s in rungs if (longer := at(lr, s)) and paid(now, longer)]
            if not paying:
                stalled = diagnose(at(lr, rungs[0])) == "never left the start"
                break
            steps = paying[0]
            choice = lr, steps
        if stalled:                  # the rate, not the budget, failed there: the rates around it run
            floor, steps = at(lr, steps), rungs[0]
        elif steps < 4 * start:
            return choice, ties


def climb(row):
    """What a cell's budget ladder found, from seed 0 at the row's rate at each budget it trained
    there (best_by_lr's row["ladder"]; row["budgets"]: the budgets seed 0 trained at any rate) and
    the row's budget N: "at 98% or more by N", "memorised at N", "never left the start at N",
    "converged at N" (no longer run at that rate gained: paid), "not converged at the cap", "not
    converged at N" (cut off while a doubling still paid, or none ran), or None (one budget)."""
    ladder, n = row.get("ladder") or {}, row.get("budget")
    if len(row.get("budgets") or ()) < 2 or n not in ladder:
        return None
    if run_score(ladder[n]) >= (True, 0.98):
        return f"at 98% or more by {n:,}"
    if (found := diagnose(ladder[n])) in ("memorised", "never left the start"):   # no longer run mends it
        return f"{found} at {n:,}"
    if any(s > n for s in ladder) and not any(paid(ladder[n], ladder[s]) for s in ladder if s > n):
        return f"converged at {n:,}"
    return "not converged at the cap" if n >= CAP_STEPS[row["best"]["config"]["task"]] else \
        f"not converged at {n:,}"


def cell_name(family, width):
    """A grid cell's name in CHOSEN: 'mamba (d_conv 2, d 64)'."""
    words = [describe(k, v) for k, v in family.items() if k not in ("arch", "num_values")]
    return f"{family['arch']} ({', '.join(filter(None, words + [f'd {width}']))})"


def copy_guess(cfg):
    """The accuracy of guessing any value of the context: 1/pairs on AR; on ATR the mean over the
    evaluation documents (the training set not made) of 1 / the sentence's distinct terminals."""
    if cfg.task == "ar":
        return 1 / cfg.num_pairs
    data = mechsm.make_documents(mechsm.data_key(replace(cfg, train_size=4))).eval     # cached
    return statistics.mean(1 / len(set(doc[1:end].tolist())) for doc, end in zip(data.tokens,
                                                                                 data.positions["divider"]))


def diagnose(record, *, start_margin=0.07, memorised_gap=2.0, fall=0.25, rise=0.05, learned=0.95,
             plateau=1.5):
    """What one run's history shows (a detail: whether a longer run gains is climb's to say): the
    first case that holds of the rule in results/README.md ("How training went"), its thresholds
    these keywords (None: no history)."""
    final = record["final"]
    history = [h for h in record.get("history") or [] if None not in map(h.get, ("acc", "loss"))]   # what it reads
    trained = [h for h in history if h.get("train_loss") is not None]
    if record["status"] != "ok" or not trained or None in map(final.get, ("acc", "loss", "train_loss")):
        return None
    if final["acc"] >= learned:
        return "learned"
    if len(trained) < 3:                        # a start, a last quarter and an end to compare
        return "too few evaluations"
    at = lambda runs, part: ([h for h in runs if h["step"] <= part * runs[-1]["step"]] or runs)[-1]
    if final["train_loss"] >= (1 - start_margin) * trained[0]["train_loss"]:
        return "never left the start"
    if final["loss"] - final["train_loss"] >= memorised_gap and final["loss"] > at(history, 2 / 3)["loss"]:
        return "memorised"                               # before the copy guess it explains
    fell = at(trained, 3 / 4)["train_loss"] - final["train_loss"]
    rose = final["acc"] - at(history, 3 / 4)["acc"]
    if fell >= fall or rose >= rise:
        return "still learning"
    guess = copy_guess(config_of(record))          # on ATR: made from the evaluation documents
    if final["acc"] < plateau * guess and final["loss"] <= plateau * -math.log(guess):
        return "near the copy guess"
    return "slowing"


def paper_text(name, row):
    """The paper's text for a row of experiment `name` (by its label, else its arch), or None."""
    numbers = EXPERIMENTS[name].paper_numbers
    return numbers.get(row["label"], numbers.get(row["arch"]))


def describe(name, value):
    """A Config field's value in a row label: 'd 32', '1 layer', 'NoPE', 'default conv', ..."""
    words = {"d_model": f"d {value}", "n_layers": f"{value} layer{'s' * (value != 1)}",
             "pos_emb": "PE" if value else "NoPE", "num_keys": f"{value} keys",
             "long_only": "long convs only" if value else None, "steps": f"{value} steps",
             "d_conv": "default conv" if value is None else f"d_conv {value}"}
    return words.get(name, f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}")


def row_label(cfg, configs, ladder=True):
    """cfg's arch and each Config field varying among its arch's `configs` (but the run's own: lr,
    seed and, on a budget `ladder`, steps; a field that follows one before it, as num_values
    follows num_keys, once), in Config's order but d_model first: 'mamba (d_conv 0)'."""
    cfg = cfg.resolved()
    same_arch = [c.resolved() for c in configs if c.arch == cfg.arch]
    own = {"arch", "lr", "seed", "device", *["steps"] * ladder}
    names = ["d_model"] + [f.name for f in fields(mechsm.Config) if f.name not in own | {"d_model"}]
    kept = []
    for name in names:                    # kept when it splits runs the fields before it do not
        split = lambda keys: len({tuple(getattr(c, k) for k in keys) for c in same_arch})
        if split(kept + [name]) > split(kept) and not (name == "d_conv" and cfg.long_only):
            kept.append(name)
    parts = list(filter(None, [describe(name, getattr(cfg, name)) for name in kept]))
    return cfg.arch + (f" ({', '.join(parts)})" if parts else "")


def catalogue():
    """`--list`: each experiment, its claim, the paper's numbers, each preset's runs."""
    lines = []
    for name, exp in EXPERIMENTS.items():
        sizes = [f"{preset}: {len(experiment_configs(name, preset))} runs" for preset in PRESETS]
        numbers = "; ".join(f"{k} {v}" for k, v in exp.paper_numbers.items()) or "no number quoted"
        lines += [f"{name:<19} {exp.section}: {exp.finding}", f"{'':<19} paper: {numbers}",
                  f"{'':<19} " + " | ".join(sizes)]
    return "\n".join(lines)


def print_heatmap(rows):
    """Print the patching heatmap of the most accurate run with an extra site, else the most accurate."""
    tables = [row for row in rows if row["best"].get("mechanism_table")]
    if tables:
        pick = max(tables, key=lambda row: (bool(row["best"]["mechanism_table"].get("extra")),
                                            row["best"]["final"].get("acc") or 0))
        print(f"\nheatmap of {pick['label']} (the most accurate model with an extra site, else "
              "the most accurate):\n" + interventions.render_heatmap(pick["best"]["mechanism_table"]))


def markdown(cells, columns=None):
    """A markdown table of dicts, one per row (missing cells: '-'); columns default to every key."""
    columns = columns or dict.fromkeys(k for c in cells for k in c)
    rows = [" | ".join(str(r.get(c, "-")).replace("|", "\\|") for c in columns) for r in cells]
    return "\n".join([f"| {' | '.join(columns)} |", "|---" * len(columns) + "|"]
                     + [f"| {row} |" for row in rows])


def widest_rows(rows):
    """{label less its width ('attention (d 16, NoPE)' -> 'attention (NoPE)'): its widest row}."""
    keep = {}
    for row in rows:
        d = row["d_model"]
        label = row.get("label", row["arch"]).replace(f"d {d}, ", "").replace(f" (d {d})", "")
        keep[label] = max(keep.get(label, row), row, key=lambda r: r["d_model"])
    return keep


# --- Records: a JSON line per run

DEFAULTS = {f.name: f.default for f in fields(mechsm.Config) if f.name != "device"}


def run_key(config):
    """The identity of a run, old or new: canonical JSON of its (resolved) config less the device (where
    it ran is not what it is), a field Config lacks dropped (read_results names it), one missing at its default."""
    return json.dumps({k: config.get(k, v) for k, v in DEFAULTS.items()}, sort_keys=True)


cell_key = lambda config: run_key({k: v for k, v in config.items() if k not in ("lr", "seed")})   # its cell
config_key = lambda cfg: run_key(asdict(cfg.resolved()))   # a Config's run_key
by_run = lambda records: {run_key(r["config"]): r for r in records}   # {run_key: each run's last record}


def config_of(record):
    """The Config of a record (fields that Config no longer has are dropped)."""
    return mechsm.Config(**{k: v for k, v in record["config"].items() if k in DEFAULTS or k == "device"})


finite = lambda v: v is None or isinstance(v, (int, float)) and math.isfinite(v)   # a bool is an int


def readable(record):
    """Whether a line is a run record the reports and figures can read: a status, a config naming
    its arch, a number wherever they read one (a string there would stop a report, a NaN or inf
    accuracy top a table without a word), and its table and circuit read by what reads them."""
    try:
        config, mechanism = record["config"], record.get("mechanism") or {}
        table, circuit = record.get("mechanism_table") or {}, record.get("circuit") or {}
        numbers = [record["n_params"], record.get("wall_s"), *record["final"].values(),
                   *(config[k] for k in ("lr", "seed", "d_model", "n_layers", "eval_size")),
                   *(v for h in record.get("history") or () for v in (h["step"], *h.values())),
                   *(v for k, v in mechanism.items() if k != "verdict"),
                   *(table.get("headline") or {}).values(), circuit.get("restored"),
                   *(v for r in table.get("rows", ()) for v in r["scores"].values())]
        if not (record["status"] in ("ok", "failed") and isinstance(config["arch"], str)
                and all(map(finite, numbers))):
            return False
        if table:                        # what the reports read of it, each field there
            interventions.render_heatmap(table), verdict_of(record)
            table["headline"] and lean(record)
        return not circuit or bool(circuit_words(circuit))
    except (TypeError, KeyError, AttributeError, ValueError, IndexError, ArithmeticError):
        return False                     # not a dict, a field missing or not what it should be


def read_results(out, warn=True):
    """The run records of one results file, or of every results*.jsonl in the folder `out` (warn:
    one warning per line skipped: torn, not JSON, or not what the reports read)."""
    records, unknown, say = [], set(), lambda text: warn and print(f"warning: {text}", file=sys.stderr)
    pattern = os.path.join(out, "results*.jsonl") if os.path.isdir(out) else out
    seen = {}                               # {run_key: (where, its measurements)}
    for path in sorted(glob.glob(pattern)):
        with open(path, encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f, 1):
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):      # a blank or torn line
                    record = None
                if readable(record):
                    key, measured = run_key(record["config"]), [record["status"], record["final"]]
                    where, before = seen.get(key, (None, measured))
                    if before != measured:      # a patch or a saved checkpoint adds, never changes
                        say(f"{path}:{i}: a second record of {record.get('name')} ({where}), "
                            "with other measurements (hand-edited, or trained twice); the later "
                            "one is read")
                    seen[key] = f"{path}:{i}", measured
                    records.append(record)
                    unknown |= set(record["config"]) - set(DEFAULTS) - {"device"}
                elif line.strip():
                    say(f"{path}:{i}: not a run record (torn, corrupt or hand-edited); skipped")
    if unknown:
        say(f"{out}: config fields this code lacks, ignored (the runs without them): {', '.join(sorted(unknown))}")
    return records


def folder_records(folder, warn=True):
    """{experiment: its runs' latest records} from folder/<experiment>.jsonl ([]: none)."""
    return {name: latest(read_results(os.path.join(folder, f"{name}.jsonl"), warn)) for name in EXPERIMENTS}


def latest(records):
    """Each run once, its last record, in the order first met."""
    return list(by_run(records).values())


def json_safe(x):
    """Replace non-finite floats by None (strict JSON has no NaN) recursively."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def out_path(out, *parts):
    """out/parts, to be written, its folder made (a link is followed, as every tool follows it)."""
    path = os.path.join(out, *parts)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return path


def append_result(path, record):
    """Append one JSON line, on a line of its own (after a torn line too), then fsync."""
    line = (json.dumps(json_safe(record), sort_keys=True) + "\n").encode()
    try:
        with open(path, "a+b") as f:
            if f.seek(0, os.SEEK_END):                   # not empty: does its last line end?
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = b"\n" + line
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:                                 # a full disk's names no file
        raise OSError(e.errno, e.strerror or str(e), path) from None


# --- The sweep

def check_runs(configs):
    """Raise ValueError (one line) for the first bad run of `configs`, before a sweep starts."""
    for cfg in configs:                          # every document length before any is made
        mechsm.fits(mechsm.Config.check(cfg, "configs"),
                    cfg.task == "ar" and 2 * cfg.num_pairs + 5)
    built = set()                                # a model per group: lr and seed change no shape
    for cfg in configs:
        vocab = mechsm.make_data(cfg).vocab_size  # documents that do not fit the model: ValueError
        if mechsm.group_key(cfg) not in built:   # a model too large to allocate is bad input
            mechsm.build(replace(cfg, device="cpu"), vocab)
            built.add(mechsm.group_key(cfg))


def make_groups(configs, group_size=None):
    """configs -> lists differing only in lr and seed, group_size at most (None: a whole cell)."""
    cells = {}
    for cfg in configs:
        cells.setdefault(mechsm.group_key(cfg), []).append(cfg)
    return [cell[i:i + (group_size or len(cell))] for cell in cells.values()
            for i in range(0, len(cell), group_size or len(cell))]


def choose_lrs(configs, out, **options):
    """--choose-lr: sweep, round by round, what each cell's choice needs next (chosen_lr on the
    records in `out`) until a round adds nothing (done, or other shards' share): every round's runs."""
    rounds = []
    while (todo := choice_round(configs, out)) not in rounds:
        rounds.append(todo)
        sweep(todo, out, **options)
    return list({config_key(c): c for runs in rounds for c in runs}.values())


def choice_round(configs, out):
    """The runs the cells of `configs` (at the grid's rates and steps) need next: seed 0 at the (rate,
    steps) still to try, or the cell's every seed at its chosen (rate, steps)."""
    done, todo = by_run(read_results(out, warn=False)), []
    for cell in make_groups(configs):                       # whole cells
        choice, untried = cell_choice(cell[0], done)
        todo += [replace(cell[0], lr=lr, steps=steps, seed=seed) for lr, steps, seed in untried] or [
            replace(c, lr=choice[0], steps=choice[1]) for c in cell]
    return todo


def do_job(kind, payload, out, wants):
    """A worker's job: train a group of configs (one_run, or mechsm.train_group for several), or
    patch a recorded run from its checkpoint: the records; none if it fails (a rerun retries it)."""
    wants = dict(wants)
    captured = wants.pop("captured", False)             # train_group's; patch and save: finish's
    try:
        if kind == "train":
            if len(payload) == 1:
                return [one_run(payload[0], out, **wants)]
            pairs = mechsm.train_group(payload, on_eval=timeline, captured=captured)
            return [finish(record, model, out, **wants) for record, model in pairs]
        cfg, record = payload
        model, saved = mechsm.load(os.path.join(out, record["checkpoint"]),
                                   device=mechsm.resolve_device(cfg.device))
        if config_key(saved) != run_key(record["config"]):
            raise ValueError(f"checkpoint {record['checkpoint']} holds another run")
        return [finish({**record, **patched(model, cfg, mechsm.make_data(cfg).eval)}, model, out,
                       **wants)]
    except Exception as e:
        if not isinstance(e, ValueError):          # a ValueError (a bad checkpoint) says it all
            import traceback
            traceback.print_exc()
        mend = "a rerun retries it" if kind != "patch" or not isinstance(e, ValueError) else (
            f"delete {payload[1]['checkpoint']} in {out} to train it again")   # a rerun cannot mend it
        print(f"error: {kind} of {payload[0].name()}: {type(e).__name__}: {e} (not recorded; {mend})",
              file=sys.stderr)
        return []


quiet = lambda msg: None


def recorded_without(cfg, what, e):
    why = getattr(e, "strerror", None) or " ".join(str(e).split())[:200]
    print(f"warning: {cfg.name()}: {what} ({why}); the run is recorded without it", file=sys.stderr)


def sweep(configs, out, *, jobs=1, shard=(0, 1), patch=True, save=True, group_size=1,
          captured=False, log=lambda msg: print(msg, file=sys.stderr, flush=True)):
    """Train this shard's runs of `configs` not complete in `out` (patch one with a checkpoint),
    each record appended as it ends; return the grid's in `out`. group_size: runs per model;
    captured: a group's steps replayed as a CUDA graph (mechsm.CapturedStep)."""
    i, n = shard if isinstance(shard, tuple) and len(shard) == 2 else (None, None)
    size = lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0
    for name, value, ok, expected in [
            ("configs", configs, isinstance(configs, (list, tuple)) and configs,
             "a non-empty list of mechsm.Config"),
            ("patch", patch, isinstance(patch, bool), "True or False"),
            ("save", save, isinstance(save, bool), "True or False"),
            ("captured", captured, isinstance(captured, bool), "True or False"),
            ("out", out, isinstance(out, (str, os.PathLike)) and os.fspath(out), "a folder's path"),
            ("jobs", jobs, size(jobs), "a positive integer"),
            ("group_size", group_size, group_size is None or size(group_size),
             "a positive integer (None: a whole cell)"),
            ("shard", shard, size(n) and isinstance(i, int) and 0 <= i < n, "(I, N), 0 <= I < N")]:
        if not ok:
            raise ValueError(f"{name}: got {value!r}, expected {expected}")
    check_runs(configs)
    check_links(out)
    unique = {}
    for cfg in configs:
        unique.setdefault(config_key(cfg), cfg)
    mine = [key for j, key in enumerate(unique) if j % n == i]
    results = out_path(out, results_name(shard))
    open(results, "ab").close()                     # writable (its OSError names it), before training
    saved = lambda r, say=quiet: (path := checkpoint_in(out, r, say)) and os.path.isfile(path)
    complete = lambda r, say=quiet: r["status"] != "ok" or (
        not patch or r.get("mechanism_table") is not None) and (not save or saved(r, say))
    while True:       # a run another command trains (its byte of OUT/.lock held) is left to it
        first = by_run(read_results(out, warn=False))
        wanted = [k for k in mine if not (k in first and complete(first[k]))]
        busy = [k for k in wanted if not lock_byte(out, k, fcntl.LOCK_EX | fcntl.LOCK_NB)]
        done = by_run(read_results(out))            # after the claims: what the others finished
        todo = [k for k in wanted if k not in busy and not (k in done and complete(done[k], log))]
        if len(mine) - len(wanted):
            log(f"sweep: {len(mine) - len(wanted)} of {len(mine)} runs already in {out}; skipped")
        if busy:
            log(f"sweep: {len(busy)} runs are being trained by another command into {out}; "
                "waiting for it after this command's own")
        patchable = [k for k in todo if k in done and saved(done[k])]   # all "ok"
        for key in [k for k in todo if k in done and k not in patchable]:     # why it is trained
            log(f"sweep: {done[key]['name']} has no checkpoint in {out}; trained again")
        groups = make_groups([unique[k] for k in todo if k not in patchable], group_size)
        work = [("patch", (unique[k], done[k])) for k in patchable] + [("train", g)
                                                                       for g in groups]
        try:
            for record in run_jobs(work, out, dict(patch=patch, save=save, captured=captured),
                                  jobs):
                with locked(out):
                    append_result(results, record)
        finally:
            for k in set(wanted) - set(busy):
                lock_byte(out, k, fcntl.LOCK_UN)
        if not busy:
            break
        for k in busy:                              # wait until the other command lets it go
            lock_byte(out, k, fcntl.LOCK_EX) and lock_byte(out, k, fcntl.LOCK_UN)
    newest = by_run(read_results(out, warn=False))
    return [newest[k] for k in unique if k in newest]


LOCKS = {}   # {OUT/.lock's real path: its descriptor}: one per process, never closed (closing any
#              descriptor of a file drops every POSIX lock the process holds on it)


def lock_byte(out, key, how):
    """fcntl.lockf on one byte of OUT/.lock (POSIX locks: NFS honours them): byte 0 the folder's
    (locked), a run's own byte (key: its run_key) while this process trains it. how: LOCK_EX
    (wait), LOCK_EX | LOCK_NB (False if another process holds it) or LOCK_UN."""
    path = os.path.realpath(out_path(out, ".lock"))
    if path not in LOCKS:
        LOCKS[path] = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    start = int(hashlib.sha1(key.encode()).hexdigest()[:12], 16) + 1 if key else 0
    try:
        fcntl.lockf(LOCKS[path], how, 1, start)
    except (BlockingIOError, PermissionError):      # held by another process
        return False
    return True


@contextlib.contextmanager
def locked(out):
    """Hold the folder's lock of `out` around a read-then-replace (one writer at a time; never
    nested: the inner one's end would end the outer's)."""
    lock_byte(out, "", fcntl.LOCK_EX)
    try:
        yield
    finally:
        lock_byte(out, "", fcntl.LOCK_UN)


def checkpoint_in(out, record, log):
    """The path in `out` of the checkpoint a record names, or None: none named, or one outside
    `out` (a record is data: the path it names is never followed out of its folder; said once)."""
    path = record.get("checkpoint")
    if path and (not isinstance(path, str) or os.path.isabs(path)
                 or os.path.normpath(path).split(os.sep)[0] == os.pardir):
        log(f"sweep: {record['name']}: its record names the checkpoint {path!r}, a path outside "
            f"{out}; not read")
        return None
    return path and os.path.join(out, path)


def check_links(out):
    """A link in OUT or OUT/ckpt that leads nowhere (dangling: a disk not mounted; or looping):
    bad input, named before any training."""
    for folder in (out, os.path.join(out, "ckpt")):
        entries = [e.path for e in os.scandir(folder)] if os.path.isdir(folder) else []
        for path in filter(os.path.islink, [folder, *entries]):
            try:
                os.stat(path)
            except OSError as e:                    # a link: the file it names is not there
                kind = "looping" if e.errno == errno.ELOOP else "dangling"
                raise ValueError(f"{path}: a {kind} link (to {os.readlink(path)}); mend it or "
                                 "remove it") from None


def command_file(folder, name):
    """(path, {key: entry}) of folder/<name>.command.json as found, every entry kept (an older
    file's single record: one entry; a file that is not a JSON object: one entry, its text)."""
    path = os.path.join(folder, f"{name}.command.json")
    if not os.path.isfile(path):
        return path, {}
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    try:
        entries = json.loads(text)
    except (ValueError, RecursionError):
        entries = None
    if not isinstance(entries, dict):
        return path, {"unreadable, as found": text}
    older = isinstance(entries.get("command"), str)
    return path, {entries["command"]: entries} if older else entries


COMMAND_FIELDS = {"command": str, "trained": int, "jobs": int, "wall_s": (int, float), "date": str,
                  "machine": str, "load": str}


def read_commands(folder, name):
    """{command: its record that trained the most runs} of folder/<name>.command.json (each command
    that trained runs there, how long it took); an entry that is not one: skipped, warned of."""
    (path, entries), best = command_file(folder, name), {}
    for key, c in entries.items():
        whole = isinstance(c, dict) and all(isinstance(c.get(k), t)
                                            for k, t in COMMAND_FIELDS.items())
        if not (whole and math.isfinite(c["wall_s"])):
            print(f"warning: {path}: {key[:80]!r} is not a command record (corrupt or "
                  "hand-edited); skipped", file=sys.stderr)
        elif c["trained"] >= best.get(c["command"], {"trained": -1})["trained"]:
            best[c["command"]] = c
    return best


FIGURES_HINT = "figures: pip install matplotlib to draw them (everything else works without it)"


def render(name, preset, records, folder=None):
    """(rows, markdown text) of an experiment's records: the table, the timeline, the provenance."""
    exp, records = EXPERIMENTS[name], latest(records)       # a run landed again (a circuit added): once
    rows = rows_of(name, records)
    if not rows:
        raise ValueError(f"{name}: no run finished; nothing to report")
    made = {json.dumps(m, sort_keys=True): m for r in records if (m := r.get("provenance"))}
    made = "; ".join(f"{m.get('date')} on {machine_of(m)} with torch {m.get('torch')} at commit {m.get('commit')}"
                     for _, m in sorted(made.items()))
    wall = sum(r.get("wall_s") or 0 for r in records)
    kinds = figures_of(name, rows)                 # what --figures draws from these records
    commands = read_commands(folder, name).values() if folder else []
    attrib = lambda h, key: "-" if h.get("attrib_low_signal") else fmt_num(h.get(key))
    timeline = []
    for row in rows:                  # the best run's history: 6 evaluations at most, the last kept
        history, one = row["best"].get("history") or [], row["best"]["config"]["n_layers"] == 1
        keep = {round(i * (len(history) - 1) / 5) for i in range(6)}
        timeline.append(f"- {row['label']}: " + "; ".join(         # 1 layer: no layer-1 input
            f"{h['step']}: {fmt_pct(h.get('acc'))} " + ("n/a" if one else f"{attrib(h, 'attrib_value')}/"
            f"{attrib(h, 'attrib_query')}") for i, h in enumerate(history) if i in keep))
    return rows, "\n".join([f"# {name}: {exp.finding} ({exp.section}), preset {preset}", "",
        short_table(rows, name), "",
        "Each row counts every seed of its cell's chosen learning rate and budget. Accuracy: the final "
        f"models on {records[0]['config']['eval_size']} fresh documents, median (range). Attrib@X: "
        "the median, over the seeds that can be read, of the restoration of the clean answer "
        "probability when the block input of layer 1 is patched at X (n/a: a 1-layer model has none; "
        "its layer-0 mixer output is in the heatmaps). Verdicts: each seed's, by the README's rule. "
        f"Paper: {exp.section}; holds?: whether our seeds bear out its reading (README).", "",
        "## Details", "",
        result_table(rows, None if exp.probe else name), "",
        "lr: where several were tried, seed 0's accuracy at each, 'failed' where its loss went "
        "non-finite and it stopped, and in bold, the rate chosen: seed 0's best (results/README.md). "
        "Leans: where the seeds with no signal point. Training: what each seed's training did "
        "(run.diagnose, results/README.md).", "",
        "Timeline (step: accuracy, Attrib@Value/Attrib@Query on the first eval documents; '-': "
        "too little signal to read):", *timeline, "",
        f"Records: {len(records)} runs, {wall / 60:.1f} minutes of training (the runs' wall times, "
        f"summed), made {made}."
        + "".join(f" The command `{c['command']}` trained {c['trained']} of them in {c['wall_s'] / 60:.1f}"
                  f" minutes of wall time with {c['jobs']} job(s), {c['date']}, {c['machine']}, "
                  f"{c['load']}." for c in commands), "", *[f"![{k}]({name}_{k}.png)" for k in kinds], ""])


def holds(text, s):
    """Whether a row's seeds (s: its spread) bear out `text`: its reading the majority verdict of
    the readable ones ('unreadable': under half are), 'fails' a median accuracy < 50%; else '-'."""
    for reading in interventions.READINGS.values():
        if reading in text:
            if 2 * s["readable"] < s["n"]:
                return "unreadable"
            return "yes" if 2 * s["verdicts"][reading] > s["readable"] else "no"
    if "fails" in text:
        return "yes" if statistics.median(s["acc"]) < 0.5 else "no"
    return "-"


# --- The command line

class Parser(argparse.ArgumentParser):
    """argparse that raises ValueError (one line) and names a close match of an unknown option; a
    token after an option that takes a value is its value, even one that starts with '-' (--lr -1)."""

    def error(self, message):
        raise ValueError(message)

    def parse_known_args(self, args=None, namespace=None):
        args, known, i = list(sys.argv[1:] if args is None else args), self._option_string_actions, 0
        end = args.index("--") if "--" in args else len(args)
        while i < end:
            token, name = args[i], args[i].split("=", 1)[0]
            if token[:1] == "-" and token != "-" and name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ValueError(f"unknown option {name}{hint}; see run.py --help")
            if (name in known and known[name].nargs is None and "=" not in token and i + 1 < end
                    and args[i + 1].split("=", 1)[0] not in known):
                args[i:i + 2], end = [f"{token}={args[i + 1]}"], end - 1   # its value, even -1e-3
            i += 1
        namespace, extras = super().parse_known_args(args, namespace)
        namespace.given = {k for k, v in vars(namespace).items() if v is not None} - {"command"}
        return namespace, extras


def typed(kind, many=False, zero=False):
    """An argparse type: a non-empty str, or a positive (zero: or 0) int below 2**62 or finite
    float; many: a comma list of them, ints also a range of seeds lo-hi (0-4); a value given
    twice is one run."""
    def one(text):
        text = text.strip()
        if not text:
            raise argparse.ArgumentTypeError("empty value")
        try:
            value = kind(text)
        except ValueError:
            value = None
        if kind is not str and not (value is not None and (value >= 0 if zero else value > 0)
                                    and (value < 2**62 if kind is int else math.isfinite(value))):
            what = "integer below 2**62" if kind is int else "number"
            raise argparse.ArgumentTypeError(f"got {text}, expected a "
                                             f"{'non-negative' if zero else 'positive'} {what}")
        return value

    def comma_list(text):
        values = []
        for part in text.split(","):
            lo, dash, hi = part.strip().partition("-")
            span = range(one(lo), one(hi) + 1) if dash and kind is int and lo else [one(part)]
            if not 0 < len(span) <= 10_000:
                raise argparse.ArgumentTypeError(f"{part.strip()} is " + (
                    f"a range of {len(span):,} values, at most 10,000" if span else "an empty "
                    "range: lo-hi needs lo <= hi"))
            values += span
        return values
    return comma_list if many else one


def build_parser():
    p = Parser(prog="run.py", description=__doc__, epilog="Options left unset take their value "
               "from the experiment's preset (README: what each runs).",
               formatter_class=argparse.RawDescriptionHelpFormatter)

    def a(flag, kind=None, many=False, switch=False, zero=False, **kw):
        p.add_argument(flag, **kw, **(dict(type=typed(kind, many, zero)) if kind else {}),
                       **(dict(action="store_true", default=None) if switch else {}))
    p.add_argument("command", nargs="?", default="train", choices=["train", "bench"],
                   help="train (default) or bench")
    a("--experiment", choices=EXPERIMENTS, metavar="NAME", help="a paper result (default: ar, its FIRST archs)")
    a("--list", switch=True, help="print the catalogue of experiments and exit")
    a("--preset", choices=PRESETS, help="quick (default: CPU-sized grids, see --list) or paper")
    a("--task", choices=mechsm.TASKS, help="ar or atr: the same as --experiment ar / atr")
    a("--arch", str, True, help="an arch, a comma list or 'all' (" + ", ".join(ALL_ARCHS) + ")")
    a("--d-model", int, True, help="width(s), e.g. 64 or 16,32,64")
    a("--lr", float, True, help="peak learning rate(s), e.g. 1e-3 or 3e-4,1e-3")
    a("--seeds", int, True, zero=True, help="model seed(s): 42, or 0,1,2, or 0-4")
    a("--replicates", switch=True, help="quick grids: every seed of each row, as results/ holds "
      "(default: seed 0)")
    a("--choose-lr", switch=True, help="quick grids: choose each cell's rate (on AR its budget "
      "too) as results/ did (cell_choice), then train every seed there")
    for dest, f in FLAGS.items():          # a flag per Config field, its help the field's
        flag, kind = "--" + dest.replace("_", "-"), f.type if f.type in (bool, float, int, str) else None
        if kind is bool:
            a(flag, switch=True, help=f.metadata["help"])
        elif kind is None and bool in typing.get_args(f.type):        # pos_emb: True, False, None
            a(flag, choices=SWITCH, help=f.metadata["help"])
        else:
            a(flag, kind or int, zero=zero_ok(f.name), help=f.metadata["help"])
    a("--device", choices=mechsm.DEVICES, help="auto (default: cuda if available), cpu or cuda")
    a("--jobs", int, help="runs trained in parallel (default: one per CPU core, 1 on cuda)")
    a("--group-size", int, metavar="K", help="train up to K runs differing only in lr and seed as "
      "one batched model (default: 1 on a CPU, a whole cell on cuda)")
    a("--cuda-graph", switch=True, help="on cuda: a group's steps replayed as a CUDA graph "
      "(mechsm.CapturedStep; off by default until measured faster: README)")
    a("--shard", metavar="I/N", help="train runs I, I+N, ... of the grid (default: SLURM's "
      "array task); shards of one --out read each other's results")
    a("--out", str, help="output folder (default: out/)")
    a("--dry-run", switch=True, help="print the runs, their groups and an estimated time from "
      "measured rates; train nothing")
    a("--no-interventions", switch=True, help="train and evaluate only, skip the patching")
    a("--no-save", switch=True, help="do not save checkpoints under OUT/ckpt/")
    a("--checkpoint", str, help="evaluate and patch this saved model (OUT/ckpt/*.pt), no training")
    a("--figures", str, metavar="FOLDER", help="redraw the figures of a results folder and exit")
    a("--report", str, metavar="FOLDER", help="rewrite the markdown of a results folder from its "
      "records (results/: also the READMEs' tables) and exit")
    return p


# A flag per Config field, set on every run it applies to (--layers: n_layers), but the fields
# that the grid's lists (--arch, --d-model, --lr, --seeds), --task and --device set.
FLAGS = {{"n_layers": "layers", "n_heads": "heads"}.get(f.name, f.name): f for f in fields(mechsm.Config)
         if f.name not in ("task", "arch", "d_model", "lr", "seed", "device")}
SWITCH = {"on": True, "off": False, "auto": None}
TASK_OF = {**dict.fromkeys(mechsm.AR_FIELDS, "ar"),                # field -> the task that has it
           **dict.fromkeys((*mechsm.PCFG_FIELDS, "max_terminals"), "atr")}
MIXER_FIELDS = ("d_conv", "long_only", "n_heads", "freeze_features")   # only where a mixer takes it


def zero_ok(name):
    """Whether Config takes 0 for the field `name` (--d-conv 0: no conv; --steps 0: refused)."""
    try:
        return bool(replace(mechsm.Config(), **{name: 0}).check())
    except ValueError:
        return False
# the options each command takes; any other option given with it is refused, never silently ignored
COMMAND_OPTIONS = {"bench": {"device"}, **{c: {c} for c in ("list", "figures", "report")},
                   "checkpoint": {"checkpoint", "device", "out", "eval_size", "no_interventions"}}


def grid_runs(args, name, device):
    """(configs, notes): the grid narrowed by --arch/--d-model/--lr/--seeds, each field flag set."""
    for a, b, both in [("--task", "--experiment", args.task and args.experiment),
                       ("--epochs", "--steps", args.epochs and args.steps),
                       ("--replicates", "--seeds", args.replicates and args.seeds),
                       ("--choose-lr", "--lr", args.choose_lr and args.lr),
                       ("--choose-lr", "--epochs", args.choose_lr and args.epochs),
                       ("--choose-lr", "--seeds", args.choose_lr and args.seeds),
                       ("--choose-lr", "--preset paper", args.choose_lr and args.preset == "paper"),
                       ("--replicates", "--preset paper", args.replicates and args.preset == "paper")]:
        if both:
            raise ValueError(f"{a} and {b}: give one of them ({b} decides what {a} would)")
    given = {dest: getattr(args, dest) for dest in FLAGS if getattr(args, dest) is not None}
    if "pos_emb" in given:
        given["pos_emb"] = SWITCH[given["pos_emb"]]
    configs = experiment_configs(name, args.preset or "quick", widths=args.d_model, lrs=args.lr,
                                 archs=ALL_ARCHS if args.arch == ["all"] else args.arch or (
                                     None if args.experiment or args.task else FIRST),
                                 seeds=args.seeds or (None if args.replicates or args.choose_lr
                                                      or args.preset == "paper" else [0]),
                                 chosen_lrs=not args.choose_lr, device=device)
    if not (args.experiment or args.task or args.arch):              # `python run.py`: FIRST
        configs = [c for c in configs if c.num_keys == QUICK_VOCAB]
    if args.epochs is not None and args.steps is None:
        given["steps"] = None                                # --epochs beats the grid's step counts
    notes = []
    for flag, value in given.items():
        field, opt = FLAGS[flag].name, "--" + flag.replace("_", "-")
        hit = [c.task == TASK_OF[field] if field in TASK_OF else field not in MIXER_FIELDS or field
               in models.mixer_options(c.arch) and not (field == "d_conv" and c.long_only) for c in configs]
        missed = sorted({c.arch + " (long convs only)" * c.long_only for c, h in zip(configs, hit) if not h})
        if not any(hit):
            raise ValueError(f"{opt}: does not apply to any run of this grid ({', '.join(missed)} "
                             f"on {configs[0].task})")
        if missed:
            notes.append(f"note: {opt} ignored for {', '.join(missed)}, which do not have it")
        configs = [replace(c, **{field: value}) if h else c for c, h in zip(configs, hit)]
    return configs, notes


def evaluate_checkpoint(args):
    """--checkpoint: evaluate (and patch) a saved model into OUT/checkpoint_eval/<name>-<hash>/."""
    model, cfg = mechsm.load(args.checkpoint, device=mechsm.resolve_device(args.device or "auto"))
    cfg = replace(cfg, eval_size=args.eval_size or cfg.eval_size)        # --eval-size 0: refused
    digest = hashlib.sha1(os.path.abspath(args.checkpoint).encode()).hexdigest()[:8]
    path = out_path(args.out or "out", "checkpoint_eval", Path(args.checkpoint).stem
                    + "-" + digest, f"result_eval{cfg.eval_size}{'_unpatched' * bool(args.no_interventions)}.json")
    writable(os.path.dirname(path))                       # before evaluating
    data = mechsm.make_data(cfg)
    record = {"config": asdict(cfg), "name": cfg.name(), "status": "ok", "checkpoint": None,
              "n_params": models.count_parameters(model), "final": mechsm.evaluate_all(model, data)}
    if not math.isfinite(record["final"]["loss"]):          # NaN weights: nothing to read
        raise ValueError(f"--checkpoint {args.checkpoint}: its model's evaluation loss is "
                         f"{record['final']['loss']} (NaN or inf weights); nothing evaluated")
    if not args.no_interventions:
        record.update(patched(model, cfg, data.eval))
    mechsm.write_whole(path, json.dumps(json_safe(record), indent=1).encode())
    print(result_table([dict(label=cfg.arch, best=record, runs=[record])]))
    if not args.no_interventions:
        print(f"\nheatmap of {cfg.arch} ({args.checkpoint}):\n"
              + interventions.render_heatmap(record["mechanism_table"]))
    print(f"\nresult in {path}", file=sys.stderr)


def other_command(args):
    """Run the command `args` names if it is not training (bench, --list, --figures, --report,
    --checkpoint): True; False for training."""
    command = "bench" if args.command == "bench" else next(
        (c for c in ("list", "figures", "report", "checkpoint") if getattr(args, c)), "train")
    if command == "train":
        return bool(args.dry_run) and dry_run(args)
    flags = lambda names: ", ".join("--" + g.replace("_", "-") for g in sorted(names))
    if args.given - COMMAND_OPTIONS[command]:
        raise ValueError(f"{flags(args.given - COMMAND_OPTIONS[command])}: cannot be used with "
                         f"{'bench' if command == 'bench' else '--' + command} (it takes "
                         f"{flags(COMMAND_OPTIONS[command] - {command}) or 'no options'})")
    folder = args.figures or args.report
    if folder and not os.path.isdir(folder):
        raise ValueError(f"--{command} {folder}: " + ("not a folder" if os.path.exists(folder) else
                                                        "no such folder"))
    {"bench": lambda: bench(args.device or "auto"), "list": lambda: print(catalogue()),
     "checkpoint": lambda: evaluate_checkpoint(args), "figures": lambda: redraw_figures(folder),
     "report": lambda: report_folder(folder)}[command]()
    return True


def sweep_plan(args, name, configs, device, notes, out):
    """(jobs, shard, group_size) of a training command, printed with the grid's size; --out checked
    writable before any training."""
    runs = len(set(map(config_key, configs)))     # flags can make two alike
    for note in notes:
        print(note, file=sys.stderr)
    jobs, why = (args.jobs, "--jobs") if args.jobs else (1, "one process drives the GPU")
    if not args.jobs and device == "cpu":                       # one worker per core
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            os.cpu_count() or 1                                     # taskset's, else the machine's
        jobs = min(cores, runs)
        why = f"{cores} CPU cores" + (f", {jobs} runs" if jobs < cores else "")
    shard, group_size = shard_of(args.shard), args.group_size or (1 if device == "cpu" else None)
    if args.cuda_graph and not device.startswith("cuda"):
        raise ValueError(f"--cuda-graph: needs a CUDA device (got {device})")
    writable(out)                                       # before any training
    print(f"mechsm | experiment {name} ({EXPERIMENTS[name].section}) | preset "
          f"{args.preset or 'quick'} | {runs} runs"
          + (f" | shard {shard[0]}/{shard[1]}" if shard[1] > 1 else "")
          + f" | device {device} | vocabulary {mechsm.probe_task(configs[0])}", file=sys.stderr)
    print(f"plan: {jobs} job{'s' * (jobs > 1)} ({why})", file=sys.stderr)
    return jobs, shard, group_size


def writable(folder, flag="--out"):
    """An OSError naming flag unless folder can be written (made if missing), checked before the
    work that would end in writing there; a dangling or looping link there: a ValueError."""
    check_links(folder)
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise OSError(f"{flag} {folder}: cannot write there ({e.strerror or e})") from None


# --- --dry-run: the grid's groups and a time from measured rates, before anything trains
GPU_BENCH = os.path.join(HERE, "results", "gpu", "bench.txt")   # `run.py bench` on a GPU


def dry_run(args):
    """Print the runs and groups the training command `args` would train, each group's step rate
    and the time its steps take: timed here (2 steps of each group shape) on the device at hand, or
    for --device cuda without one, read from results/gpu/bench.txt. Evaluations not counted."""
    name, wanted = args.experiment or args.task or "ar", args.device or "auto"
    here = not wanted.startswith("cuda") or torch.cuda.is_available()
    device = mechsm.resolve_device(wanted) if here else "cuda"
    configs, notes = grid_runs(args, name, device if here else "cpu")
    check_runs(configs)
    groups = make_groups(configs, args.group_size or (1 if device == "cpu" else None))
    gpu = f" ({torch.cuda.get_device_name(device)})" if device.startswith("cuda") and here else ""
    rates, source = gpu_rates() if not here else (
        None, f"timed here, 2 steps of each group shape on {device}{gpu}")
    jobs = args.jobs or (min(os.cpu_count() or 1, len(groups)) if device == "cpu" else 1)
    print(f"plan: {name} | preset {args.preset or 'quick'} | {len(configs)} runs in {len(groups)} "
          f"groups | device {device} | {jobs} job{'s' * (jobs > 1)}")
    print(f"{'group':<36}{'runs':>6}{'steps':>9}{'model-steps/s':>15}{'time':>10}")
    lasting = lambda s: f"{s / 3600:.2f} h" if s >= 3600 else f"{s / 60:.1f} min"
    total, shapes = 0.0, {}
    for group in groups:
        c = group[0].resolved()
        key = (mechsm.group_key(c), len(group))
        if key not in shapes:
            shapes[key] = group_seconds(group) if here else rate_from(rates, c.arch, len(group))
        seconds = shapes[key] and c.total_steps() * shapes[key]
        total += seconds or 0
        rate = f"{len(group) / shapes[key]:,.0f}" if shapes[key] else "-"
        label = row_label(c, [x for x in configs if x.d_model == c.d_model], ladder=False)
        print(f"{label + f' d {c.d_model}':<36}{len(group):>6}"
              f"{c.total_steps():>9,}{rate:>15}{lasting(seconds) if seconds else 'unmeasured':>10}")
    missing = sum(s is None for s in shapes.values())
    print(f"estimate: {lasting(total / jobs)} of training steps with {jobs} job"
          f"{'s' * (jobs > 1)}" + (f", {missing} group shapes not measured" if missing else "")
          + f"; rates {source}. Evaluations and patching add to it.")
    return True


def gpu_rates():
    """{(arch, K): (group model-steps/s, one model's steps/s)} from results/gpu/bench.txt's table of
    K runs as one batched model, and where that was measured."""
    text = Path(GPU_BENCH).read_text() if os.path.exists(GPU_BENCH) else ""
    rates = {(w[0], int(w[1])): (float(w[2].replace(",", "")), float(w[3].replace(",", "")))
             for w in map(str.split, text.splitlines())
             if len(w) >= 4 and w[0] in models.ARCHS and w[1].isdigit()}
    gpu = next((w[w.index("NVIDIA"):] for w in text[:text.find("\n")].split("|") if "NVIDIA" in w),
               "GPU")
    return rates, (f"measured on an {gpu} (results/gpu/bench.txt) at d 64 on the paper's "
                   "AR shape: wider models, or ATR's longer documents, may step slower" if rates
                   else "not measured on a GPU (no results/gpu/bench.txt)")


def rate_from(rates, arch, k):
    """Seconds a step of k runs of `arch` takes by the measured rates: one model's (K 1, trained
    alone), else a group step's seconds linear in K between measured sizes; None: unmeasured."""
    sizes = sorted(kk for a, kk in rates if a == arch)
    if k == 1 or not sizes:
        return 1 / rates[arch, 1][1] if (arch, 1) in rates else None
    seconds = np.interp(k, sizes, [kk / rates[arch, kk][0] for kk in sizes])   # a group step
    return float(seconds) * max(1, k / sizes[-1])          # past the largest: in proportion


def group_seconds(group):
    """Seconds a training step of `group` takes here (2 steps after one, at one thread on a CPU as
    a worker): as train() steps one model, or as train_group steps several."""
    cfg, threads = group[0].resolved(), torch.get_num_threads()
    data, device = mechsm.make_data(cfg), torch.device(mechsm.resolve_device(cfg.device))
    batch = mechsm.training_batches(cfg, data)(0)
    if len(group) == 1:
        model = mechsm.build(cfg, data.vocab_size)
        step = functools.partial(train_steps, model, model, mechsm.adamw(model, cfg.lr), batch, 1)
    else:
        ens = mechsm.Ensemble([mechsm.build(c, data.vocab_size) for c in group])
        lrs = torch.tensor([c.lr for c in group], dtype=torch.float64, device=device)
        step = lambda: ens.train_step(*batch, lrs)
    torch.set_num_threads(1 if device.type == "cpu" else threads)
    try:
        return medians({"step": lambda: [step() for _ in range(2)]}, 1, device)["step"] / 2
    finally:
        torch.set_num_threads(threads)


def record_command(argv, out, name, trained, jobs, seconds):
    """OUT/<name>.command.json, {command: its record}: the command line that trained `trained` runs
    (--out relative to the project: no machine's path), how long it took; every entry kept."""
    rel = os.path.relpath(out, HERE)
    argv = [w.replace(out, rel) if w in (out, "--out=" + out) else w
            for w in (sys.argv[1:] if argv is None else argv)]
    command, p = shlex.join(["python", "run.py", *argv]), provenance()
    with locked(out):                    # every entry kept: a rerun's under a key of its own
        path, commands = command_file(out, name)
        key, i = command, 1
        while key in commands:
            key, i = f"{command} ({i + 1})", i + 1
        commands[key] = {"command": command, "trained": trained, "jobs": jobs,
                         "wall_s": round(seconds, 1), "date": time.strftime("%Y-%m-%d"),
                         "machine": machine_of(p), "commit": p.get("commit"),   # its speed's
                         "load": "load average %.1f over the last 15 minutes" % os.getloadavg()[2]}
        mechsm.write_whole(path, json.dumps(commands, indent=1).encode())


@contextlib.contextmanager
def exit_status():
    """main's frame: its `status.code` for bad input (2, one line), a dead worker (1), Ctrl-C (130)
    and SIGTERM (143), which stops the workers as Ctrl-C does."""
    def on_sigterm(signum, frame):     # as Ctrl-C is: the workers stop, finished runs stay kept
        raise KeyboardInterrupt("SIGTERM")
    status = types.SimpleNamespace(code=None, training=False)      # main: training once it starts
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield status
    except (ValueError, OSError, BrokenExecutor) as e:   # bad input, ..., a worker process died
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        status.code = 1 if isinstance(e, BrokenExecutor) else 2
    except KeyboardInterrupt as e:
        signal.signal(signal.SIGINT, signal.SIG_IGN)       # a second Ctrl-C cannot cut this short
        sigterm = e.args == ("SIGTERM",)
        print(f"\n{'terminated (SIGTERM)' if sigterm else 'interrupted'}" + (": finished runs are "
              "kept in the results files; rerun to continue") * status.training, file=sys.stderr)
        status.code = 143 if sigterm else 130
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- Worker processes and signals

def run_jobs(work, out, wants, jobs):
    """Yield each job's records as it finishes: here, or in `jobs` spawned one-thread workers."""
    if jobs <= 1 or len(work) <= 1:
        for job in work:                  # a job: (kind, payload)
            yield from do_job(*job, out, wants)
        return
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(work)), initializer=worker_init,
                               initargs=(os.getpid(),), mp_context=get_context("spawn"))
    try:
        futures = [pool.submit(do_job, *job, out, wants) for job in work]
        for future in as_completed(futures):
            yield from future.result()
    except BaseException as e:      # a worker died; Ctrl-C, SIGTERM (a KeyboardInterrupt); a crash
        # SIGTERM each worker, wait, SIGKILL any left; SIGINT/SIGTERM are held back meanwhile
        processes = list((getattr(pool, "_processes", None) or {}).values())   # no API before 3.14
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            for process in processes:
                process.terminate()
            for process in processes:
                process.join(5)
                process.kill()                   # a process that has ended is not signalled
                process.join(5)
            pool.shutdown(wait=False, cancel_futures=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        if isinstance(e, BrokenExecutor):
            raise BrokenExecutor("a worker process died (killed by a signal, or out of memory); "
                                 f"finished runs are kept in {out}; rerun to continue") from None
        raise
    pool.shutdown(wait=True)


def worker_init(parent):
    """A sweep worker: one thread, SIGINT ignored (the parent stops it), gone with its parent."""
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def exit_with_parent():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=exit_with_parent, daemon=True).start()


# --- Shards, provenance, older records, the READMEs' tables

def shard_of(text):
    """(I, N) of --shard "I/N", or of SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT, or (0, 1)."""
    source = "--shard"
    if text is None and "SLURM_ARRAY_TASK_ID" in os.environ:      # an array from 1, or 0-6:2, too
        task, first, step = (os.environ.get(f"SLURM_ARRAY_TASK_{k}", "")
                             for k in ("ID", "MIN", "STEP"))
        if (task + first + step).isdigit() and int(step or 1):
            task = str((int(task) - int(first or 0)) // int(step or 1))
        text = f"{task}/{os.environ.get('SLURM_ARRAY_TASK_COUNT', '')}"
        source = "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT (the shard when --shard is not given)"
    if text is None:
        return 0, 1
    i, slash, n = text.partition("/")
    if not (slash and i.strip().isdigit() and n.strip().isdigit() and int(i) < int(n)):
        raise ValueError(f"{source}: got {text!r}, expected I/N with 0 <= I < N, e.g. 0/4")
    return int(i), int(n)


results_name = lambda shard: "results.jsonl" if shard[1] == 1 else f"results.shard{shard[0]}of{shard[1]}.jsonl"


def provenance():
    """Where and with what a record was made: date, machine, CPU and torch's kernels for it, commit
    (of this project's own git checkout alone, '+dirty' when a tracked file differs from it)."""
    git = lambda *a: subprocess.run(["git", "--no-optional-locks", *a], capture_output=True, text=True,
                                    cwd=HERE, timeout=10, check=True).stdout.strip()
    try:
        top, _, commit = git("rev-parse", "--show-toplevel", "--short", "HEAD").partition("\n")
        commit = (commit + "+dirty" * bool(git("status", "--porcelain", "--untracked-files=no"))
                  if top == os.path.realpath(HERE) else None)            # not another repository's
    except (OSError, subprocess.SubprocessError):
        commit = None
    info = Path("/proc/cpuinfo").read_text() if os.path.isfile("/proc/cpuinfo") else ""
    cpu = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")]
    return {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "commit": commit or None,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "cpu": (cpu or [platform.processor()])[0] or None, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


machine_of = lambda p: ", ".join(str(p[k]) for k in ("machine", "cpu", "cpu_capability") if p.get(k))  # a provenance's


README = os.path.join(HERE, "README.md")
# A block of a README: between "<!-- NAME: ..." and "<!-- /NAME -->", rendered by --report results.
BLOCK = "<!-- {}: `python run.py --report results` writes this from results/*.jsonl -->"


def run_py_line(folder):
    """What `python run.py` trains, and how long it took, as folder/ar.command.json records it."""
    c = read_commands(folder, "ar").get("python run.py")
    return f"`python run.py` trains seed 0 of `ar`'s {', '.join(FIRST)} rows at {QUICK_VOCAB:,} keys, at " \
        "their chosen rates and budgets (`--experiment ar`: every row)" + (
        f"; it trained {c['trained']} runs in {c['wall_s'] / 60:.1f} minutes with "
        f"{c['jobs']} jobs on {c['date']} at commit {c.get('commit') or 'unknown'} ({c['machine']}, "
        f"{c['load']})." if c else ".")


def spent_line(records):
    """How many runs `records` ({experiment: runs}) hold, and what they cost."""
    unique = by_run(r for rs in records.values() for r in rs).values()
    cost = lambda r: (r.get("wall_s") or 0) + ((r.get("mechanism_table") or {}).get("seconds") or 0)
    return (f"results/ holds {len(unique)} runs: {sum(map(cost, unique)) / 3600:.1f} CPU-hours of "
            "training and patching (the records' wall times summed; every run on one thread).")


def experiment_tables(records):
    """Every experiment's short table under its name and claim, then the probes, linked."""
    parts = [f"### [{name}](./{name}.md): {exp.finding} ({exp.section})\n\n"
             + short_table(rows_of(name, records[name]), name)
             for name, exp in EXPERIMENTS.items() if not exp.probe and records[name]]
    probes = [f"[{n}](./{n}.md) ({e.finding})" for n, e in EXPERIMENTS.items() if e.probe]
    return "\n\n".join(parts + [f"The probes that chose the quick grids: {'; '.join(probes)}."])


def with_blocks(text, folder):
    """`text` (a README) with each block it holds rendered anew from `folder`'s records: `ar`'s
    short table, every experiment's, the runs' cost, `python run.py`'s, the circuits, Mamba's conv."""
    records = folder_records(folder, warn=False)
    blocks = {"ar": lambda: short_table(rows_of("ar", records["ar"]), "ar"),
              "experiments": lambda: experiment_tables(records),
              "runs": lambda: spent_line(records), "first": lambda: run_py_line(folder),
              "circuits": lambda: circuit_table(records), "conv": lambda: conv_table(records)}
    for name, block in blocks.items():
        first, last = BLOCK.format(name), f"<!-- /{name} -->"
        if first in text:
            start, end = text.index(first) + len(first), text.index(last)
            text = text[:start] + "\n" + block() + "\n" + text[end:]
    return text


def circuit_table(records):
    """Every row's circuit (row_circuit) in `records` ({experiment: runs}) that carry one, by
    architecture."""
    cells = [{"architecture": row["arch"], "experiment: row": f"{name}: {row['label']}",
              "circuit (the median-accuracy seed's)": circuit_words(found[0], restored=False),
              "seeds sharing it / with a circuit": f"{found[1]}/{found[2]}",
              "restored": fmt_pct(found[0].get("restored"))}
             for name, runs in records.items() for row in rows_of(name, runs)
             if (found := row_circuit(row))]
    return markdown(sorted(cells, key=lambda c: arch_rank(c["architecture"]))) if cells else \
        "No record here carries a circuit yet (a patched run made from this commit on does)."


def conv_table(records):
    """Whether Mamba's short conv carries the key to the next token (conv@next_key: the attribution of
    layer 0's conv output there) in the AR runs of `records` ({experiment: runs}) with signal, by
    cell and budget: how many of the runs read carry it (0.5 or more), each run's value and
    accuracy (seed, rate)."""
    runs = {run_key(r["config"]): r for rs in records.values()
            for r in rs if r["config"]["task"] == "ar" and r["status"] == "ok"
            and (r.get("mechanism") or {}).get("conv@next_key") is not None and not r["mechanism"]["low_signal"]}
    cells = {}
    for r in sorted(runs.values(), key=lambda r: (r["config"]["lr"], r["config"]["seed"])):
        c = r["config"]
        name = ", ".join([f"d {c['d_model']}", f"{c['num_keys']:,} keys", describe("n_layers", c["n_layers"]),
                          describe("d_conv", c["d_conv"])])
        order = (c["d_model"], c["num_keys"], c["n_layers"], -1 if c["d_conv"] is None else c["d_conv"])
        cells.setdefault((order, name, budget_of(r)), []).append(r)
    carries = lambda rs: sum(r["mechanism"]["conv@next_key"] >= 0.5 for r in rs)
    return markdown([{"Mamba": name, "steps": f"{steps:,}", "carries the key": f"{carries(rs)}/{len(rs)}",
                      "conv@next_key, accuracy (seed, rate)": " · ".join(
                          f"{fmt_num(r['mechanism']['conv@next_key'])}, {fmt_pct(r['final']['acc'])} "
                          f"(s{r['config']['seed']}, {r['config']['lr']:g})" for r in rs)}
                     for (_, name, steps), rs in sorted(cells.items(), key=lambda kv: kv[0][::2])])


def preset_of(command):
    """The --preset of a recorded command line (None: one this code cannot parse)."""
    try:
        return build_parser().parse_args(shlex.split(command)[2:]).preset or "quick"
    except ValueError:
        return None


def report_folder(folder):
    """--report FOLDER: <experiment>.md of each <experiment>.jsonl (results/: the READMEs too)."""
    written = {name: records for name, records in folder_records(folder).items() if records}
    for name, records in written.items():
        made = {preset_of(c["command"]) for c in read_commands(folder, name).values()} - {None}
        preset = made.pop() if len(made) == 1 else max(PRESETS, key=lambda p: len(  # else the grid
            by_run(records).keys() & set(map(config_key, experiment_configs(name, p)))))
        mechsm.write_whole(out_path(folder, f"{name}.md"), render(name, preset, records, folder)[1].encode())
    readme = os.path.realpath(folder) == os.path.realpath(os.path.join(HERE, "results"))
    for path in [README, out_path(folder, "README.md")] * readme:
        mechsm.write_whole(path, with_blocks(Path(path).read_text(), folder).encode())
    print(f"{len(written)} reports written to {folder}/" + (" and the READMEs' tables" * readme))


# --- Figures: the paper's plots, from the records alone

FRAME = (-0.25, 1.25)   # the attribution axes (the scatter marks a point beyond on its edge)


def redraw_figures(folder):
    """--figures FOLDER: each experiment's figures from <experiment>.jsonl."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(FIGURES_HINT)
        return
    found = {name: records for name, records in folder_records(folder).items() if records}
    for name, records in found.items():
        draw_figures(rows_of(name, records), name, folder)
    print(f"figures of {len(found)} experiment{'s' * (len(found) != 1)} written to {folder}/")


# One colour per built-in mixer (tab10 without its grey, which marks "too little signal"); another
# arch: cyan.
COLOURS = dict(zip(ALL_ARCHS, "tab:blue tab:orange tab:green tab:red tab:purple tab:brown tab:pink "
                              "tab:olive".split()))
colour = lambda arch: COLOURS.get(arch, "tab:cyan")


def patched_runs(records, with_signal=False):
    """The patched records, each run once (its last); only those with signal if `with_signal`."""
    runs = by_run(r for r in records if (r.get("mechanism") or {}).get("attrib_value") is not None)
    return [r for r in runs.values() if not (with_signal and r["mechanism"].get("low_signal"))]


def tiles(fig, n, cols, height):
    """n axes in rows of `cols`, the figure `height` inches per row."""
    fig.set_size_inches(8.0, height * math.ceil(n / cols) + 0.6)
    return [fig.add_subplot(math.ceil(n / cols), cols, i + 1) for i in range(n)]


def plot_scatter(fig, records, of=None):
    """Attrib@Value against Attrib@Query of every patched run of 2+ layers, every seed (the paper's
    Fig. 3): left the runs with signal in the verdict's regions, right those with too little signal
    (hollow: no verdict); a run held at the key is a triangle, one outside FRAME a cross on its edge;
    beside a mark that stacks runs, how many of each mixer; the title: how many runs, of the
    experiment's `of` records."""
    runs = [r for r in patched_runs(records) if r["config"]["n_layers"] > 1]
    arch, mech = [r["config"]["arch"] for r in runs], [r["mechanism"] for r in runs]
    x, y = (np.array([m[k] for m in mech], float) for k in ("attrib_value", "attrib_query"))
    low = np.array([bool(m.get("low_signal")) for m in mech], bool)
    key = np.array([verdict_of(r) == interventions.READINGS["key"] for r in runs], bool)
    (lo, hi), cut = FRAME, interventions.CUT
    outside = (x < lo) | (x > hi) | (y < lo) | (y > hi)
    fig.set_size_inches(11.0, 5.5)
    axes, stacks = fig.subplots(1, 2, sharey=True), {}  # {(hollow, a mark): the runs within 0.03}
    for ax, hollow in zip(axes, (False, True)):
        if not hollow:
            ax.fill_between([cut, hi], [lo, lo], [cut, cut], color="tab:green", alpha=0.12, lw=0)
            ax.fill_between([lo, cut], [cut, cut], [hi, hi], color="tab:purple", alpha=0.12, lw=0)
            ax.text(hi - 0.03, lo + 0.03, "induction", ha="right", color="tab:green")
            ax.text(lo + 0.03, hi - 0.03, "direct retrieval", va="top", color="tab:purple")
        for a in sorted(set(arch), key=arch_rank):
            for tri in (False, True):
                m = (np.array(arch) == a) & (low == hollow) & (key == tri) & ~outside
                ax.scatter(x[m], y[m], s=40, edgecolors=colour(a), marker="^" if tri else "o",
                           facecolors="none" if hollow else colour(a))
        edge = outside & (low == hollow)
        ax.scatter(np.clip(x[edge], lo, hi), np.clip(y[edge], lo, hi), s=50, marker="x",
                   clip_on=False, color=[colour(a) for a, o in zip(arch, edge) if o] or "grey")
        panel = {}
        here = low == hollow
        for a, p in zip(np.array(arch)[here], zip(*np.clip([x, y], lo, hi)[:, here].tolist())):
            at = next((q for q in panel if math.dist(q, p) < 0.03), p)
            panel.setdefault(at, collections.Counter())[a] += 1
        for at, counts in panel.items():
            if sum(counts.values()) > 1:        # one line per mixer, in its colour, largest first
                for i, (a, k) in enumerate(counts.most_common()):
                    ax.annotate(f"{a} ×{k}" if len(counts) > 1 else str(k), at, color=colour(a),
                                xytext=(6, 4 - 9 * i), textcoords="offset points", fontsize=7)
        stacks.update({(hollow, at): sum(c.values()) for at, c in panel.items()})
        ax.set(xlim=FRAME, ylim=FRAME, aspect="equal", xlabel="Attrib@Value")
    axes[0].set(ylabel="Attrib@Query", title=f"with signal: {(~low).sum()} runs")
    axes[1].set_title(f"too little signal (no verdict): {low.sum()} runs")
    for a in sorted(set(arch), key=arch_rank):                         # the legend: every mixer
        axes[0].scatter([], [], s=40, color=colour(a), label=a)
    axes[0].scatter([], [], s=40, marker="^", color="grey", label="held at the key")
    axes[0].scatter([], [], s=50, marker="x", color="grey",
                    label=f"beyond, on the edge ({outside.sum()})")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right center")
    fig.suptitle(f"Attrib@Value against Attrib@Query: {len(runs)} runs of {of or len(records)} "
                 "records (each row's seeds at its chosen rate, patched, 2+ layers; beside a mark: "
                 "the runs it stacks)")
    return {"arch": arch, "value": x, "query": y, "low_signal": low, "key": key, "outside": outside,
            "stacks": stacks}


def plot_width(fig, rows):
    """Accuracy against width (log2 axis), a line per label: the median over seeds, range shaded;
    dashed in its colour, the paper's (WIDTHS_PAPER) where the label is a plain arch."""
    lines, out, ax, ar = {}, {}, fig.subplots(), rows[0]["best"]["config"]["task"] == "ar"
    for row in sorted(rows, key=lambda r: r["d_model"]):
        lines.setdefault(next(iter(widest_rows([row]))), []).append(row)      # its label less width
    for label, line in lines.items():
        accs, c = [spread(row)["acc"] for row in line], colour(line[0]["arch"])
        out[label] = d, med, low, high = (np.array([r["d_model"] for r in line]), *(
            np.array([f(a) for a in accs], float) for f in (statistics.median, min, max)))
        ax.plot(d, med, marker="o", color=c, label=label)
        ax.fill_between(d, low, high, color=c, alpha=0.12, lw=0)
        for w, m, row in zip(d, med, line):
            n, tried = row.get("budget"), row.get("budgets")
            if tried and n > min(tried):                # a budget that grew on its ladder
                ax.annotate(f"{n / 1000:g}k steps", (w, m), xytext=(4, -9), fontsize=7,
                            textcoords="offset points", color=c)
        if ar and label in WIDTHS_PAPER:
            out[label + " (paper)"] = WIDTHS, [float(v) / 100 for v in WIDTHS_PAPER[label][:-1].split(" / ")]
            ax.plot(*out[label + " (paper)"], "--", marker=".", color=c)
    widths = sorted({r["d_model"] for r in rows} | set(WIDTHS * (len(out) > len(lines))))
    ax.set_xscale("log", base=2)
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.set(ylim=(-0.02, 1.02), xlabel="model width (d_model)", ylabel="accuracy",
           title="Accuracy against width: median over seeds, range shaded; beside a point, its steps\n"
           "where its budget grew" + "; dashed: the paper's (the best of its learning rates; 4,096 keys, "
           "16 pairs)" * (len(out) > len(lines)))
    ax.legend(fontsize=8)
    return out


def plot_heatmaps(fig, rows):
    """Per label (its widest row), the best run's table: site x layer by position, with values."""
    rows = [(k, r) for k, r in widest_rows(rows).items() if r["best"].get("mechanism_table")]
    height = 0.24 * max(len(r["best"]["mechanism_table"]["rows"]) for _, r in rows) + 1.2
    panels, image = [], None
    for ax, (label, row) in zip(tiles(fig, len(rows), 1, height), rows):   # one column: screen width
        table = row["best"]["mechanism_table"]
        positions = table["positions"]
        cells = np.array([[t["scores"].get(p) for p in positions] for t in table["rows"]], float)
        sites = [f"L{t['layer']} {t['label'].replace('_', ' ')}" for t in table["rows"]]
        noise = verdict_of(row["best"]) == "no signal"          # its ratios are noise: greyed
        shown = ax.imshow(cells, cmap="Greys" if noise else "RdBu_r", vmin=-1, vmax=1,
                          aspect="auto", alpha=0.3 if noise else 1.0)
        image = shown if image is None or not noise else image      # the colour bar's: in colour
        ax.set_xticks(range(len(positions)), positions, fontsize=8)
        ax.set_yticks(range(len(sites)), sites, fontsize=8)
        for (i, j), c in np.ndenumerate(cells):
            if np.isfinite(c):
                ax.text(j, i, f"{c:.2f}".replace("-0.00", "0.00"), ha="center", va="center",
                        fontsize=7, color="grey" if noise else "white" if abs(c) > 0.6 else "black")
        ax.set_title(f"{label} (d {row['d_model']}): {verdict_of(row['best'])}\n"   # today's rule
                     f"its best seed, {row['best']['config']['seed']}"
                     + " (grey: too little signal, noise)" * noise, fontsize=9)
        panels.append({"label": row.get("label", row["arch"]), "sites": sites, "cells": cells,
                       "positions": list(positions)})
    fig.colorbar(image, ax=fig.axes, shrink=min(1.0, 4 / len(rows)), label="attribution")
    return panels


def plot_box(fig, rows):
    """ATR, as the paper's box plot: a row per site in its order (key, query, value), a box per table
    row over its seeds that can be read, every seed a dot (hollow: too little signal), the cut a line."""
    runs = {row["label"]: [r for r in patched_runs(row["runs"]) if r["config"]["n_layers"] > 1] for row in rows}
    labels = [label for label, patched in runs.items() if patched]          # rows in the table's order
    of = lambda a, k, low: np.array([r["mechanism"][f"attrib_{k}"] for r in runs[a]
                                     if bool(r["mechanism"].get("low_signal")) == low], float)
    out = {a: {k: of(a, k, False) for k in ATTRIBS} for a in labels}
    fig.set_size_inches(8.0, 6.5)
    for ax, k in zip(fig.subplots(3, 1, sharex=True), ("key", "query", "value")):
        (name, c), cut = ATTRIBS[k], interventions.CUT
        ax.axhline(cut, color="grey", ls="--", lw=0.8)
        ax.boxplot([out[a][k] for a in labels], positions=range(len(labels)), widths=0.6,
                   patch_artist=True, boxprops={"facecolor": c, "alpha": 0.5},
                   medianprops={"color": "k"}, showfliers=False)
        for i, a in enumerate(labels):
            for low in (False, True):
                y = np.clip(of(a, k, low), *FRAME)
                ax.scatter(i + np.linspace(-0.15, 0.15, len(y)), y, s=12, color=c,
                           facecolors="none" if low else c, zorder=3)
        ax.set(ylabel=name, ylim=FRAME)
    ax.set_xticks(range(len(labels)), labels)
    fig.axes[0].set_title("Attrib@Key, @Query, @Value, every seed (hollow: too little signal; "
                          f"dashed: the cut, {cut})", fontsize=9)
    return out


def effective_panels(rows):
    """Per mixer of an AR experiment at one width, its most accurate row's (the most keys first)
    best seed's stored effective attention (record["effective"], interventions.effective_record):
    {"label", "verdict", "sites", "positions", "cells"}, cells a row per (layer, reading position)
    over positions 0..query, NaN after a reading position (causal)."""
    with_maps = [row for row in rows if row["best"].get("effective")]
    panels = []
    for a in sorted({row["arch"] for row in with_maps}, key=arch_rank):
        row = max((r for r in with_maps if r["arch"] == a),
                  key=lambda r: (r["best"]["config"].get("num_keys") or 0, run_score(r["best"])))
        eff = row["best"]["effective"]
        at, n = eff["positions"], eff["positions"]["query"] + 1
        pad = lambda v: v + [math.nan] * (n - len(v))
        panels.append({"label": row["label"], "verdict": verdict_of(row["best"]), "positions": at,
                       "sites": ["L0 from the value"]
                       + [f"L{i} from the query" for i in range(len(eff["query"]))],
                       "cells": np.array([pad(eff["value"]), *map(pad, eff["query"])], float),
                       "acc": row["best"]["final"].get("acc")})
    return panels


def plot_effective(fig, panels):
    """effective_panels' maps, a panel per mixer: each row scaled to its largest entry, the roles'
    positions named; titled with the mixer, its seed's accuracy and verdict."""
    for ax, p in zip(tiles(fig, len(panels), 2, 1.5), panels):
        cells = p["cells"] / np.nanmax(np.abs(p["cells"]), axis=1, keepdims=True)
        ax.imshow(cells, cmap="viridis", vmin=0, vmax=1, aspect="auto")
        roles = [k for k in p["positions"] if k in ATTRIBS]                 # key, value, query
        ax.set_xticks([p["positions"][k] for k in roles], [k[0].upper() for k in roles], fontsize=7)
        ax.set_yticks(range(len(p["sites"])), p["sites"], fontsize=7)
        ax.set_title(f"{p['label']} ({fmt_pct(p['acc'])}): {p['verdict']}", fontsize=9)
    fig.supxlabel("position read: K the key, V its value, Q the query (each row scaled to its "
                  "largest entry)", fontsize=8)
    return panels


# The one table of figure kinds, <experiment>_<kind>.png: its drawing, and the data it draws from an
# experiment's (records, rows), none where it does not apply. It names train_grid's and render's files.
FIGURE_KINDS = {
    "scatter": (lambda fig, data: plot_scatter(fig, *data), lambda records, rows: patched_runs(records)
                and (records, sum(r.get("records", len(r["runs"])) for r in rows))),
    "heatmaps": (plot_heatmaps, lambda records, rows: any(r["best"].get("mechanism_table")
                                                          for r in rows) and rows),
    "width": (plot_width, lambda records, rows: len(widest_rows(rows)) < len(rows) and rows),
    "box": (plot_box, lambda records, rows: records[0]["config"]["task"] == "atr"
            and patched_runs(records, with_signal=True) and rows),
    "effective": (plot_effective, lambda records, rows: records[0]["config"]["task"] == "ar"
                  and len({r["d_model"] for r in rows}) == 1
                  and len(p := effective_panels(rows)) >= 4 and p)}


def figures_of(name, rows):
    """{kind: data} of each figure kind that applies to an experiment's rows (a probe: its scatter
    only); drawn by draw_figures, linked by render."""
    probe = EXPERIMENTS[name].probe
    records = [r for row in rows for r in row["runs"]]          # each cell's seeds at its chosen lr
    return {kind: data for kind, (_, of) in FIGURE_KINDS.items()
            if (data := (kind == "scatter" or not probe) and of(records, rows))}


def draw_figures(rows, name, folder):
    """folder/<name>_<kind>.png of each kind that applies: {kind: drawn}; None without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    out = {}
    for kind, data in figures_of(name, rows).items():
        fig = Figure(figsize=(8.0, 6 if kind == "scatter" else 4.5), layout="constrained")
        out[kind] = FIGURE_KINDS[kind][0](fig, data)
        above = fig.get_suptitle()                     # every figure named by its experiment
        fig.suptitle(f"{name}: {EXPERIMENTS[name].finding}" + f"\n{above}" * bool(above),
                     fontsize=10)
        fig.savefig(png := io.BytesIO(), format="png", dpi=100, metadata={"Software": None},
                    bbox_inches="tight")
        mechsm.write_whole(out_path(folder, f"{name}_{kind}.png"), png.getvalue())
    return out


# --- `python run.py bench`: where a training step's time goes, each a ratio measured in one run
# 1. K runs as one batched model (mechsm.Ensemble, as train_group steps them) against the same K
#    models stepped one after another, with the operators each model-step dispatches: on a GPU a
#    small model's step is bound by those launches, and batching is what cuts them.
# 2. Training steps, the fast kernels and readout-only head against kernels="reference".
# 3. The parallel scan against the loop, fft_conv against the direct sum, at long lengths.
# Each kernel gives its slow twin's values and gradients (test_all.py checks it); this times them:
# medians of interleaved rounds after a warm-up round, one thread on a CPU as a sweep's workers run.
# With OpenMP's spinning wait policy a busy second process made the loop kernels 20-30x slower on
# 2 cores: run OMP_WAIT_POLICY=PASSIVE. results/gpu/bench.txt: an H200's (commit e574a2b).

def bench(device="auto", batch=32, steps=None, repeats=None, archs=None, ks=(1, 7, 35),
          lengths=(256, 1024, 4096), print_fn=print):
    """Print (each table as it ends) and return {"groups", "train", "kernels": rows}, each arch at
    d 64 with 2 layers on AR documents. repeats: rounds (default 5 on a GPU, 1 on a CPU), each
    one step of every group and its K models, `steps` training steps (default 10 on a GPU, 1 on a
    CPU)."""
    device, threads = torch.device(mechsm.resolve_device(device)), torch.get_num_threads()
    gpu = device.type == "cuda"
    steps, repeats = steps or (10 if gpu else 1), repeats or (5 if gpu else 1)
    timed = lambda fns: medians(fns, repeats, device)
    print_fn(f"mechsm bench | torch {torch.__version__} | {device}" + (
        f" {torch.cuda.get_device_name(device)}" if gpu else ", one thread")
        + f" | OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY')} | batch {batch} | median of "
        f"{repeats} rounds")
    parts = {"groups": lambda: bench_groups(device, batch, archs, ks, timed),
             "train": lambda: bench_train(device, batch, steps, archs, timed),
             "kernels": lambda: bench_kernels(device, lengths, timed)}
    tables = {}
    torch.set_num_threads(1 if device.type == "cpu" else threads)
    try:
        for (name, part), title in zip(parts.items(), BENCH_TITLES):
            rows = tables[name] = part()
            print_fn("\n" + title.format(steps=steps))
            for row in [rows[0].keys(), *(r.values() for r in rows)]:
                print_fn("".join(f"{v:>18,.2f}" if isinstance(v, float) else f"{v!s:>18}"
                                 for v in row))
    finally:
        torch.set_num_threads(threads)
    return tables


BENCH_TITLES = (
    "1. K runs as one batched model (Ensemble.train_step) against K models stepped one after "
    "another: model-steps/s, and operators per model-step (aten operators dispatched, views not "
    "counted; optimizer included), the paper's AR shape (37 tokens)",
    "2. Training steps/s ({steps} steps a round): fast kernels and readout-only head against "
    "kernels='reference' and the full-vocabulary head",
    "3. Forward+backward ms: parallel_scan_custom_grad against sequential_scan (a, b of "
    "(B, L, 64, 16), B L = 4,096); fft_conv against direct_conv's Toeplitz sum (B 8, D channels)")


def bench_groups(device, batch, archs, ks, timed):
    data = mechsm.tasks.make_ar(batch, seed=0)                 # the paper's AR shape
    tensors = [t.to(device) for t in (data.tokens, data.positions["query"], data.answers)]
    rows = []
    for arch in archs or models.ARCHS:
        for k in ks:
            members = [models.build_model(arch, data.vocab_size, 64, 2, seed=s).to(device)
                       for s in range(k)]
            group, opts = mechsm.Ensemble(members), [mechsm.adamw(m, 1e-3) for m in members]
            lrs = torch.full((k,), 1e-3, dtype=torch.float64, device=device)
            one = lambda: group.train_step(*tensors, lrs)
            t = timed({"group": one, "separate": lambda: [
                train_steps(m, m, o, tensors, 1) for m, o in zip(members, opts)]})
            alone = functools.partial(train_steps, members[0], members[0], opts[0], tensors, 1)
            rows.append(dict(arch=arch, K=k, group_steps_s=k / t["group"],
                             separate_steps_s=k / t["separate"],
                             speedup=t["separate"] / t["group"], group_ops=ops_of(one) / k,
                             separate_ops=ops_of(alone)))
    return rows


def bench_train(device, batch, steps, archs, timed):
    rows = []
    for shape, pairs in (("quick", 8), ("paper", 16)):
        data = mechsm.tasks.make_ar(batch, num_pairs=pairs, seed=0)
        tensors = [t.to(device) for t in (data.tokens, data.positions["query"], data.answers)]
        for arch in archs or models.ARCHS:
            fast, ref = (models.build_model(arch, data.vocab_size, 64, 2, kernels=k, seed=0)
                         .to(device) for k in ("fast", "reference"))
            full_head = lambda t, readout: ref(t)[torch.arange(len(t), device=device), readout]
            opts = mechsm.adamw(fast, 1e-3), mechsm.adamw(ref, 1e-3)
            t = timed({"fast": lambda: train_steps(fast, fast, opts[0], tensors, steps),
                       "reference": lambda: train_steps(ref, full_head, opts[1], tensors, steps)})
            rows.append(dict(shape=shape, tokens=data.tokens.shape[1], arch=arch,
                             fast_steps_s=steps / t["fast"],
                             reference_steps_s=steps / t["reference"],
                             speedup=t["reference"] / t["fast"]))
    return rows


def bench_kernels(device, lengths, timed):
    rows, g = [], torch.Generator().manual_seed(0)
    for length in lengths:
        b, d = max(1, 4096 // length), max(1, min(64, 2**24 // length**2))  # Toeplitz <= 64 MiB
        a, x = (torch.randn(b, length, 64, 16, generator=g) for _ in "ax")   # (b, l, e, n)
        u, k = torch.randn(8, length, d, generator=g), torch.randn(length, d, generator=g)
        for name, slow, fast, inputs, shape in [
                ("parallel_scan", models.sequential_scan, models.parallel_scan_custom_grad,
                 (a.sigmoid(), x), f"B {b}"),
                ("fft_conv", models.direct_conv, models.fft_conv, (u, k / length), f"B 8, D {d}")]:
            inputs = [t.to(device) for t in inputs]
            t = timed({"slow": functools.partial(backward_of, slow, inputs),
                       "fast": functools.partial(backward_of, fast, inputs)})
            rows.append(dict(kernel=name, L=length, shape=shape, reference_ms=1e3 * t["slow"],
                             fast_ms=1e3 * t["fast"], speedup=t["slow"] / t["fast"]))
    return rows


def backward_of(kernel, inputs):
    inputs = [x.detach().requires_grad_() for x in inputs]
    kernel(*inputs).sum().backward()


def train_steps(model, forward, optimizer, tensors, steps):
    """`steps` AdamW steps of `model`, its answer loss from forward(tokens, readout)."""
    for _ in range(steps):
        loss = mechsm.answer_loss(forward, *tensors)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def medians(fns, repeats, device):
    """{name: median seconds of fns[name]()} over `repeats` interleaved rounds after a warm-up."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None
    seconds = {name: [] for name in fns}
    for _ in range(repeats + 1):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s[1:]) for name, s in seconds.items()}


class OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Inside: counts the aten operators dispatched to a kernel (a view launches none)."""
    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += not func.is_view
        return func(*args, **(kwargs or {}))


def ops_of(fn):                          # after a timed round: no one-time setup counted
    with OpCount() as count:
        fn()
    return count.n


if __name__ == "__main__":
    sys.exit(main())
