"""run.py: train the seven architectures on AR (or ATR), patch them, and print one table.

Replicates the central finding of "Mechanistic evaluation of Transformers and state space models"
(Arora et al. 2025, arXiv 2505.15105, Sec. 5): accuracy alone does not tell how a model retrieves;
interchange interventions do (attention/based: induction through the value token; mamba: direct
retrieval at the query). The recipe is mechsm.py's (PROTOCOL.md §4-§6, §8); the patching is
interventions.py's (PROTOCOL.md §7).

CPU examples:
  python run.py                                    # quick preset on AR: 7 archs in 2 parallel jobs
  python run.py --task atr                         # the same on ATR (L_max = 5, |Σ| = 20)
  python run.py --arch attention,mamba --d-model 32,64 --lr 1e-3,3e-3 --seeds 0-2
  python run.py --checkpoint out/ckpt/ar_mamba_d64_L2_lr0.001_s0.pt   # evaluate + patch a saved model
  python run.py bench --device cpu                 # kernel and step timings
GPU examples:
  python run.py --device cuda                      # quick preset, one job on the GPU
  python run.py --preset paper --device cuda       # the paper's full grid (7 archs x 5 widths x 7 lrs)

Outputs under --out (default out/): results.jsonl (one JSON line per finished run, with the config,
metrics, history and mechanism summary; reruns skip what is there), results.md (the table),
mechanism_<arch>.json (the full patching result of the run in the table), ckpt/*.pt (checkpoints),
mechanism/*.json (the patching result of every run).
Bad input prints one line "error: ..." and exits with status 2.
"""

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace

import mechsm


# ----------------------------------------------------------------------------------------------
# Command-line parsing helpers: lists, ranges, on/off. Every mistake becomes one "error: ..." line.
# ----------------------------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    def error(self, message):           # argparse would print usage + message and exit 2; we want one line
        raise ValueError(message)


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
    a("--preset", default="quick", choices=sorted(mechsm.PRESETS),
      help="quick (default): minutes on a 2-core CPU; paper: the paper's full grid")
    a("--task", default="ar", choices=mechsm.TASKS, help="ar (associative recall, default) or atr (treecall)")
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
    a("--bench-size", default="full", choices=["full", "tiny"], help="bench only: full (minutes on CPU) or tiny (seconds)")
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


def table_rows(rows):
    """One table row per (arch, width): the best learning rate's runs (PROTOCOL §6: max over LR)."""
    widths = {row["d_model"] for row in rows}
    out = []
    for row in rows:
        runs = row["runs"]
        mechs = [r.get("mechanism") or {} for r in runs]
        def mean_of(key):
            values = [m[key] for m in mechs if m.get(key) is not None]
            return sum(values) / len(values) if values else None
        verdicts = sorted({m["verdict"] for m in mechs if m.get("verdict")})
        failed = all(r["status"] == "failed" for r in runs)
        name = row["arch"] if len(widths) == 1 else f"{row['arch']} (d={row['d_model']})"
        cells = {"architecture": name, "parameters": f"{runs[0]['n_params']:,}",
                 "accuracy": "failed (NaN)" if failed else fmt_pct(row["mean"], row["std"], row["n_seeds"])}
        if "test_mean" in row:
            cells["test accuracy"] = fmt_pct(row["test_mean"])
        novel = [(r.get("final") or {}).get("novel_acc") for r in runs]
        if any(v is not None for v in novel):
            novel = [v for v in novel if v is not None]
            cells["novel accuracy"] = fmt_pct(sum(novel) / len(novel))
        cells.update({"Attrib@Key": fmt_num(mean_of("attrib_key")), "Attrib@Value": fmt_num(mean_of("attrib_value")),
                      "Attrib@Query": fmt_num(mean_of("attrib_query")), "verdict": " / ".join(verdicts) or "-"})
        out.append(cells)
    return out


def markdown_table(cells_list):
    columns = list(cells_list[0])
    for cells in cells_list:               # the optional columns (test, novel) of any row
        columns += [c for c in cells if c not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cells.get(c, "-") for c in columns) + " |" for cells in cells_list]
    return "\n".join(lines)


def pick_heatmap_row(rows):
    """The model whose heatmap we print: the most accurate NON-attention model that has a patching
    result. Attention's induction pattern is the textbook one; the interesting question of the paper
    is how the other architectures retrieve (mamba: directly at the query). Falls back to attention."""
    candidates = [row for row in rows if any(r.get("mechanism_path") for r in row["runs"])]
    others = [row for row in candidates if row["arch"] != "attention"] or candidates
    return max(others, key=lambda row: row["mean"]) if others else None


def render_heatmap(mechanism_path):
    import interventions
    return interventions.render_heatmap(read_json(mechanism_path))


def read_json(path):
    with open(path) as f:
        return json.load(f)


def interventions_available():
    try:
        import interventions
    except ImportError:
        return False
    return hasattr(interventions, "mechanism") and hasattr(interventions, "render_heatmap")


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
    try:
        from bench_part import bench
    except ImportError:
        raise ValueError("bench is not available in this checkout (bench_part.py is missing)") from None
    device = mechsm.resolve_device(args.device)
    print(f"device: {device}", file=sys.stderr)
    bench(device, size=args.bench_size)
    return 0


def checkpoint_command(args, use_interventions):
    """Evaluate (and patch) one saved model: the table with a single row."""
    t0 = time.time()
    device = mechsm.resolve_device(args.device)
    model, cfg = mechsm.load(args.checkpoint, device=device)
    cfg = replace(cfg, out_dir=args.out, device=device)
    print(f"device: {device} | {mechsm.models.count_parameters(model):,} parameters | {cfg.name()}", file=sys.stderr)
    data = mechsm.make_data(cfg)
    final = mechsm.evaluate_all(model, data)
    record = {"config": asdict(cfg), "status": "ok", "n_params": mechsm.models.count_parameters(model),
              "final": final}
    if use_interventions:
        prepare_out(args.out)
        record.update(mechsm.run_interventions(model, data, cfg, record))
        mechsm.write_json(os.path.join(args.out, f"mechanism_{cfg.arch}.json"), read_json(record["mechanism_path"]))
    rows = [{"arch": cfg.arch, "d_model": cfg.d_model, "best_lr": cfg.lr, "mean": final["acc"], "std": 0.0,
             "n_seeds": 1, "runs": [record]}]
    print(markdown_table(table_rows(rows)))
    if use_interventions and record.get("mechanism_path"):
        print(f"\nheatmap of {cfg.arch} ({args.checkpoint}):\n" + render_heatmap(record["mechanism_path"]))
    print(f"\ntotal wall time {time.time() - t0:.1f}s", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------
# The default pipeline, top to bottom.
# ----------------------------------------------------------------------------------------------

def run(argv=None):
    t0 = time.time()
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        return bench_command(args)
    use_interventions = not args.no_interventions and interventions_available()
    if not args.no_interventions and not use_interventions:
        print("warning: interventions.py is not available yet; training and evaluating only", file=sys.stderr)
    if args.checkpoint:
        return checkpoint_command(args, use_interventions)

    # -- the runs: preset defaults, then the command-line overrides ------------------------------
    preset = mechsm.PRESETS[args.preset][args.task]
    overrides = {"task": args.task, "layers": args.layers, "heads": args.heads, "pos_emb": args.pos_emb,
                 "d_conv": args.d_conv, "long_only": args.long_only, "num_keys": args.num_keys,
                 "num_values": args.num_values, "num_pairs": args.num_pairs,
                 "num_terminals": args.num_terminals, "max_rhs_len": args.max_rhs_len,
                 "max_depth": args.max_depth, "holdout": args.holdout, "data_seed": args.data_seed,
                 "steps": args.steps, "epochs": args.epochs, "train_size": args.train_size,
                 "batch_size": args.batch_size, "schedule": args.schedule, "eval_every": args.eval_every,
                 "eval_size": args.eval_size}
    rename = {"layers": "n_layers", "heads": "n_heads"}
    settings = dict(preset["config"])
    if args.epochs is not None and args.steps is None:
        settings["steps"] = None           # an explicit --epochs beats a preset's step count
    for name, value in overrides.items():
        if value is not None:
            settings[rename.get(name, name)] = None if value is AUTO else value
    settings.update(device=args.device, out_dir=args.out, save_checkpoint=not args.no_save)
    base = mechsm.Config(**settings)
    grid = preset["grid"]
    archs = mechsm.ALL_ARCHS if args.arch == ["all"] else args.arch or grid["archs"]
    widths = args.d_model or grid["widths"]
    lrs = args.lr or grid["lrs"]
    if isinstance(lrs, dict):              # per-arch learning rates: an arch the preset lacks gets 1e-3
        lrs = {arch: lrs.get(arch, [1e-3]) for arch in archs}
    seeds = args.seeds or grid["seeds"]
    configs = mechsm.grid_configs(base, archs, widths, lrs, seeds)
    for cfg in configs:                    # one "error: ..." line for bad input, before anything runs
        cfg.check()

    # -- device, data, parameter counts (printed at start) ---------------------------------------
    device = mechsm.resolve_device(args.device)
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs: got {args.jobs}, expected a positive integer")
    jobs = args.jobs or (min(2, os.cpu_count() or 1) if device == "cpu" else 1)
    vocab = mechsm.probe_task(base)        # raises tasks' ValueError if the task cannot be generated
    prepare_out(args.out)                  # an unwritable --out fails now, not after an hour of training
    print(f"mechsm | task {args.task} | preset {args.preset} | {len(configs)} runs | device {device} | "
          f"{jobs} job{'s' * (jobs > 1)} | vocabulary {vocab}", file=sys.stderr)
    counts = []
    for arch in archs:
        for width in widths:
            c = replace(base, arch=arch, d_model=width).resolved()
            model = mechsm.models.build_model(arch, vocab, width, c.n_layers, pos_emb=c.pos_emb,
                                              n_positions=c.n_positions, n_heads=c.n_heads, d_conv=c.d_conv,
                                              long_only=c.long_only)
            counts.append(f"{arch}{'' if len(widths) == 1 else f' d{width}'} {mechsm.models.count_parameters(model):,}")
    print("parameters: " + " | ".join(counts), file=sys.stderr)

    # -- train (every finished run lands in results.jsonl at once) -------------------------------
    results_path = os.path.join(args.out, "results.jsonl")
    after = mechsm.run_interventions if use_interventions else None
    records = mechsm.sweep(base, archs, widths, lrs, seeds, results_path=results_path, jobs=jobs, after=after)
    errors = [r for r in records if r["status"] == "error"]
    for r in errors:
        print(f"error in run {r['name']}: {r['error']} (not recorded; a rerun retries it)", file=sys.stderr)

    # -- the table: best learning rate per (arch, width), its patching summary -------------------
    rows = mechsm.best_by_lr(records)
    if not rows:
        raise ValueError("no run finished; nothing to report")
    table = markdown_table(table_rows(rows))
    chosen = ", ".join(f"{cells['architecture']} {row['best_lr']:g}" for cells, row in zip(table_rows(rows), rows))
    note = (f"accuracy: final model on {base.eval_size} fresh documents, best learning rate per row "
            f"({chosen}); Attrib@X: the patched site's restoration of the clean answer probability.")
    print(table)
    print(note)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(f"# mechsm results: task {args.task}, preset {args.preset}\n\n{table}\n\n{note}\n")

    # -- the mechanisms: one JSON per table row, one heatmap on stdout ----------------------------
    for row in rows:
        run_ = next((r for r in row["runs"] if r.get("mechanism_path")), None)
        if run_ and os.path.exists(run_["mechanism_path"]):
            name = row["arch"] if len(widths) == 1 else f"{row['arch']}_d{row['d_model']}"
            mechsm.write_json(os.path.join(args.out, f"mechanism_{name}.json"), read_json(run_["mechanism_path"]))
    pick = pick_heatmap_row(rows)
    if use_interventions and pick is not None:
        path = next(r["mechanism_path"] for r in pick["runs"] if r.get("mechanism_path"))
        print(f"\nheatmap of {pick['arch']} (the most accurate non-attention model):")
        print(render_heatmap(path))
    print(f"\nresults in {args.out}/ (results.jsonl, results.md, mechanism_*.json) | "
          f"total wall time {time.time() - t0:.1f}s", file=sys.stderr)
    return 1 if errors else 0


def main(argv=None):
    """Exit status: 0 ok, 1 some run crashed, 2 bad input (one line on stderr), 130 interrupted."""
    try:
        return run(argv)
    except (ValueError, OSError) as e:     # bad input, tasks that cannot be generated, corrupt checkpoints
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: finished runs are kept in results.jsonl; rerun to continue", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
