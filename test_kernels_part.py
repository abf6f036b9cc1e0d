import pytest
import torch

import models


def _grads(fn, inputs, weight):
    """Values and input gradients of sum(fn(*inputs) * weight); unused inputs get zero gradients."""
    out = fn(*inputs)
    grads = torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True)
    return out, [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]


@pytest.mark.parametrize("length", [1, 7, 64, 1000])
@pytest.mark.parametrize("decay", ["near0", "near1"])
@pytest.mark.parametrize("fast", [models.parallel_scan, models.loop_scan])
def test_scans_match_the_loop_in_values_and_gradients(length, decay, fast):
    gen = torch.Generator().manual_seed(length)
    shape = (2, length, 3)
    r = torch.rand(shape, generator=gen, dtype=torch.float64)
    a = (r * 0.05 if decay == "near0" else 1 - r * 0.01).requires_grad_()
    b = torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_()
    weight = torch.randn(shape, generator=gen, dtype=torch.float64)
    ref, ref_grads = _grads(models.sequential_scan, (a, b), weight)
    out, out_grads = _grads(fast, (a, b), weight)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for g, g_ref in zip(out_grads, ref_grads):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)


def test_sequential_scan_is_the_recurrence():
    a = torch.tensor([[0.5, 2.0, 0.0, 1.0]])
    b = torch.tensor([[1.0, 1.0, 3.0, -1.0]])
    # h0 = 1, h1 = 2*1 + 1 = 3, h2 = 0*3 + 3 = 3, h3 = 1*3 - 1 = 2
    assert models.sequential_scan(a, b).tolist() == [[1.0, 3.0, 3.0, 2.0]]


@pytest.mark.parametrize("length", [1, 5, 37])
def test_selective_scan_fused_matches_reference(length):
    gen = torch.Generator().manual_seed(length)
    b, e, n = 2, 5, 3
    u = torch.randn(b, length, e, generator=gen, dtype=torch.float64).requires_grad_()
    delta = (torch.rand(b, length, e, generator=gen, dtype=torch.float64) * 0.5).requires_grad_()
    A = (-torch.rand(e, n, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    B = torch.randn(b, length, n, generator=gen, dtype=torch.float64).requires_grad_()
    C = torch.randn(b, length, n, generator=gen, dtype=torch.float64).requires_grad_()
    weight = torch.randn(b, length, e, generator=gen, dtype=torch.float64)
    inputs = (u, delta, A, B, C)
    ref, ref_grads = _grads(models.selective_scan_reference, inputs, weight)
    out, out_grads = _grads(models.selective_scan, inputs, weight)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for g, g_ref in zip(out_grads, ref_grads):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("length", [1, 2, 37, 300])
def test_fft_conv_matches_direct_conv(length):
    gen = torch.Generator().manual_seed(length)
    u = torch.randn(2, length, 4, generator=gen, dtype=torch.float64).requires_grad_()
    k = torch.randn(length, 4, generator=gen, dtype=torch.float64).requires_grad_()
    weight = torch.randn(2, length, 4, generator=gen, dtype=torch.float64)
    ref, ref_grads = _grads(models.direct_conv, (u, k), weight)
    out, out_grads = _grads(models.fft_conv, (u, k), weight)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    for g, g_ref in zip(out_grads, ref_grads):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-9)


def test_direct_conv_is_the_causal_sum():
    u = torch.tensor([[[1.0], [2.0], [3.0]]])     # (b=1, l=3, d=1)
    k = torch.tensor([[10.0], [1.0], [0.5]])      # k_0, k_1, k_2
    # y0 = 10*1, y1 = 10*2 + 1*1, y2 = 10*3 + 1*2 + 0.5*1
    assert models.direct_conv(u, k).flatten().tolist() == [10.0, 21.0, 32.5]


@pytest.mark.parametrize("kernel", [1, 3, 4])
def test_short_conv_matches_its_definition_and_is_causal(kernel):
    gen = torch.Generator().manual_seed(kernel)
    x = torch.randn(2, 9, 5, generator=gen, dtype=torch.float64)
    w = torch.randn(5, 1, kernel, generator=gen, dtype=torch.float64)
    bias = torch.randn(5, generator=gen, dtype=torch.float64)
    y = models.short_conv(x, w, bias)
    torch.testing.assert_close(y, models.short_conv_reference(x, w, bias))
    x2 = x.clone()
    x2[:, 6] += 1.0                                 # change token 6: outputs 0..5 must not move
    torch.testing.assert_close(models.short_conv(x2, w, bias)[:, :6], y[:, :6])
    # the last tap multiplies the current token
    assert torch.allclose(models.short_conv(x, torch.zeros_like(w).index_fill_(2, torch.tensor([kernel - 1]), 1.0)), x)


def test_selective_scan_inference_path_matches_reference():
    gen = torch.Generator().manual_seed(3)
    u, delta = torch.randn(2, 11, 5, generator=gen), torch.rand(2, 11, 5, generator=gen)
    A = -torch.rand(5, 3, generator=gen) * 2
    B, C = torch.randn(2, 11, 3, generator=gen), torch.randn(2, 11, 3, generator=gen)
    with torch.no_grad():
        fast = models.selective_scan(u, delta, A, B, C)
    torch.testing.assert_close(fast, models.selective_scan_reference(u, delta, A, B, C), rtol=1e-5, atol=1e-6)
