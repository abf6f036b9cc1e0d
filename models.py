"""models.py: the language-model backbone, seven sequence mixers and the kernels they need, in plain PyTorch.

Follows "Mechanistic evaluation of Transformers and state space models" (Arora et al. 2025,
arXiv 2505.15105), Sec. 4 and App. B, as specified from the upstream modules in ARCHITECTURES.md:
  [1] ARCHITECTURES.md §1  the two convolution primitives (short causal conv, long causal conv)
  [2] ARCHITECTURES.md §2  backbone: embedding, pre-norm blocks, tied head, the global init pass
  [3] ARCHITECTURES.md §3  mixers: attention, base_conv, based, hyena, h3, mamba, deltanet
  [4] ARCHITECTURES.md §5  intervention sites (every HookPoint below)

Shape glossary (used in every comment of this file):
  b batch   l sequence length   d d_model   e Mamba inner width (2d)   n SSM state size
  h heads   k head width (d/h)  f Based feature dim   v vocabulary   c channels of a conv
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# ----------------------------------------------------------------------------------------------
# Kernels. Each fast kernel has a slow, obviously correct twin right beside it; test_all.py checks
# that the two agree in values and gradients.
# ----------------------------------------------------------------------------------------------

def sequential_scan(a, b):
    """The reference linear recurrence h_t = a_t * h_{t-1} + b_t along dim 1, with h_{-1} = 0.

    a, b: (b, l, ...) of the same shape. Returns h with that shape. A plain Python loop under
    autograd: slow, but impossible to get wrong. `unbind` (not `x[:, t]`) keeps the backward linear in l.
    """
    h, out = torch.zeros_like(b[:, 0]), []
    for a_t, b_t in zip(a.unbind(1), b.unbind(1)):
        h = a_t * h + b_t
        out.append(h)
    return torch.stack(out, dim=1)


def _shift_right(x, s, fill):
    """x shifted by s steps along dim 1, the first s entries set to `fill`: out[:, t] = x[:, t - s]."""
    pad = torch.full_like(x[:, :s], fill)
    return torch.cat([pad, x[:, :-s]], dim=1)


def parallel_scan(a, b):
    """The same recurrence as sequential_scan with no Python loop over the length (Hillis-Steele).

    Each step t is the affine map h -> a_t*h + b_t; composing two such maps is again affine, so the
    recurrence is a prefix "sum" under an associative operator. After the sweep with offset s, the pair
    (A_t, B_t) is the composition of steps t-2s+1 .. t; log2(l) sweeps over shifted views cover every
    prefix. Each sweep is a few elementwise ops over the whole (b, l, ...) tensor, which is where the
    parallelism comes from: on a GPU that is log2(l) kernel launches instead of l. It does O(l log l)
    work, so on a CPU the loop in `scan` is faster (see `python run.py bench`).
    """
    length = a.shape[1]
    A, B = a, b
    s = 1
    while s < length:
        B = B + A * _shift_right(B, s, 0.0)  # B_t <- A_t * B_{t-s} + B_t  (nothing before step 0)
        A = A * _shift_right(A, s, 1.0)      # A_t <- A_t * A_{t-s}
        s *= 2
    return B


class _LoopScanFn(torch.autograd.Function):
    """Sequential scan with a hand-written backward: no autograd graph of l small ops.

    Forward: the loop of sequential_scan, writing into one preallocated tensor.
    Backward: with g = dLoss/dh, the gradient flowing into h_t is  c_t = g_t + a_{t+1} * c_{t+1}
    (a reverse scan), and then dLoss/db_t = c_t and dLoss/da_t = c_t * h_{t-1}.
    """

    @staticmethod
    def forward(ctx, a, b):
        a_t = a.transpose(0, 1).contiguous()  # (l, b, ...) so that each step reads contiguous memory
        b_t = b.transpose(0, 1).contiguous()
        h = torch.empty_like(b_t)
        prev = torch.zeros_like(b_t[0])
        for t in range(h.shape[0]):
            prev = torch.addcmul(b_t[t], a_t[t], prev)
            h[t] = prev
        ctx.save_for_backward(a_t, h)
        return h.transpose(0, 1)

    @staticmethod
    def backward(ctx, grad_h):
        a_t, h = ctx.saved_tensors
        g = grad_h.transpose(0, 1).contiguous()
        grad_b = torch.empty_like(g)
        carry = torch.zeros_like(g[0])
        for t in range(g.shape[0] - 1, -1, -1):
            carry = g[t] if t == g.shape[0] - 1 else torch.addcmul(g[t], a_t[t + 1], carry)
            grad_b[t] = carry
        h_prev = torch.cat([torch.zeros_like(h[:1]), h[:-1]], dim=0)  # h_{t-1}, zero before step 0
        grad_a = grad_b * h_prev
        return grad_a.transpose(0, 1), grad_b.transpose(0, 1)


def loop_scan(a, b):
    """sequential_scan's loop with a hand-written backward (fastest pure-PyTorch form on a CPU)."""
    return _LoopScanFn.apply(a, b)


def scan(a, b, reference=False):
    """The scan the models use: the loop with a hand-written backward on CPU, the parallel scan elsewhere.

    reference=True gives the plain-autograd loop (the benchmark's baseline).
    """
    if reference:
        return sequential_scan(a, b)
    if a.device.type == "cpu":
        return loop_scan(a, b)
    return parallel_scan(a, b)


def direct_conv(u, k):
    """Reference causal long convolution y_t = sum_{s<=t} k_{t-s} * u_s, per channel.

    u: (b, l, d), k: (l, d). Builds the (l, l, d) Toeplitz tensor T[t, s] = k[t-s] (0 above the
    diagonal) and contracts it: exact, O(l^2 d) time and memory, fine for the tens of tokens of AR.
    """
    length = u.shape[1]
    t = torch.arange(length, device=u.device)
    lag = t[:, None] - t[None, :]                         # (l, l): t - s
    toeplitz = k[lag.clamp(min=0)] * (lag >= 0)[..., None].to(k.dtype)  # (l, l, d)
    return torch.einsum("tsd,bsd->btd", toeplitz, u)      # (l,l,d) x (b,l,d) -> (b,l,d)


def fft_conv(u, k):
    """The same convolution as direct_conv by real FFT, O(l log l).

    Both signals are zero-padded to 2l so that the circular convolution the FFT computes has no
    wrap-around: the first l outputs are exactly the causal linear convolution.
    """
    length = u.shape[1]
    n = 2 * length
    u_f = torch.fft.rfft(u, n=n, dim=1)                  # (b, l+1, d) complex
    k_f = torch.fft.rfft(k, n=n, dim=0)                  # (l+1, d) complex
    return torch.fft.irfft(u_f * k_f, n=n, dim=1)[:, :length].to(u.dtype)  # (b, l, d)


def long_conv(u, k, reference=False):
    """Causal long convolution as the mixers use it: FFT, or the direct sum when reference=True."""
    return direct_conv(u, k) if reference else fft_conv(u, k)


def short_conv(x, weight, bias=None):
    """Causal depthwise short convolution SC_K (ARCHITECTURES.md §1.2).

    x: (b, l, c), weight: (c, 1, K), bias: (c,) or None. weight[:, 0, K-1] multiplies the current
    token, weight[:, 0, K-2] the previous one, and so on (PyTorch's Conv1d layout, so weights move
    to and from the reference implementation unchanged).
    """
    length, kernel = x.shape[1], weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2), weight, bias, padding=kernel - 1, groups=x.shape[2])  # (b, c, l+K-1)
    return y[..., :length].transpose(1, 2)               # keep the causal part -> (b, l, c)


def short_conv_reference(x, weight, bias=None):
    """SC_K written as the sum in its definition: y_t = bias + sum_j w_j * x_{t-(K-1)+j}."""
    kernel = weight.shape[-1]
    y = torch.zeros_like(x) if bias is None else bias.expand_as(x).clone()
    for j in range(kernel):
        shift = kernel - 1 - j                           # how many steps back tap j looks
        shifted = _shift_right(x, shift, 0.0) if shift > 0 else x
        y = y + weight[:, 0, j] * shifted
    return y


# ----------------------------------------------------------------------------------------------
# Hook points. Every patchable tensor flows through an identity module, so `named_modules()` lists
# every site and interventions.py can replace a site's value with a forward hook.
# ----------------------------------------------------------------------------------------------

class HookPoint(nn.Module):
    """Identity module marking an intervention site (TransformerLens-style).

    seq_dim is the dimension that indexes token positions (1 for (b, l, ...) tensors, 2 for the
    (b, h, l, l) attention patterns, whose rows are query positions), or None for tensors derived
    from parameters alone (filters, kernels), which cannot be patched per position.
    """

    def __init__(self, seq_dim=1):
        super().__init__()
        self.seq_dim = seq_dim

    def forward(self, x):
        return x


class Mixer(nn.Module):
    """Base class of every sequence mixer: (b, l, d) -> (b, l, d), with hook_in and hook_out.

    hook_in sees the mixer input (after the block's norm), hook_out its output (before the residual
    add). Subclasses implement `mix`; INTERNAL_SITES names the hooks inside the mixer that
    interventions.py patches by default, besides the block-level sites.
    """

    INTERNAL_SITES = []

    def __init__(self, reference=False):
        super().__init__()
        self.reference = reference  # use the slow reference kernels (sequential_scan, direct_conv)
        self.hook_in = HookPoint()
        self.hook_out = HookPoint()

    def mix(self, x):
        raise NotImplementedError

    def forward(self, x):
        return self.hook_out(self.mix(self.hook_in(x)))
