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
# Presets. "paper" is the paper's grid exactly (PROTOCOL §5, §8); "quick" is a miniature sized for a
# 2-core CPU.  The "quick" values are chosen by measurement, see README ("Choosing the quick preset").
# Each preset maps a task to {"config": Config overrides, "grid": archs, widths, lrs, seeds}; lrs is
# a list, or a dict arch -> list when each architecture gets its own learning rate(s).
# ----------------------------------------------------------------------------------------------

ALL_ARCHS = ["attention", "base_conv", "based", "h3", "hyena", "mamba", "deltanet"]
LR5 = [3e-5, 1e-4, 3e-4, 1e-3, 3e-3]
LR7 = LR5 + [1e-2, 3e-2]

# The quick preset's runs (see the comment in PRESETS): one measured lr per architecture, and the
# step counts that fit 15 minutes on 2 cores. Archs are listed longest run first, so that two
# parallel jobs finish together.
QUICK_GRID = dict(archs=["mamba", "attention", "h3", "deltanet", "hyena", "based", "base_conv"],
                  widths=[64], seeds=[0],
                  lrs={"attention": [5e-4], "base_conv": [3e-3], "based": [3e-3], "h3": [1e-3],
                       "hyena": [1e-3], "mamba": [1e-2], "deltanet": [1e-3]},
                  per_arch={"attention": dict(steps=16_000), "mamba": dict(steps=8000),
                            "based": dict(steps=8000), "h3": dict(steps=4000)})

PRESETS = {
    "quick": {
        # A miniature of the paper's AR run for a 2-core CPU, chosen by measurement (README, "Choosing
        # the quick preset"): the paper's vocabulary (4,096 keys, 4,096 values) and recipe (fixed
        # 100,032-document training set walked in order, batch 32, 10% warmup, cosine decay), but 8
        # pairs instead of 16 (21 tokens, every step ~1.7x cheaper), width 64 only, one measured
        # learning rate per architecture, and 4k-16k steps instead of 50k. Attention gets the most
        # steps: its induction circuit forms only after a long plateau (~9k steps in our curves);
        # the SSMs cost the most per step on a CPU.
        "ar": {
            "config": dict(num_keys=4096, num_values=4096, num_pairs=8, d_model=64, n_layers=2,
                           train_size=100_032, steps=6000, eval_every=1000),
            "grid": QUICK_GRID,
        },
        "atr": {   # the same budget on ATR (L_max = 5, |Σ| = 20); not tuned separately. Grammar seed
                   # 125: its sentence lengths are closest to the reference's (README, "The tasks")
            "config": dict(num_terminals=20, max_rhs_len=5, d_model=64, n_layers=2, data_seed=125,
                           train_size=100_032, steps=6000, eval_every=1000),
            "grid": QUICK_GRID,
        },
    },
    "paper": {   # PROTOCOL §4, §5.1, §8: 100,032 docs, batch 32, 2 layers, one seed (42)
        "ar": {
            "config": dict(num_keys=4096, num_values=4096, num_pairs=16, n_layers=2, batch_size=32,
                           train_size=100_032, epochs=16, eval_every=200),
            "grid": dict(archs=ALL_ARCHS, widths=[16, 32, 64, 128, 256], lrs=LR7, seeds=[42]),
        },
        "atr": {
            "config": dict(num_terminals=20, max_rhs_len=5, max_depth=10, n_layers=2, batch_size=32,
                           data_seed=125, train_size=100_032, epochs=32, eval_every=200),
            "grid": dict(archs=ALL_ARCHS, widths=[16, 32, 64, 128, 256], lrs=LR5, seeds=[42]),
        },
    },
}

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
        for name in ("num_keys", "num_values", "num_pairs", "num_terminals", "num_nonterminals",
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
                  cfg.terminal_weight)
    return (cfg.task, params, cfg.holdout, cfg.data_seed, cfg.train_size, cfg.eval_size)


@lru_cache(maxsize=2)
def _make_data(key):
    task, params, holdout, seed, train_size, eval_size = key
    if task == "ar":
        k, v, m = params
        make = lambda n, split: tasks.make_ar(n, num_keys=k, num_values=v, num_pairs=m, seed=seed,
                                              split=split, holdout=holdout)
    else:
        s, nt, rhs, rules, depth, weight = params
        grammar = tasks.PCFG(num_terminals=s, num_nonterminals=nt, max_rhs_len=rhs, max_rules=rules,
                             max_depth=depth, terminal_weight=weight, seed=seed)
        make = lambda n, split: tasks.make_atr(n, grammar, split=split, holdout=holdout, seed=seed)
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
    model = models.build_model(cfg.arch, data.vocab_size, cfg.d_model, cfg.n_layers, pos_emb=cfg.pos_emb,
                               n_positions=cfg.n_positions, n_heads=cfg.n_heads, d_conv=cfg.d_conv,
                               long_only=cfg.long_only, kernels=cfg.kernels, seed=cfg.seed).to(device)
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
    t_loop, step = time.time(), 0

    def record(step):
        nonlocal loss_sum, loss_count
        metrics = evaluate_all(model, data, novel)
        train_loss = (loss_sum / loss_count).item() if loss_count else None
        entry = {"step": step, "lr": lr_at(step, total, cfg.warmup_frac, cfg.schedule, cfg.lr),
                 "train_loss": train_loss, **metrics}
        history.append(entry)
        loss_sum, loss_count = torch.zeros((), device=device), 0
        elapsed = time.time() - t_loop
        rate = step / elapsed if elapsed > 0 and step else 0.0
        eta = (total - step) / rate if rate else float("nan")
        log(f"step {step}/{total} | loss {'-' if train_loss is None else f'{train_loss:.3f}'} | "
            f"acc {metrics['acc']:.3f}" + (f" | test {metrics['test_acc']:.3f}" if "test_acc" in metrics else "")
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
              "steps_per_s": round(step / max(1e-9, time.time() - t_loop), 2), "checkpoint": checkpoint}
    return _json_safe(result), model


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


def sweep(base_cfg, archs, widths, lrs, seeds, *, results_path, jobs=1, after=None, log=None, per_arch=None):
    """Train every (arch, width, lr, seed) of the grid not already in results_path; return the grid's
    records (old and new) in grid order.

    Each finished run is appended to results_path at once as one JSON line; runs already there (same
    run_key) are skipped, so rerunning a finished sweep trains nothing and Ctrl-C loses only the runs
    in flight. jobs > 1 trains in that many worker processes ("spawn", one thread each). after(model,
    data, cfg, result) -> dict, if given, runs in the worker on each successful run and its dict is
    merged into the record before it is written (run.py uses it for the interventions); it must be a
    module-level function so that it can be sent to a worker.
    """
    log = log or stderr_log()
    configs = grid_configs(base_cfg, archs, widths, lrs, seeds, per_arch)
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
    mech = interventions.mechanism(model, data.eval)
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
