"""Tests of mechsm.py (recipe, evaluation, sweeps, checkpoints) and run.py (the command line).

Small configs and fixed seeds; the whole file runs in well under a minute on 2 CPU cores.
Run: cd /work/main && OMP_WAIT_POLICY=PASSIVE python -m pytest -q test_experiment_part.py
"""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import mechsm
import run as run_cli

HERE = os.path.dirname(os.path.abspath(__file__))

# A miniature AR that attention learns in a few hundred steps (see test_tiny_attention_learns_ar).
TINY_AR = dict(task="ar", num_keys=16, num_values=16, num_pairs=4, arch="attention", d_model=32,
               n_layers=2, device="cpu", eval_size=128)


def tiny(**kw):
    """A very small, fast config (tens of steps): for plumbing tests, not for learning."""
    return mechsm.Config(**{**TINY_AR, "train_size": 320, "epochs": 1, "eval_every": 5, "eval_size": 32, **kw})


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def quiet(msg):
    pass


# ----------------------------------------------------------------------------------------------
# The recipe
# ----------------------------------------------------------------------------------------------

def test_lr_schedule_warms_up_linearly_then_decays_to_zero():
    total, peak = 1000, 3e-3
    lrs = [mechsm.lr_at(s, total, 0.1, "cosine", peak) for s in range(total + 1)]
    assert lrs[0] == 0.0                                         # the reference's first step uses lr 0
    assert lrs[50] == pytest.approx(peak / 2) and lrs[100] == pytest.approx(peak)   # linear warmup, w = 100
    assert all(b - a == pytest.approx(peak / 100) for a, b in zip(lrs[:100], lrs[1:101]))
    assert all(b <= a + 1e-15 for a, b in zip(lrs[100:], lrs[101:]))                # then non-increasing
    assert lrs[550] == pytest.approx(peak / 2)                  # cosine: half way down at mid-decay
    assert lrs[total] == pytest.approx(0.0, abs=1e-12)
    linear = [mechsm.lr_at(s, total, 0.1, "linear", peak) for s in (100, 550, 1000)]
    assert linear == pytest.approx([peak, peak / 2, 0.0])
    assert mechsm.lr_at(0, 10, 0.0, "cosine", 1.0) == 1.0      # no warmup: starts at the peak


def test_loss_reads_only_the_answer_at_the_query():
    cfg = tiny()
    data = mechsm.make_data(cfg)
    torch.manual_seed(0)
    model = mechsm.models.build_model("attention", data.vocab_size, 32, 2)
    tokens, q, a = data.train.tokens[:16], data.train.positions["query"][:16], data.train.answers[:16]
    loss = mechsm.answer_loss(model, tokens, q, a)
    full = model(tokens)                                          # (b, l, v)
    assert torch.allclose(loss, F.cross_entropy(full[torch.arange(16), q], a), atol=1e-6)
    # every token after the query (the answer itself, the final EOS) is invisible to the loss
    perturbed = tokens.clone()
    after = torch.arange(tokens.shape[1])[None] > q[:, None]
    perturbed[after] = torch.randint(3, data.vocab_size, (int(after.sum()),))
    assert torch.equal(mechsm.answer_loss(model, perturbed, q, a), loss)
    # and the gradient w.r.t. the residual stream at positions after the query is exactly zero
    grads = {}

    def keep_grad(module, inputs, out):
        out.register_hook(lambda g: grads.setdefault("g", g))   # returns None: the output is unchanged

    handle = model.blocks[0].hook_resid_pre.register_forward_hook(keep_grad)
    mechsm.answer_loss(model, tokens, q, a).backward()
    handle.remove()
    assert grads["g"][after].abs().max() == 0 and grads["g"][~after].abs().max() > 0


def test_evaluate_counts_argmax_over_full_vocab():
    cfg = tiny()
    data = mechsm.make_data(cfg)

    class Oracle(torch.nn.Module):      # puts all mass on the answer for even documents, on PAD for odd ones
        def __init__(self, answers):
            super().__init__()
            self.answers, self.w, self.i = answers, torch.nn.Parameter(torch.zeros(1)), 0

        def forward(self, tokens, readout=None):
            b = tokens.shape[0]
            rows = torch.arange(self.i, self.i + b)
            self.i += b
            logits = torch.zeros(b, data.vocab_size)
            target = torch.where(rows % 2 == 0, self.answers[rows], torch.zeros_like(rows))
            logits[torch.arange(b), target] = 30.0
            return logits

    m = mechsm.evaluate(Oracle(data.eval.answers), data.eval, batch_size=7)
    assert m["acc"] == 0.5 and m["n"] == len(data.eval)
    assert m["prob"] == pytest.approx(0.5, abs=1e-6)


def test_tiny_attention_leaves_chance_quickly():
    """The recipe optimises: in 300 steps a width-32 attention model reaches the first AR plateau,
    "some value that is in the context" (loss well below ln 16 = uniform over the values, accuracy
    well above 1/16). Measured: eval acc 0.21, eval loss 2.36 (uniform over the values: 0.06, 2.77)."""
    cfg = mechsm.Config(**{**TINY_AR, "train_size": 300 * 32, "epochs": 1, "lr": 3e-3, "eval_every": 10_000,
                           "eval_size": 320, "seed": 0})
    result, _ = mechsm.train(cfg, log=quiet)
    assert result["status"] == "ok"
    assert result["final"]["loss"] < 2.6 and result["final"]["acc"] > 0.12, result["final"]


# The >= 90% test of issue 4, measured on a loaded 2-core machine. Attention miniatures (widths 32-128,
# 16-1024 keys, 2-16 pairs, lr 1e-3..1e-2, batch 32-256, up to 3000 steps) all stayed on the
# 1/pairs plateau ("a value from the context"): induction needs two layers to line up (PROBES.md).
# DeltaNet's short convolutions give it the previous-token step for free, and it gets there fast:
# batch 64, lr 3e-3, 500 steps -> 79% at step 100... 97% at 300, 100% at 500 (seed 0; deterministic
# on CPU). Shorter schedules were not reliable (350 steps: 47%; batch 128 x 250 steps: 90%).
LEARNS_AR = dict(arch="deltanet", d_model=32, batch_size=64, train_size=500 * 64, lr=3e-3)


def test_tiny_model_learns_ar_to_90_percent():
    cfg = mechsm.Config(**{**TINY_AR, "epochs": 1, "eval_every": 10_000, "eval_size": 320, "seed": 0, **LEARNS_AR})
    result, _ = mechsm.train(cfg, log=quiet)
    assert result["status"] == "ok" and result["final"]["acc"] >= 0.9, result["final"]


def test_same_seed_same_metrics_and_novel_accuracy_for_atr():
    cfg = tiny(task="atr", num_terminals=8, max_rhs_len=3, seed=3, train_size=160, eval_every=100)
    r1, _ = mechsm.train(cfg, log=quiet)
    r2, _ = mechsm.train(cfg, log=quiet)
    assert r1["history"] == r2["history"] and r1["n_params"] == r2["n_params"]
    final = r1["final"]
    assert 0 <= final["novel_frac"] <= 1 and "novel_acc" in final    # ATR: eval docs unseen in training
    r3, _ = mechsm.train(replace(cfg, seed=4), log=quiet)
    assert r3["history"] != r1["history"]


def test_holdout_reports_dev_and_test():
    r, _ = mechsm.train(tiny(holdout=0.3, train_size=64, eval_every=100), log=quiet)
    assert {"acc", "test_acc", "test_prob", "test_loss"} <= set(r["final"])


def test_novel_mask_finds_verbatim_repeats():
    data = mechsm.make_data(tiny())
    mask = mechsm.novel_mask(data.train, data.train.subset(slice(0, 5)))
    assert not mask.any()
    assert mechsm.novel_mask(data.train, data.eval).float().mean() > 0.9   # AR: collisions are rare


def test_nan_loss_fails_the_run_and_the_sweep_goes_on(tmp_path):
    path = str(tmp_path / "results.jsonl")
    base = tiny(train_size=640)
    records = mechsm.sweep(base, ["attention"], [32], [1e30, 1e-3], [0], results_path=path)
    by_lr = {r["config"]["lr"]: r for r in records}
    assert by_lr[1e30]["status"] == "failed" and "loss is" in by_lr[1e30]["error"]
    assert by_lr[1e30]["history"] and by_lr[1e30]["steps_done"] < by_lr[1e30]["total_steps"]
    assert by_lr[1e-3]["status"] == "ok"
    lines = open(path).read().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["config"]["arch"] == "attention" for line in lines)
    best = mechsm.best_by_lr(records)
    assert len(best) == 1 and best[0]["best_lr"] == 1e-3


def test_rerun_of_finished_sweep_trains_nothing_and_survives_a_torn_line(tmp_path, monkeypatch):
    path = str(tmp_path / "results.jsonl")
    base = tiny()
    first = mechsm.sweep(base, ["attention", "mamba"], [16], [1e-3], [0, 1], results_path=path, log=quiet)
    with open(path, "a") as f:
        f.write('{"config": {"arch": "attent')                 # a crash mid-write
    monkeypatch.setattr(mechsm, "train", lambda *a, **k: pytest.fail("a finished run was trained again"))
    again = mechsm.sweep(base, ["attention", "mamba"], [16], [1e-3], [0, 1], results_path=path, log=quiet)
    assert [r["name"] for r in again] == [r["name"] for r in first] and len(again) == 4
    rows = mechsm.best_by_lr(again)
    assert [(r["arch"], r["n_seeds"]) for r in rows] == [("attention", 2), ("mamba", 2)]
    assert all(r["std"] >= 0 for r in rows)


def test_sweep_in_parallel_workers(tmp_path):
    path = str(tmp_path / "results.jsonl")
    records = mechsm.sweep(tiny(train_size=96), ["attention", "base_conv"], [16], [1e-3], [0],
                           results_path=path, jobs=2, log=quiet)
    assert [r["status"] for r in records] == ["ok", "ok"]
    serial = mechsm.sweep(tiny(train_size=96), ["attention"], [16], [1e-3], [0],
                          results_path=str(tmp_path / "serial.jsonl"), log=quiet)
    assert serial[0]["history"] == records[0]["history"]       # a worker reproduces the in-process run


def test_config_check_names_the_field():
    for bad, field in [(dict(arch="transformer"), "arch"), (dict(task="mqar"), "task"),
                       (dict(d_model=30, n_heads=4), "n_heads"), (dict(lr=-1.0), "lr"),
                       (dict(lr=float("nan")), "lr"), (dict(schedule="step"), "schedule"),
                       (dict(epochs=0), "epochs"), (dict(train_size=8), "train_size")]:
        with pytest.raises(ValueError, match=f"^{field}:"):
            mechsm.Config(**bad).check()


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["attention", "mamba"])
def test_save_load_round_trip_gives_identical_logits(tmp_path, arch):
    cfg = tiny(arch=arch, out_dir=str(tmp_path), save_checkpoint=True, train_size=64)
    result, model = mechsm.train(cfg, log=quiet)
    loaded, cfg2 = mechsm.load(result["checkpoint"])
    tokens = mechsm.make_data(cfg).eval.tokens[:8]
    assert torch.equal(model.cpu()(tokens), loaded(tokens))
    assert cfg2 == cfg.resolved()


def test_load_rejects_corrupt_and_mismatched_checkpoints(tmp_path):
    cfg = tiny(train_size=32)
    _, model = mechsm.train(cfg, log=quiet)
    good = mechsm.save(model, cfg, str(tmp_path / "good.pt"))
    blob = open(good, "rb").read()
    for name, content in [("truncated.pt", blob[: len(blob) // 2]), ("garbage.pt", b"not a checkpoint"),
                          ("empty.pt", b"")]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(mechsm.CheckpointError, match="checkpoint"):
            mechsm.load(str(tmp_path / name))
    ck = torch.load(good, weights_only=True)
    ck["build_args"]["d_model"] = 16                             # the weights no longer fit
    torch.save(ck, tmp_path / "mismatch.pt")
    with pytest.raises(mechsm.CheckpointError, match="does not rebuild"):
        mechsm.load(str(tmp_path / "mismatch.pt"))
    torch.save({"hello": 1}, tmp_path / "other.pt")
    with pytest.raises(mechsm.CheckpointError, match="not a mechsm"):
        mechsm.load(str(tmp_path / "other.pt"))
    assert issubclass(mechsm.CheckpointError, ValueError)


# ----------------------------------------------------------------------------------------------
# run.py
# ----------------------------------------------------------------------------------------------

def test_run_help_documents_every_option():
    out = subprocess.run([sys.executable, "run.py", "--help"], cwd=HERE, capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ["--task", "--arch", "--d-model", "--lr", "--seeds", "--layers", "--heads", "--preset",
                 "--device", "--out", "--jobs", "--num-keys", "--num-pairs", "--holdout", "--steps",
                 "--epochs", "--train-size", "--pos-emb", "--d-conv", "--no-interventions", "--checkpoint"]:
        assert flag in out.stdout


def test_run_bad_input_exits_2_with_one_line_in_a_subprocess(tmp_path):
    out = subprocess.run([sys.executable, "run.py", "--arch", "transformer", "--out", str(tmp_path)],
                         cwd=HERE, capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and "arch" in out.stderr


def test_run_bad_inputs_exit_2_and_leave_results_untouched(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_text('{"keep": "me"}\n')
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    (tmp_path / "corrupt.pt").write_bytes(b"\x00" * 100)
    tiny_run = ["--num-keys", "16", "--num-values", "16", "--num-pairs", "4", "--steps", "2",
                "--train-size", "64", "--eval-size", "8", "--no-interventions"]
    cases = [
        (["--arch", "transformer"], "arch"),
        (["--d-model", "30", "--heads", "4"], "n_heads"),
        (["--lr", "-1e-3"], "lr"),
        (["--lr", "fast"], "--lr"),
        (["--d-model", "sixty"], "--d-model"),
        (["--seeds", "a-b"], "--seeds"),
        (["--task", "mqar"], "--task"),
        (["--num-pairs", "40", "--num-keys", "16"], "num_pairs"),          # the task cannot be generated
        (["--arch", "attention", "--out", str(blocker / "sub")] + tiny_run, "--out"),
        (["--checkpoint", str(tmp_path / "corrupt.pt")], "checkpoint"),
    ]
    for argv, needle in cases:
        if "--out" not in argv:
            argv = argv + ["--out", str(out)]
        assert run_cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (argv, err)
    assert (out / "results.jsonl").read_text() == '{"keep": "me"}\n'
