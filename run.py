"""run.py: train the seven architectures on AR (or ATR), patch them, and print one table.

Replicates the central finding of "Mechanistic evaluation of Transformers and state space models"
(Arora et al. 2025, arXiv 2505.15105, Sec. 5): accuracy alone does not tell how a model retrieves;
interchange interventions do (attention/based: induction through the value token; mamba: direct
retrieval at the query). The recipe is mechsm.py's (paper Sec. 4 and App. C); the patching is
interventions.py's (paper Sec. 3-4).

CPU examples:
  python run.py                                    # quick preset on AR: 7 archs in 2 parallel jobs
  python run.py --task atr                         # the same on ATR (L_max = 5, |Σ| = 20)
  python run.py --arch attention,mamba --d-model 32,64 --lr 1e-3,3e-3 --seeds 0-2
  python run.py --checkpoint out/ckpt/ar_mamba_d64_L2_lr0.001_s0.pt   # evaluate + patch a saved model
  python run.py bench --device cpu                 # kernel and step timings
GPU examples:
  python run.py --device cuda                      # quick preset, one job on the GPU
  python run.py --preset paper --device cuda       # the paper's full grid (7 archs x 5 widths x 7 lrs)
                                                   # each cell's lrs and seeds as one batched model;
                                                   # --group-size 7 caps a group at 7 models (memory)

Outputs under --out (default out/): results.jsonl (one JSON line per finished run, with the config,
metrics, history and mechanism summary; reruns skip what is there), results.md (the table),
mechanism_<arch>.json (the full patching result of the run in the table), ckpt/*.pt (checkpoints),
mechanism/*.json (the patching result of every run), claims/ (which process trains which run, so
that several processes can share one --out). --checkpoint writes only under
checkpoint_eval/<checkpoint name>-<hash>/ (result.json, mechanism.json).
Bad input prints one line "error: ..." and exits with status 2. Ctrl-C (130) and SIGTERM (143) stop
the workers and keep every finished run; a rerun resumes.
"""

import argparse
import contextlib
import difflib
import hashlib
import json
import math
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, replace

# PyTorch's CPU allocator backs tensors of 2 MB and more with transparent huge pages when this is set
# (read once, at torch's first allocation, so it must precede `import torch`). A Mamba scan's (b, l, e, n)
# tensors are tens of MB, and the kernel filling fresh 4 KB pages cost more than the arithmetic: with it,
# the CPU scan at L = 1024 ran 2.3x the plain loop instead of 1.3-1.7x (`run.py bench`; both got
# faster). A no-op on a GPU, on macOS or where Linux THP is off. THP_MEM_ALLOC_ENABLE=0 turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402  (after the allocator setting above)

import mechsm
import models


# ----------------------------------------------------------------------------------------------
# Command-line parsing helpers: lists, ranges, on/off. Every mistake becomes one "error: ..." line.
# ----------------------------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    def error(self, message):           # argparse would print usage + message and exit 2; we want one line
        raise ValueError(message)

    def parse_known_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        self.check_options(argv)
        return super().parse_known_args(argv, namespace)

    def check_options(self, argv):
        """Name an unknown option as such. argparse would hand the value after a typo'd flag (--lrr 1e-3)
        to the optional positional subcommand and report "invalid choice: '1e-3'", hiding the typo.
        A token is an option when it starts with '-' and is not a number (-1e-3 is a value)."""
        known = list(self._option_string_actions)
        for token in argv:
            if token == "--":
                break
            if not token.startswith("-") or token == "-":
                continue
            try:
                float(token)
                continue
            except ValueError:
                pass
            name = token.split("=", 1)[0]
            if name in known or (self.allow_abbrev and name.startswith("--")
                                 and any(option.startswith(name) for option in known)):
                continue
            close = difflib.get_close_matches(name, known, n=1)
            raise ValueError(f"unknown option {name}" + (f" (did you mean {close[0]}?)" if close else "")
                             + "; see run.py --help")


def comma_list(kind, what):
    """'a,b,c' -> [kind(a), kind(b), kind(c)]."""
    def parse(text):
        items = [s.strip() for s in text.split(",") if s.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {text!r}")
        try:
            return [kind(s) for s in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {text!r}") from None
    return parse


def seed_list(text):
    """'42' -> [42]; '0,1,2' -> [0, 1, 2]; '0-4' -> [0, 1, 2, 3, 4]."""
    try:
        if "-" in text.strip("-") and "," not in text:
            lo, hi = (int(s) for s in text.split("-"))
            if hi < lo:
                raise ValueError
            return list(range(lo, hi + 1))
        return comma_list(int, "integers")(text)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected seeds like 42, 0,1,2 or 0-4, got {text!r}") from None


AUTO = "auto"   # --pos-emb auto: the paper's convention (learned positions for attention only)


def on_off_auto(text):
    options = {"on": True, "off": False, "auto": AUTO}
    if text not in options:
        raise argparse.ArgumentTypeError(f"expected on, off or auto, got {text!r}")
    return options[text]


def build_parser():
    p = Parser(prog="run.py", description=__doc__,
               epilog="Options left unset take their value from the preset (mechsm.PRESETS); "
                      "see README for what each preset runs and how long it takes.",
               formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("command", nargs="?", default="train", choices=["train", "bench"],
      help="train (default): the sweep, interventions and table; bench: timings of kernels and steps")
    a("--experiment", choices=list(mechsm.EXPERIMENTS), metavar="NAME",
      help="one result of the paper (default: ar); --list shows them all")
    a("--list", action="store_true", help="print the catalogue of experiments and exit")
    a("--preset", default="quick", choices=mechsm.PRESET_NAMES,
      help="quick (default): at most 15 minutes on a 2-core CPU; paper: the paper's full grid")
    a("--task", default="ar", choices=mechsm.TASKS, help="ar (default) or atr: the same as --experiment ar / atr")
    # the grid
    a("--arch", type=comma_list(str, "architecture names"),
      help="one architecture or a comma list, or 'all' (" + ", ".join(mechsm.ALL_ARCHS) + ")")
    a("--d-model", type=comma_list(int, "integers"), help="width(s), e.g. 64 or 16,32,64")
    a("--lr", type=comma_list(float, "numbers"), help="peak learning rate(s), e.g. 1e-3 or 3e-4,1e-3")
    a("--seeds", type=seed_list, help="model seed(s): 42, or 0,1,2, or 0-4")
    # the model
    a("--layers", type=int, help="number of blocks (paper: 2)")
    a("--heads", type=int, help="attention heads (paper: 1); must divide every width")
    a("--pos-emb", type=on_off_auto, help="learned positions: on, off, or auto (= attention only, the paper's figures)")
    a("--d-conv", type=int, help="mamba short-conv size (0 removes it) / based, base_conv short kernel")
    a("--long-only", action="store_true", default=None, help="based/base_conv: long conv instead of the short conv")
    # the task
    a("--num-keys", type=int, help="AR keys (paper: 4096)")
    a("--num-values", type=int, help="AR values (paper: 4096)")
    a("--num-pairs", type=int, help="AR key-value pairs per document (paper: 16)")
    a("--num-terminals", type=int, help="ATR terminals |Σ| (paper: 20 or 8192)")
    a("--max-rhs-len", type=int, help="ATR L_max (paper: 5 or 10)")
    a("--max-depth", type=int, help="ATR d_max (paper: 10)")
    a("--holdout", type=float, help="fraction of pairs held out for a test split (paper's generalisation runs: 0.2)")
    a("--data-seed", type=int, help="language seed: grammar, held-out pairs and documents (default 42)")
    # training
    a("--steps", type=int, help="total optimizer steps (overrides --epochs; the training set is walked cyclically)")
    a("--epochs", type=int, help="passes over the training set (paper: 16 AR, 32 ATR)")
    a("--train-size", type=int, help="documents in the fixed training set (paper: 100,032)")
    a("--batch-size", type=int, help="batch size (paper: 32)")
    a("--schedule", choices=mechsm.SCHEDULES, help="decay after the 10%% warmup: cosine (paper) or linear")
    a("--eval-every", type=int, help="steps between evaluations (paper: 200); the final step is always evaluated")
    a("--eval-size", type=int, help="evaluation documents (paper: 320)")
    # where and how
    a("--device", default="auto", choices=mechsm.DEVICES, help="auto (default: cuda if available), cpu or cuda")
    a("--jobs", type=int, help="runs trained in parallel (default: 2 on a CPU with >= 2 cores, 1 on cuda)")
    a("--group-size", type=int, metavar="K",
      help="train up to K runs that differ only in lr and seed as one batched model (default: 1 on a CPU, "
           "where groups do not pay; a whole (arch, width) cell on cuda); lower it if a group runs out of memory")
    a("--bench-size", default="full", choices=["full", "tiny"], help="bench only: full (minutes on CPU) or tiny (seconds)")
    a("--bench-threads", type=int, default=None, metavar="N",
      help="bench only: torch threads for the run (default: 1 on a CPU, as run.py's training workers use; all on a GPU)")
    a("--out", default="out", help="output folder (default: out/)")
    a("--no-interventions", action="store_true", help="train and evaluate only, skip the patching")
    a("--no-save", action="store_true", help="do not save checkpoints under OUT/ckpt/")
    a("--checkpoint", help="skip training: evaluate and patch this saved model (a .pt from OUT/ckpt/)")
    return p


# ----------------------------------------------------------------------------------------------
# The summary table.
# ----------------------------------------------------------------------------------------------

def fmt_pct(mean, std=None, n=1):
    if mean is None:
        return "-"
    return f"{100 * mean:.1f}%" + (f" ± {100 * std:.1f}" if n > 1 else "")


def fmt_num(x):
    return "-" if x is None else f"{x:.2f}"


def table_rows(rows, paper=None):
    """One table row per family of runs (arch and variant, width): the best run of its grid, as the
    paper reports the best learning rate; the spread over seeds at that learning rate; and the
    paper's number for the row from `paper` ({row label or arch: text})."""
    out = []
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
        cells.update({"Attrib@Key": fmt_num(mech.get("attrib_key")), "Attrib@Value": fmt_num(mech.get("attrib_value")),
                      "Attrib@Query": fmt_num(mech.get("attrib_query"))})
        if any((r["best"].get("mechanism") or {}).get("conv_next_key") is not None for r in rows):
            cells["conv@next_key"] = fmt_num(mech.get("conv_next_key"))
        cells["verdict"] = mech.get("verdict") or "-"
        if paper is not None:
            cells["paper"] = paper.get(cells["architecture"], paper.get(row["arch"], "-"))
        out.append(cells)
    return out


def timeline_text(row, max_rows=6):
    """The best run's history as one line: 'mamba: 0: 0% -/-; 2000: 45% 0.01/0.97; ...' with at most
    max_rows evaluations (evenly spaced, the last one always kept)."""
    history = row["best"].get("history") or []
    keep = sorted({round(i * (len(history) - 1) / max(1, max_rows - 1)) for i in range(max_rows)}) if history else []
    steps = [f"{h['step']}: {fmt_pct(h.get('acc'))} {mechsm.fmt_attrib(h, 'attrib_value')}/"
             f"{mechsm.fmt_attrib(h, 'attrib_query')}" for h in (history[i] for i in keep)]
    return f"  {row.get('label', row['arch'])}: " + "; ".join(steps)


def markdown_table(cells_list):
    columns = list(cells_list[0])
    for cells in cells_list:               # the optional columns (test, novel) of any row
        columns += [c for c in cells if c not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cells.get(c, "-") for c in columns) + " |" for cells in cells_list]
    return "\n".join(lines)


def pick_heatmap_row(rows):
    """The model whose heatmap we print: Mamba when it was trained and patched (the paper's central
    contrast: it retrieves directly at the query, and its short conv carries the key forward, which
    its internal sites show), otherwise the most accurate non-attention model, otherwise attention."""
    candidates = [row for row in rows if row["best"].get("mechanism_path")]
    mamba = [row for row in candidates if row["arch"] == "mamba"]
    others = mamba or [row for row in candidates if row["arch"] != "attention"] or candidates
    return max(others, key=lambda row: (row["best"].get("final") or {}).get("acc") or 0) if others else None


def render_heatmap(mechanism_path):
    import interventions
    return interventions.render_heatmap(read_json(mechanism_path))


def read_json(path):
    with open(path) as f:
        return json.load(f)


def prepare_out(out):
    """Create the output folder and make sure we can write into it, before any training."""
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, f".write_test_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise OSError(f"--out {out}: cannot write there ({e.strerror or e})") from None


# ----------------------------------------------------------------------------------------------
# Subcommands other than the default pipeline.
# ----------------------------------------------------------------------------------------------

def bench_command(args):
    device = mechsm.resolve_device(args.device)
    threads = args.bench_threads if args.bench_threads is not None else (1 if device == "cpu" else None)
    if threads is not None and threads < 1:
        raise ValueError(f"--bench-threads: got {threads}, expected a positive integer")
    bench(device, size=args.bench_size, threads=threads)
    return 0


# The options --checkpoint honours. The saved model fixes its task, architecture, data and training, so
# any other option given with it (--task, --arch, --steps, --jobs, ...) is refused, not silently ignored.
CHECKPOINT_OPTIONS = {"command", "checkpoint", "device", "out", "eval_size", "no_interventions"}


def explicit_options(argv):
    """The dests of the options given on the command line: the parsed namespace alone cannot tell
    `--task ar` from no --task, since argparse fills in defaults."""
    parser = build_parser()
    for action in parser._actions:           # parse again with no defaults: only what was typed remains
        if action.option_strings:            # (a positional keeps its default: argparse checks it)
            action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv))) - {"command"}


def checkpoint_folder(out, checkpoint):
    """OUT/checkpoint_eval/<checkpoint name>-<8 hex digits of its absolute path>: the outputs of one
    --checkpoint evaluation, apart from every file a sweep writes (two checkpoints of the same name
    in different folders get different folders)."""
    stem = os.path.splitext(os.path.basename(checkpoint))[0]
    digest = hashlib.sha1(os.path.abspath(checkpoint).encode()).hexdigest()[:8]
    return os.path.join(out, "checkpoint_eval", f"{stem}-{digest}")


def checkpoint_command(args, use_interventions, explicit=frozenset()):
    """Evaluate (and patch) one saved model: the table with a single row. Its outputs (result.json and
    mechanism.json) go to checkpoint_folder(), never to the sweep's results.jsonl, results_*.md,
    mechanism_*.json or mechanism/; explicit (the options given) outside CHECKPOINT_OPTIONS is refused
    with one line. The checkpoint's vocabulary must match its task (mechsm.load checks it)."""
    t0 = time.time()
    refused = sorted(explicit - CHECKPOINT_OPTIONS)
    if refused:
        raise ValueError(f"{', '.join('--' + name.replace('_', '-') for name in refused)}: cannot be used with "
                         "--checkpoint, which evaluates the saved model on its own task and data (with it: "
                         "--device, --out, --eval-size, --no-interventions)")
    device = mechsm.resolve_device(args.device)          # --device cuda without CUDA: one line, first
    model, cfg = mechsm.load(args.checkpoint, device=device)
    cfg = replace(cfg, out_dir=None, device=device, save_checkpoint=False,
                  eval_size=args.eval_size if args.eval_size is not None else cfg.eval_size).check()
    folder = checkpoint_folder(args.out, args.checkpoint)
    prepare_out(folder)
    n_params = mechsm.models.count_parameters(model)
    print(f"device: {device} | {n_params:,} parameters | {cfg.name()} | outputs in {folder}/", file=sys.stderr)
    data = mechsm.make_data(cfg)
    novel = None
    if cfg.task == "atr":                                 # as train() reports it
        novel = {"eval": mechsm.novel_mask(data.train, data.eval)}
        if data.test is not None:
            novel["test"] = mechsm.novel_mask(data.train, data.test)
    final = mechsm.evaluate_all(model, data, novel)
    record = {"config": asdict(cfg), "name": cfg.name(), "status": "ok", "n_params": n_params, "final": final,
              "checkpoint": os.path.abspath(args.checkpoint)}
    if use_interventions:
        import interventions
        mech = interventions.mechanism(model, data.eval, threshold=cfg.gap_filter)
        record.update(mechanism=mechsm.mechanism_summary(mech),
                      mechanism_path=mechsm.write_json(os.path.join(folder, "mechanism.json"), mech))
    mechsm.write_json(os.path.join(folder, "result.json"), record)
    rows = [{"arch": cfg.arch, "d_model": cfg.d_model, "best": record, "mean": final["acc"], "std": 0.0,
             "n_seeds": 1, "label": cfg.arch}]
    print(markdown_table(table_rows(rows)))
    if use_interventions:
        print(f"\nheatmap of {cfg.arch} ({args.checkpoint}):\n" + render_heatmap(record["mechanism_path"]))
    print(f"\nresults in {folder}/ (result.json{', mechanism.json' if use_interventions else ''}) | "
          f"total wall time {time.time() - t0:.1f}s", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------
# The default pipeline, top to bottom.
# ----------------------------------------------------------------------------------------------

# command-line flag -> Config field, for the flags that override every run of the grid
OVERRIDES = {"layers": "n_layers", "heads": "n_heads", "pos_emb": "pos_emb", "d_conv": "d_conv",
             "long_only": "long_only", "num_keys": "num_keys", "num_values": "num_values",
             "num_pairs": "num_pairs", "num_terminals": "num_terminals", "max_rhs_len": "max_rhs_len",
             "max_depth": "max_depth", "holdout": "holdout", "data_seed": "data_seed", "steps": "steps",
             "epochs": "epochs", "train_size": "train_size", "batch_size": "batch_size",
             "schedule": "schedule", "eval_every": "eval_every", "eval_size": "eval_size"}


def experiment_runs(args, name):
    """The Configs to train: the experiment's grid (mechsm.experiment_configs), narrowed by --arch,
    --d-model, --lr, --seeds and overridden field by field by the other flags. An explicit --epochs
    beats the grid's step counts."""
    fields = {field: None if getattr(args, flag) is AUTO else getattr(args, flag)
              for flag, field in OVERRIDES.items() if getattr(args, flag) is not None}
    if args.epochs is not None and args.steps is None:
        fields["steps"] = None
    archs = mechsm.ALL_ARCHS if args.arch == ["all"] else collapse(args.arch, "--arch")
    return mechsm.experiment_configs(name, args.preset, archs=archs, widths=collapse(args.d_model, "--d-model"),
                                     lrs=collapse(args.lr, "--lr"), seeds=collapse(args.seeds, "--seeds"),
                                     device=args.device, out_dir=args.out,
                                     save_checkpoint=not args.no_save, **fields)


def collapse(values, flag):
    """values (None: the flag was not given) without repeats, in order, with a note on stderr when some
    were repeated: --seeds 0,0 is one seed, never two runs of the same seed counted as two seeds."""
    if values is None:
        return None
    unique = list(dict.fromkeys(values))           # 1e-3 and 0.001 are the same learning rate
    if len(unique) < len(values):
        print(f"note: {flag}: repeated values collapsed: {','.join(f'{v:g}' if isinstance(v, float) else str(v) for v in values)}"
              f" -> {','.join(f'{v:g}' if isinstance(v, float) else str(v) for v in unique)}", file=sys.stderr)
    return unique


def list_command():
    """`run.py --list`: every experiment with the paper's numbers and the expected time of each preset."""
    for name, exp in mechsm.EXPERIMENTS.items():
        times = []
        for preset in mechsm.PRESET_NAMES:
            configs = mechsm.experiment_configs(name, preset)
            times.append(f"{preset}: {len(configs)} runs, ~{mechsm.fmt_hours(mechsm.estimate_seconds(configs, 2))}")
        print(f"{name:<19} {exp.section}: {exp.tests}")
        print(f"{'':<19} paper: " + ("; ".join(f"{k} {v}" for k, v in exp.paper.items()) or "no number quoted"))
        print(f"{'':<19} " + " | ".join(times) + " (2 CPU cores, 2 jobs)")
    return 0


def print_plan(configs, group_size, jobs, device, warmup_steps=0):
    """One stderr line: runs, groups (runs that differ only in lr and seed train as one batched model,
    mechsm.train_group) and, after a short timed warm-up when warmup_steps > 0, the expected wall time."""
    if warmup_steps:
        print(f"plan: timing {warmup_steps} steps of one group per architecture...", file=sys.stderr)
    plan = mechsm.plan(configs, group_size, jobs, warmup_steps)
    expected = "" if plan["seconds"] is None else \
        f" | expected ~{mechsm.fmt_hours(plan['seconds'])} on {device} (from a {warmup_steps}-step warm-up)"
    print(f"plan: {plan['runs']} runs in {plan['groups']} group{'s' * (plan['groups'] != 1)} of at most "
          f"{plan['largest']} (--group-size) | {jobs} job{'s' * (jobs > 1)}{expected}", file=sys.stderr)


def run(argv=None):
    t0 = time.time()
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        return bench_command(args)
    if args.list:
        return list_command()
    if args.experiment and args.task != "ar":
        raise ValueError("--task and --experiment: give one of them (--task atr is --experiment atr)")
    use_interventions = not args.no_interventions
    if args.checkpoint:
        return checkpoint_command(args, use_interventions, explicit_options(argv))

    # -- the runs: the experiment's grid, then the command-line overrides ------------------------
    name = args.experiment or args.task          # --task atr is the experiment "atr"
    configs = experiment_runs(args, name)
    for cfg in configs:                    # one "error: ..." line for bad input, before anything runs
        cfg.check()
    base = configs[0]

    # -- device, data, parameter counts (printed at start) ---------------------------------------
    device = mechsm.resolve_device(args.device)
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs: got {args.jobs}, expected a positive integer")
    jobs = args.jobs or (min(2, os.cpu_count() or 1) if device == "cpu" else 1)
    if args.group_size is not None and args.group_size < 1:
        raise ValueError(f"--group-size: got {args.group_size}, expected a positive integer")
    group_size = args.group_size or mechsm.default_group_size(device)
    vocab = mechsm.probe_task(base)        # raises tasks' ValueError if the task cannot be generated
    for cfg in configs:                    # documents longer than a model's positions: one line, now
        mechsm.check_length(cfg)
    labels = {}
    for cfg in configs:
        labels.setdefault(mechsm.row_label(cfg, configs), cfg)
    # built before anything is printed, so that a model too large to allocate is the only line
    counts = " | ".join(f"{label} {mechsm.count_parameters(cfg, vocab):,}" for label, cfg in labels.items())
    prepare_out(args.out)                  # an unwritable --out fails now, not after an hour of training
    print(f"mechsm | experiment {name} ({mechsm.EXPERIMENTS[name].section}) | preset {args.preset} | "
          f"{len(configs)} runs | device {device} | {jobs} job{'s' * (jobs > 1)} | vocabulary {vocab}",
          file=sys.stderr)
    print("parameters: " + counts, file=sys.stderr)
    print_plan(configs, group_size, jobs, device, warmup_steps=20 if args.preset == "paper" else 0)

    # -- train (every finished run lands in results.jsonl at once) -------------------------------
    results_path = os.path.join(args.out, "results.jsonl")
    after = mechsm.run_interventions if use_interventions else None
    records = mechsm.sweep(configs, results_path=results_path, jobs=jobs, after=after, group_size=group_size)
    errors = [r for r in records if r["status"] == "error"]
    for r in errors:
        print(f"error in run {r['name']}: {r['error']} (not recorded; a rerun retries it)", file=sys.stderr)

    # -- the table: best learning rate per (arch, width), its patching summary -------------------
    rows = mechsm.best_by_lr(records)
    if not rows:
        raise ValueError("no run finished; nothing to report")
    for row in rows:
        row["label"] = mechsm.row_label(mechsm.Config(**row["best"]["config"]), configs)
    table = markdown_table(table_rows(rows, mechsm.EXPERIMENTS[name].paper))
    chosen = ", ".join(f"{row['label']} {row['best']['config']['lr']:g}" for row in rows)
    note = (f"accuracy: final model on {base.eval_size} fresh documents, the best run of the row's grid "
            f"(learning rate: {chosen}); over seeds: mean ± std at that learning rate; Attrib@X: the best "
            f"run's restoration of the clean answer probability (block input of layer 1); paper: "
            f"{mechsm.EXPERIMENTS[name].section}, its largest width unless it says otherwise.")
    timelines = "\n".join(timeline_text(row) for row in rows)
    print(table)
    print(note)
    print("\ntimeline (step: accuracy, Attrib@Value / Attrib@Query on the first "
          f"{base.timeline_docs} eval documents; '-' = too little signal to read):\n{timelines}")
    with open(os.path.join(args.out, f"results_{name}.md"), "w") as f:
        f.write(f"# mechsm results: experiment {name}, preset {args.preset}\n\n{table}\n\n{note}\n\n"
                f"{timelines}\n")

    # -- the mechanisms: one JSON per table row, one heatmap on stdout ----------------------------
    for row in rows:
        path = row["best"].get("mechanism_path")
        if path and os.path.exists(path):
            slug = row["label"].replace(" ", "_").replace("(", "").replace(")", "").replace(",", "")
            mechsm.write_json(os.path.join(args.out, f"mechanism_{name}_{slug}.json"), read_json(path))
    pick = pick_heatmap_row(rows)
    if use_interventions and pick is not None:
        why = ("the paper's central contrast" if pick["arch"] == "mamba" else "the most accurate non-attention model"
               if pick["arch"] != "attention" else "no other architecture was patched")
        print(f"\nheatmap of {pick['label']} ({why}):")
        print(render_heatmap(pick["best"]["mechanism_path"]))
    print(f"\nresults in {args.out}/ (results.jsonl, results_{name}.md, mechanism_{name}_*.json) | "
          f"total wall time {time.time() - t0:.1f}s", file=sys.stderr)
    return 1 if errors else 0



# ----------------------------------------------------------------------------------------------
# `python run.py bench`: how fast the kernels, training steps and patching are, each against its
# slow reference. The paper reports 0.5-5 GPU-hours per training run; our models are tiny,
# so the cost lies in the scan, the long convolutions and framework overhead. Measured:
#   1. the scan as Mamba uses it: (a) the plain scan, shipped `scan` (auto-selected per device) vs the
#      plain-autograd loop `sequential_scan`, with `loop_scan`, `parallel_scan_custom_grad` and plain
#      `parallel_scan` (autograd through the recursion) beside it; (b) Mamba's whole selective scan,
#      `selective_scan` vs `selective_scan_reference`; float64 errors and memory
#      (bytes autograd saves for the backward; on CUDA also the peak allocation);
#   2. `fft_conv` vs `direct_conv` (autograd), forward+backward;
#   3. training steps/s per architecture at the paper's AR configuration (width 64, 2 layers, batch 32,
#      37 tokens, vocabulary 8195): fast kernels + readout-only head vs kernels="reference" + full head;
#   4. the wall time of one full interventions.mechanism table (320 AR documents) per architecture.
# Every figure is the median of several *interleaved* repeats (candidate and reference alternate in the
# same loop, so a burst of load from another process hits both), printed with its ratio to the
# reference measured in the same run: ratios are more stable than times on a shared machine. With
# OpenMP's default (spinning) wait policy a second busy process made loop-heavy kernels 20-30x slower
# on a 2-core machine, so run it as: OMP_WAIT_POLICY=PASSIVE python run.py bench [--device cuda]
# ----------------------------------------------------------------------------------------------

# Sizes. "full" is what `python run.py bench` reports; "tiny" is a smoke test (a few seconds) that
# test_all.py runs so that this code cannot rot. Batch sizes shrink at long l so that everything fits
# in memory on a laptop; the batch actually used is printed in every row.
SIZES = {
    "full": dict(
        scan_lengths=(37, 256, 1024, 4096), scan_shape=dict(b=32, e=128, n=16),
        scan_batch_cpu={1024: 8, 4096: 2},   # CPU: keep b*l <= 8192 so one pass is minutes, not hours
        conv_lengths=(64, 256, 1024, 4096), conv_shape=dict(b=32, d=128),
        toeplitz_mib=64,                     # cap on direct_conv's (l, l, d) tensor (x16 on a GPU)
        repeats=5, train_steps=10, train_repeats=5, train_batch=32,
        archs=None, mech_docs=320,
        ensemble_sizes=(1, 7, 35), ensemble_width=64, ensemble_steps=2, ensemble_repeats=3),
    "tiny": dict(
        scan_lengths=(37, 64), scan_shape=dict(b=2, e=8, n=4), scan_batch_cpu={},
        conv_lengths=(16, 64), conv_shape=dict(b=2, d=8), toeplitz_mib=512,
        repeats=1, train_steps=2, train_repeats=1, train_batch=4,
        archs=("attention", "mamba"), mech_docs=8,
        ensemble_sizes=(1, 35), ensemble_width=16, ensemble_steps=1, ensemble_repeats=1),
}

AR_VOCAB, AR_LENGTH = 8195, 37    # the paper's AR configuration: 4096 keys + 4096 values + 3 specials


# ----------------------------------------------------------------------------------------------
# Timing and printing helpers
# ----------------------------------------------------------------------------------------------

def _pick_device(device):
    """bench's device as a torch.device; mechsm.resolve_device turns "auto" into cuda or cpu and a CUDA
    device on a machine without one into a one-line ValueError."""
    return torch.device(mechsm.resolve_device(str(device)))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(candidates, repeats, device, warmup=1):
    """Median wall time (s) of each zero-argument callable, with the candidates run in turn.

    One warm-up call each first (allocator, lazy init); then `repeats` rounds, each timing every
    candidate once. Alternating inside a round means that a burst of load from another process
    lands on all candidates alike instead of on whichever happened to be running.
    """
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    times = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def saved_tensor_mib(fn):
    """MiB of distinct storages autograd keeps for the backward while fn() runs its forward.

    This is the activation memory a training step holds between forward and backward, measured
    exactly and on any device (a CPU has no peak-allocation counter). Views of one storage (e.g. the
    slices `unbind` hands the loop) are counted once.
    """
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[(s.device, s.data_ptr())] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values()) / 2**20


def cuda_peak_mib(fn, device):
    """Peak CUDA memory (MiB) allocated while fn() runs, above what was allocated before it."""
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def format_table(rows, columns, print_fn=print, title=None):
    """Print dict rows as an aligned table; columns = [(key, header, format)]."""
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        line = []
        for key, _, fmt in columns:
            value = row.get(key)
            line.append("-" if value is None else (fmt.format(value) if fmt else str(value)))
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    if title:
        print_fn(title)
    for i, line in enumerate(cells):
        print_fn("  " + "  ".join(c.rjust(w) for c, w in zip(line, widths)))
        if i == 0:
            print_fn("  " + "  ".join("-" * w for w in widths))
    print_fn("")


# ----------------------------------------------------------------------------------------------
# 1. The scan as Mamba uses it
# ----------------------------------------------------------------------------------------------

def _repeats(cfg, length):
    """Fewer repeats at long l, where one reference call alone takes seconds on a CPU."""
    return cfg["repeats"] if length <= 256 else max(1, (cfg["repeats"] + 1) // 2)


def mamba_like_scan_inputs(b, l, e, n, device, seed=0):
    """Selective-scan inputs distributed like a freshly initialised Mamba layer's (Mamba's own init, models.Mamba).

    Δ log-uniform in [1e-3, 1e-1] (Mamba's Δ init range), A = -(1..n) (S4D-real), u, B, C standard
    normal. Returns dict(u, delta (b,l,e), A (e,n), B, C (b,l,n), a, b (b,l,e,n)) where a = exp(Δ A)
    and b = Δ B u are the inputs of the plain scan h_t = a_t h_{t-1} + b_t. Small Δ means a close to
    1, i.e. long memory, which is where a float32 scan accumulates the most rounding error.
    """
    g = torch.Generator().manual_seed(seed)
    delta = torch.exp(torch.empty(b, l, e).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
    A = -torch.arange(1, n + 1, dtype=torch.float32).repeat(e, 1)            # (e, n)
    u = torch.randn(b, l, e, generator=g)
    B = torch.randn(b, l, n, generator=g)
    C = torch.randn(b, l, n, generator=g)
    a = torch.exp(delta[..., None] * A)                                    # (b, l, e, n)
    bu = (delta * u)[..., None] * B[:, :, None, :]                         # (b, l, e, n)
    out = dict(u=u, delta=delta, A=A, B=B, C=C, a=a, b=bu)
    return {k: v.to(device) for k, v in out.items()}


def scan_candidates():
    """Name -> kernel(a, b) for the plain-scan table; "sequential" (plain autograd loop) is the reference."""
    return {
        "sequential": models.sequential_scan,
        "scan": models.scan,
        "loop": models.loop_scan,
        "parallel": models.parallel_scan_custom_grad,
        "parallel_autograd": models.parallel_scan,
    }


def selective_candidates():
    """Name -> kernel(u, delta, A, B, C) for Mamba's whole selective scan; "reference" is the baseline."""
    return {"reference": models.selective_scan_reference, "selective_scan": models.selective_scan,
            "cpu_loop": models.selective_scan_loop}  # the CPU path, reported on every device


def _time_kernels(kernels, inputs, grad_out, reference, repeats, device):
    """Forward (no_grad) and forward+backward medians, float64 errors and memory for each kernel.

    inputs: tuple of float32 tensors; the oracle is kernels[reference] run in float64. Errors: max abs
    error of the output, and max over inputs of max|grad - grad64| / max|grad64| (gradients of
    <output, grad_out>).
    """
    leaves = tuple(x.clone().requires_grad_() for x in inputs)
    with torch.enable_grad():
        ref_leaves = tuple(x.double().requires_grad_() for x in inputs)
        out64 = kernels[reference](*ref_leaves)
        grads64 = torch.autograd.grad(out64, ref_leaves, grad_out.double())
    out64 = out64.detach()
    del ref_leaves

    def forward(kernel):
        def run():
            with torch.no_grad():
                return kernel(*inputs)
        return run

    def forward_backward(kernel):
        def run():
            return torch.autograd.grad(kernel(*leaves), leaves, grad_out)
        return run

    fwd = interleaved_medians({k: forward(f) for k, f in kernels.items()}, repeats, device)
    fwdbwd = interleaved_medians({k: forward_backward(f) for k, f in kernels.items()}, repeats, device)
    rows = []
    for name, kernel in kernels.items():
        err = (forward(kernel)().double() - out64).abs().max().item()
        grads = forward_backward(kernel)()
        grad_err = max(((g.double() - g64).abs().max() / g64.abs().max().clamp(min=1e-30)).item()
                       for g, g64 in zip(grads, grads64))
        row = dict(kernel=name, repeats=repeats,
                   fwd_ms=1e3 * fwd[name], fwd_speedup=fwd[reference] / fwd[name],
                   fwdbwd_ms=1e3 * fwdbwd[name], fwdbwd_speedup=fwdbwd[reference] / fwdbwd[name],
                   max_abs_err=err, grad_rel_err=grad_err,
                   saved_mib=saved_tensor_mib(lambda: kernel(*leaves)))
        if device.type == "cuda":
            row["peak_mib"] = cuda_peak_mib(forward_backward(kernel), device)
        rows.append(row)
    return rows


SCAN_COLUMNS = [("l", "L", None), ("b", "B", None), ("kernel", "kernel", None), ("repeats", "reps", None),
                ("fwd_ms", "fwd ms", "{:.2f}"), ("fwd_speedup", "x ref", "{:.2f}"),
                ("fwdbwd_ms", "fwd+bwd ms", "{:.2f}"), ("fwdbwd_speedup", "x ref", "{:.2f}"),
                ("max_abs_err", "err vs f64", "{:.1e}"), ("grad_rel_err", "grad rel err", "{:.1e}"),
                ("saved_mib", "saved MiB", "{:.1f}")]


def bench_scan(device, cfg, print_fn=print):
    """Table 1a (the plain scan on Mamba-shaped inputs) and 1b (Mamba's whole selective scan)."""
    shape, plain, selective = cfg["scan_shape"], [], []
    columns = SCAN_COLUMNS + ([("peak_mib", "peak MiB", "{:.1f}")] if device.type == "cuda" else [])
    for length in cfg["scan_lengths"]:
        batch = shape["b"] if device.type == "cuda" else cfg["scan_batch_cpu"].get(length, shape["b"])
        x = mamba_like_scan_inputs(batch, length, shape["e"], shape["n"], device, seed=length)
        g = torch.Generator().manual_seed(1)
        grad_h = torch.randn(x["a"].shape, generator=g).to(device)
        for row in _time_kernels(scan_candidates(), (x["a"], x["b"]), grad_h, "sequential",
                                 _repeats(cfg, length), device):
            plain.append(dict(l=length, b=batch, **row))
        del grad_h
        grad_y = torch.randn(x["u"].shape, generator=g).to(device)
        for row in _time_kernels(selective_candidates(), tuple(x[k] for k in "u delta A B C".split()),
                                 grad_y, "reference", _repeats(cfg, length), device):
            selective.append(dict(l=length, b=batch, **row))
        del x
    format_table(plain, columns, print_fn,
                 title=f"1a. Plain scan h_t = a_t h_(t-1) + b_t on Mamba-shaped a, b (B, L, E={shape['e']}, "
                       f"N={shape['n']}) float32. `scan` = shipped, auto-selected per device; x ref = "
                       "speed-up over `sequential` (plain-autograd loop); fwd under no_grad; err vs a "
                       "float64 loop; saved MiB = tensors autograd keeps for the backward")
    format_table(selective, columns, print_fn,
                 title="1b. Mamba's selective scan (what the Mamba mixer runs): y = sum_n C h, "
                       "h_t = exp(delta_t A) h_(t-1) + delta_t B_t u_t; `selective_scan` = shipped; "
                       "x ref = speed-up over selective_scan_reference (materialised + plain loop)")
    return plain, selective


# ----------------------------------------------------------------------------------------------
# 2. Long convolution
# ----------------------------------------------------------------------------------------------

def bench_conv(device, cfg, print_fn=print):
    rows = []
    for length in cfg["conv_lengths"]:
        # direct_conv materialises an (l, l, d) Toeplitz tensor, and its backward scatters l^2 d
        # gradient entries back into k (seconds on a CPU): cap d so the reference stays affordable.
        budget = cfg["toeplitz_mib"] * (16 if device.type == "cuda" else 1)
        d = int(max(1, min(cfg["conv_shape"]["d"], budget * 2**20 // (4 * length * length))))
        batch = cfg["conv_shape"]["b"]
        g = torch.Generator().manual_seed(length)
        u = torch.randn(batch, length, d, generator=g).to(device)
        k = (torch.randn(length, d, generator=g) / length ** 0.5).to(device)
        grad_out = torch.randn(batch, length, d, generator=g).to(device)
        u_req, k_req = u.clone().requires_grad_(), k.clone().requires_grad_()

        def forward_backward(kernel):
            def run():
                return torch.autograd.grad(kernel(u_req, k_req), (u_req, k_req), grad_out)
            return run

        repeats = _repeats(cfg, length)
        times = interleaved_medians({"direct": forward_backward(models.direct_conv),
                                     "fft": forward_backward(models.fft_conv)}, repeats, device)
        with torch.no_grad():
            y64 = models.direct_conv(u.double(), k.double())
            err = (models.fft_conv(u, k).double() - y64).abs().max().item()
        rows.append(dict(l=length, b=batch, d=d, repeats=repeats, direct_ms=1e3 * times["direct"],
                         fft_ms=1e3 * times["fft"], fft_speedup=times["direct"] / times["fft"],
                         fft_max_abs_err=err))
    format_table(rows, [("l", "L", None), ("b", "B", None), ("d", "D", None), ("repeats", "reps", None),
                        ("direct_ms", "direct ms", "{:.2f}"), ("fft_ms", "fft ms", "{:.2f}"),
                        ("fft_speedup", "fft x direct", "{:.2f}"), ("fft_max_abs_err", "fft err vs f64", "{:.1e}")],
                 print_fn,
                 title="2. Long convolution u (B, L, D) * k (L, D), forward+backward (grads to u and k): "
                       "fft_conv vs direct_conv (autograd); D capped at long L so direct_conv's (L, L, D) "
                       "Toeplitz tensor and its scatter-add backward stay affordable")
    return rows


# ----------------------------------------------------------------------------------------------
# 3. Training steps per second
# ----------------------------------------------------------------------------------------------

def _ar_dataset(n, seed=0):
    return mechsm.tasks.make_ar(n, seed=seed)


def _archs(cfg):
    """Every registered architecture (or the few a tiny run uses)."""
    return list(cfg["archs"] or models.ARCHS)


def make_train_step(model, data, batch, reference, device):
    """A closure doing one AdamW step on the next AR batch, with loss at the readout position only.

    Fast: model(tokens, readout=query) applies the head to one row per document. Reference: the
    full-vocabulary head over every position, then index the query row (what a naive loop does).
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    tokens, answers = data.tokens.to(device), data.answers.to(device)
    query = data.positions["query"].to(device)
    n_batches = len(tokens) // batch
    state = {"i": 0}

    def step():
        i = state["i"] % n_batches
        state["i"] += 1
        sl = slice(i * batch, (i + 1) * batch)
        x, y, q = tokens[sl], answers[sl], query[sl]
        if reference:
            logits = model(x)[torch.arange(len(x), device=device), q]   # (b, l, v) -> (b, v)
        else:
            logits = model(x, readout=q)                                 # (b, v)
        loss = torch.nn.functional.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    return step


def _bench_model(arch, device, kernels="fast"):
    """The paper's AR-shaped model (width 64, 2 layers), seeded so that twins start identical."""
    return models.build_model(arch, AR_VOCAB, 64, 2, kernels=kernels, seed=0).to(device)


def bench_train(device, cfg, print_fn=print):
    data = _ar_dataset(cfg["train_batch"] * cfg["train_steps"] * 2, seed=0)
    rows = []
    for arch in _archs(cfg):
        fast, ref = _bench_model(arch, device), _bench_model(arch, device, "reference")
        steps = {"fast": make_train_step(fast, data, cfg["train_batch"], False, device),
                 "reference": make_train_step(ref, data, cfg["train_batch"], True, device)}
        n = cfg["train_steps"]

        def many(step):
            def run():
                for _ in range(n):
                    loss = step()
                return loss.item()  # .item() syncs, like a real training loop logging its loss
            return run

        times = interleaved_medians({k: many(s) for k, s in steps.items()}, cfg["train_repeats"], device)
        rows.append(dict(arch=arch, params=sum(p.numel() for p in fast.parameters()),
                         fast_steps_s=n / times["fast"], reference_steps_s=n / times["reference"],
                         speedup=times["reference"] / times["fast"]))
    format_table(rows, [("arch", "arch", None), ("params", "params", "{:,}"),
                        ("fast_steps_s", "steps/s", "{:.1f}"), ("reference_steps_s", "ref steps/s", "{:.1f}"),
                        ("speedup", "x ref", "{:.2f}")], print_fn,
                 title=f"3. Training steps/s at the paper's AR configuration (d=64, 2 layers, batch "
                       f"{cfg['train_batch']}, {AR_LENGTH} tokens, V={AR_VOCAB}, AdamW, loss at the "
                       "readout only); ref = kernels='reference' + full-vocabulary head")
    return rows


# ----------------------------------------------------------------------------------------------
# 4. One full intervention table
# ----------------------------------------------------------------------------------------------

def bench_mechanism(device, cfg, print_fn=print):
    import interventions
    data = _ar_dataset(cfg["mech_docs"], seed=1).to(device)
    rows = []
    for arch in _archs(cfg):
        model = _bench_model(arch, device).eval()
        _sync(device)
        start = time.perf_counter()
        result = interventions.mechanism(model, data, n_docs=cfg["mech_docs"])
        _sync(device)
        seconds = time.perf_counter() - start
        rows.append(dict(arch=arch, docs=len(data), seconds=seconds, cells=_count_cells(result)))
    format_table(rows, [("arch", "arch", None), ("docs", "docs", None), ("cells", "table cells", None),
                        ("seconds", "seconds", "{:.2f}")], print_fn,
                 title="4. One full interventions.mechanism table (every site x layer x position), "
                       "untrained model, one run each")
    return rows


def _count_cells(result):
    """Number of patched (site, position) cells in a mechanism result."""
    return sum(len(row.get("scores", {})) for row in result.get("rows", []))


# ----------------------------------------------------------------------------------------------
# 5. Groups: K runs of one (arch, width) cell trained as one batched model
# ----------------------------------------------------------------------------------------------

# Operators that only make a view or read metadata: no kernel on any device, so not counted as work.
VIEW_OPS = frozenset("aten::" + name for name in (
    "view as_strided _reshape_alias reshape t transpose permute expand squeeze unsqueeze select slice detach "
    "alias empty empty_strided empty_like movedim unflatten flatten split split_with_sizes chunk unbind narrow "
    "_unsafe_view view_as lift_fresh resolve_conj resolve_neg item _local_scalar_dense result_type").split())


def ops_per_call(fn):
    """Operators that do work dispatched by fn(), counted by torch.profiler on the CPU side of any device
    (second call; the first warms up): the aten:: events with no aten:: event inside them (what is left
    once composite ops and vmap's batching rules are taken apart), less VIEW_OPS. On a GPU each is
    about one kernel launch, the cost that dominates runs this small."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    outer = {e.cpu_parent.id for e in events if e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")}
    return sum(1 for e in events if e.id not in outer and e.name not in VIEW_OPS)


def bench_ensemble(device, cfg, print_fn=print):
    """Table 5: K members of one group (mechsm.Ensemble) against the same K models trained one after
    another (answer_loss + torch.optim.AdamW, as mechsm.train steps), at the paper's AR shape."""
    batch, width, n = cfg["train_batch"], cfg["ensemble_width"], cfg["ensemble_steps"]
    data = _ar_dataset(batch, seed=0)
    x, q, y = data.tokens.to(device), data.positions["query"].to(device), data.answers.to(device)

    def alone(model, optimizer):
        loss = mechsm.answer_loss(model, x, q, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    rows = []
    for arch in _archs(cfg):
        separate_ops = None
        for k in cfg["ensemble_sizes"]:
            members = [models.build_model(arch, AR_VOCAB, width, 2, seed=s).to(device) for s in range(k)]
            ensemble, lrs = mechsm.Ensemble(members), [1e-3] * k
            optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0) for m in members]
            separate = lambda: [alone(m, o) for m, o in zip(members, optimizers) for _ in range(n)][-1].item()
            group = lambda: [ensemble.step(x, q, y, lrs, 1) for _ in range(n)][-1].sum().item()
            times = interleaved_medians({"group": group, "separate": separate}, cfg["ensemble_repeats"], device)
            separate_ops = separate_ops or ops_per_call(lambda: alone(members[0], optimizers[0]))  # one per arch
            group_ops = ops_per_call(lambda: ensemble.step(x, q, y, lrs, 1)) / k
            rows.append(dict(arch=arch, k=k, group_steps_s=k * n / times["group"], separate_steps_s=k * n / times["separate"],
                             speedup=times["separate"] / times["group"], group_ops=group_ops,
                             separate_ops=separate_ops, ops_ratio=group_ops / separate_ops))
            del members, ensemble, optimizers
    format_table(rows, [("arch", "arch", None), ("k", "K", None), ("group_steps_s", "group model-steps/s", "{:.1f}"),
                        ("separate_steps_s", "separate model-steps/s", "{:.1f}"), ("speedup", "x separate", "{:.2f}"),
                        ("group_ops", "ops/model-step", "{:.1f}"), ("separate_ops", "separate ops", "{:.0f}"),
                        ("ops_ratio", "ops ratio", "{:.3f}")], print_fn,
                 title=f"5. Groups: K runs of one cell (width {width}, 2 layers, batch {batch}) as one batched model "
                       "(mechsm.Ensemble: vmap over functional_call, one AdamW over the stacked parameters) vs the same "
                       "K models trained one after another (torch.optim.AdamW); model-steps/s = K x steps/s; ops = "
                       "operators that do work dispatched per model-step (torch.profiler), optimizer included")
    return rows


# ----------------------------------------------------------------------------------------------
# The whole benchmark
# ----------------------------------------------------------------------------------------------

def bench(device="auto", size="full", print_fn=print, parts=(1, 2, 3, 4, 5), threads=None):
    """Run the benchmark, print aligned tables, return every number as a JSON-serialisable dict.

    device: "auto" (cuda if available, else cpu), "cpu", "cuda", ...
    size: "full" (what the README reports; minutes on a 2-core CPU) or "tiny" (seconds; a smoke test).
    parts: which of the four tables to run.
    threads: torch.set_num_threads for the run (restored after); None keeps the current setting. On a
      shared CPU, 1 thread is often faster for the loop kernels (no per-op thread hand-off).
    Recommended on CPU: OMP_WAIT_POLICY=PASSIVE (set before Python starts; see the module docstring).
    """
    device = _pick_device(device)
    cfg = SIZES[size]
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _bench(device, cfg, size, print_fn, parts)
    finally:
        torch.set_num_threads(previous_threads)


def _bench(device, cfg, size, print_fn, parts):
    """The body of bench() once the device, sizes and thread count are settled."""
    env = dict(torch=torch.__version__, device=str(device), threads=torch.get_num_threads(),
               omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "(unset)"),
               thp_alloc=os.environ.get("THP_MEM_ALLOC_ENABLE", "(unset)"), size=size)
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    print_fn("mechsm bench | " + " | ".join(f"{k} {v}" for k, v in env.items()))
    if device.type == "cpu" and env["omp_wait_policy"].upper() != "PASSIVE":
        print_fn("  note: OMP_WAIT_POLICY is not PASSIVE; loop kernels can be 20-30x slower when "
                 "another process is busy")
    print_fn("  each time is the median of interleaved repeats; ratios compare against the reference "
             "timed in the same loop\n")
    result = dict(env=env, scan=[], selective_scan=[], conv=[], train=[], mechanism=[], ensemble=[])
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if 1 in parts:
            result["scan"], result["selective_scan"] = bench_scan(device, cfg, print_fn)
        if 2 in parts:
            result["conv"] = bench_conv(device, cfg, print_fn)
        if 3 in parts:
            result["train"] = bench_train(device, cfg, print_fn)
        if 4 in parts:
            result["mechanism"] = bench_mechanism(device, cfg, print_fn)
        if 5 in parts:
            result["ensemble"] = bench_ensemble(device, cfg, print_fn)
    return result


class Terminated(KeyboardInterrupt):
    """SIGTERM (what timeout, SLURM, systemd and kill send) raised in the main thread. A KeyboardInterrupt,
    so that it takes Ctrl-C's path everywhere: the sweep stops its workers and drops their claims,
    finished runs stay in results.jsonl, and a rerun resumes."""


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While the block runs, SIGTERM raises Terminated in the main thread (Python's default for SIGTERM
    is to die at once, leaving the worker processes training as orphans); the previous handler comes
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


def main(argv=None):
    """Exit status: 0 ok, 1 some run crashed (or a worker process died), 2 bad input (one line on
    stderr), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM)."""
    try:
        with sigterm_as_interrupt():
            return run(argv)
    except (ValueError, OSError) as e:     # bad input, tasks that cannot be generated, corrupt checkpoints
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    except mechsm.WorkerLost as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 1
    except Terminated:
        print("\nterminated (SIGTERM): finished runs are kept in results.jsonl; rerun to continue", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("\ninterrupted: finished runs are kept in results.jsonl; rerun to continue", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
