"""run.py: train the architectures of one experiment of the paper, patch them, report.

Replicates "Mechanistic evaluation of Transformers and state space models" (Arora et al. 2025,
arXiv 2505.15105): accuracy alone does not tell how a model retrieves; interchange interventions
do (attention, Based: induction through the value token; Mamba: direct retrieval at the query).

What `python run.py` does, in the order of this file's first half:
  1. EXPERIMENTS: the experiment's grid, each cell (a row at one width) at its chosen learning
     rate (CHOSEN_LRS, from results/chosen_lrs.json), seed 0 (--replicates: every seed, as results/ holds);
  2. one_run: each run trained (mechsm.py, paper Sec. 4), patched (interventions.py, Sec. 3), saved;
  3. the report: a row per cell, every seed counted, beside the paper's numbers;
  4. main: flags -> the grid -> sweep (one_run per run not yet in --out) -> report_grid.
Below the line `# ===== Below` is the engine (command line, records on disk, the sweep's workers
and shards, the README summary, figures, the benchmark): nothing above needs it to be read.

  python run.py                                    # the quick `ar` experiment, a job per core
  python run.py --experiment atr-medium            # one result of the paper; --list shows them all
  python run.py --arch attention,mamba --d-model 32,64 --lr 1e-3,3e-3 --seeds 0-2
  python run.py --shard 0/4                        # every 4th run of the grid
  python run.py --checkpoint out/ckpt/<run>.pt     # evaluate + patch a saved model
  python run.py --report results; --figures results   # re-render a results folder from its records
  python run.py --device cuda --preset paper       # the paper's grid on a GPU, a cell batched
  OMP_WAIT_POLICY=PASSIVE python run.py bench      # fast kernels against their references

Shape letters: b batch, l sequence length, d d_model, e Mamba's inner width, n SSM state size,
r runs trained as one batched model. Outputs under --out (default out/): results.jsonl (a JSON line
per run; reruns skip what is there), <experiment>.jsonl (added to, never rewritten), .md, _*.png,
ckpt/. Bad input: one line "error: ..." (exit 2); Ctrl-C (130), SIGTERM (143) keep finished runs.
"""

import argparse
import collections
import contextlib
import difflib
import glob
import hashlib
import io
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
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
# One per result of the paper, each with a "quick" grid (sized for a 2-core CPU, aiming at 20
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
# train there (README, difference 18). CHOSEN_LRS (below the line): the cells whose choice is not the
# grid's rate, read from results/chosen_lrs.json, which `--report results` writes from the records.
LR_CHOICE = ("ar-widths", "mamba-conv", "based-ablation", "ar-layers", "atr", "atr-mamba-conv",
             "atr-medium", "ar")   # the grids whose cells choose, in the order they were trained
rung = lambda lr, k: float(f"{lr * 3.0 ** k:.2g}")
run_score = lambda record: (record["status"] == "ok", record["final"].get("acc") or 0.0)   # a failed run never wins


def chosen_lr(lr, seed0):
    """(a cell's rate or None while undecided, the rates seed 0 must train next) from {lr: its seed-0
    record} and the grid's rate `lr`."""
    missing = [rung(lr, k) for k in (-1, 0, 1) if rung(lr, k) not in seed0]
    if missing:
        return None, missing
    tried = [k for k in (-2, -1, 0, 1, 2) if rung(lr, k) in seed0]
    best = max(tried, key=lambda k: (*run_score(seed0[rung(lr, k)]), -abs(k)))
    return (None, [rung(lr, 2 * best)]) if abs(best) == 1 and 2 * best not in tried else (
        rung(lr, best), [])


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
               "Mamba without its short conv learns attention-like induction on ATR",
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
LABEL_FIELDS = ("d_model", "n_layers", "pos_emb", "d_conv", "long_only", "holdout",
                "freeze_features", "num_keys", "steps")


def experiment_configs(name, preset="quick", *, archs=None, widths=None, lrs=None, seeds=None,
                       chosen_lrs=True, **fields_):
    """The Configs of an experiment's grid (runs -> widths -> lrs -> seeds), `fields_` set on every
    run; archs / widths / lrs / seeds narrow or replace the grid's (a new arch: a plain run). The
    quick grids train each cell at its CHOSEN_LRS rate (chosen_lrs=False: the grid's rate)."""
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
    chosen = CHOSEN_LRS.get(name, {}) if preset == "quick" and chosen_lrs and not lrs else {}
    configs = []
    for family in runs:
        arch, steps = family["arch"], pick(spec.get("steps", {}), family["arch"])
        base = {**spec["config"], **({"steps": steps} if steps else {}), **family, **fields_}
        family_lrs = lrs or ([family["lr"]] if "lr" in family else pick(spec["lrs"], arch, [1e-3]))
        for width in widths or spec["widths"]:
            cell_lrs = [chosen.get(cell_name(family, width), lr) for lr in family_lrs]
            configs += [mechsm.Config(**{**base, "d_model": width, "seed": seed,
                                          "lr": float(lr) if isinstance(lr, (int, float)) else lr})
                        for lr in cell_lrs for seed in seeds or pick(spec["seeds"], arch)]
    for cfg in configs:                 # as Config.check, naming the list that set a bad field
        try:
            cfg.check()
        except ValueError as e:
            field = str(e).split(":")[0]
            raise ValueError(f"{by_list.get(field, field)}: {e}" if field in by_list else str(e)) from None
    return configs


# ===== One run: train, patch, record

def patched(model, cfg, dataset):
    """A record's patching fields: the mechanism table, its summary, the effective attention."""
    table = interventions.mechanism(model, dataset, threshold=cfg.gap_filter)
    maps = all(type(b.mixer).effective_map is not models.Mixer.effective_map for b in model.blocks)  # optional
    head = table.get("headline") or table.get("mixer_out") or {}
    summary = {**{f"attrib_{k}": head.get(k) for k in ("key", "value", "query")},
               **{k: table.get(k) for k in ("verdict", "p_clean", "p_corrupt", "low_signal")},
               **table.get("extra", {})}
    return json_safe({"mechanism": summary, "mechanism_table": table,
                      "effective": interventions.effective_record(model, dataset) if maps else None})


def one_run(cfg, out, patch=True, save=True):
    """One run: train `cfg` (mechsm.train, paper Sec. 4), patch the trained model (Sec. 3) and save
    it under OUT/ckpt/: its record, one JSON line of OUT/results.jsonl."""
    record, model = mechsm.train(cfg)
    return finish(record, model, out, patch, save)


def finish(record, model, out, patch=True, save=True):
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

def best_by_lr(records):
    """A row per group of runs differing only in lr and seed (a cell), at the lr whose first seed is
    the most accurate (as chosen_lr; a failed run never wins; ties: the lr with the most seeds, then
    the smaller): arch, d_model, best_lr, runs (best_lr's seeds), best (of them), label, first ({lr:
    the first seed's record})."""
    groups, configs = {}, [config_of(r) for r in records]
    for r in latest(records):
        groups.setdefault(cell_key(r["config"]), {}).setdefault(r["config"]["lr"], []).append(r)
    rows = []
    for per_lr in groups.values():
        seed = min(r["config"]["seed"] for runs in per_lr.values() for r in runs)
        first = {lr: r for lr, runs in sorted(per_lr.items()) for r in runs if r["config"]["seed"] == seed}
        best_lr = max(per_lr, key=lambda lr: (run_score(first[lr]) if lr in first else (False, -1.0),
                                               len(per_lr[lr]), -lr))
        best = max(per_lr[best_lr], key=lambda r: (run_score(r), -r["config"]["seed"]))
        rows.append({"arch": best["config"]["arch"], "d_model": best["config"]["d_model"],
                     "best_lr": best_lr, "runs": per_lr[best_lr], "best": best, "first": first,
                     "label": row_label(config_of(best), configs), "records": sum(map(len, per_lr.values()))})
    return sorted(rows, key=lambda r: (arch_rank(r["arch"]), r["arch"], r["d_model"]))


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
fmt_training = lambda s: tally(s["diagnoses"], s["n"]) or "-"


# a record's attrib_key / _value / _query: their names in the tables and colours in the figures
ATTRIBS = {"key": ("Attrib@Key", "tab:green"), "value": ("Attrib@Value", "tab:red"),
           "query": ("Attrib@Query", "tab:blue")}
UNREADABLE = ("no signal", "failed", "n/a (1 layer)", "-")   # verdicts that give no attribution
lean = lambda record: max(ATTRIBS, key=record["mechanism_table"]["headline"].get)   # its largest


def verdict_of(record, cut=interventions.CUT, gap_scale=1.0):
    """A record's verdict from its stored table, at any cut and gap filter; None if unpatched."""
    table = record.get("mechanism_table")
    if record["status"] != "ok" or not table:
        return "failed" if record["status"] != "ok" else None
    if not table.get("headline"):
        return "n/a (1 layer)"                       # no layer-1 block input to read
    threshold = table["threshold"] * gap_scale
    low = interventions.no_signal(table.get("gap"), threshold)
    return interventions.verdict(table["headline"], low, min(threshold, 0.99), cut)[0]


def spread(row, **rule):
    """A row's distribution over its seeds: n, accuracies, verdicts, where the runs with no signal
    lean (the site of the largest attribution), diagnoses, the readable ones' medians."""
    runs = row["runs"]
    verdicts = [verdict_of(r, **rule) or "-" for r in runs]
    readable = [r for r, v in zip(runs, verdicts) if v not in UNREADABLE]
    heads = [r["mechanism_table"]["headline"] for r in readable]
    return {"n": len(runs), "acc": sorted((r["final"].get("acc") or 0.0) for r in runs),
            "verdicts": collections.Counter(verdicts), "readable": len(readable),
            "leans": collections.Counter(lean(r) for r, v in zip(runs, verdicts) if v == "no signal"
                                         and None not in r["mechanism_table"]["headline"].values()),  # NaN
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
             "seeds": s["n"], "accuracy: median (range)": fmt_acc(s)}
        c.update({k.replace("_acc", " accuracy"): fmt_pct(statistics.median(r["final"].get(k) or 0.0
                  for r in row["runs"])) for k in ("test_acc", "novel_acc") if k in best["final"]})
        c.update({name: "n/a" if best["config"]["n_layers"] == 1 else fmt_num(s["median"][k])
                  for k, (name, _) in ATTRIBS.items()})
        mechs = [r.get("mechanism") or {} for r in row["runs"]]
        for name in [k for k in best.get("mechanism") or {} if "@" in k]:  # the mixer's extras
            c[name] = " / ".join("-" if m.get("low_signal") else fmt_num(m.get(name)) for m in mechs)
        c["verdicts"], c["training"] = fmt_counts(s), fmt_training(s)
        if experiment is not None:
            c["paper"] = paper_text(experiment, row) or "-"
        cells.append(c)
    return markdown(cells)


# ===== main: the story of `python run.py`

def report_grid(name, preset, records, out):
    """Add the records not already in OUT/<name>.jsonl (never rewritten); of all its runs draw the
    figures, write OUT/<name>.md, print its table, timeline and a heatmap."""
    path = out_path(out, f"{name}.jsonl")
    kept = {run_key(r["config"]): r for r in read_results(path)}
    for record in records:
        if kept.get(run_key(record["config"])) != record:
            append_result(path, record)
    records = latest(read_results(path, warn=False))
    if draw_figures(best_by_lr(records), name, out) is None:
        print(FIGURES_HINT, file=sys.stderr)
    rows, text = render(name, preset, records, out)
    mechsm.write_whole(out_path(out, f"{name}.md"), text.encode())
    print(text.split("\n", 2)[2].split("\n![")[0])
    print_heatmap(rows)   # of the most accurate run with an extra site, else the most accurate


def main(argv=None):
    """`python run.py [flags]`: train an experiment's grid, patch each run, report it beside the
    paper. Exit status: 0 ok, 1 a run crashed or a worker died, 2 bad input, 130 Ctrl-C, 143 SIGTERM."""
    with exit_status() as status:          # bad input: one line; Ctrl-C, SIGTERM: finished runs kept
        args = build_parser().parse_args(argv)
        if other_command(args):                  # bench, --list, --figures, --report, --checkpoint
            return 0
        t0, name, out = time.time(), args.experiment or args.task or "ar", args.out or "out"
        device = mechsm.resolve_device(args.device or "auto")
        configs, notes = grid_runs(args, name, device)    # the catalogue's grid, narrowed by flags
        check_runs(configs)                               # bad input: one line, before any training
        jobs, shard, group_size = sweep_plan(args, name, configs, device, notes)   # printed
        before = {run_key(r["config"]): r for r in read_results(out, warn=False)}
        options = dict(jobs=jobs, shard=shard, patch=not args.no_interventions,
                       save=not args.no_save, group_size=group_size)
        if args.choose_lr:              # in rounds: each cell's rates at seed 0, then its seeds
            configs = choose_lrs(configs, out, **options)
        records = sweep(configs, out, **options)          # one_run per run not yet in out
        if not records:
            raise ValueError("no run finished; nothing to report")
        trained = sum(before.get(run_key(r["config"])) != r for r in records)
        if trained:                                       # OUT/<name>.command.json: how to redo it
            record_command(argv, out, name, trained, jobs, time.time() - t0)
        report_grid(name, args.preset or "quick", records, out)
        missing = len({run_key(asdict(c.resolved())) for c in configs}) - sum(   # or to patch
            args.no_interventions or r["status"] != "ok" or bool(r.get("mechanism_table")) for r in records)
        print(f"\n{len(records)} runs in {out}/ ({name}.md, results*.jsonl)" + (
            f"; {missing} still to train or patch (other shards, or runs that crashed)" if missing else "")
            + f" | total wall time {time.time() - t0:.1f}s", file=sys.stderr)
        return 1 if missing and shard[1] == 1 else 0
    return status.code


# ===== Below: machinery a learner can skip (workers, shards, README, figures, benchmark) =====


# --- The grid's helpers

def choices_of(folder):
    """{experiment: {cell_name: rate}} of the LR_CHOICE grids: chosen_lr of each cell's seed-0 records
    in `folder`, where decided and not the grid's rate (results/chosen_lrs.json)."""
    out = {}
    for name in LR_CHOICE:
        seed0, spec = {}, EXPERIMENTS[name].quick                  # {cell_key: {lr: seed 0's record}}
        for r in latest(read_results(os.path.join(folder, f"{name}.jsonl"), warn=False)):
            if r["config"]["seed"] == 0:
                seed0.setdefault(cell_key(r["config"]), {})[r["config"]["lr"]] = r
        names = [cell_name(family, width) for family in spec["runs"] for width in spec["widths"]]
        for label, base in zip(names, experiment_configs(name, seeds=[0], chosen_lrs=False), strict=True):
            lr = chosen_lr(base.lr, seed0.get(cell_key(asdict(base.resolved())), {}))[0]
            if lr not in (None, base.lr):
                out.setdefault(name, {})[label] = lr
    return out


CHOSEN = os.path.join(HERE, "results", "chosen_lrs.json")
CHOSEN_LRS = json.loads(Path(CHOSEN).read_text()) if os.path.isfile(CHOSEN) else {}   # {} in a fork without results/


def cell_name(family, width):
    """A grid cell's name in CHOSEN_LRS: 'mamba (d_conv 2, d 64)'."""
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


def diagnose(record, *, start_margin=0.07, memorised_gap=2.0, plateau=1.5, rise=0.05):
    """What a run's training did, read from its history: the first of the rule under the README's
    summary that holds, its thresholds these keywords (None: no history)."""
    final = record["final"]
    history = [h for h in record.get("history") or [] if None not in map(h.get, ("acc", "loss"))]   # what it reads
    losses = [h["train_loss"] for h in history if h.get("train_loss") is not None]
    if record["status"] != "ok" or not losses or None in map(final.get, ("acc", "loss", "train_loss")):
        return None
    at = lambda part: ([h for h in history if h["step"] <= part * history[-1]["step"]] or history)[-1]
    if final["train_loss"] >= (1 - start_margin) * losses[0]:
        return "never left the start"
    if final["loss"] - final["train_loss"] >= memorised_gap and final["loss"] > at(2 / 3)["loss"]:
        return "memorised"                               # before the copy plateau it explains
    if final["acc"] < plateau * copy_guess(config_of(record)):
        return "copy plateau"
    return "still learning" if final["acc"] - at(3 / 4)["acc"] >= rise else "learned"


def paper_text(name, row):
    """The paper's text for a row of experiment `name` (by its label, else its arch), or None."""
    numbers = EXPERIMENTS[name].paper_numbers
    return numbers.get(row["label"], numbers.get(row["arch"]))


def describe(name, value):
    """A LABEL_FIELDS value in words: 'd 32', '1 layer', 'NoPE', 'd_conv 0', 'default conv', ..."""
    words = {"d_model": f"d {value}", "n_layers": f"{value} layer{'s' * (value != 1)}",
             "pos_emb": "PE" if value else "NoPE", "num_keys": f"{value} keys",
             "long_only": "long convs only" if value else None, "steps": f"{value} steps",
             "d_conv": "default conv" if value is None else f"d_conv {value}"}
    return words.get(name, f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}")


def row_label(cfg, configs, fields_=LABEL_FIELDS):
    """cfg's arch and each of `fields_` varying among its arch's `configs`: 'mamba (d_conv 0)'."""
    cfg = cfg.resolved()
    same_arch = [c.resolved() for c in configs if c.arch == cfg.arch]
    parts = list(filter(None, [describe(name, getattr(cfg, name)) for name in fields_
                               if len({getattr(c, name) for c in same_arch}) > 1
                               and not (name == "d_conv" and cfg.long_only)]))
    return cfg.arch + (f" ({', '.join(parts)})" if parts else "")


# The planner. Training steps/s of one CPU thread at the quick AR shape (V = 8,195), `run.py bench`
# part 3 (results/bench.txt, the other core busy with one job as in a 2-job sweep), scaled per grid.
CPU_STEPS_PER_S = {"attention": 130.3, "base_conv": 136.5, "based": 133.1, "h3": 39.9, "hyena": 85.6,
                   "mamba": 43.7, "deltanet": 79.2,
                   "gated_deltanet": 72.0}  # not in bench.txt: 0.91x DeltaNet's, measured side by side


def estimate_time(configs, jobs=1, shards=1):
    """Rough CPU wall time (text) of training `configs`, split in `shards`, on `jobs` workers."""
    total = 0.0
    for cfg in (c.resolved() for c in configs):
        tokens = 2 * cfg.num_pairs + 5 if cfg.task == "ar" else min(cfg.max_terminals, 64) + 5
        rate = (CPU_STEPS_PER_S.get(cfg.arch, 20.0) * 21 / tokens / max(1.0, cfg.d_model / 64)
                * 2 / cfg.n_layers * 32 / cfg.batch_size)
        total += cfg.total_steps() / rate
    seconds = total / max(1, min(jobs, len(configs))) / shards
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def catalogue():
    """`--list`: each experiment, its claim, the paper's numbers, each preset's runs and time."""
    lines = []
    for name, exp in EXPERIMENTS.items():
        times = [f"{preset}: {len(configs)} runs, ~{estimate_time(configs, 2)}"
                 for preset in PRESETS for configs in [experiment_configs(name, preset)]]
        numbers = "; ".join(f"{k} {v}" for k, v in exp.paper_numbers.items()) or "no number quoted"
        lines += [f"{name:<19} {exp.section}: {exp.finding}", f"{'':<19} paper: {numbers}",
                  f"{'':<19} " + " | ".join(times) + " (2 CPU cores, 2 jobs)"]
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
    columns = columns or list(dict.fromkeys(k for c in cells for k in c))
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


def config_of(record):
    """The Config of a record (fields that Config no longer has are dropped)."""
    return mechsm.Config(**{k: v for k, v in record["config"].items() if k in DEFAULTS or k == "device"})


def fits(value, spec):
    """Whether `value` fits `spec`: a type, a test, {key: spec} (a missing key is None) or [spec]
    (a list, each item fitting spec)."""
    if isinstance(spec, dict):
        return isinstance(value, dict) and all(fits(value.get(k), s) for k, s in spec.items())
    if isinstance(spec, list):
        return isinstance(value, list) and all(fits(v, spec[0]) for v in value)
    return isinstance(value, spec) if isinstance(spec, type) else bool(spec(value))


# What the readers of a record use (tables, timeline, figures, heatmap), of their types.
NUM = lambda v: v is None or isinstance(v, (int, float)) and not isinstance(v, bool) and v - v == 0
REAL = lambda v: v is not None and NUM(v)
NUMS = lambda d: isinstance(d, dict) and all(map(NUM, d.values()))
MAYBE = lambda spec: lambda v: v is None or fits(v, spec)
RECORD = {
    "status": lambda v: v in ("ok", "failed"), "n_params": int, "wall_s": NUM,
    "config": lambda c: fits(c, {"arch": str, "task": lambda v: v in mechsm.TASKS, "lr": REAL,
                                 "d_model": int, "seed": int, "n_layers": int, "eval_size": int})
    and all(v is None or isinstance(v, (str, int, float)) for v in c.values()),
    "final": lambda f: isinstance(f, dict) and all(NUM(v) for k, v in f.items()
                                                    if k.endswith(("acc", "prob", "loss"))),
    "history": MAYBE([{"step": int, **dict.fromkeys(("acc", "loss", "train_loss", "attrib_value", "attrib_query"),
                                                     NUM)}]),
    "mechanism": MAYBE(lambda m: isinstance(m, dict) and fits(m.get("verdict"), MAYBE(str))
                       and all(NUM(v) for k, v in m.items() if k not in ("verdict", "low_signal"))
                       and len({"attrib_key", "attrib_value", "attrib_query"} & set(m)) in (0, 3)),
    "mechanism_table": MAYBE({                           # interventions.mechanism's dict
        "rows": [{"site": str, "label": str, "layer": NUM, "scores": NUMS}], "positions": [str],
        **dict.fromkeys(("p_clean", "p_corrupt", "gap", "seconds"), NUM), "threshold": REAL,
        "verdict": str, "low_signal": bool, "verdict_reason": MAYBE(str), "extra": MAYBE(NUMS),
        "headline": MAYBE(lambda h: NUMS(h) and {"key", "value", "query"} <= set(h))}),
    "effective": MAYBE({                                 # interventions.effective_record's dict
        "query": lambda q: fits(q, [[REAL]]) and q and all(q),
        "value": lambda v: fits(v, [REAL]) and v,
        "positions": lambda p: isinstance(p, dict) and fits(list(p.values()), [int])}),
    "provenance": MAYBE(dict),
    "checkpoint": MAYBE(lambda p: isinstance(p, str) and not os.path.isabs(p)   # inside the folder
                        and ".." not in p.split("/"))}


def read_results(out, warn=True):
    """The run records of one results file, or of every results*.jsonl in the folder `out` (warn: say what is skipped)."""
    records, unknown, say = [], set(), lambda text: warn and print(f"warning: {text}", file=sys.stderr)
    folder, pattern = (out, os.path.join(out, "results*.jsonl")) if os.path.isdir(out) else (os.path.dirname(out), out)
    for path in sorted(glob.glob(pattern)):
        if why := outside(folder, path):
            say(f"{why}; not read")
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f, 1):
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):      # a blank or torn line
                    record = None
                if fits(record, RECORD):                  # not a hand-edited one
                    records.append(record)
                    unknown |= set(record["config"]) - set(DEFAULTS) - {"device"}
                elif line.strip():
                    say(f"{path}:{i}: not a run record (torn, corrupt or hand-edited); skipped")
    if unknown:
        say(f"{out}: config fields this code lacks, ignored (the runs without them): {', '.join(sorted(unknown))}")
    return records


def latest(records):
    """Each run once, its last record, in the order first met."""
    return list({run_key(r["config"]): r for r in records}.values())


def json_safe(x):
    """Replace non-finite floats by None (strict JSON has no NaN) recursively."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def outside(folder, path):
    """Why path, in `folder`, is not the folder's (a link leaving it), else '': every read's and write's."""
    real, target = os.path.realpath(folder), os.path.realpath(path)
    return f"{path} links to {target}, outside {folder}" * (os.path.commonpath([real, target]) != real)


def out_path(out, *parts):
    """out/parts, its folders made, to be written; a ValueError (one line) where writing it would
    change a file outside `out` (a symbolic link leaving it; a file hard-linked to other names)."""
    path = os.path.join(out, *parts)
    if why := outside(out, path):
        raise ValueError(f"{why}; not written (remove the link)")
    if os.path.isfile(path) and os.stat(path).st_nlink > 1:
        raise ValueError(f"{path} is hard-linked to {os.stat(path).st_nlink - 1} other name(s), "
                         "which writing it would change too; not written (remove it or copy it)")
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
    for cfg in configs:
        mechsm.is_config(cfg, "configs").check()
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
    return list({run_key(asdict(c.resolved())): c for runs in rounds for c in runs}.values())


def choice_round(configs, out):
    """The runs the cells of `configs` (at the grid's rates) need next: seed 0 at the rates still to
    try, or the cell's every seed at its chosen rate."""
    done, todo = {run_key(r["config"]): r for r in read_results(out, warn=False)}, []
    for cell in make_groups(configs):                       # whole cells
        at = lambda lr, seed=0: replace(cell[0], lr=lr, seed=seed)
        seed0 = {rung(cell[0].lr, k): done[key] for k in (-2, -1, 0, 1, 2)
                 if (key := run_key(asdict(at(rung(cell[0].lr, k)).resolved()))) in done}
        lr, untried = chosen_lr(cell[0].lr, seed0)
        todo += [at(r) for r in untried] if lr is None else [replace(c, lr=lr) for c in cell]
    return todo


def do_job(kind, payload, out, wants):
    """A worker's job: train a group of configs (one_run, or mechsm.train_group for several), or
    patch a recorded run from its checkpoint: the records; none if it fails (a rerun retries it)."""
    try:
        if kind == "train":
            return ([one_run(payload[0], out, **wants)] if len(payload) == 1 else
                    [finish(record, model, out, **wants) for record, model in mechsm.train_group(payload)])
        cfg, record = payload
        model, saved = mechsm.load(os.path.join(out, record["checkpoint"]),
                                   device=mechsm.resolve_device(cfg.device))
        if run_key(asdict(saved.resolved())) != run_key(record["config"]):
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


def recorded_without(cfg, what, e):
    why = getattr(e, "strerror", None) or " ".join(str(e).split())[:200]
    print(f"warning: {cfg.name()}: {what} ({why}); the run is recorded without it", file=sys.stderr)


def sweep(configs, out, *, jobs=1, shard=(0, 1), patch=True, save=True, group_size=1,
          log=lambda msg: print(msg, file=sys.stderr, flush=True)):
    """Train this shard's runs of `configs` not complete in `out` (patch one with a checkpoint),
    each record appended as it ends; return the grid's in `out`. group_size: runs per model."""
    i, n = shard if isinstance(shard, tuple) and len(shard) == 2 else (None, None)
    size = lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0
    for name, value, ok, expected in [
            ("configs", configs, isinstance(configs, (list, tuple)) and configs,
             "a non-empty list of mechsm.Config"),
            ("patch", patch, isinstance(patch, bool), "True or False"),
            ("save", save, isinstance(save, bool), "True or False"),
            ("out", out, isinstance(out, (str, os.PathLike)) and os.fspath(out), "a folder's path"),
            ("jobs", jobs, size(jobs), "a positive integer"),
            ("group_size", group_size, group_size is None or size(group_size),
             "a positive integer (None: a whole cell)"),
            ("shard", shard, size(n) and isinstance(i, int) and 0 <= i < n, "(I, N), 0 <= I < N")]:
        if not ok:
            raise ValueError(f"{name}: got {value!r}, expected {expected}")
    check_runs(configs)
    unique = {}
    for cfg in configs:
        unique.setdefault(run_key(asdict(cfg.resolved())), cfg)
    mine = [key for j, key in enumerate(unique) if j % n == i]
    done = {run_key(r["config"]): r for r in read_results(out)}
    saved = lambda r: os.path.isfile(p := os.path.join(out, r.get("checkpoint") or "")) and not outside(out, p)
    tabled = lambda r: not patch or r.get("mechanism_table") is not None
    complete = lambda r: r["status"] != "ok" or tabled(r) and (not save or saved(r))
    todo = [key for key in mine if not (key in done and complete(done[key]))]
    if len(todo) < len(mine):
        log(f"sweep: {len(mine) - len(todo)} of {len(mine)} runs already in {out}; skipped")
    patchable = [k for k in todo if k in done and saved(done[k])]   # all "ok"
    [out_path(out, "ckpt", unique[k].name() + ".pt") for k in todo if save]   # a link out of it: refused now
    results = out_path(out, results_name(shard))
    open(results, "ab").close()                     # writable (its OSError names it), before training
    for key in [k for k in todo if k in done and k not in patchable]:     # why a recorded run is trained
        log(f"sweep: {done[key]['name']} has no checkpoint in {out} (or a link out of it); trained again")
    groups = make_groups([unique[k] for k in todo if k not in patchable], group_size)
    work = [("patch", (unique[k], done[k])) for k in patchable] + [("train", g) for g in groups]
    for record in run_jobs(work, out, dict(patch=patch, save=save), jobs):
        append_result(results, record)
    newest = {run_key(r["config"]): r for r in read_results(out, warn=False)}
    return [newest[k] for k in unique if k in newest]


def read_commands(folder, name):
    """{command: its record} of folder/<name>.command.json (each command that trained its runs, and
    how long it took), or {}; warns if bad."""
    path = os.path.join(folder, f"{name}.command.json")
    if not os.path.exists(path):
        return {}
    try:
        c = None if (why := outside(folder, path)) else json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, OSError, RecursionError):
        c = None
    if isinstance(c, dict) and all(fits(v, {**dict.fromkeys(("command", "date", "machine", "load"), str),
                                            "wall_s": REAL, "trained": int, "jobs": int})
                                   for v in c.values()):
        return c
    print(f"warning: {why}; not read" if why else f"warning: {path}: not a command record (corrupt or hand-edited); "
          "skipped", file=sys.stderr)
    return {}


FIGURES_HINT = "figures: pip install matplotlib to draw them (everything else works without it)"


def render(name, preset, records, folder=None):
    """(rows, markdown text) of an experiment's records: the table, the timeline, the provenance."""
    exp, rows = EXPERIMENTS[name], best_by_lr(records)
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
        result_table(rows, None if exp.probe else name), "",
        "Each row counts every seed of its learning rate (lr: where several were tried, seed 0's "
        "accuracy at each, 'failed' where its loss went non-finite and it stopped, and in bold, the "
        "rate chosen: seed 0's best; README, difference 18). Accuracy: the final models on "
        f"{records[0]['config']['eval_size']} fresh documents, median (range). Attrib@X: the median, "
        "over the seeds that can be read, of the restoration of the clean answer probability when "
        "the block input of layer 1 is patched at X (n/a: a 1-layer model has none; its layer-0 "
        "mixer output is in the heatmaps). Verdicts: each seed's, by the README's rule; leans: where "
        "those with no signal point. Training: what each seed's training did, by the rule under the "
        "README's summary. Paper: "
        f"{exp.section}.", "",
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


PAPER = ("paper (accuracy: the best of its 5-7 learning rates at that width; box: its box plot's "
         "medians, pooled over widths and learning rates)")               # which statistic is which
OURS = ("ours (median (range) over seeds at one width and learning rate: the range's top is the best "
        "seed; box: medians)")


def summary_rows(name, rows):
    """The summary's rows of one experiment: each row the paper quotes (every row where it quotes
    none); an experiment over widths: one row per label, its median accuracy at each width."""
    if len({row["d_model"] for row in rows}) > 1:
        lines = {}
        for row in sorted(rows, key=lambda r: r["d_model"]):
            line = lines.setdefault(next(iter(widest_rows([row]))), {"row": row, "cells": []})
            s = spread(row)
            line["cells"].append(f"d {row['d_model']}: {fmt_acc(s)}; {fmt_counts(s)}; {fmt_training(s)}")
        return [{"row": label, PAPER: paper_text(name, line["row"]) or "no number quoted",
                 "holds?": "-", OURS: " · ".join(line["cells"])} for label, line in lines.items()]
    out = []
    for row in [row for row in rows if paper_text(name, row)] or rows:
        s, final, text = spread(row), row["best"]["final"], paper_text(name, row) or ""
        test = statistics.median(r["final"].get("test_acc") or 0 for r in row["runs"])
        split = f"dev {fmt_acc(s)}, test {fmt_pct(test)}" if "test_acc" in final else fmt_acc(s)
        box = " ".join(f"{k[0].upper()} {fmt_num(s['median'][k])}" for k in ("key", "value", "query"))
        box = f"; box {box} ({s['readable']} seeds read)" * ("box" in text)
        out.append({"row": row["label"], PAPER: text or "no number quoted", "holds?": holds(text, s),
                    OURS: f"{split}, best seed {fmt_pct(s['acc'][-1])}{box}; {fmt_counts(s)}; "
                          f"{fmt_training(s)}"})
    return out


SENSITIVITY = [("cut 0.4", dict(cut=interventions.CUT - 0.1)),
               ("cut 0.6", dict(cut=interventions.CUT + 0.1)),
               ("gap filter halved", dict(gap_scale=0.5)), ("gap filter doubled", dict(gap_scale=2.0))]


def sensitivity_table(records):
    """How many verdicts (every patched run) and 'holds?' answers each SENSITIVITY rule changes."""
    runs = {run_key(r["config"]): r for name, rs in records.items() if not EXPERIMENTS[name].probe
            for r in rs if r.get("mechanism_table")}.values()
    judged = [(text, row, answer) for name, rs in records.items() if not EXPERIMENTS[name].probe
              for row in best_by_lr(rs) for text in [paper_text(name, row)] if text
              for answer in [holds(text, spread(row))] if answer != "-"]    # a judged reading
    verdicts, cells = [verdict_of(r) for r in runs], []
    for label, rule in SENSITIVITY:
        moved = collections.Counter((a, b) for a, b in zip(verdicts, (verdict_of(r, **rule) for r in runs))
                                    if a != b)
        flips = sum(a != holds(t, spread(row, **rule)) for t, row, a in judged)
        cells.append({"change": label, "verdicts that change": f"{sum(moved.values())}/{len(verdicts)}",
                      "how": ", ".join(f"{a} -> {b} {k}" for (a, b), k in moved.most_common()) or "-",
                      "'holds?' answers that change": f"{flips}/{len(judged)}"})
    return ("Sensitivity of the verdicts (every patched run of the experiments; "
            f"cut {interventions.CUT}, gap filter per experiment):\n\n" + markdown(cells))


def summary_table(folder="results", names=None, rel=None):
    """The summary of the records in `folder`: the table, the notes under it, probes (names: those
    experiments' rows alone). Links relative to the README (rel: to that folder instead)."""
    rel = os.path.relpath(folder, HERE) if rel is None else rel
    records = {name: latest(read_results(os.path.join(folder, f"{name}.jsonl"), warn=False))
               for name in EXPERIMENTS}
    lines = [{"experiment": f"[{name}]({rel}/{name}.md)" + f": {exp.finding}" * (i == 0), **line}
             for name, exp in EXPERIMENTS.items() if not exp.probe and records[name]
             and name in (names or EXPERIMENTS)
             for i, line in enumerate(summary_rows(name, best_by_lr(records[name])))]
    unique = {run_key(r["config"]): r for rs in records.values() for r in rs}.values()
    cost = lambda r: (r.get("wall_s") or 0) + ((r.get("mechanism_table") or {}).get("seconds") or 0)
    spent = (f"results/ holds {len(unique)} runs: {sum(map(cost, unique)) / 3600:.1f} CPU-hours of training "
             "and patching (the records' wall times summed; every run on one thread), made in shards with "
             "`--choose-lr` and `--replicates`. " + run_py_line(folder))
    out = [markdown(lines, ["experiment", "row", PAPER, OURS, "holds?"])]
    if names:
        return out[0] + "\n\n" + spent
    mech = lambda r: r.get("mechanism") or {}              # a seed recorded unpatched: none
    extras = [f"{row['label']}: " + (", ".join(fmt_num(mech(r).get(name)) for r in row["runs"]
                                           if verdict_of(r) not in UNREADABLE) or "none")
              for row in best_by_lr(records["ar"]) for name in row["best"].get("mechanism") or {}
              if "@" in name]
    if extras:
        out.append("\nThe extra numbers of `ar` (e.g. Mamba's conv@next_key), every seed that can "
                   "be read: " + "; ".join(extras) + ".")
    out.append("\n" + sensitivity_table(records))
    out.append("\n" + spent)
    probes = [f"[{n}]({rel}/{n}.md) ({e.finding})" for n, e in EXPERIMENTS.items() if e.probe]
    out.append("\nThe probes that chose the quick grids (README: how the quick grids were chosen): "
               + "; ".join(probes) + ".")
    return "\n".join(out)


# --- The command line

class Parser(argparse.ArgumentParser):
    """argparse that raises ValueError, refuses an unknown or repeated option, and reads the token
    after an option that takes a value as its value, even one that starts with '-' (--lr -1e-3)."""

    def error(self, message):
        raise ValueError(message)

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        known, given, twice, i = self._option_string_actions, set(), [], 0
        end = args.index("--") if "--" in args else len(args)
        while i < end:
            token, name = args[i], args[i].split("=", 1)[0]
            if token[:1] == "-" and token != "-":
                if name not in known:
                    close = difflib.get_close_matches(name, list(known), n=1)
                    hint = f" (did you mean {close[0]}?)" if close else ""
                    raise ValueError(f"unknown option {name}{hint}; see run.py --help")
                twice += [name] if known[name].dest in given else []
                given.add(known[name].dest)
                if (known[name].nargs is None and "=" not in token and i + 1 < end
                        and args[i + 1].split("=", 1)[0] not in known):
                    args[i:i + 2], end = [f"{token}={args[i + 1]}"], end - 1   # its value, even -1e-3
            i += 1
        namespace, extras = super().parse_known_args(args, namespace)
        if twice:
            raise ValueError(f"{twice[0]}: given twice; give it once (a comma list for several "
                             "values)")
        namespace.given = given                        # the options given, by their dest
        return namespace, extras


def typed(kind, many=False, zero=False):
    """An argparse type: a non-empty str, or a positive (zero: or 0) int below 2**62 or finite
    float; many: a comma list of them, none twice, ints also a range of seeds lo-hi (0-4)."""
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
        if len(set(values)) < len(values):
            raise argparse.ArgumentTypeError(f"a value is repeated in {values}")
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
    a("--experiment", choices=list(EXPERIMENTS), metavar="NAME", help="a paper result (default ar)")
    a("--list", switch=True, help="print the catalogue of experiments and exit")
    a("--preset", choices=PRESETS, help="quick (default: CPU-sized grids, see --list) or paper")
    a("--task", choices=mechsm.TASKS, help="ar or atr: the same as --experiment ar / atr")
    a("--arch", str, True, help="an arch, a comma list or 'all' (" + ", ".join(ALL_ARCHS) + ")")
    a("--d-model", int, True, help="width(s), e.g. 64 or 16,32,64")
    a("--lr", float, True, help="peak learning rate(s), e.g. 1e-3 or 3e-4,1e-3")
    a("--seeds", int, True, zero=True, help="model seed(s): 42, or 0,1,2, or 0-4")
    a("--replicates", switch=True, help="quick grids: every seed of each row, as results/ holds "
      "(default: seed 0 only, a first run)")
    a("--choose-lr", switch=True, help="quick grids: choose each cell's rate as results/ did "
      "(seed 0 at the grid's rate x 3^k, k = -1, 0, 1, a step more past a best end), then train "
      "every seed there")
    # model, task, training: each sets the Config field of its name (--layers: n_layers)
    for flag, text in [
            ("--layers", "number of blocks (paper: 2)"), ("--heads", "attention heads (paper: 1)"),
            ("--d-conv", "short-conv size of the archs that have one (mamba: 0 removes it)"),
            ("--num-keys", "AR keys (paper: 4096)"), ("--num-values", "AR values (paper: 4096)"),
            ("--num-pairs", "AR key-value pairs per document (paper: 16)"),
            ("--num-terminals", "ATR terminals |Σ| (paper: 20 or 8192)"),
            ("--max-rhs-len", "ATR L_max (paper: 5, 10)"), ("--max-depth", "ATR d_max (paper: 10)"),
            ("--holdout", "fraction of pairs held out for a test split (paper: 0.2)"),
            ("--data-seed", "language seed: grammar, held-out pairs, documents (default 42)"),
            ("--steps", "total optimizer steps (beats --epochs; the training set cycles)"),
            ("--epochs", "passes over the training set (paper: 16 AR, 32 ATR)"),
            ("--train-size", "documents in the fixed training set (paper: 100,032)"),
            ("--batch-size", "batch size (paper: 32)"),
            ("--eval-every", "steps between evaluations (paper: 200), and always the last"),
            ("--eval-size", "evaluation documents (paper: 320)")]:
        a(flag, float if flag == "--holdout" else int, zero=flag in ("--d-conv", "--holdout", "--data-seed"),
          help=text)
    a("--pos-emb", choices=["on", "off", "auto"], help="learned positions (auto: per arch)")
    a("--long-only", switch=True, help="based/base_conv: long conv instead of the short conv")
    a("--schedule", choices=mechsm.SCHEDULES, help="decay after the 10%% warmup (paper: cosine)")
    a("--device", choices=mechsm.DEVICES, help="auto (default: cuda if available), cpu or cuda")
    a("--jobs", int, help="runs trained in parallel (default: one per CPU core, 1 on cuda)")
    a("--group-size", int, metavar="K", help="train up to K runs differing only in lr and seed as "
      "one batched model (default: 1 on a CPU, where it does not pay; a whole cell on cuda)")
    a("--shard", metavar="I/N", help="train runs I, I+N, I+2N, ... of the grid (default: "
      "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT); shards of one --out read each other's results")
    a("--out", str, help="output folder (default: out/)")
    a("--no-interventions", switch=True, help="train and evaluate only, skip the patching")
    a("--no-save", switch=True, help="do not save checkpoints under OUT/ckpt/")
    a("--checkpoint", str, help="evaluate and patch this saved model (OUT/ckpt/*.pt), no training")
    a("--figures", str, metavar="FOLDER", help="redraw the figures of a results folder and exit")
    a("--report", str, metavar="FOLDER", help="rewrite the markdown of a results folder from its "
      "records (results/: also the README's summary table) and exit")
    return p


# command-line flag -> Config field, for the flags that set one field of every run they apply to
FIELD_FLAGS = {"layers": "n_layers", "heads": "n_heads", **{name: name for name in (
    "pos_emb d_conv long_only num_keys num_values num_pairs num_terminals max_rhs_len max_depth "
    "holdout data_seed steps epochs train_size batch_size schedule eval_every eval_size").split()}}
TASK_OF = {**dict.fromkeys(["num_keys", "num_values", "num_pairs"], "ar"),   # field -> its task
           **dict.fromkeys(["num_terminals", "max_rhs_len", "max_depth"], "atr")}
MIXER_FIELDS = ("d_conv", "long_only", "n_heads")   # apply only to the archs whose mixer takes them
# the options each command takes; any other option given with it is refused, never silently ignored
COMMAND_OPTIONS = {"bench": {"device"}, **{c: {c} for c in ("list", "figures", "report")},
                   "checkpoint": {"checkpoint", "device", "out", "eval_size", "no_interventions"}}


def grid_runs(args, name, device):
    """(configs, notes): the grid narrowed by --arch/--d-model/--lr/--seeds, each field flag set."""
    for a, b, both in [("--task", "--experiment", args.task and args.experiment),
                       ("--epochs", "--steps", args.epochs and args.steps),
                       ("--replicates", "--seeds", args.replicates and args.seeds),
                       ("--choose-lr", "--lr", args.choose_lr and args.lr),
                       ("--choose-lr", "--seeds", args.choose_lr and args.seeds),
                       ("--choose-lr", "--preset paper", args.choose_lr and args.preset == "paper"),
                       ("--replicates", "--preset paper", args.replicates and args.preset == "paper")]:
        if both:
            raise ValueError(f"{a} and {b}: give one of them ({b} decides what {a} would)")
    given = {flag: getattr(args, flag) for flag in FIELD_FLAGS if getattr(args, flag) is not None}
    if "pos_emb" in given:
        given["pos_emb"] = {"on": True, "off": False, "auto": None}[given["pos_emb"]]
    configs = experiment_configs(name, args.preset or "quick", widths=args.d_model, lrs=args.lr,
                                 archs=ALL_ARCHS if args.arch == ["all"] else args.arch,
                                 seeds=args.seeds or (None if args.replicates or args.choose_lr
                                                      or args.preset == "paper" else [0]),
                                 chosen_lrs=not args.choose_lr, device=device)
    if args.epochs is not None and args.steps is None:
        given["steps"] = None                                # --epochs beats the grid's step counts
    notes = []
    for flag, value in given.items():
        field, opt = FIELD_FLAGS[flag], "--" + flag.replace("_", "-")
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
    cfg = replace(cfg, eval_size=cfg.eval_size if args.eval_size is None else args.eval_size)
    digest = hashlib.sha1(os.path.abspath(args.checkpoint).encode()).hexdigest()[:8]
    path = out_path(args.out or "out", "checkpoint_eval", os.path.splitext(os.path.basename(args.checkpoint))[0]
                    + "-" + digest, f"result_eval{cfg.eval_size}{'_unpatched' * bool(args.no_interventions)}.json")
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
        return False
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


def sweep_plan(args, name, configs, device, notes):
    """(jobs, shard, group_size) of a training command, printed with the grid's size; --out checked
    writable (and free of links out of it) before any training."""
    runs = len({run_key(asdict(c.resolved())) for c in configs})     # flags can make two alike
    for note in notes:
        print(note, file=sys.stderr)
    jobs, why = (args.jobs, "--jobs") if args.jobs else (1, "one process drives the GPU")
    if not args.jobs and device == "cpu":                       # one worker per core
        cores = os.cpu_count() or 1
        jobs = min(cores, runs)
        why = f"{cores} CPU cores" + (f", {jobs} runs" if jobs < cores else "")
    shard, group_size = shard_of(args.shard), args.group_size or (1 if device == "cpu" else None)
    out = args.out or "out"
    files = [results_name(shard), *(name + end for end in (".jsonl", ".md", ".command.json")),
             *(f"{name}_{kind}.png" for kind in FIGURE_KINDS), *["ckpt/"] * (not args.no_save)]
    try:                       # before any training: --out unwritable, or a file linking out of it
        for file in files:
            out_path(out, file)
        tempfile.TemporaryFile(dir=out).close()         # a new file of its own: follows no link
    except OSError as e:
        raise OSError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    print(f"mechsm | experiment {name} ({EXPERIMENTS[name].section}) | preset "
          f"{args.preset or 'quick'} | {runs} runs"
          + (f" | shard {shard[0]}/{shard[1]}" if shard[1] > 1 else "")
          + f" | device {device} | vocabulary {mechsm.probe_task(configs[0])}", file=sys.stderr)
    hours = estimate_time(configs, jobs, shard[1])
    expected = f" | expected ~{hours} on a 2-core CPU" if device == "cpu" else ""
    print(f"plan: {jobs} job{'s' * (jobs > 1)} ({why}){expected}", file=sys.stderr)
    return jobs, shard, group_size


def record_command(argv, out, name, trained, jobs, seconds):
    """OUT/<name>.command.json, {command: its record}: the command line that trained `trained` runs
    (--out relative to the project: no machine's path), how long it took; other commands' kept."""
    rel = os.path.relpath(out, HERE)
    argv = [w.replace(out, rel) if w in (out, "--out=" + out) else w
            for w in (sys.argv[1:] if argv is None else argv)]
    command, p = shlex.join(["python", "run.py", *argv]), provenance()
    commands = {**read_commands(out, name), command: {"command": command,
        "trained": trained, "jobs": jobs, "wall_s": round(seconds, 1), "date": time.strftime("%Y-%m-%d"),
        "machine": machine_of(p),   # what its speed depends on
        "load": "load average %.1f over the last 15 minutes" % os.getloadavg()[2]}}
    mechsm.write_whole(out_path(out, f"{name}.command.json"), json.dumps(commands, indent=1).encode())


@contextlib.contextmanager
def exit_status():
    """main's frame: its `status.code` for bad input (2, one line), a dead worker (1), Ctrl-C (130)
    and SIGTERM (143), which stops the workers as Ctrl-C does."""
    def on_sigterm(signum, frame):     # as Ctrl-C is: the workers stop, finished runs stay kept
        raise KeyboardInterrupt("SIGTERM")
    status, previous = types.SimpleNamespace(code=None), signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield status
    except (ValueError, OSError, BrokenExecutor) as e:   # bad input, ..., a worker process died
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        status.code = 1 if isinstance(e, BrokenExecutor) else 2
    except KeyboardInterrupt as e:
        signal.signal(signal.SIGINT, signal.SIG_IGN)       # a second Ctrl-C cannot cut this short
        sigterm = e.args == ("SIGTERM",)
        print(f"\n{'terminated (SIGTERM)' if sigterm else 'interrupted'}: finished runs are kept "
              "in the results files; rerun to continue", file=sys.stderr)
        status.code = 143 if sigterm else 130
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- Worker processes and signals

def run_jobs(work, out, wants, jobs):
    """Yield each job's records as it finishes: here, or in `jobs` spawned one-thread workers."""
    if jobs <= 1 or len(work) <= 1:
        yield from (r for kind, payload in work for r in do_job(kind, payload, out, wants))
        return
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(work)), initializer=worker_init,
                               initargs=(os.getpid(),), mp_context=get_context("spawn"))
    try:
        futures = [pool.submit(do_job, kind, payload, out, wants) for kind, payload in work]
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


# --- Shards, provenance, older records, the README's summary

def shard_of(text):
    """(I, N) of --shard "I/N", or of SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT, or (0, 1)."""
    source = "--shard"
    if text is None and "SLURM_ARRAY_TASK_ID" in os.environ:
        text = f"{os.environ['SLURM_ARRAY_TASK_ID']}/{os.environ.get('SLURM_ARRAY_TASK_COUNT', '')}"
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
                                    cwd=HERE, timeout=10).stdout.strip()
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


# the pair an effective record's document queries: since 93174a6 a middle one (each role its own
# token), before the last
layout = lambda eff: ("a middle pair", "the last pair")[
    eff["positions"]["next_key"] + 1 == eff["positions"]["query"]]


def best_per_arch(rows):
    """The most accurate row of each architecture (the effective-attention figure's), in order."""
    best = {r["arch"]: r for r in sorted(rows, key=lambda r: r["best"]["final"].get("acc") or 0)}
    return [best[a] for a in dict.fromkeys(r["arch"] for r in rows)]


README = os.path.join(HERE, "README.md")
SUMMARY = ("<!-- summary: `python run.py --report results` writes this table from results/*.jsonl -->",
           "<!-- /summary -->")
HEADLINE = ("ar-widths",)   # the README's rows: the paper's main figure


def run_py_line(folder):
    """What `python run.py` trains, and how long it took, as folder/ar.command.json records it."""
    c, n = read_commands(folder, "ar").get("python run.py"), len(experiment_configs("ar", seeds=[0]))
    return f"`python run.py` trains the {n} seed-0 runs of `ar` at their chosen rates" + (
        f"; `{c['command']}` trained {c['trained']} runs in {c['wall_s'] / 60:.1f} minutes with "
        f"{c['jobs']} jobs on {c['date']} ({c['machine']}, {c['load']})." if c else ".")


def readme_with_summary(text, folder="results"):
    """The README text with its summary block (the HEADLINE rows) rendered anew from `folder`."""
    start, end = text.index(SUMMARY[0]) + len(SUMMARY[0]), text.index(SUMMARY[1])
    return (text[:start] + "\n" + summary_table(folder, HEADLINE) + " Every experiment, the sensitivity of "
            "the verdicts and the probes: [results/README.md](results/README.md).\n" + text[end:])


def results_readme(folder="results"):
    """results/README.md: the whole summary, beside the records it is rendered from."""
    return ("# Every experiment beside the paper\n\n`python run.py --report results` writes this "
            "file from results/*.jsonl; how to read it: the README's \"What we find\".\n\n"
            + summary_table(folder, rel=".") + "\n")


def report_folder(folder):
    """--report FOLDER: <experiment>.md of each <experiment>.jsonl (results/: the READMEs too)."""
    written = {name: records for name in EXPERIMENTS    # each experiment with a record to report
               if (records := latest(read_results(os.path.join(folder, f"{name}.jsonl"))))}
    for name, records in written.items():
        preset = max(PRESETS, key=lambda p: len({run_key(r["config"]) for r in records} & {  # the
            run_key(asdict(c.resolved())) for c in experiment_configs(name, p)}))     # records' grid
        mechsm.write_whole(out_path(folder, f"{name}.md"), render(name, preset, records, folder)[1].encode())
    readme = os.path.realpath(folder) == os.path.realpath(os.path.join(HERE, "results"))
    if readme:
        mechsm.write_whole(README, readme_with_summary(Path(README).read_text(), folder).encode())
        mechsm.write_whole(out_path(folder, "README.md"), results_readme(folder).encode())
        chosen = json.dumps(choices_of(folder), indent=1) + "\n"      # read by the catalogue (CHOSEN_LRS)
        mechsm.write_whole(out_path(folder, "chosen_lrs.json"), chosen.encode())
    print(f"{len(written)} reports written to {folder}/" + (" and the READMEs' summaries" * readme))


# --- Figures: the paper's plots, from the records alone

FRAME = (-0.25, 1.25)   # the attribution axes (the scatter marks a point beyond on its edge)


def redraw_figures(folder):
    """--figures FOLDER: each experiment's figures from <experiment>.jsonl."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(FIGURES_HINT)
        return
    found = {name: records for name in EXPERIMENTS   # each experiment with a record (as --report)
             if (records := latest(read_results(os.path.join(folder, f"{name}.jsonl"))))}
    for name, records in found.items():
        draw_figures(best_by_lr(records), name, folder)
    print(f"figures of {len(found)} experiment{'s' * (len(found) != 1)} written to {folder}/")


def colour(arch):
    """A fixed tab10 colour per arch (ALL_ARCHS order; another arch: one of the last three)."""
    from matplotlib import colormaps
    return colormaps["tab10"](ALL_ARCHS.index(arch) if arch in ALL_ARCHS else 7 + len(arch) % 3)


def patched_runs(records, with_signal=False):
    """The patched records, each run once (its last); only those with signal if `with_signal`."""
    runs = {run_key(r["config"]): r for r in records if (r.get("mechanism") or {}).get("attrib_value") is not None}
    return [r for r in runs.values() if not (with_signal and r["mechanism"].get("low_signal"))]


def tiles(fig, n, cols, height):
    """n axes in rows of `cols`, the figure `height` inches per row."""
    fig.set_size_inches(8.0, height * math.ceil(n / cols) + 0.6)
    return [fig.add_subplot(math.ceil(n / cols), cols, i + 1) for i in range(n)]


def plot_scatter(fig, records, of=None):
    """Attrib@Value against Attrib@Query of every patched run of 2+ layers, every seed, and the
    verdict's regions (the paper's Fig. 3); a run held at the key is a triangle, one outside FRAME
    a cross on its edge; beside a mark, how many runs it stacks; the title: how many runs, of the
    experiment's `of` records."""
    runs = [r for r in patched_runs(records) if r["config"]["n_layers"] > 1]
    arch, mech = [r["config"]["arch"] for r in runs], [r["mechanism"] for r in runs]
    x, y = (np.array([m[k] for m in mech], float) for k in ("attrib_value", "attrib_query"))
    low = np.array([bool(m.get("low_signal")) for m in mech], bool)
    key = np.array([verdict_of(r) == interventions.READINGS["key"] for r in runs], bool)
    (lo, hi), cut, ax = FRAME, interventions.CUT, fig.subplots()
    outside = (x < lo) | (x > hi) | (y < lo) | (y > hi)
    ax.fill_between([cut, hi], [lo, lo], [cut, cut], color="tab:green", alpha=0.12, lw=0)
    ax.fill_between([lo, cut], [cut, cut], [hi, hi], color="tab:purple", alpha=0.12, lw=0)
    ax.text(hi - 0.03, lo + 0.03, "induction", ha="right", color="tab:green")
    ax.text(lo + 0.03, hi - 0.03, "direct retrieval", va="top", color="tab:purple")
    for a in sorted(set(arch), key=arch_rank):
        label, c = a, colour(a)
        for hollow, tri in ((False, False), (False, True), (True, False)):
            m = (np.array(arch) == a) & (low == hollow) & (key == tri) & ~outside
            ax.scatter(x[m], y[m], s=40, edgecolors=c, marker="^" if tri else "o",
                       facecolors="none" if hollow else c, label=label if m.any() else None)
            label = None if m.any() else label
    ax.scatter([], [], s=40, facecolors="none", edgecolors="grey", label="too little signal")
    ax.scatter([], [], s=40, marker="^", color="grey", label="held at the key")
    ax.scatter(np.clip(x[outside], lo, hi), np.clip(y[outside], lo, hi), s=50, marker="x", clip_on=False,
               color=[colour(a) for a, o in zip(arch, outside) if o] or "grey",
               label=f"beyond, on the edge ({outside.sum()})")
    stacks = {}                              # {a mark: the runs within 0.03 of it, drawn over it}
    for p in zip(*np.clip([x, y], lo, hi).tolist()):
        at = next((q for q in stacks if math.dist(q, p) < 0.03), p)
        stacks[at] = stacks.get(at, 0) + 1
    for at, k in stacks.items():
        if k > 1:
            ax.annotate(str(k), at, xytext=(5, 5), textcoords="offset points", fontsize=8)
    ax.set(xlim=FRAME, ylim=FRAME, aspect="equal", xlabel="Attrib@Value", ylabel="Attrib@Query",
           title=f"Attrib@Value against Attrib@Query: {len(runs)} runs of {of or len(records)} records"
           "\n(each row's seeds at its chosen rate, patched, 2+ layers; a number: the runs at a mark)")
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5))
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
        if ar and label in WIDTHS_PAPER:
            out[label + " (paper)"] = WIDTHS, [float(v) / 100 for v in WIDTHS_PAPER[label][:-1].split(" / ")]
            ax.plot(*out[label + " (paper)"], "--", marker=".", color=c)
    widths = sorted({r["d_model"] for r in rows} | set(WIDTHS * (len(out) > len(lines))))
    ax.set_xscale("log", base=2)
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.set(ylim=(-0.02, 1.02), xlabel="model width (d_model)", ylabel="accuracy",
           title="Accuracy against width: median over seeds, range shaded" + ";\ndashed: the paper's "
           "(the best of its learning rates; 4,096 keys, 16 pairs)" * (len(out) > len(lines)))
    ax.legend(fontsize=8)
    return out


def plot_heatmaps(fig, rows):
    """Per label (its widest row), the best run's table: site x layer by position, with values."""
    rows = [(k, r) for k, r in widest_rows(rows).items() if r["best"].get("mechanism_table")]
    height, panels = 0.2 * max(len(r["best"]["mechanism_table"]["rows"]) for _, r in rows) + 1.1, []
    for ax, (label, row) in zip(tiles(fig, len(rows), min(2, len(rows)), height), rows):
        table = row["best"]["mechanism_table"]
        positions = table["positions"]
        cells = np.array([[t["scores"].get(p) for p in positions] for t in table["rows"]], float)
        sites = [f"L{t['layer']} {t['label'].replace('_', ' ')}" for t in table["rows"]]
        image = ax.imshow(cells, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
        ax.set_xticks(range(len(positions)), positions, fontsize=7, rotation=30)
        ax.set_yticks(range(len(sites)), sites, fontsize=7)
        for (i, j), c in np.ndenumerate(cells):
            if np.isfinite(c):
                ax.text(j, i, f"{c:.2f}".replace("-0.00", "0.00"), ha="center", va="center", fontsize=6,
                        color="white" if abs(c) > 0.6 else "black")
        ax.set_title(f"{label} (d {row['d_model']}): {verdict_of(row['best'])}\n"   # today's rule
                     f"its best seed, {row['best']['config']['seed']}", fontsize=9)
        panels.append({"label": row.get("label", row["arch"]), "sites": sites, "cells": cells,
                       "positions": list(positions)})
    fig.colorbar(image, ax=fig.axes, shrink=0.5, label="attribution")
    return panels


def plot_timeline(fig, rows):
    """Per label (its widest row), the best run's accuracy and attributions against the step."""
    rows, out = widest_rows(rows), {}
    axes = tiles(fig, len(rows), min(3, len(rows)), 2.2)
    for ax, (label, row) in zip(axes, rows.items()):
        history = row["best"].get("history") or []
        s = {k: np.array([h.get(k) for h in history], float) for k in ("step", "acc", "attrib_value", "attrib_query")}
        one = row["best"]["config"]["n_layers"] == 1                # n/a in the table: not drawn
        low = np.array([bool(h.get("attrib_low_signal")) or one for h in history], bool)
        s["attrib_value"][low] = s["attrib_query"][low] = np.nan    # too little signal: a gap
        for k, name, c in (("acc", "accuracy", "black"), ("attrib_value", *ATTRIBS["value"]),
                           ("attrib_query", *ATTRIBS["query"])):
            ax.plot(s["step"], np.clip(s[k], *FRAME), color=c, label=name, marker=".", ms=3)
        ax.set(ylim=FRAME, title=f"{label} (d {row['d_model']})\n"
                                 f"its best seed, {row['best']['config']['seed']}")
        ax.tick_params(labelsize=7)
        out[row.get("label", row["arch"])] = s
    fig.supxlabel("training step")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside upper center", ncols=3)
    return out


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
    fig.suptitle(f"ATR: Attrib@Key, @Query, @Value, every seed (hollow: too little signal; dashed: the cut, {cut})")
    return out


def plot_effective(fig, rows):
    """The best run of each architecture, its effective attention on one document: the query's row
    in each layer and the value's row in layer 0, each scaled to its maximum, its named positions on
    the x axis; documents of one layout, the one most of these runs hold (the title: which, and who
    is left out)."""
    rows = [(r, layout(r["best"]["effective"])) for r in best_per_arch(rows) if r["best"].get("effective")]
    kind = collections.Counter(k for _, k in rows).most_common(1)[0][0]         # ties: the first met
    left = [r["arch"] for r, k in rows if k != kind]
    rows = [(r["label"], r) for r, k in rows if k == kind]
    panels = []
    for ax, (label, row) in zip(tiles(fig, len(rows), min(2, len(rows)), 1.5), rows):
        eff = row["best"]["effective"]
        lines = [*eff["query"], eff["value"]]
        cells = np.full((len(lines), len(eff["query"][0])), np.nan)
        for i, line in enumerate(lines):
            cells[i, :len(line)] = np.array(line) / max(max(line), 1e-30)
        names = [f"L{i} @query" for i in range(len(eff["query"]))] + ["L0 @value"]
        ax.imshow(cells, cmap="viridis", vmin=0, vmax=1, aspect="auto")
        at = {**eff["positions"], "divider": eff["positions"]["query"] - 1}   # older records: none
        columns = {t: role.replace("_", " ") for role, t in at.items()}   # the last pair's next key
        ax.set_xticks(list(columns), list(columns.values()), fontsize=6, rotation=90)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_title(f"{label} (d {row['d_model']})", fontsize=9)
        panels.append({"label": row.get("label", row["arch"]), "rows": names, "cells": cells,
                       "columns": columns})
    fig.suptitle("Where the query reads: effective attention, each row / its max (one document per "
                 f"panel, each querying {kind})" + f";\nnot drawn: {', '.join(left)} (documents of "
                 "another layout)" * bool(left))
    return panels


# The one table of figure kinds, <experiment>_<kind>.png: its drawing, and the data it draws from an
# experiment's (records, rows), none where it does not apply. It names train_grid's and render's files.
FIGURE_KINDS = {
    "scatter": (lambda fig, data: plot_scatter(fig, *data), lambda records, rows: patched_runs(records)
                and (records, sum(r.get("records", len(r["runs"])) for r in rows))),
    "timeline": (plot_timeline, lambda records, rows: rows),
    "heatmaps": (plot_heatmaps, lambda records, rows: any(r["best"].get("mechanism_table")
                                                          for r in rows) and rows),
    "width": (plot_width, lambda records, rows: len(widest_rows(rows)) < len(rows) and rows),
    "box": (plot_box, lambda records, rows: records[0]["config"]["task"] == "atr"
            and patched_runs(records, with_signal=True) and rows),
    "effective": (plot_effective, lambda records, rows: any(r["best"].get("effective")
                                                            for r in best_per_arch(rows)) and rows)}


def figures_of(name, rows):
    """{kind: data} of each figure kind that applies to an experiment's rows (a probe: its scatter
    only); drawn by draw_figures, linked by render."""
    probe = getattr(EXPERIMENTS.get(name), "probe", False)
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
        fig.savefig(png := io.BytesIO(), format="png", dpi=100, metadata={"Software": None},
                    bbox_inches="tight")
        mechsm.write_whole(out_path(folder, f"{name}_{kind}.png"), png.getvalue())
    return out


# --- `python run.py bench`: fast paths against references
# Timed in the same run (medians of interleaved repeats). With OpenMP's spinning wait policy a busy
# second process made the loop kernels 20-30x slower on 2 cores: run OMP_WAIT_POLICY=PASSIVE.

def make_step(model, data, device, forward=None, lr=1e-3):
    """A closure: one training step of `model` (or an Ensemble, or `forward`) on all of `data`."""
    batch = [t.to(device) for t in (data.tokens, data.positions["query"], data.answers)]
    if isinstance(model, mechsm.Ensemble):
        return lambda: model.train_step(*batch, [lr] * len(model.modules))
    optimizer = mechsm.adamw(model, lr)

    def step():
        loss = mechsm.answer_loss(forward or model, *batch)
        optimizer.zero_grad(set_to_none=True)
        loss.sum().backward()
        optimizer.step()
        return loss
    return step


SIZES = {"full": dict(lengths=(37, 256, 1024, 4096), b=32, tokens=8192, e=128, n=16, d=128,
                      toeplitz_mib=64, repeats=5, batch=32, steps=10, ks=(1, 7, 35), width=64),
         "tiny": dict(lengths=(37, 64), b=2, tokens=128, e=8, n=4, d=8, toeplitz_mib=512, repeats=1,
                      batch=4, steps=2, archs=("attention", "mamba"), ks=(1, 35), width=16)}


def bench(device="auto", size="full", print_fn=print, parts=(1, 2, 3, 4)):
    """Run the parts (one thread on a CPU, as the workers), print their tables, return them."""
    device, threads = torch.device(mechsm.resolve_device(str(device))), torch.get_num_threads()
    env = dict(torch=torch.__version__, device=str(device), threads=1 if device.type == "cpu" else threads,
               omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "(unset)"), size=size,
               gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None)
    print_fn("mechsm bench | " + " | ".join(f"{k} {v}" for k, v in env.items() if v is not None) + "\n")
    result = dict(env=env)
    torch.set_num_threads(env["threads"])
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            measures = (bench_scan, bench_conv, bench_train, bench_ensemble)
            for part in parts:
                for key, rows, title in measures[part - 1](device, SIZES[size]):
                    print_table(title, rows, print_fn)
                    result[key] = rows
    finally:
        torch.set_num_threads(threads)
    return result


def bench_scan(device, sizes):
    """1a: the plain scan h_t = a_t h_(t-1) + b_t, Mamba-shaped inputs; 1b: the selective scan."""
    plain, selective, e, n = [], [], sizes["e"], sizes["n"]
    for length in sizes["lengths"]:
        b, g = max(1, min(sizes["b"], sizes["tokens"] // length)), torch.Generator().manual_seed(length)
        # a fresh Mamba layer's: delta log-uniform in [1e-3, 1e-1], A = -(1..n), u, B, C normal
        delta = torch.empty(b, length, e).uniform_(math.log(1e-3), math.log(0.1), generator=g).exp()
        A = -torch.arange(1, n + 1, dtype=torch.float32).repeat(e, 1)
        u, B, C = (torch.randn(b, length, k, generator=g) for k in (e, n, n))
        a, bu = torch.exp(delta[..., None] * A), (delta * u)[..., None] * B[:, :, None]   # a_t, b_t
        g = torch.Generator().manual_seed(1)
        plain += compare({"sequential": models.sequential_scan, "scan": models.scan,
                          "parallel": models.parallel_scan_custom_grad}, (a, bu),
                         torch.randn(a.shape, generator=g), sizes, device, L=length, B=b)
        rows = compare({"reference": models.selective_scan_reference,
                        "selective_scan": models.selective_scan}, (u, delta, A, B, C),
                       torch.randn(u.shape, generator=g), sizes, device, L=length, B=b)
        state = a.to(device, copy=True)      # the floor: one in-place pass over that state
        floor = medians({"pass": lambda: state.mul_(1.0)}, max(3, sizes["repeats"]), device)["pass"]
        selective += [dict(row, passes=row["ms"] / (1e3 * floor)) for row in rows]
    return [("scan", plain, f"1a. Plain scan, Mamba-shaped a, b (B, L, {e}, {n}): `scan` (shipped, "
             "picked per device) and `parallel_scan_custom_grad` against `sequential_scan` (plain "
             "autograd)"),
            ("selective_scan", selective, "1b. Mamba's selective scan h_t = exp(delta_t A) h_(t-1) + "
             "delta_t B_t u_t, y = sum_n C h: `selective_scan` against `selective_scan_reference` "
             "(materialised + plain loop); passes = forward+backward time in elementwise passes over "
             "its (B, L, e, n) state (x.mul_(1.0), the floor)")]


def compare(kernels, inputs, grad_out, sizes, device, **labels):
    """Rows: forward+backward of each kernel(*inputs) timed, and its errors against the first's."""
    inputs, grad_out, first = [x.to(device) for x in inputs], grad_out.to(device), list(kernels)[0]
    wide = lambda x: x.to(torch.complex128 if x.is_complex() else torch.float64)  # H3's are complex

    def forward_backward(kernel, xs):                          # [out, *grads]
        xs = [x.detach().requires_grad_() for x in xs]
        out = kernel(*xs)
        return [out, *torch.autograd.grad(out, xs, grad_out.to(out.dtype))]
    exact = forward_backward(kernels[first], [wide(x) for x in inputs])
    times = medians({name: lambda k=k: forward_backward(k, inputs) for name, k in kernels.items()},
                    sizes["repeats"], device)

    def errors(got):
        err = [(wide(x) - x64).abs().max() for x, x64 in zip(got, exact)]
        rel = max(e / x64.abs().max().clamp(min=1e-30) for e, x64 in zip(err[1:], exact[1:]))
        return dict(max_abs_err=err[0].item(), grad_rel_err=rel.item())
    return [dict(labels, kernel=name, ms=1e3 * times[name], speedup=times[first] / times[name],
                 **errors(forward_backward(kernel, inputs))) for name, kernel in kernels.items()]


def bench_conv(device, sizes):
    """2a: the long convolution u (B, L, d) * k (L, d); 2b: the short conv; 2c: H3's SSM kernel."""
    conv, short, ssm, b, c = [], [], [], sizes["b"], 3 * sizes["width"]
    budget = sizes["toeplitz_mib"] * 2**20 * (16 if device.type == "cuda" else 1)
    for length in sizes["lengths"]:
        d, g = max(1, min(sizes["d"], budget // (4 * length * length))), torch.Generator().manual_seed(length)
        u, k, grad_out = (torch.randn(*shape, generator=g)
                          for shape in ((b, length, d), (length, d), (b, length, d)))
        conv += compare({"direct": models.direct_conv, "fft": models.fft_conv},
                        (u, k / length ** 0.5), grad_out, sizes, device, L=length, B=b, D=d)
    g = torch.Generator().manual_seed(0)
    for length in sizes["lengths"][:2]:
        x, w, bias, grad_out = (torch.randn(*shape, generator=g)
                                for shape in ((b, length, c), (c, 1, 3), (c,), (b, length, c)))
        kernels = {"reference": models.short_conv_reference, "short_conv": models.short_conv}
        short += compare(kernels, (x, w, bias), grad_out, sizes, device, L=length, B=b, C=c)
    for length in sizes["lengths"][:2]:
        modes = [t.detach() for t in models.H3(sizes["width"]).to(device).diag_modes()]  # (h, n/2)
        reference = lambda A, W, l=length: 2 * torch.einsum("hn,hnl->lh", W, torch.cumprod(
            A[..., None].expand(*A.shape, l), dim=-1) / A[..., None]).real   # as H3.ssm_kernel's
        kernels = {"reference": reference, "vandermonde": lambda A, W, l=length: models.vandermonde_kernel(A, W, l)}
        (h, half), grad_out = modes[0].shape, torch.randn(length, modes[0].shape[0], generator=g)
        ssm += compare(kernels, modes, grad_out, sizes, device, L=length, H=h, modes=half)
    return [("conv", conv, "2a. Long convolution, forward+backward: fft_conv against direct_conv "
             "(an explicit Toeplitz sum)"),
            ("short_conv", short, "2b. Short causal conv SC_3 (Hyena's, C = 3 x width), "
             "forward+backward: short_conv against short_conv_reference (a shifted copy per tap)"),
            ("ssm_kernel", ssm, "2c. H3's diagonal-SSM kernel K = 2 Re sum W A^lag, forward+backward "
             "from the modes: vandermonde_kernel against the reference's cumprod under autograd")]


def bench_train(device, sizes):
    """3: training steps/s at the quick and the paper's AR shape, the fast path against the slow."""
    rows, n = [], sizes["steps"]
    for shape, pairs in (("quick", 8), ("paper", 16)):
        data = mechsm.tasks.make_ar(sizes["batch"], num_pairs=pairs, seed=0)
        for arch in sizes.get("archs") or models.ARCHS:
            fast, ref = (models.build_model(arch, data.vocab_size, 64, 2, kernels=k, seed=0).to(device)
                         for k in ("fast", "reference"))
            full_head = lambda t, readout, m=ref: m(t)[torch.arange(len(t), device=device), readout]
            steps = {"fast": make_step(fast, data, device), "reference": make_step(ref, data, device, full_head)}
            t = medians({k: lambda s=s: [s() for _ in range(n)][-1].item() for k, s in steps.items()},
                        sizes["repeats"], device)
            rows.append(dict(shape=shape, tokens=data.tokens.shape[1], arch=arch, fast_steps_s=n / t["fast"],
                             reference_steps_s=n / t["reference"], speedup=t["reference"] / t["fast"]))
    return [("train", rows, f"3. Training steps/s (d 64, 2 layers, batch {sizes['batch']}, AdamW): "
             "fast kernels and readout-only head against kernels='reference' and the full-vocabulary head")]


def bench_ensemble(device, sizes):
    """4: K runs as one batched model (mechsm.Ensemble) against K models, stepped one by one."""
    data, rows = mechsm.tasks.make_ar(sizes["batch"], seed=0), []
    for arch in sizes.get("archs") or models.ARCHS:
        for k in sizes["ks"]:
            members = [models.build_model(arch, data.vocab_size, sizes["width"], 2, seed=s).to(device) for s in range(k)]
            group, alone = make_step(mechsm.Ensemble(members), data, device), [make_step(m, data, device) for m in members]
            t = medians({"group": lambda: group().sum().item(), "separate": lambda: [s().item() for s in alone]},
                        sizes["repeats"], device)
            group_ops, separate_ops = ops_per_call(group) / k, ops_per_call(alone[0])
            rows.append(dict(arch=arch, k=k, group_steps_s=k / t["group"], separate_steps_s=k / t["separate"],
                             speedup=t["separate"] / t["group"], group_ops=group_ops, separate_ops=separate_ops,
                             ops_ratio=group_ops / separate_ops))
    return [("ensemble", rows, f"4. K runs (width {sizes['width']}) as one batched model against K models "
             "one after another: model-steps/s, and operators dispatched per model-step (torch.profiler), "
             "optimizer included")]


# Operators that only make a view or read metadata: no kernel on any device, not counted as work.
VIEW_OPS = frozenset("aten::" + name for name in (
    "view as_strided _reshape_alias reshape t transpose permute expand squeeze unsqueeze select slice detach "
    "alias empty empty_strided empty_like movedim unflatten flatten split split_with_sizes chunk unbind narrow "
    "_unsafe_view view_as lift_fresh resolve_conj resolve_neg item _local_scalar_dense result_type").split())


def ops_per_call(fn):
    """Operators doing work in fn()'s second call: its innermost aten:: events less VIEW_OPS."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    outer = {e.cpu_parent.id for e in events if e.cpu_parent and e.cpu_parent.name.startswith("aten::")}
    return sum(1 for e in events if e.id not in outer and e.name not in VIEW_OPS)


def medians(fns, repeats, device):
    """Median seconds of each callable over `repeats` interleaved rounds after a warm-up one."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    times = {name: [] for name in fns}
    for _ in range(repeats + 1):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts[1:]) for name, ts in times.items()}


def print_table(title, rows, print_fn):
    """Print dict rows (the same keys) under a title as aligned columns."""
    fmt = lambda v: (f"{v:.1e}" if 0 < abs(v) < 0.01 else f"{v:,.2f}") if isinstance(v, float) else \
        f"{v:,}" if isinstance(v, int) else str(v)
    cells = [list(rows[0])] + [[fmt(v) for v in row.values()] for row in rows]
    widths = [max(map(len, column)) for column in zip(*cells)]
    print_fn("\n".join([title, *("  " + "  ".join(c.rjust(w) for c, w in zip(line, widths))
                                 for line in cells), ""]))


if __name__ == "__main__":
    sys.exit(main())
