"""Tests for interventions.py: patching mechanics, corruption, attribution, the batched table.

Small models (d=16, V=35, 4 AR pairs) in float64 wherever exactness matters. Run with
`cd /work/main && python -m pytest -q test_interventions_part.py`.
"""

import json

import pytest
import torch

import interventions as iv
import models
import tasks

ARCHS = list(models.ARCHS)


@pytest.fixture(scope="module")
def data():
    return tasks.make_ar(48, num_keys=16, num_values=16, num_pairs=4, seed=3)


def small_model(arch, vocab_size, n_layers=2, scale=3.0):
    """Random float64 model with large weights (Linear ~ N(0, scale^2 / fan_in), embeddings ~ N(0, 1)),
    so that the corrupted key moves the answer probability: with the paper's small init an
    untrained model is ~uniform and p_clean ~= p_corrupt."""
    model = models.build_model(arch, vocab_size, 16, n_layers, seed=0).double().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g, dtype=m.weight.dtype)
                               * scale / m.in_features ** 0.5)
        model.embed.weight.copy_(torch.randn(model.embed.weight.shape, generator=g, dtype=torch.float64))
    return model


def no_hooks_left(model):
    return all(len(m._forward_hooks) == 0 for m in model.modules())


# ---------------------------------------------------------------------------------------------
# Sites and hooks
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_sites_and_labels(arch, data):
    model = small_model(arch, data.vocab_size)
    sites = iv.default_sites(model)
    labels = {(iv.site_layer(s), iv.site_label(s)) for s in sites}
    for layer in (0, 1):
        for label in ("block_in", "mixer_in", "mixer_out", "block_out"):
            assert (layer, label) in labels
        assert ((layer, "mlp_in") in labels) == (arch != "mamba")  # Mamba blocks have no MLP
    assert set(sites) <= set(iv.hook_points(model))
    if arch == "mamba":
        assert "blocks.0.mixer.hook_conv_out" in sites and iv.site_label("blocks.0.mixer.hook_conv_out") == "conv_out"


@pytest.mark.parametrize("arch", ARCHS)
def test_self_patch_changes_no_logit(arch, data):
    """Patching every site of a clean run with its own clean activations changes nothing."""
    model = small_model(arch, data.vocab_size)
    sites = list(iv.hook_points(model))
    clean = iv.record(model, data.tokens, sites)
    with torch.no_grad():
        before = model(data.tokens)
        with iv.patch(model, {s: (lambda act, s=s: clean[s]) for s in sites}):
            after = model(data.tokens)
    assert torch.equal(before, after)
    assert no_hooks_left(model)


def test_hooks_removed_after_exception(data):
    model = small_model("attention", data.vocab_size)
    with torch.no_grad():
        before = model(data.tokens)

    def boom(act):
        raise RuntimeError("inside the patched forward")

    with pytest.raises(RuntimeError, match="inside the patched forward"):
        with iv.patch(model, {"blocks.0.hook_resid_pre": lambda a: a * 0, "blocks.1.mixer.hook_z": boom}):
            model(data.tokens)
    assert no_hooks_left(model)
    with torch.no_grad():
        assert torch.equal(model(data.tokens), before)
    with pytest.raises(KeyError):  # not a HookPoint: refused before anything is registered
        with iv.patch(model, {"blocks.0.hook_resid_pre": lambda a: a, "blocks.0.ln1": lambda a: a}):
            pass
    assert no_hooks_left(model)


# ---------------------------------------------------------------------------------------------
# Corruption and attribution
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("role", ["key", "value"])
@pytest.mark.parametrize("strict", [False, True])
def test_corrupt_keeps_class_and_changes_one_token(data, role, strict):
    corrupted = iv.corrupt(data, role, seed=1, strict=strict)
    changed = corrupted != data.tokens
    assert (changed.sum(1) == 1).all()
    rows = torch.arange(len(data))
    pos = data.positions[role]
    assert changed[rows, pos].all()
    lo, hi = data.classes[role]
    new = corrupted[rows, pos]
    assert ((new >= lo) & (new < hi)).all()  # a value is replaced by a value (PROTOCOL §10.1)
    if strict:  # the replacement occurs nowhere in the clean document (§10.20)
        assert not (data.tokens == new[:, None]).any()
    assert torch.equal(corrupted, iv.corrupt(data, role, seed=1, strict=strict))
    assert not torch.equal(corrupted, iv.corrupt(data, role, seed=2, strict=strict))


def test_attribution_is_a_ratio_of_means():
    p_clean = torch.tensor([1.0, 0.5])
    p_corrupt = torch.tensor([0.0, 0.25])
    p_patched = torch.tensor([0.5, 0.5])
    a = iv.attribution(p_clean, p_corrupt, p_patched)
    # means 0.75, 0.125, 0.5 -> (0.5 - 0.125) / (0.75 - 0.125) = 0.6; the mean of the
    # per-document ratios would be (0.5 + 1.0) / 2 = 0.75
    assert a["score"] == pytest.approx(0.6)
    assert (a["p_clean"], a["p_corrupt"], a["p_patched"]) == pytest.approx((0.75, 0.125, 0.5))
    assert a["per_doc"] == pytest.approx([0.5, 0.25])
    assert not a["low_signal"]
    small = iv.attribution(torch.tensor([0.3]), torch.tensor([0.295]), torch.tensor([0.3]))
    assert small["low_signal"] and small["score"] == pytest.approx(1.0)
    assert not iv.attribution(torch.tensor([0.3]), torch.tensor([0.295]), torch.tensor([0.3]),
                              threshold=0.001)["low_signal"]


def test_verdict_rule():
    assert iv.verdict(0.9, 0.2, False)[0] == "induction"
    assert iv.verdict(0.1, 0.9, False)[0] == "direct retrieval"
    assert iv.verdict(0.4, 0.4, False)[0] == "mixed"
    assert iv.verdict(0.9, 0.95, False)[0] == "mixed"
    assert iv.verdict(0.9, 0.2, True)[0] == "no signal"


# ---------------------------------------------------------------------------------------------
# Interchange interventions
# ---------------------------------------------------------------------------------------------

def _runs(model, data, seed=0):
    corrupted = iv.corrupt(data, "key", seed=seed)
    query = data.positions["query"]
    p_clean = iv.answer_prob(model, data.tokens, data.answers, query)
    p_corrupt = iv.answer_prob(model, corrupted, data.answers, query)
    return corrupted, query, p_clean, p_corrupt


@pytest.mark.parametrize("arch", ARCHS)
def test_layer0_key_restores_and_answer_is_zero(arch, data):
    model = small_model(arch, data.vocab_size)
    corrupted, query, p_clean, p_corrupt = _runs(model, data)
    assert abs(float(p_clean.mean() - p_corrupt.mean())) > 1e-4  # a real gap to attribute
    positions = {name: data.positions[name] for name in ("key", "answer")}
    sites = ["blocks.0.hook_resid_pre", "blocks.0.mixer.hook_out", "blocks.1.hook_resid_pre",
             "blocks.1.mixer.hook_out", "blocks.1.hook_resid_post"]
    cache = iv.prepare(model, data.tokens, corrupted, sites, positions, data.answers, query)
    for site in sites:
        p = iv.interchange(model, data.tokens, corrupted, site, positions, data.answers, query, cache=cache)
        answer = iv.attribution(p_clean, p_corrupt, p["answer"])["score"]
        assert abs(answer) < 1e-9, (site, answer)  # the answer lies after the readout
        if site == "blocks.0.hook_resid_pre":
            # restores the clean embedding: the whole forward is the clean one
            assert iv.attribution(p_clean, p_corrupt, p["key"])["score"] == pytest.approx(1, abs=1e-5)
            assert torch.allclose(p["key"], p_clean, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_equals_one_position_at_a_time(arch, data):
    """The stacked, chunked, prefix-reusing interchange equals patching one position at a time
    with a full forward (this also checks _forward_from against models.LM.forward)."""
    model = small_model(arch, data.vocab_size)
    data = data.subset(slice(0, 20))
    corrupted, query, _, _ = _runs(model, data, seed=5)
    positions = {name: data.positions[name] for name in iv.POSITIONS}
    for site in iv.default_sites(model):
        fast = iv.interchange(model, data.tokens, corrupted, site, positions, data.answers, query,
                              chunk_rows=16)  # 16 < 20 docs: chunks cut across the stacked copies
        for name, pos in positions.items():
            slow = iv.interchange_reference(model, data.tokens, corrupted, site, pos, data.answers, query)
            assert torch.allclose(fast[name], slow, rtol=1e-9, atol=1e-12), (site, name)


def test_attention_pattern_site_is_patched_by_query_row(data):
    """hook_pattern has seq_dim=2: patching position t overwrites query row t of the pattern."""
    model = small_model("attention", data.vocab_size)
    corrupted, query, p_clean, p_corrupt = _runs(model, data)
    positions = {"query": data.positions["query"]}
    p = iv.interchange(model, data.tokens, corrupted, "blocks.1.mixer.hook_pattern", positions,
                       data.answers, query)["query"]
    assert not torch.allclose(p, p_corrupt)  # the readout row's attention is restored
    slow = iv.interchange_reference(model, data.tokens, corrupted, "blocks.1.mixer.hook_pattern",
                                    positions["query"], data.answers, query)
    assert torch.allclose(p, slow, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# The whole table, rendering, JSON
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["attention", "mamba"])
def test_mechanism_table_render_and_json(arch, data, tmp_path):
    model = small_model(arch, data.vocab_size)
    result = iv.mechanism(model, data, n_docs=40, seed=1)
    assert result["arch"] == arch and result["n_docs"] == 40
    assert len(result["rows"]) == len(iv.default_sites(model))
    row = {r["site"]: r for r in result["rows"]}
    assert row["blocks.0.hook_resid_pre"]["scores"]["key"] == pytest.approx(1, abs=1e-5)
    assert all(abs(r["scores"]["answer"]) < 1e-9 for r in result["rows"])
    assert result["headline"] == {n: row["blocks.1.hook_resid_pre"]["scores"][n] for n in ("key", "value", "query")}
    assert result["verdict"] in ("induction", "direct retrieval", "mixed", "no signal")
    assert ("conv_next_key" in result) == (arch == "mamba")
    text = iv.render_heatmap(result)
    assert "L1 block_in" in text and "verdict:" in text
    assert len(iv.render_heatmap(result, sites=["block_in"]).splitlines()) == 2 + 2 + 2 + (arch == "mamba")
    path = tmp_path / "table.json"
    iv.save_json(result, path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    assert iv.save_png(result, tmp_path / "table.png") in (True, False)


def test_mechanism_one_and_three_layers(data):
    one = iv.mechanism(small_model("attention", data.vocab_size, n_layers=1), data, n_docs=16)
    assert one["verdict"] == "n/a (1 layer)" and one["headline"] is None
    assert set(one["mixer_out"]) == {"key", "value", "query"}
    three = iv.mechanism(small_model("mamba", data.vocab_size, n_layers=3), data, n_docs=16,
                         sites=["blocks.0.hook_resid_pre"])
    assert set(three["later_layers"]) == {"blocks.2.hook_resid_pre"}
    assert {r["site"] for r in three["rows"]} == {"blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre",
                                                  "blocks.2.hook_resid_pre", "blocks.0.mixer.hook_conv_out"}
