"""run.py: train the seven architectures on AR (or ATR), patch them, and print one table.

Replicates the central finding of "Mechanistic evaluation of Transformers and state space models"
(Arora et al. 2025, arXiv 2505.15105, Sec. 5): accuracy alone does not tell how a model retrieves;
interchange interventions do (attention/based: induction through the value token; mamba: direct
retrieval at the query). The recipe is mechsm.py's (paper Sec. 4 and App. C); the patching is
interventions.py's (paper Sec. 3-4).

CPU examples:
  python run.py                                    # quick preset on AR: 7 archs in 2 parallel jobs
  python run.py --experiment atr-medium            # one result of the paper; --list shows all twelve
  python run.py --arch attention,mamba --d-model 32,64 --lr 1e-3,3e-3 --seeds 0-2
  python run.py --checkpoint out/ckpt/<run>.pt     # evaluate + patch a saved model
  OMP_WAIT_POLICY=PASSIVE python run.py bench      # fast kernels against their references (GPU: --device cuda)
GPU examples:
  python run.py --device cuda                      # quick preset, one job on the GPU
  python run.py --preset paper --device cuda       # the paper's grid (7 archs x 5 widths x 7 lrs), each
                                                   # cell's lrs and seeds as one batched model (at most K
                                                   # with --group-size K, if memory runs short)

Outputs under --out (default out/): results.jsonl (a JSON line per finished run: config, metrics,
history, mechanism summary; reruns skip what is there), results_<experiment>.md (the table),
mechanism_<experiment>_<row>.json (each row's full patching result), ckpt/ and mechanism/ (every run's
checkpoint and patching result), claims/ (which process trains which run: processes can share one
--out). --checkpoint writes only to checkpoint_eval/<checkpoint name>-<hash>/. Bad input prints one
line "error: ..." (exit 2); Ctrl-C (130) and SIGTERM (143) stop the workers and keep every finished run.
"""

import argparse
import difflib
import hashlib
import json
import math
import os
import statistics
import sys
import time

# Set before torch's first allocation: PyTorch's CPU allocator then backs tensors of 2 MB and more with
# transparent huge pages. Filling fresh 4 KB pages cost a Mamba scan's (b, l, e, n) tensors more than
# the arithmetic (`run.py bench`: the CPU scan at L = 1024 ran 2.3x the plain loop with it, 1.3-1.7x
# without). A no-op on a GPU, on macOS or where Linux THP is off; THP_MEM_ALLOC_ENABLE=0 turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402  (after the allocator setting above)

import mechsm  # noqa: E402
import models  # noqa: E402


# ----------------------------------------------------------------------------------------------
# Parsing. Every mistake becomes one "error: ..." line.
# ----------------------------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: error() raises ValueError (main prints it), and an unknown option
    is named as such. argparse alone would hand the value after a typo'd flag (--lrr 1e-3) to the
    optional positional command and report "invalid choice: '1e-3'", hiding the typo. A token that
    starts with '-' is a value, not an option, when a digit or '.' follows (-1e-3)."""

    def error(self, message):
        raise ValueError(message)

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        known = list(self._option_string_actions)
        for token in args[:args.index("--")] if "--" in args else args:
            name = token.split("=", 1)[0]
            if not token.startswith("-") or token == "-" or token[1] in "0123456789." or name in known \
                    or (name.startswith("--") and any(option.startswith(name) for option in known)):
                continue
            close = difflib.get_close_matches(name, known, n=1)
            raise ValueError(f"unknown option {name}" + (f" (did you mean {close[0]}?)" if close else "")
                             + "; see run.py --help")
        return super().parse_known_args(args, namespace)


def comma_list(kind, what):
    """'a,b,c' -> [kind(a), kind(b), kind(c)]."""
    def parse(text):
        try:
            items = [kind(s.strip()) for s in text.split(",") if s.strip()]
        except ValueError:
            items = []
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {text!r}")
        return items
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


def build_parser():
    p = Parser(prog="run.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog="Options left unset take their value from the experiment's preset (README: what each runs).")
    a = p.add_argument
    a("command", nargs="?", default="train", choices=["train", "bench"], help="train (default) or bench")
    a("--experiment", choices=list(mechsm.EXPERIMENTS), metavar="NAME", help="a result of the paper (default: ar)")
    a("--list", action="store_true", help="print the catalogue of experiments and exit")
    a("--preset", default="quick", choices=mechsm.PRESET_NAMES, help="quick (default; <= 15 min on 2 CPU cores) or paper")
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
    a("--pos-emb", choices=["on", "off", "auto"], help="learned positions (auto: attention only, as the paper's figures)")
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
    a("--schedule", choices=mechsm.SCHEDULES, help="decay after the 10%% warmup: cosine (paper) or linear")
    a("--steps", type=int, metavar="N", help="total optimizer steps (beats --epochs; the training set is walked cyclically)")
    a("--epochs", type=int, metavar="N", help="passes over the training set (paper: 16 AR, 32 ATR)")
    a("--train-size", type=int, metavar="N", help="documents in the fixed training set (paper: 100,032)")
    a("--batch-size", type=int, metavar="N", help="batch size (paper: 32)")
    a("--eval-every", type=int, metavar="N", help="steps between evaluations (paper: 200); the last step is always evaluated")
    a("--eval-size", type=int, metavar="N", help="evaluation documents (paper: 320)")
    # where and how
    a("--device", default="auto", choices=mechsm.DEVICES, help="auto (default: cuda if available), cpu or cuda")
    a("--jobs", type=int, help="runs trained in parallel (default: 2 on a CPU with >= 2 cores, 1 on cuda)")
    a("--group-size", type=int, metavar="K",
      help="train up to K runs that differ only in lr and seed as one batched model (default: 1 on a CPU, where "
           "groups do not pay; a whole (arch, width) cell on cuda); lower it if a group runs out of memory")
    a("--out", default="out", help="output folder (default: out/)")
    a("--no-interventions", action="store_true", help="train and evaluate only, skip the patching")
    a("--no-save", action="store_true", help="do not save checkpoints under OUT/ckpt/")
    a("--checkpoint", help="skip training: evaluate and patch this saved model (a .pt from OUT/ckpt/)")
    return p


# ----------------------------------------------------------------------------------------------
# The default pipeline, top to bottom: the experiment's grid, the plan, the sweep, the table, the
# timeline, the heatmap.
# ----------------------------------------------------------------------------------------------

def run(argv=None):
    """The command line: bench, --list or --checkpoint, else the default pipeline, top to bottom."""
    t0 = time.time()
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        bench(args.device)
        return 0
    if args.list:
        print(mechsm.catalogue())
        return 0
    if args.experiment and args.task != "ar":
        raise ValueError("--task and --experiment: give one of them (--task atr is --experiment atr)")
    if args.checkpoint:
        return checkpoint_command(args, explicit_options(argv))
    name = args.experiment or args.task          # --task atr is the experiment "atr"
    configs = experiment_runs(args, name)
    vocab = mechsm.check_runs(configs)           # one "error: ..." line for bad input, before anything runs
    device = mechsm.resolve_device(args.device)
    for flag, value in (("--jobs", args.jobs), ("--group-size", args.group_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag}: got {value}, expected a positive integer")
    jobs = args.jobs or (min(2, os.cpu_count() or 1) if device == "cpu" else 1)
    group_size = args.group_size or mechsm.default_group_size(device)
    # built before anything is printed, so that a model too large to allocate is the only line
    counts = " | ".join(f"{label} {n:,}" for label, n in mechsm.parameter_counts(configs, vocab).items())
    prepare_out(args.out)                  # an unwritable --out fails now, not after an hour of training
    print(f"mechsm | experiment {name} ({mechsm.EXPERIMENTS[name].section}) | preset {args.preset} | "
          f"{len(configs)} runs | device {device} | {jobs} job{'s' * (jobs > 1)} | vocabulary {vocab}",
          file=sys.stderr)
    print("parameters: " + counts, file=sys.stderr)
    print_plan(configs, group_size, jobs, device, warmup_steps=20 if args.preset == "paper" else 0)
    records = mechsm.sweep(configs, results_path=os.path.join(args.out, "results.jsonl"), jobs=jobs,
                           after=None if args.no_interventions else mechsm.run_interventions, group_size=group_size)
    errors = [r for r in records if r["status"] == "error"]
    for r in errors:
        print(f"error in run {r['name']}: {r['error']} (not recorded; a rerun retries it)", file=sys.stderr)
    rows, text = mechsm.report(records, configs, name, args.preset, args.out)
    print(text)
    pick = mechsm.pick_heatmap_row(rows)
    if not args.no_interventions and pick is not None:
        why = {"mamba": "the paper's central contrast", "attention": "no other architecture was patched"}.get(
            pick["arch"], "the most accurate non-attention model")
        print(f"\nheatmap of {pick['label']} ({why}):\n" + heatmap(pick["best"]["mechanism_path"]))
    print(f"\nresults in {args.out}/ (results.jsonl, results_{name}.md, mechanism_{name}_*.json) | "
          f"total wall time {time.time() - t0:.1f}s", file=sys.stderr)
    return 1 if errors else 0


# command-line flag -> Config field, for the flags that override every run of the grid (all but two same-named)
OVERRIDES = {"layers": "n_layers", "heads": "n_heads", **{name: name for name in (
    "pos_emb d_conv long_only num_keys num_values num_pairs num_terminals max_rhs_len max_depth holdout data_seed "
    "steps epochs train_size batch_size schedule eval_every eval_size").split()}}


def experiment_runs(args, name):
    """The Configs to train: the experiment's grid (mechsm.experiment_configs), narrowed by --arch,
    --d-model, --lr, --seeds and overridden field by field by the other flags. An explicit --epochs
    beats the grid's step counts."""
    fields = {field: getattr(args, flag) for flag, field in OVERRIDES.items() if getattr(args, flag) is not None}
    if "pos_emb" in fields:                      # auto: None, the paper's convention
        fields["pos_emb"] = {"on": True, "off": False, "auto": None}[fields["pos_emb"]]
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
        text = lambda vs: ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in vs)
        print(f"note: {flag}: repeated values collapsed: {text(values)} -> {text(unique)}", file=sys.stderr)
    return unique


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


def heatmap(mechanism_path):
    import interventions
    with open(mechanism_path) as f:
        return interventions.render_heatmap(json.load(f))


# ----------------------------------------------------------------------------------------------
# --list and --checkpoint
# ----------------------------------------------------------------------------------------------

# The options --checkpoint honours. The saved model fixes its task, architecture, data and training, so
# any other option given with it (--task, --arch, --steps, --jobs, ...) is refused, not silently ignored.
CHECKPOINT_OPTIONS = {"checkpoint", "device", "out", "eval_size", "no_interventions"}


def explicit_options(argv):
    """The dests of the options given on the command line: the parsed namespace alone cannot tell
    `--task ar` from no --task, since argparse fills in defaults."""
    parser = build_parser()
    for action in parser._actions:           # parse again with no defaults: only what was typed remains
        if action.option_strings:            # (a positional keeps its default: argparse checks it)
            action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv))) - {"command"}


def checkpoint_command(args, explicit):
    """Evaluate (and patch) one saved model (mechsm.evaluate_saved): the table with a single row. Its
    outputs go to OUT/checkpoint_eval/<checkpoint name>-<8 hex digits of its absolute path>/, never
    to the sweep's files (two checkpoints of one name in different folders get different folders).
    An option in `explicit` (those given) outside CHECKPOINT_OPTIONS is refused with one line."""
    t0 = time.time()
    refused = sorted(explicit - CHECKPOINT_OPTIONS)
    if refused:
        raise ValueError(f"{', '.join('--' + name.replace('_', '-') for name in refused)}: cannot be used with "
                         "--checkpoint, which evaluates the saved model on its own task and data (with it: "
                         "--device, --out, --eval-size, --no-interventions)")
    device = mechsm.resolve_device(args.device)          # --device cuda without CUDA: one line, first
    model, cfg = mechsm.load(args.checkpoint, device=device)   # checks the vocabulary against the task
    digest = hashlib.sha1(os.path.abspath(args.checkpoint).encode()).hexdigest()[:8]
    folder = os.path.join(args.out, "checkpoint_eval", os.path.splitext(os.path.basename(args.checkpoint))[0] + "-" + digest)
    prepare_out(folder)
    print(f"device: {device} | {models.count_parameters(model):,} parameters | {cfg.name()} | outputs in {folder}/",
          file=sys.stderr)
    patch = not args.no_interventions
    record = mechsm.evaluate_saved(model, cfg, args.checkpoint, folder, device, args.eval_size, patch)
    print(mechsm.markdown_table([{"arch": cfg.arch, "best": record, "n_seeds": 1, "label": cfg.arch}]))
    if patch:
        print(f"\nheatmap of {cfg.arch} ({args.checkpoint}):\n" + heatmap(record["mechanism_path"]))
    print(f"\nresults in {folder}/ (result.json{', mechanism.json' if patch else ''}) | "
          f"total wall time {time.time() - t0:.1f}s", file=sys.stderr)
    return 0


def main(argv=None):
    """Exit status: 0 ok, 1 some run crashed (or a worker process died), 2 bad input (one line on
    stderr), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM)."""
    try:
        with mechsm.sigterm_as_interrupt():
            return run(argv)
    except (ValueError, OSError, mechsm.WorkerLost) as e:   # bad input, tasks that cannot be generated, ...
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 1 if isinstance(e, mechsm.WorkerLost) else 2
    except KeyboardInterrupt as e:
        sigterm = isinstance(e, mechsm.Terminated)
        print(f"\n{'terminated (SIGTERM)' if sigterm else 'interrupted'}: finished runs are kept in results.jsonl; "
              "rerun to continue", file=sys.stderr)
        return 143 if sigterm else 130


# ----------------------------------------------------------------------------------------------
# `python run.py bench`: each fast path against its slow reference, timed in the same run and printed
# as ratios. Our models are tiny, so the cost lies in the scan, the long convolutions and framework
# overhead. Each time is the median of interleaved repeats (candidate and reference alternate, so a
# burst of load from another process hits both). With OpenMP's default (spinning) wait policy a busy
# second process made the loop kernels 20-30x slower on 2 cores: run OMP_WAIT_POLICY=PASSIVE.
# ----------------------------------------------------------------------------------------------

# "full": the README's numbers (minutes on a 2-core CPU); "tiny": the test's (seconds). Scans take b =
# min(b, tokens // L) documents; direct_conv's (L, L, d) tensor stays under toeplitz_mib (x16 on a GPU).
SIZES = {
    "full": dict(lengths=(37, 256, 1024, 4096), b=32, tokens=8192, e=128, n=16, d=128, toeplitz_mib=64,
                 repeats=5, batch=32, steps=10, archs=None, docs=320, ks=(1, 7, 35), width=64),
    "tiny": dict(lengths=(37, 64), b=2, tokens=128, e=8, n=4, d=8, toeplitz_mib=512,
                 repeats=1, batch=4, steps=2, archs=("attention", "mamba"), docs=8, ks=(1, 35), width=16),
}


def bench(device="auto", size="full", print_fn=print, parts=(1, 2, 3, 4, 5)):
    """Run the benchmark's parts, print a table each, return every number as a JSON-serialisable dict.
    device: "auto" (cuda if available), "cpu", "cuda", ...; size: a key of SIZES. On a CPU it runs on
    one thread, as run.py's training workers do (the caller's thread count is restored after)."""
    device, sizes, threads = torch.device(mechsm.resolve_device(str(device))), SIZES[size], torch.get_num_threads()
    env = dict(torch=torch.__version__, device=str(device), threads=1 if device.type == "cpu" else threads,
               omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "(unset)"), size=size,
               gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None)
    print_fn("mechsm bench | " + " | ".join(f"{k} {v}" for k, v in env.items() if v is not None) + "\n")
    result = dict(env=env, scan=[], selective_scan=[], conv=[], short_conv=[], ssm_kernel=[], train=[], mechanism=[],
                  ensemble=[])
    torch.set_num_threads(env["threads"])
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for part in parts:
                measure = (bench_scan, bench_conv, bench_train, bench_mechanism, bench_ensemble)[part - 1]
                result.update(measure(device, sizes, print_fn))
    finally:
        torch.set_num_threads(threads)
    return result


def bench_scan(device, sizes, print_fn):
    """1a: the plain scan h_t = a_t h_(t-1) + b_t on Mamba-shaped inputs; 1b: Mamba's selective scan."""
    plain, selective = [], []
    for length in sizes["lengths"]:
        b = max(1, min(sizes["b"], sizes["tokens"] // length))
        x, g = scan_inputs(b, length, sizes["e"], sizes["n"], device, seed=length), torch.Generator().manual_seed(1)
        kernels = {"sequential": models.sequential_scan, "scan": models.scan, "parallel": models.parallel_scan_custom_grad}
        rows = compare(kernels, (x["a"], x["b"]), torch.randn(x["a"].shape, generator=g).to(device), sizes, device)
        plain += [dict(L=length, B=b, **row) for row in rows]
        kernels = {"reference": models.selective_scan_reference, "selective_scan": models.selective_scan}
        rows = compare(kernels, [x[k] for k in ("u", "delta", "A", "B", "C")],
                       torch.randn(x["u"].shape, generator=g).to(device), sizes, device)
        # The floor: one elementwise in-place pass over a (B, L, e, n) tensor (the scan's state), same run
        state = x["a"].clone()
        one_pass = medians({"pass": lambda: state.mul_(1.0)}, max(3, sizes["repeats"]), device)["pass"]
        selective += [dict(L=length, B=b, **row, passes=row["ms"] / (1e3 * one_pass)) for row in rows]
    print_table(f"1a. Plain scan, Mamba-shaped a, b (B, L, {sizes['e']}, {sizes['n']}): `scan` (shipped, picked per "
                "device) and `parallel_scan_custom_grad` against `sequential_scan` (plain autograd)", plain, print_fn)
    print_table("1b. Mamba's selective scan h_t = exp(delta_t A) h_(t-1) + delta_t B_t u_t, y = sum_n C h: "
                "`selective_scan` against `selective_scan_reference` (materialised + plain loop); passes = "
                "forward+backward time in elementwise passes over its (B, L, e, n) state (x.mul_(1.0), the floor)",
                selective, print_fn)
    return dict(scan=plain, selective_scan=selective)


def scan_inputs(b, l, e, n, device, seed=0):
    """Selective-scan inputs distributed like a freshly initialised Mamba layer's (models.Mamba): Δ
    log-uniform in [1e-3, 1e-1], A = -(1..n) (S4D-real), u, B, C standard normal; dict(u, delta
    (b, l, e), A (e, n), B, C (b, l, n), and the plain scan's a = exp(Δ A), b = Δ B u (b, l, e, n)).
    Small Δ puts a near 1 (long memory), where a float32 scan accumulates the most error."""
    g = torch.Generator().manual_seed(seed)
    delta = torch.exp(torch.empty(b, l, e).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
    A = -torch.arange(1, n + 1, dtype=torch.float32).repeat(e, 1)
    u, B, C = (torch.randn(*shape, generator=g) for shape in ((b, l, e), (b, l, n), (b, l, n)))
    x = dict(u=u, delta=delta, A=A, B=B, C=C, a=torch.exp(delta[..., None] * A), b=(delta * u)[..., None] * B[:, :, None])
    return {k: v.to(device) for k, v in x.items()}


def compare(kernels, inputs, grad_out, sizes, device):
    """Forward+backward of each kernel(*inputs) in float32: milliseconds, speed-up over the first kernel
    (the reference), and errors against the reference run in float64: max abs error of the output, max
    over inputs of max|grad - grad64| / max|grad64| (gradients of <output, grad_out>)."""
    def forward_backward(kernel, xs):
        xs = [x.detach().requires_grad_() for x in xs]
        out = kernel(*xs)
        return out, torch.autograd.grad(out, xs, grad_out.to(out.dtype))

    wide = lambda x: x.to(torch.complex128 if x.is_complex() else torch.float64)   # H3's modes are complex
    out64, grads64 = forward_backward(next(iter(kernels.values())), [wide(x) for x in inputs])
    times = medians({name: lambda k=k: forward_backward(k, inputs) for name, k in kernels.items()}, sizes["repeats"], device)
    rows = []
    for name, kernel in kernels.items():
        out, grads = forward_backward(kernel, inputs)
        rows.append(dict(kernel=name, ms=1e3 * times[name], speedup=next(iter(times.values())) / times[name],
                         max_abs_err=(out.double() - out64).abs().max().item(),
                         grad_rel_err=max(((wide(g) - g64).abs().max() / g64.abs().max().clamp(min=1e-30)).item()
                                          for g, g64 in zip(grads, grads64))))
    return rows


def bench_conv(device, sizes, print_fn):
    """2: the long convolution u (B, L, d) * k (L, d), fft_conv against direct_conv (autograd)."""
    rows = []
    for length in sizes["lengths"]:
        budget = sizes["toeplitz_mib"] * 2**20 * (16 if device.type == "cuda" else 1)
        d, g = max(1, min(sizes["d"], budget // (4 * length * length))), torch.Generator().manual_seed(length)
        u, k, grad_out = (torch.randn(*shape, generator=g).to(device) for shape in
                          ((sizes["b"], length, d), (length, d), (sizes["b"], length, d)))
        kernels = {"direct": models.direct_conv, "fft": models.fft_conv}
        rows += [dict(L=length, B=sizes["b"], D=d, **row) for row in compare(kernels, (u, k / length ** 0.5), grad_out,
                                                                             sizes, device)]
    print_table("2a. Long convolution, forward+backward: fft_conv against direct_conv (an explicit Toeplitz sum)",
                rows, print_fn)
    short, g = [], torch.Generator().manual_seed(0)
    for length in sizes["lengths"][:2]:
        x, w, bias, grad_out = (torch.randn(*shape, generator=g).to(device) for shape in
                                ((sizes["b"], length, 3 * sizes["width"]), (3 * sizes["width"], 1, 3),
                                 (3 * sizes["width"],), (sizes["b"], length, 3 * sizes["width"])))
        kernels = {"reference": models.short_conv_reference, "short_conv": models.short_conv}
        short += [dict(L=length, B=sizes["b"], C=x.shape[-1], **row) for row in compare(kernels, (x, w, bias), grad_out,
                                                                                         sizes, device)]
    print_table("2b. Short causal conv SC_3 (Hyena's, C = 3 x width), forward+backward: short_conv against "
                "short_conv_reference (a shifted copy per tap)", short, print_fn)
    ssm = []
    for length in sizes["lengths"][:2]:
        fast = models.H3(sizes["width"]).to(device)
        modes = [t.detach() for t in fast.diag_modes()]                        # A_bar, W (h, n/2) complex
        reference = lambda A, W, l=length: 2 * torch.einsum("hn,hnl->lh", W, torch.cumprod(
            A[..., None].expand(*A.shape, l), dim=-1) / A[..., None]).real        # H3.ssm_kernel's reference form
        kernels = {"reference": reference, "vandermonde": lambda A, W, l=length: models.vandermonde_kernel(A, W, l)}
        grad_out = torch.randn(length, modes[0].shape[0], generator=g).to(device)
        ssm += [dict(L=length, H=modes[0].shape[0], modes=modes[0].shape[1], **row)
                for row in compare(kernels, modes, grad_out, sizes, device)]
    print_table("2c. H3's diagonal-SSM kernel K = 2 Re sum W A^lag, forward+backward from the modes: vandermonde_kernel "
                "against the reference's cumprod under autograd", ssm, print_fn)
    return dict(conv=rows, short_conv=short, ssm_kernel=ssm)


def bench_train(device, sizes, print_fn):
    """3: training steps/s at the paper's AR shape (width 64, 2 layers, 37 tokens, V = 8195), fast kernels
    and readout-only head (mechsm.make_step) against kernels="reference" and the head on every position.
    Each timed call ends reading the loss on the host (a sync), as a training loop logging it does."""
    data = mechsm.tasks.make_ar(sizes["batch"], seed=0)
    x, q, y = (t.to(device) for t in (data.tokens, data.positions["query"], data.answers))
    rows = []
    for arch in sizes["archs"] or models.ARCHS:
        fast, ref = (models.build_model(arch, data.vocab_size, 64, 2, kernels=k, seed=0).to(device)
                     for k in ("fast", "reference"))
        full_head = lambda t, readout, m=ref: m(t)[torch.arange(len(t), device=device), readout]
        steps = {"fast": mechsm.make_step(fast, x, q, y, 1e-3),
                 "reference": mechsm.make_step(ref, x, q, y, 1e-3, full_head)}
        t = medians({k: lambda s=s: [s() for _ in range(sizes["steps"])][-1].item() for k, s in steps.items()},
                    sizes["repeats"], device)
        rows.append(dict(arch=arch, params=models.count_parameters(fast), fast_steps_s=sizes["steps"] / t["fast"],
                         reference_steps_s=sizes["steps"] / t["reference"], speedup=t["reference"] / t["fast"]))
    print_table(f"3. Training steps/s, paper's AR shape (d 64, 2 layers, batch {sizes['batch']}, AdamW): fast kernels "
                "and readout-only head against kernels='reference' and the full-vocabulary head", rows, print_fn)
    return dict(train=rows)


def bench_mechanism(device, sizes, print_fn):
    """4: the time of one full interventions.mechanism table per architecture (untrained models)."""
    import interventions
    data, rows = mechsm.tasks.make_ar(sizes["docs"], seed=1).to(device), []
    for arch in sizes["archs"] or models.ARCHS:
        model, result = models.build_model(arch, data.vocab_size, 64, 2, seed=0).to(device).eval(), {}
        t = medians({"one": lambda: result.update(interventions.mechanism(model, data, n_docs=sizes["docs"]))}, 1, device)
        rows.append(dict(arch=arch, docs=len(data), cells=sum(len(r["scores"]) for r in result["rows"]), seconds=t["one"]))
    print_table("4. One full interventions.mechanism table (every site x layer x position)", rows, print_fn)
    return dict(mechanism=rows)


def bench_ensemble(device, sizes, print_fn):
    """5: K runs of one (arch, width) cell as one batched model (mechsm.Ensemble) against the same K
    models stepped one after another (mechsm.make_step): model-steps/s and operators per model-step."""
    data = mechsm.tasks.make_ar(sizes["batch"], seed=0)
    x, q, y = (t.to(device) for t in (data.tokens, data.positions["query"], data.answers))
    rows = []
    for arch in sizes["archs"] or models.ARCHS:
        for k in sizes["ks"]:
            members = [models.build_model(arch, data.vocab_size, sizes["width"], 2, seed=s).to(device) for s in range(k)]
            ensemble, alone = mechsm.Ensemble(members), [mechsm.make_step(m, x, q, y, 1e-3) for m in members]
            group = lambda: ensemble.step(x, q, y, [1e-3] * k, 1)
            t = medians({"group": lambda: group().sum().item(), "separate": lambda: [s().item() for s in alone]},
                        sizes["repeats"], device)
            group_ops, separate_ops = ops_per_call(group) / k, ops_per_call(alone[0])
            rows.append(dict(arch=arch, k=k, group_steps_s=k / t["group"], separate_steps_s=k / t["separate"],
                             speedup=t["separate"] / t["group"], group_ops=group_ops, separate_ops=separate_ops,
                             ops_ratio=group_ops / separate_ops))
    print_table(f"5. K runs (width {sizes['width']}) as one batched model against K models one after another: model-"
                "steps/s, and operators dispatched per model-step (torch.profiler), optimizer included", rows, print_fn)
    return dict(ensemble=rows)


# Operators that only make a view or read metadata: no kernel on any device, so not counted as work.
VIEW_OPS = frozenset("aten::" + name for name in (
    "view as_strided _reshape_alias reshape t transpose permute expand squeeze unsqueeze select slice detach "
    "alias empty empty_strided empty_like movedim unflatten flatten split split_with_sizes chunk unbind narrow "
    "_unsafe_view view_as lift_fresh resolve_conj resolve_neg item _local_scalar_dense result_type").split())


def ops_per_call(fn):
    """Operators that do work dispatched by fn() (its second call; the first warms up), counted by
    torch.profiler on the CPU side of any device: the aten:: events with no aten:: event inside them,
    less VIEW_OPS. On a GPU each is about one kernel launch, the cost that dominates runs this small."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    outer = {e.cpu_parent.id for e in events if e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")}
    return sum(1 for e in events if e.id not in outer and e.name not in VIEW_OPS)


def medians(fns, repeats, device):
    """Median seconds of each zero-argument callable over `repeats` rounds, each round calling every one
    in turn, after an untimed warm-up call each; the device is drained around every timed call."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def print_table(title, rows, print_fn):
    """Print dict rows (the same keys) under a title as aligned columns."""
    fmt = lambda v: (f"{v:.1e}" if 0 < abs(v) < 0.01 else f"{v:,.2f}") if isinstance(v, float) else \
        f"{v:,}" if isinstance(v, int) else str(v)
    cells = [list(rows[0])] + [[fmt(v) for v in row.values()] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    print_fn(title)
    for line in cells:
        print_fn("  " + "  ".join(c.rjust(w) for c, w in zip(line, widths)))
    print_fn("")


if __name__ == "__main__":
    sys.exit(main())
