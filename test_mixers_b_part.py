"""Tests for mixers_b.py (Hyena, H3, DeltaNet): parameter counts, causality, fast vs reference kernels,
recurrent step mode, delta-rule retrieval, hooks. ARCHITECTURES.md §3.4, §3.5, §3.7, §4, §8.

Small widths, float64 wherever two forms are compared. Run: python -m pytest -q test_mixers_b_part.py
Shapes: b batch, l sequence length, d d_model, h heads, k head width, m H3 head width.
"""

import math

import pytest
import torch

import models
import models as mixers_b
from models import H3, DeltaNet, Hyena, delta_rule_parallel, delta_rule_recurrent

torch.set_num_threads(1)

# (class, options) for every mixer variant under test; small d_state keeps H3 fast.
VARIANTS = {
    "hyena": (Hyena, {}),
    "hyena_skip": (Hyena, {"hyena_skip": True}),
    "h3": (H3, {"h3_d_state": 32}),
    "h3_m1": (H3, {"h3_d_state": 32, "h3_head_dim": 1}),
    "deltanet": (DeltaNet, {}),
    "deltanet_h2": (DeltaNet, {"n_heads": 2}),
    "deltanet_noconv": (DeltaNet, {"n_heads": 2, "d_conv": 0}),
}
RECURRENT = [name for name, (cls, _) in VARIANTS.items() if hasattr(cls, "step")]


def make(name, d=16, reference=False, seed=0):
    """A float64 mixer with every parameter perturbed away from its (often degenerate) init."""
    cls, options = VARIANTS[name]
    torch.manual_seed(seed)
    mixer = cls(d, 0, 2, reference, **options).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return mixer


def inputs(b=2, l=11, d=16, seed=1):
    return torch.randn(b, l, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


# --- parameter counts (ARCHITECTURES.md §4) ---------------------------------------------------

@pytest.mark.parametrize("cls,options,expected", [
    (Hyena, {}, 33_280), (H3, {}, 246_144),
    (DeltaNet, {"n_heads": 1}, 17_280), (DeltaNet, {"n_heads": 2}, 17_312), (DeltaNet, {"n_heads": 4}, 17_424),
])
def test_mixer_parameter_counts(cls, options, expected):
    assert models.count_parameters(cls(64, 0, 2, **options)) == expected


@pytest.mark.parametrize("arch,d_model,n_heads,expected", [
    ("hyena", 16, 1, 179_984), ("hyena", 32, 1, 348_832), ("hyena", 64, 1, 723_392),
    ("hyena", 128, 1, 1_619_968), ("hyena", 256, 1, 4_002_944),
    ("h3", 16, 1, 268_848), ("h3", 32, 1, 549_984), ("h3", 64, 1, 1_149_120),
    ("h3", 128, 1, 2_494_848), ("h3", 256, 1, 5_776_128),
    ("deltanet", 64, 1, 691_392), ("deltanet", 64, 2, 691_456), ("deltanet", 64, 4, 691_680),
])
def test_model_parameter_counts(arch, d_model, n_heads, expected):
    model = models.build_model(arch, 8195, d_model, 2, pos_emb=True, n_heads=n_heads)
    assert models.count_parameters(model) == expected


def test_registry_and_init_pass():
    assert {"hyena", "h3", "deltanet"} <= set(models.MIXER_CLASSES)
    model = models.build_model("hyena", 50, 64, 2, seed=0)
    mixer = model.blocks[0].mixer
    # Hyena's out_proj is down-scaled to N(0, 0.01^2); H3's output_linear and DeltaNet's o_proj are not.
    assert 0.008 < mixer.out_proj.weight.std() < 0.012
    assert 0.018 < models.build_model("h3", 50, 64, 2, seed=0).blocks[0].mixer.output_linear.weight.std() < 0.022
    assert 0.018 < models.build_model("deltanet", 50, 64, 2, seed=0).blocks[0].mixer.o_proj.weight.std() < 0.022
    # The filter MLP is a set of Linears, so the init pass makes the filter start near zero (§3.4).
    assert mixer.filter(40).abs().max() < 1e-2
    assert torch.all(mixer.filter.freq == 1)
    decay = mixer.filter.decay
    assert math.isclose(decay[0].item(), 3.0701, abs_tol=1e-4) and math.isclose(decay[-1].item(), 15.3506, abs_tol=1e-4)


# --- equivalences (float64) ---------------------------------------------------------------------

@pytest.mark.parametrize("name", list(VARIANTS))
def test_fast_equals_reference(name):
    x = inputs()
    assert torch.allclose(make(name)(x), make(name, reference=True)(x), atol=1e-10)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_causality(name):
    mixer, x = make(name), inputs(l=13)
    y = mixer(x)
    for t in (0, 5, 12):
        x2 = x.clone()
        x2[:, t] += torch.randn_like(x2[:, t])
        y2 = mixer(x2)
        assert torch.allclose(y2[:, :t], y[:, :t], atol=1e-12)
        assert not torch.allclose(y2[:, t], y[:, t])


@pytest.mark.parametrize("name", RECURRENT)
def test_step_equals_mix(name):
    mixer, x = make(name), inputs(l=9)
    state = mixer.init_state(x.shape[0], x.device, x.dtype)
    outputs = []
    for x_t in x.unbind(1):
        y_t, state = mixer.step(x_t, state)
        outputs.append(y_t)
    assert torch.allclose(torch.stack(outputs, 1), mixer(x), atol=1e-10)


def test_delta_rule_parallel_equals_loop_with_gradients():
    g = torch.Generator().manual_seed(0)
    b, l, h, k = 2, 10, 3, 4
    q, key, v = (torch.randn(b, l, h, k, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3))
    beta = torch.rand(b, l, h, dtype=torch.float64, generator=g, requires_grad=True)
    keys = mixers_b.l2_normalize(key)
    out_loop, out_par = delta_rule_recurrent(q, keys, v, beta), delta_rule_parallel(q, keys, v, beta)
    assert torch.allclose(out_loop, out_par, atol=1e-12)
    weights = torch.randn(out_loop.shape, dtype=torch.float64, generator=g)
    grads_loop = torch.autograd.grad((out_loop * weights).sum(), (q, key, v, beta), retain_graph=True)
    grads_par = torch.autograd.grad((out_par * weights).sum(), (q, key, v, beta))
    for a, b_ in zip(grads_loop, grads_par):
        assert torch.allclose(a, b_, atol=1e-10)


@pytest.mark.parametrize("delta_rule", [delta_rule_recurrent, delta_rule_parallel])
def test_delta_rule_retrieves_and_overwrites(delta_rule):
    """beta = 1 and orthonormal keys: S_t^T k_s = v_s for every stored pair (§8.7), and writing a key
    again replaces its value instead of adding to it (what distinguishes the delta rule)."""
    k_dim, n_pairs = 8, 5
    basis = torch.linalg.qr(torch.randn(k_dim, k_dim, dtype=torch.float64))[0]      # orthonormal columns
    keys = torch.cat([basis.T[:n_pairs], basis.T[:1]])                              # k_0..k_4, then k_0 again
    values = torch.randn(n_pairs + 1, k_dim, dtype=torch.float64)
    ones = torch.ones(1, n_pairs + 1, 1, dtype=torch.float64)
    # Query the last state with every stored key: put the query at the last position, one batch row each.
    q = torch.zeros(n_pairs, n_pairs + 1, 1, k_dim, dtype=torch.float64)
    q[:, -1, 0] = basis.T[:n_pairs]
    k_batch = keys[None, :, None].expand(n_pairs, -1, -1, -1)
    v_batch = values[None, :, None].expand(n_pairs, -1, -1, -1)
    read = delta_rule(q, k_batch, v_batch, ones.expand(n_pairs, -1, -1))[:, -1, 0] * math.sqrt(k_dim)
    expected = torch.cat([values[-1:], values[1:n_pairs]])                           # k_0 now holds the new value
    assert torch.allclose(read, expected, atol=1e-12)


# --- H3 specifics -------------------------------------------------------------------------------

def test_h3_kernels_at_init():
    for reference in (False, True):
        torch.manual_seed(0)
        h3 = H3(16, 0, 2, reference, h3_d_state=64).double()
        shift = h3.shift_kernel(20)                                   # (l, d)
        assert torch.allclose(shift, h3.shift_C[:, :20].T, atol=1e-15, rtol=0)
        assert h3.ssm_kernel(20).dtype == torch.float64               # K^d comes out real
    with pytest.raises(ValueError):
        h3.shift_kernel(65)


def test_h3_m1_closed_form_and_channel_order():
    """m = 1: y = q * (K^d * (k~ v) + D^d k~ v) (§8.4). m = 2: y[..., j*H + h] = sum_i q_{h,i} w_{h,i,j}."""
    x = inputs()
    h3 = make("h3_m1")
    cache = {}
    handles = [getattr(h3, name).register_forward_hook(lambda mod, inp, out, name=name: cache.__setitem__(name, out))
               for name in ("hook_q", "hook_k_tilde", "hook_v", "hook_y")]
    h3(x)
    z = cache["hook_k_tilde"] * cache["hook_v"]                                     # (b, l, d)
    conv = models.direct_conv(z, h3.ssm_kernel(x.shape[1]))
    assert torch.allclose(cache["hook_y"], cache["hook_q"] * (conv + h3.diag_D * z), atol=1e-12)
    for handle in handles:
        handle.remove()

    h3 = make("h3")
    h, m = h3.n_heads, h3.head_dim
    handles = [getattr(h3, name).register_forward_hook(lambda mod, inp, out, name=name: cache.__setitem__(name, out))
               for name in ("hook_q", "hook_ssm_out", "hook_y")]
    h3(x)
    q, w, y = cache["hook_q"], cache["hook_ssm_out"], cache["hook_y"]
    for head in range(h):
        for j in range(m):
            expected = sum(q[..., head * m + i] * w[..., head, i, j] for i in range(m))
            assert torch.allclose(y[..., j * h + head], expected, atol=1e-12)
    for handle in handles:
        handle.remove()


def test_length_limits():
    with pytest.raises(ValueError):
        H3(8, 0, 2, h3_d_state=8)(torch.randn(1, 9, 8))
    with pytest.raises(ValueError):
        Hyena(8, 0, 2, n_positions=8)(torch.randn(1, 9, 8))


# --- Hyena skip, hooks, training ------------------------------------------------------------------

def test_hyena_skip_is_inert_by_default():
    x = inputs()
    off, on = make("hyena"), make("hyena_skip")
    assert not torch.allclose(off(x), on(x))
    off(x).sum().backward()
    assert off.skip.grad is not None and torch.all(off.skip.grad == 0)  # counted, trained, never moves


HOOKS = {
    Hyena: ["hook_in_proj", "hook_short", "hook_pregate", "hook_filter", "hook_longconv", "hook_postgate"],
    H3: ["hook_q", "hook_k", "hook_v", "hook_shift_kernel", "hook_shift_out", "hook_k_tilde", "hook_kv",
         "hook_ssm_kernel", "hook_ssm_out", "hook_y"],
    DeltaNet: ["hook_q", "hook_k", "hook_v", "hook_beta", "hook_o"],
}


@pytest.mark.parametrize("name", ["hyena", "h3", "deltanet_h2"])
def test_every_hook_is_used_downstream(name):
    """Each HookPoint exists, INTERNAL_SITES name real hooks, and a hook's return value changes the output."""
    mixer, x = make(name), inputs()
    hooks = {n for n, mod in mixer.named_modules() if isinstance(mod, models.HookPoint)}
    expected = HOOKS[type(mixer)]
    assert hooks == {"hook_in", "hook_out", *expected}
    assert set(type(mixer).INTERNAL_SITES) <= hooks
    clean = mixer(x)
    for site in expected:
        module = getattr(mixer, site)
        assert module.seq_dim == (None if site in ("hook_filter", "hook_shift_kernel", "hook_ssm_kernel") else 1)
        handle = module.register_forward_hook(lambda mod, inp, out: out * 1.5)
        try:
            assert not torch.allclose(mixer(x), clean), site
        finally:
            handle.remove()
        assert torch.equal(mixer(x), clean)


@pytest.mark.parametrize("arch,options", [("hyena", {}), ("h3", {"h3_d_state": 64}), ("deltanet", {"n_heads": 2})])
def test_model_forward_backward_and_kernels(arch, options):
    torch.manual_seed(0)
    tokens = torch.randint(0, 30, (2, 17))
    fast = models.build_model(arch, 30, 16, 2, seed=0, **options).double()
    logits = fast(tokens)
    assert logits.shape == (2, 17, 30)
    logits[:, -1].logsumexp(-1).sum().backward()
    for name, p in fast.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    ref = models.build_model(arch, 30, 16, 2, seed=0, kernels="reference", **options).double()
    assert torch.allclose(ref(tokens), logits, atol=1e-10)
    # Causality through the whole model: a token changed at t leaves the logits before t alone.
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 30
    assert torch.allclose(fast(changed)[:, :9], logits[:, :9], atol=1e-12)


def test_float32_default_h3_runs():
    """The paper's d_state = 1024 in float32 (complex64 kernels) agrees with float64 at AR lengths."""
    torch.manual_seed(0)
    h3 = H3(32, 0, 2)
    x = torch.randn(2, 40, 32)
    y32 = h3(x)
    y64 = h3.double()(x.double())
    assert torch.allclose(y32.double(), y64, atol=1e-5, rtol=1e-4)
