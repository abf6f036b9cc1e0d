"""bench: how fast mechsm's kernels, training steps and patching are, each against its slow reference.

Issue 7. The paper (arXiv 2505.15105) reports 0.5-5 GPU-hours per training run; our models are tiny,
so the cost lies in the scan, the long convolutions and framework overhead. This section measures
exactly those, so that "runs on a laptop" is a number anyone can rerun:
  1. the scan as Mamba uses it: (a) the plain scan, shipped `scan` (auto-selected per device) vs the
     plain-autograd loop `sequential_scan`, with `parallel_scan` and `loop_scan` beside it; (b) Mamba's
     whole selective scan, shipped `selective_scan` vs `selective_scan_reference`; float64 errors and
     memory (bytes autograd saves for the backward; on CUDA also the peak allocation);
  2. `fft_conv` vs `direct_conv` (autograd), forward+backward;
  3. training steps/s per architecture at the paper's AR configuration (PROTOCOL.md §0, §2):
     fast kernels + readout-only head vs kernels="reference" + full-vocabulary head;
  4. the wall time of one full interventions.mechanism table (320 AR documents) per architecture.

Every figure is the median of several *interleaved* repeats (candidate and reference alternate in the
same loop, so a burst of load from another process hits both) and is printed with its ratio to the
reference measured in the same run. Timings on a shared machine are noisy; ratios are more stable.

Run it with OpenMP's passive wait policy: with the default (spinning) policy, a second busy process on
the machine made loop-heavy kernels 20-30x slower on a 2-core box:
    OMP_WAIT_POLICY=PASSIVE python run.py bench            # CPU
    python run.py bench --device cuda                      # GPU

Shape glossary: b batch, l sequence length, d channels (d_model), e Mamba inner width, n SSM state
size, v vocabulary.
"""

import math
import os
import statistics
import time

import torch

import models

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
        archs=None, mech_docs=320),
    "tiny": dict(
        scan_lengths=(37, 64), scan_shape=dict(b=2, e=8, n=4), scan_batch_cpu={},
        conv_lengths=(16, 64), conv_shape=dict(b=2, d=8), toeplitz_mib=512,
        repeats=1, train_steps=2, train_repeats=1, train_batch=4,
        archs=("attention", "mamba"), mech_docs=8),
}

AR_VOCAB, AR_LENGTH = 8195, 37    # the paper's AR configuration: 4096 keys + 4096 values + 3 specials


# ----------------------------------------------------------------------------------------------
# Timing and printing helpers
# ----------------------------------------------------------------------------------------------

def _pick_device(device):
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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
    """Selective-scan inputs distributed like a freshly initialised Mamba layer's (ARCHITECTURES.md §3.6).

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
        "parallel": models.parallel_scan,
        "loop": models.loop_scan,
    }


def selective_candidates():
    """Name -> kernel(u, delta, A, B, C) for Mamba's whole selective scan, if models.py has one."""
    if not hasattr(models, "selective_scan"):
        return {}
    out = {"reference": models.selective_scan_reference, "selective_scan": models.selective_scan}
    if hasattr(models, "_SelectiveScanLoopFn"):  # the CPU path, also reported on other devices
        out["fused_loop"] = lambda *x: models._SelectiveScanLoopFn.apply(*x)
    return out


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
        if selective_candidates():
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
    if selective:
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
    import tasks
    return tasks.make_ar(n, seed=seed)


def _archs(cfg):
    """Every registered architecture (or the few a tiny run uses); ones that fail to build are noted."""
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


def bench_train(device, cfg, print_fn=print, notes=None):
    notes = [] if notes is None else notes
    try:
        data = _ar_dataset(cfg["train_batch"] * cfg["train_steps"] * 2, seed=0)
    except Exception as exc:  # tasks.py not there yet, or broken
        notes.append(f"training table skipped: could not make AR data ({type(exc).__name__}: {exc})")
        print_fn(f"3. Training: skipped ({notes[-1]})\n")
        return []
    rows = []
    for arch in _archs(cfg):
        try:
            torch.manual_seed(0)
            fast = models.build_model(arch, AR_VOCAB, 64, 2, kernels="fast").to(device)
            torch.manual_seed(0)
            ref = models.build_model(arch, AR_VOCAB, 64, 2, kernels="reference").to(device)
        except Exception as exc:
            notes.append(f"train[{arch}] skipped: build_model failed ({type(exc).__name__}: {exc})")
            continue
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

def bench_mechanism(device, cfg, print_fn=print, notes=None):
    notes = [] if notes is None else notes
    try:
        import interventions
        data = _ar_dataset(cfg["mech_docs"], seed=1).to(device)
    except Exception as exc:
        notes.append(f"mechanism table skipped: {type(exc).__name__}: {exc}")
        print_fn(f"4. Intervention table: skipped ({notes[-1]})\n")
        return []
    rows = []
    for arch in _archs(cfg):
        try:
            torch.manual_seed(0)
            model = models.build_model(arch, AR_VOCAB, 64, 2).to(device).eval()
        except Exception as exc:
            notes.append(f"mechanism[{arch}] skipped: build_model failed ({type(exc).__name__}: {exc})")
            continue
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
# The whole benchmark
# ----------------------------------------------------------------------------------------------

def bench(device="auto", size="full", print_fn=print, parts=(1, 2, 3, 4), threads=None):
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
               omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "(unset)"), size=size)
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    print_fn("mechsm bench | " + " | ".join(f"{k} {v}" for k, v in env.items()))
    if device.type == "cpu" and env["omp_wait_policy"].upper() != "PASSIVE":
        print_fn("  note: OMP_WAIT_POLICY is not PASSIVE; loop kernels can be 20-30x slower when "
                 "another process is busy")
    print_fn("  each time is the median of interleaved repeats; ratios compare against the reference "
             "timed in the same loop\n")
    notes = []
    result = dict(env=env, scan=[], selective_scan=[], conv=[], train=[], mechanism=[], notes=notes)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if 1 in parts:
            result["scan"], result["selective_scan"] = bench_scan(device, cfg, print_fn)
        if 2 in parts:
            result["conv"] = bench_conv(device, cfg, print_fn)
        if 3 in parts:
            result["train"] = bench_train(device, cfg, print_fn, notes)
        if 4 in parts:
            result["mechanism"] = bench_mechanism(device, cfg, print_fn, notes)
    for note in notes:
        print_fn("note: " + note)
    return result


if __name__ == "__main__":
    import sys
    bench(sys.argv[1] if len(sys.argv) > 1 else "auto", sys.argv[2] if len(sys.argv) > 2 else "full")
