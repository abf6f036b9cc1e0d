"""Tests for models.py (backbone, attention, base_conv, based, mamba): run with `python -m pytest -q test_models_part.py`.

Follows ARCHITECTURES.md §4 (parameter counts) and §8 (self-checks). Small configs (v=50, d=16) and
fixed seeds keep the whole file at a few seconds on one CPU core.
Shape letters: b batch, l sequence length, d d_model, v vocabulary.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import models

ARCH_UNDER_TEST = ["attention", "base_conv", "based", "h3", "hyena", "mamba", "deltanet"]

# ARCHITECTURES.md §4: totals at v=8195, P=1024, 2 layers, pos_emb on, tied head counted once.
PARAM_COUNTS = {  # d_model: {arch: count}
    16: {"attention": 154_000, "base_conv": 155_936, "based": 153_024, "hyena": 179_984, "h3": 268_848, "mamba": 154_288},
    32: {"attention": 320_288, "base_conv": 317_952, "based": 315_776, "hyena": 348_832, "h3": 549_984, "mamba": 314_976},
    64: {"attention": 689_728, "base_conv": 669_632, "based": 670_464, "hyena": 723_392, "h3": 1_149_120,
         "mamba": 655_552, "deltanet": 691_392},
    128: {"attention": 1_576_064, "base_conv": 1_483_584, "based": 1_496_576, "hyena": 1_619_968, "h3": 2_494_848,
          "mamba": 1_413_504},
    256: {"attention": 3_938_560, "base_conv": 3_553_856, "based": 3_615_744, "hyena": 4_002_944, "h3": 5_776_128,
          "mamba": 3_236_608},
}

REQUIRED_HOOKS = {
    "attention": ["hook_q", "hook_k", "hook_v", "hook_pattern", "hook_z"],
    "base_conv": ["hook_proj", "hook_conv", "hook_gated"],
    "based": ["hook_q", "hook_k", "hook_phi_q", "hook_phi_k", "hook_v", "hook_pattern", "hook_y"],
    "mamba": ["hook_x", "hook_z", "hook_conv_out", "hook_u", "hook_delta", "hook_B", "hook_C",
              "hook_ssm_out", "hook_gate", "hook_y"],
    "hyena": ["hook_in_proj", "hook_short", "hook_pregate", "hook_longconv", "hook_postgate"],
    "h3": ["hook_q", "hook_k", "hook_v", "hook_shift_out", "hook_k_tilde", "hook_ssm_out", "hook_y"],
    "deltanet": ["hook_q", "hook_k", "hook_v", "hook_beta", "hook_o"],
}

V, D = 50, 16


def small_model(arch, dtype=torch.float64, seed=0, **options):
    return models.build_model(arch, V, D, 2, seed=seed, **options).to(dtype)


def random_tokens(b=3, l=12, seed=0):
    return torch.randint(0, V, (b, l), generator=torch.Generator().manual_seed(seed))


# Variants covering each arch's options (the ablations of the paper).
VARIANTS = [(arch, {}) for arch in ARCH_UNDER_TEST] + [
    ("mamba", {"d_conv": 0}), ("mamba", {"d_conv": 1}), ("based", {"long_only": True}),
    ("base_conv", {"long_only": True}), ("based", {"d_conv": 2}), ("attention", {"n_heads": 4}),
    ("based", {"n_heads": 2}),
]
VARIANT_IDS = [arch + "".join(f"-{k}={v}" for k, v in opts.items()) for arch, opts in VARIANTS]


# ---------------------------------------------------------------------------------------------- counts

@pytest.mark.parametrize("arch", ARCH_UNDER_TEST)
def test_parameter_counts_match_table(arch):
    for d_model, row in PARAM_COUNTS.items():
        if arch in row:
            model = models.build_model(arch, 8195, d_model, 2, pos_emb=True)
            assert models.count_parameters(model) == row[arch], (arch, d_model)


def test_frozen_features_and_nope_counts():
    base_conv = models.build_model("base_conv", 8195, 64, 2, pos_emb=True)
    assert models.count_parameters(base_conv, trainable_only=True) == 666_560  # 3P frozen features excluded
    nope = models.build_model("mamba", 8195, 64, 2)  # pos_emb defaults to off except for attention
    assert models.count_parameters(nope) == 655_552 - 1024 * 64


# ---------------------------------------------------------------------------------------------- forward

@pytest.mark.parametrize("arch,options", VARIANTS, ids=VARIANT_IDS)
def test_forward_backward(arch, options):
    model = small_model(arch, torch.float32, **options)
    tokens = random_tokens()
    logits = model(tokens)
    assert logits.shape == (3, 12, V)
    F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    unused = {"mamba": ["conv1d"]}.get(arch, []) if options.get("d_conv") == 0 else []
    for name, p in model.named_parameters():
        if p.requires_grad and not any(u in name for u in unused):
            assert p.grad is not None and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("arch,options", VARIANTS, ids=VARIANT_IDS)
def test_causality(arch, options):
    model = small_model(arch, **options)
    tokens = random_tokens()
    t = 7
    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % V
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :t], after[:, :t], rtol=0, atol=1e-12)
    assert (before[:, t] - after[:, t]).abs().max() > 1e-6  # and token t does matter


@pytest.mark.parametrize("arch", ARCH_UNDER_TEST)
def test_readout_equals_full_logits(arch):
    model = small_model(arch)
    tokens = random_tokens()
    positions = torch.tensor([0, 5, 11])
    with torch.no_grad():
        full, read = model(tokens), model(tokens, readout=positions)
    assert read.shape == (3, V)
    torch.testing.assert_close(read, full[torch.arange(3), positions])


@pytest.mark.parametrize("arch,options", VARIANTS, ids=VARIANT_IDS)
def test_reference_kernels_give_same_logits(arch, options):
    tokens = random_tokens()
    with torch.no_grad():
        fast = small_model(arch, **options)(tokens)
        slow = small_model(arch, kernels="reference", **options)(tokens)
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("arch", ARCH_UNDER_TEST)
def test_model_follows_dtype_and_rebuilds(arch):
    model = small_model(arch, torch.float64, seed=3)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert model(random_tokens()).dtype == torch.float64
    rebuilt = models.build_model(**model.build_args).to(torch.float64)
    for (name, p), q in zip(model.state_dict().items(), rebuilt.state_dict().values()):
        assert torch.equal(p, q), name


# ---------------------------------------------------------------------------------------------- hooks

@pytest.mark.parametrize("arch", ARCH_UNDER_TEST)
def test_required_hook_names_exist(arch):
    names = {name for name, _ in small_model(arch).named_modules()}
    block_sites = ["hook_resid_pre", "mixer.hook_in", "mixer.hook_out", "hook_resid_post"]
    if arch not in models.MAMBA_BLOCK_ARCHS:
        block_sites += ["mlp.hook_in", "mlp.hook_out"]
    for i in range(2):
        for site in block_sites:
            assert f"blocks.{i}.{site}" in names, (arch, i, site)
    mixer_layer = {"based": 1}.get(arch, 0)  # based: layer 0 is BaseConv, layer 1 the linear attention
    for hook in REQUIRED_HOOKS[arch]:
        assert f"blocks.{mixer_layer}.mixer.{hook}" in names, hook
    for i, block in enumerate(small_model(arch).blocks):
        for site in type(block.mixer).INTERNAL_SITES:
            assert f"blocks.{i}.mixer.{site}" in names, site
    if arch == "base_conv":
        assert "blocks.1.mixer.hook_longconv" in names


@pytest.mark.parametrize("arch,options", VARIANTS[:len(ARCH_UNDER_TEST)] + [("base_conv", {"long_only": True})])
def test_every_hook_output_is_used(arch, options):
    """Perturbing the value a HookPoint returns changes the logits: the forward uses the hook's output."""
    model = small_model(arch, **options)
    tokens = random_tokens()
    with torch.no_grad():
        clean = model(tokens)
        for name, module in model.named_modules():
            if isinstance(module, models.HookPoint):
                handle = module.register_forward_hook(lambda mod, inp, out: out * 1.5 + 0.1)
                patched = model(tokens)
                handle.remove()
                assert (patched - clean).abs().max() > 1e-8, name


# ---------------------------------------------------------------------------------------------- recurrent form

def _loop_steps(mixer, x):
    state = mixer.init_state(x.shape[0], x.device, x.dtype)
    outputs = []
    for x_t in x.unbind(1):
        y_t, state = mixer.step(x_t, state)
        outputs.append(y_t)
    return torch.stack(outputs, dim=1)


@pytest.mark.parametrize("mixer_factory", [
    lambda: models.Mamba(D, 0, 2, d_conv=0), lambda: models.Mamba(D, 0, 2, d_conv=1),
    lambda: models.Mamba(D, 0, 2, d_conv=4), lambda: models.BasedAttention(D, 1, 2),
    lambda: models.BasedAttention(D, 1, 2, n_heads=4),
], ids=["mamba-d_conv=0", "mamba-d_conv=1", "mamba-d_conv=4", "based", "based-4heads"])
def test_recurrent_step_matches_parallel_forward(mixer_factory):
    torch.manual_seed(0)
    mixer = mixer_factory().double()
    x = torch.randn(2, 13, D, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(_loop_steps(mixer, x), mixer(x), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------- init & pieces

def test_mamba_dt_bias_and_init():
    model = models.build_model("mamba", V, 64, 2, seed=0)
    for block in model.blocks:
        mixer = block.mixer
        dt = F.softplus(mixer.dt_proj.bias)
        assert dt.min() >= 1e-3 - 1e-7 and dt.max() <= 1e-1 + 1e-7
        assert torch.equal(mixer.A_log[3], torch.log(torch.arange(1.0, 17.0)))
        bound = 1 / math.sqrt(128) / math.sqrt(2)  # torch-default U(+-1/sqrt(e)), divided by sqrt(n_layers)
        assert mixer.out_proj.weight.abs().max() <= bound and mixer.out_proj.weight.abs().max() > 0.9 * bound
    assert abs(model.embed.weight.std().item() - 0.02) < 0.002


def test_transformer_init_pass():
    model = models.build_model("attention", 500, 64, 2, seed=0)
    attn, mlp = model.blocks[0].mixer, model.blocks[0].mlp
    assert abs(attn.Wqkv.weight.std().item() - 0.02) < 0.002
    assert abs(attn.out_proj.weight.std().item() - 0.01) < 0.002  # 0.02 / sqrt(2 n_layers)
    assert abs(mlp.fc2.weight.std().item() - 0.01) < 0.001
    assert abs(mlp.fc1.weight.std().item() - 0.02) < 0.001 and (mlp.fc1.bias == 0).all()
    based = models.build_model("based", 500, 64, 2, seed=0)
    assert abs(based.blocks[1].mixer.proj_o.weight.std().item() - 0.02) < 0.002  # proj_o is not down-scaled
    conv = based.blocks[0].mixer.conv.weight  # conv keeps torch-default U(+-1/sqrt(3))
    assert conv.abs().max() <= 1 / math.sqrt(3) and conv.abs().max() > 0.5


def test_layer_pattern_of_based_and_base_conv():
    kernel_sizes = lambda m: [getattr(b.mixer, "kernel_size", "attn") for b in m.blocks]
    assert kernel_sizes(models.build_model("base_conv", V, D, 3)) == [3, -1, 3]
    assert kernel_sizes(models.build_model("base_conv", V, D, 3, d_conv=2)) == [2, 2, 2]
    assert kernel_sizes(models.build_model("base_conv", V, D, 2, long_only=True)) == [-1, -1]
    assert kernel_sizes(models.build_model("based", V, D, 3)) == [3, "attn", 3]
    assert kernel_sizes(models.build_model("based", V, D, 2, long_only=True)) == [-1, "attn"]


def test_taylor_feature_kernel():
    torch.manual_seed(0)
    q, k = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    phi_q, phi_k = models.taylor_features(q), models.taylor_features(k)
    assert phi_q.shape == (5, 73)
    s = (q * k).sum(-1) / math.sqrt(8)
    torch.testing.assert_close((phi_q * phi_k).sum(-1), 1 + s + s ** 2 / 2)


def test_rmsnorm_and_mlp_pieces():
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    norm = models.RMSNorm(8).double()
    torch.testing.assert_close(norm(x), x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-5))
    mlp = models.MLP(8).double()
    torch.testing.assert_close(mlp(x), mlp.fc2(F.gelu(mlp.fc1(x), approximate="none")))


@pytest.mark.parametrize("kwargs", [
    dict(arch="transformer"), dict(arch="attention", d_model=10, n_heads=3), dict(arch="attention", n_layers=0),
    dict(arch="mamba", d_conv=5), dict(arch="mamba", kernels="slow"), dict(arch="based", d_conv=0),
    dict(arch="base_conv", d_conv=2, long_only=True),
])
def test_build_model_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        models.build_model(vocab_size=V, **kwargs)


@pytest.mark.parametrize("arch", ARCH_UNDER_TEST)
def test_half_precision_forward(arch):
    """bfloat16 models run (the FFT conv and Mamba's scan compute in float32 internally)."""
    logits = small_model(arch, torch.bfloat16)(random_tokens())
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
