"""models.py: the language model, its eight sequence mixers and their kernels, in plain PyTorch.

Follows Arora et al. 2025 (arXiv 2505.15105), Sec. 4 and App. B, with the parameter names, shapes
and init of zoology (model.py, mixers/*.py), mamba-ssm (modules/mamba_simple.py) and, for DeltaNet
and Gated DeltaNet, flash-linear-attention (fla/layers/delta_net.py, gated_deltanet.py), plus a
HookPoint on every tensor an intervention may patch (README, difference 10). Sections: 1 HookPoint,
Mixer; 2 slow reference kernels; 3 the mixers; 4 TransformerBlock, the LM and its init, registry,
build_model; 5 fast kernels, each equal to a reference of 2.

Shape letters (the README's glossary): b batch, l sequence length (t, s: positions in it),
d d_model, v vocabulary, h heads, w head width (d/h), e Mamba's inner width (2d), n SSM state size,
f Based's feature dim, c conv channels (an effective_map's: heads or channels, each of width w),
o Hyena's filter width, r runs trained as one model (mechsm.Ensemble).
"""

import contextlib
import difflib
import inspect
import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F


# ============================================ 1. Hook points and the mixer interface

class HookPoint(nn.Identity):
    """An intervention site (the identity); seq_dim: its token axis (2 in (b,h,l,l), None: none)."""

    def __init__(self, seq_dim=1):
        super().__init__()
        self.seq_dim = seq_dim


class Mixer(nn.Module):
    """A sequence mixer (b, l, d) -> (b, l, d), built as Mixer(d_model, layer_idx, n_layers,
    reference, **options), options it does not take ignored; subclasses implement `mix`. What
    generic code must know of a mixer is declared on its class:"""
    INTERNAL_SITES = []     # the inner hooks interventions.py patches by default
    READS = {}              # extra summary numbers: name -> (inner hook, position), read in layer 0
    POS_EMB = False         # learned absolute positions (the paper's convention: attention only)
    FIXED_LENGTH = False    # a filter or table of n_positions rows: documents must fit n_positions
    D_CONV = None           # the short-conv sizes the mixer accepts (None: no short conv)
    BLOCK = None            # the block it is built in; None: TransformerBlock (Mamba: MambaBlock)
    DOWN_SCALED = None      # its Linear into the residual stream, whose init is scaled down (GPT-2)
    MAP_SITE = None         # the inner hook effective_map reproduces

    def __init__(self, reference=False):
        super().__init__()
        self.reference = reference  # run the slow reference kernels of section 2
        self.short_conv = short_conv_reference if reference else short_conv
        self.hook_in, self.hook_out = HookPoint(), HookPoint()  # after the block's norm; the output

    def forward(self, x):
        return self.hook_out(self.mix(self.hook_in(x)))

    def effective_map(self, x):
        """(M (b, c, l, l), v (b, c, l, w)): the mixer on input x as c maps (heads or channels) from
        positions s to t applied to its value stream v, its gates, keys and decays held fixed: the
        activation at MAP_SITE, (b, l, c*w) in memory, is einsum("bcts,bcsw->btcw", M, v)."""
        raise NotImplementedError(f"{type(self).__name__} defines no effective_map")

    def capture(self, x, *names):
        """{name: output} of the named HookPoints in one call of mix(x)."""
        store = {}
        with contextlib.ExitStack() as hooks:  # removed on exit, even on an error
            for n in names:
                save = lambda m, i, out, n=n: store.__setitem__(n, out)
                hooks.enter_context(getattr(self, n).register_forward_hook(save))
            self.mix(x)
        return store


# ============================================ 2. Reference kernels (their fast twins: section 5)

def sequential_scan(a, b):
    """h_t = a_t h_{t-1} + b_t on dim 1, h_{-1} = 0, by a loop; `unbind` keeps the backward O(l)."""
    h, out = torch.zeros_like(b[:, 0]), []
    for a_t, b_t in zip(a.unbind(1), b.unbind(1)):
        h = a_t * h + b_t
        out.append(h)
    return torch.stack(out, dim=1)


def selective_scan_reference(u, delta, A, B, C, plain_scan=sequential_scan):
    """Mamba's selective scan (eqs. 2a, 2b, 4). u, delta (b, l, e); A (e, n); B, C (b, l, n):
      h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t,  y_t = sum_n C_t h_t  -> y (b, l, e)."""
    decay = torch.exp(delta[..., None] * A)                   # (b,l,e,n)
    drive = (delta * u)[..., None] * B[:, :, None, :]         # (b,l,e,n)
    states = plain_scan(decay, drive)                         # (b,l,e,n)
    return torch.einsum("blen,bln->ble", states, C)


def toeplitz(kernel, gate=None):
    """The causal long conv by kernel (l, c) gated by gate (b, l, c), as maps M (b, c, l, l):
    M[b, c, t, s] = gate[b, t, c] kernel[t - s, c] for s <= t, else 0 (no gate: M (c, l, l))."""
    t = torch.arange(kernel.shape[0], device=kernel.device)
    lag = t[:, None] - t[None, :]                                       # (l, l): t - s
    T = (kernel[lag.clamp(min=0)] * (lag >= 0)[..., None].to(kernel.dtype)).permute(2, 0, 1)
    return T if gate is None else gate.transpose(1, 2)[..., None] * T   # (b,c,l,1) x (c,l,l)


def direct_conv(u, k):
    """Causal long conv y_t = sum_{s<=t} k_{t-s} u_s per channel, u (b,l,d), k (l,d): Toeplitz."""
    return torch.einsum("dts,bsd->btd", toeplitz(k[:u.shape[1]]), u)  # (d,l,l) x (b,l,d) -> (b,l,d)


def _shift_right(x, s):
    """out[:, t] = x[:, t - s], the first s entries 0."""
    return torch.cat([torch.zeros_like(x[:, :s]), x[:, :x.shape[1] - s]], dim=1)


def short_conv_reference(x, weight, bias=None):
    """Causal depthwise short conv SC: y_t = bias + sum_j w_j x_{t-(size-1)+j}. x (b, l, c), weight
    (c, 1, size) (Conv1d's: weight[:, 0, -1] multiplies the current token), bias (c,) or None."""
    kernel = weight.shape[-1]
    y = torch.zeros_like(x) if bias is None else bias.expand_as(x).clone()
    for j in range(kernel):
        y = y + weight[:, 0, j] * _shift_right(x, kernel - 1 - j)  # tap j looks size-1-j steps back
    return y


def delta_rule_recurrent(q, k, v, beta, log_alpha=None):
    """The delta rule as a loop over tokens. q, k, v (b, l, h, w), beta (b, l, h) -> o (b, l, h, w):
    S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T,  o_t = S_t^T q_t / sqrt(d_k).
    Gated (log_alpha (b, l, h)): S_{t-1} first decays to alpha_t S_{t-1}
    (fla/ops/gated_delta_rule/naive.py)."""
    b, l, h, dk = k.shape
    S = k.new_zeros(b, h, dk, v.shape[-1])  # S_{-1} = 0: (b, h, w, w)
    # DeltaNet's alpha is 1: multiplying by it is exact
    alpha = torch.ones_like(beta) if log_alpha is None else log_alpha.exp()
    outputs = []
    for q_t, k_t, v_t, beta_t, alpha_t in zip(*(t.unbind(1) for t in (q, k, v, beta, alpha))):
        S = alpha_t[..., None, None] * S                                           # decay
        retrieved = torch.einsum("bhkv,bhk->bhv", S, k_t)                          # S^T k_t
        S = S + beta_t[..., None, None] * torch.einsum("bhk,bhv->bhkv", k_t, v_t - retrieved)
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q_t) / math.sqrt(dk))
    return torch.stack(outputs, dim=1)


# ============================================ 3. The backbone pieces and the mixers

class MLP(nn.Module):
    """TransformerBlock's MLP (zoology's): GELU(x W1^T + b1) W2^T + b2, width 4d, exact erf GELU."""
    DOWN_SCALED = "fc2"     # into the residual stream: its init is scaled down (LM's init pass)

    def __init__(self, d_model):
        super().__init__()
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)
        self.hook_in, self.hook_out = HookPoint(), HookPoint()  # after the 2nd norm; before the add

    def forward(self, x):
        return self.hook_out(self.fc2(F.gelu(self.fc1(self.hook_in(x)))))  # (b,l,d) via (b,l,4d)


class RMSNorm(nn.Module):
    """x / sqrt(mean_c x_c^2 + 1e-5) * g, no bias (MambaBlock's norm, DeltaNet's output norm)."""

    def __init__(self, d_model):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))  # g

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class Attention(Mixer):
    """Causal multi-head softmax attention (zoology MHA): q, k, v = x W_qkv^T per head; z =
    softmax(q k^T / sqrt(k), causal) v; out = z W_o^T + b_o. The pattern is explicit (a site)."""
    POS_EMB = True
    INTERNAL_SITES = ["hook_pattern", "hook_z"]
    DOWN_SCALED = "out_proj"
    MAP_SITE = "hook_z"

    def __init__(self, d_model, layer_idx, n_layers, reference=False, n_heads=1, **options):
        super().__init__(reference)
        self.n_heads = n_heads
        self.Wqkv = nn.Linear(d_model, 3 * d_model, bias=False)  # the paper's bias=False: only here
        self.out_proj = nn.Linear(d_model, d_model)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()  # (b,l,h,w)
        self.hook_pattern, self.hook_z = HookPoint(seq_dim=2), HookPoint()  # (b,h,l,l); (b,l,h,w)

    def mix(self, x):
        b, l, d = x.shape
        q, k, v = self.Wqkv(x).view(b, l, 3, self.n_heads, -1).unbind(2)  # (b,l,h,w) x3
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        scores = torch.einsum("bthw,bshw->bhts", q, k) / math.sqrt(d // self.n_heads)  # (b,h,l,l)
        # -inf, not upstream's -1e4: exactly zero weight (a difference of ~e^-1e4)
        future = torch.ones(l, l, dtype=torch.bool, device=x.device).triu(1)
        pattern = self.hook_pattern(scores.masked_fill(future, float("-inf")).softmax(dim=-1))
        z = self.hook_z(torch.einsum("bhts,bshw->bthw", pattern, v))  # (b,l,h,w)
        return self.out_proj(z.reshape(b, l, d))

    def effective_map(self, x):
        """The softmax pattern per head on v (b,h,l,w)."""
        a = self.capture(x, "hook_pattern", "hook_v")
        return a["hook_pattern"], a["hook_v"].transpose(1, 2)


def hyena_positional_features(n_positions):
    """Z (n_positions, 3), the input of Hyena's and BaseConv's filters:
    Z[t] = (t/(P-1), cos a_t, -sin a_t), a_t = 2 pi 1e-4 t/P, P = n_positions (Hyena's features,
    one band), never rescaled to l."""
    t = torch.arange(n_positions, dtype=torch.float32)
    angle = 2 * math.pi * 1e-4 * t / n_positions
    return torch.stack([t / (n_positions - 1), torch.cos(angle), -torch.sin(angle)], dim=1)


class BaseConv(Mixer):
    """BaseConv (zoology/mixers/base_conv.py): y = c * p + u, p = u W_p^T + b_p, c = SC(u) (a short
    conv of kernel_size >= 1) or, for kernel_size=-1, LC(u; kappa) + u, kappa (l, d) a ReLU MLP of
    features Z. Layers alternate kernel sizes 3 and -1; d_conv sets every layer's; long_only:
    all -1."""
    INTERNAL_SITES = ["hook_conv", "hook_gated"]
    D_CONV = range(1, 2**31)
    MAP_SITE = "hook_gated"

    def __init__(self, d_model, layer_idx, n_layers, reference=False, d_conv=None, long_only=False,
                 n_positions=1024, freeze_features=False, **options):
        super().__init__(reference)
        kernel_size = -1 if long_only else d_conv if d_conv is not None else [3, -1][layer_idx % 2]
        self.kernel_size = kernel_size
        self.projection = nn.Linear(d_model, d_model)
        self.hook_proj, self.hook_conv, self.hook_gated = HookPoint(), HookPoint(), HookPoint()
        if kernel_size == -1:  # Z trained as in the paper (README, difference 13) unless frozen
            self.Z = nn.Parameter(hyena_positional_features(n_positions), not freeze_features)
            self.filter_mlp = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, d_model))
            self.hook_filter, self.hook_longconv = HookPoint(seq_dim=None), HookPoint()  # kappa; LC
        else:
            self.conv = nn.Conv1d(d_model, d_model, kernel_size, groups=d_model)  # for short_conv

    def mix(self, u):
        p = self.hook_proj(self.projection(u))                              # (b,l,d)
        if self.kernel_size == -1:
            kappa = self.hook_filter(self.filter_mlp(self.Z[:u.shape[1]]))  # (l,3)->(l,16)->(l,d)
            c = self.hook_longconv(long_conv(u, kappa, self.reference)) + u  # a built-in identity
        else:
            c = self.short_conv(u, self.conv.weight, self.conv.bias)
        return self.hook_gated(self.hook_conv(c) * p) + u

    def effective_map(self, u):
        """The conv's kernel (kappa + identity, or the short conv's taps) gated by p, per channel,
        on v = u (b,d,l,1). The short conv's bias adds p_t * bias, which reads no position: it is
        not in M."""
        a = self.capture(u, "hook_proj", *["hook_filter"] * (self.kernel_size == -1))
        if self.kernel_size == -1:
            kernel = torch.cat([a["hook_filter"][:1] + 1, a["hook_filter"][1:]])   # LC(u) + u
        else:  # tap j of `size` looks size-1-j steps back
            taps = self.conv.weight[:, 0].flip(-1).t()                           # (size, d)
            kernel = F.pad(taps, (0, 0, 0, u.shape[1]))[:u.shape[1]]              # (l, d)
        return toeplitz(kernel, a["hook_proj"]), u.transpose(1, 2)[..., None]


def taylor_features(a):
    """Based's Taylor feature map (..., f) -> (..., 1 + f + f^2), phi(a) = [1, a / f^(1/4),
    vec(a a^T) / sqrt(2f)], so that phi(q).phi(k) = 1 + s + s^2/2 ~ exp(s), s = q.k / sqrt(f)."""
    f = a.shape[-1]
    outer = (a[..., :, None] * a[..., None, :]).flatten(-2)  # (..., f*f), a_m a_n at index m*f + n
    ones = torch.ones_like(a[..., :1])
    return torch.cat([ones, a / f ** 0.25, outer / (math.sqrt(2) * math.sqrt(f))], dim=-1)


class BasedAttention(Mixer):
    """Based linear attention, Taylor feature map, no biases (zoology/mixers/based.py): y W_o^T,
    y_t = sum_{s<=t} phi(q_t).phi(k_s) v_s / (sum_{s<=t} phi(q_t).phi(k_s) + eps) (as trained); as
    a recurrence y_t = phi(q_t) S_t / (phi(q_t) z_t + eps), S_t = sum phi(k_s) v_s^T."""
    INTERNAL_SITES = ["hook_phi_q", "hook_phi_k", "hook_y"]
    MAP_SITE = "hook_y"

    def __init__(self, d_model, layer_idx, n_layers, reference=False, n_heads=1, feature_dim=8,
                 **options):
        super().__init__(reference)
        self.n_heads, self.feature_dim, self.eps = n_heads, feature_dim, 1e-12
        self.proj_q, self.proj_k = (nn.Linear(d_model, feature_dim * n_heads, bias=False)
                                    for _ in "qk")
        self.proj_v = nn.Linear(d_model, d_model, bias=False)
        self.proj_o = nn.Linear(d_model, d_model, bias=False)
        self.hook_q, self.hook_k = HookPoint(), HookPoint()              # (b,l,h,f)
        self.hook_phi_q, self.hook_phi_k = HookPoint(), HookPoint()      # (b,l,h,1+f+f^2)
        self.hook_v, self.hook_y = HookPoint(), HookPoint()              # (b,l,h,w); y (b,l,d)
        self.hook_pattern = HookPoint(seq_dim=2)                         # phi(q).phi(k) (b,h,l,l)

    def mix(self, x):
        b, l, d = x.shape
        h, f = self.n_heads, self.feature_dim
        q = self.hook_q(self.proj_q(x).view(b, l, h, f))
        k = self.hook_k(self.proj_k(x).view(b, l, h, f))
        v = self.hook_v(self.proj_v(x).view(b, l, h, d // h))
        phi_q, phi_k = self.hook_phi_q(taylor_features(q)), self.hook_phi_k(taylor_features(k))
        kernel = torch.einsum("bthf,bshf->bhts", phi_q, phi_k)  # (b,l,h,1+f+f^2) twice -> (b,h,l,l)
        causal = torch.ones(l, l, dtype=torch.bool, device=x.device).tril()
        pattern = self.hook_pattern(kernel * causal)
        num = torch.einsum("bhts,bshw->bthw", pattern, v)       # (b,l,h,w)
        den = pattern.sum(-1).transpose(1, 2)[..., None]        # (b,h,l) -> (b,l,h,1); >= (t+1)/2
        return self.proj_o(self.hook_y((num / (den + self.eps)).reshape(b, l, d)))

    def effective_map(self, x):
        """The normalised pattern, per head on v:
        phi(q_t).phi(k_s) / (sum_s' phi(q_t).phi(k_s') + eps)."""
        a = self.capture(x, "hook_pattern", "hook_v")
        pattern = a["hook_pattern"]                                             # (b,h,l,l)
        return pattern / (pattern.sum(-1, keepdim=True) + self.eps), a["hook_v"].transpose(1, 2)


class H3(Mixer):
    """H3 (zoology/mixers/h3.py): a shift SSM on the keys, then per head (h = d/w heads of
    width w = h3_head_dim) a diagonal SSM on the w x w products k~ v^T: k~ = LC(k; K^s) + D^k k,
    z = LC(k~ v^T; K^d) + D^d k~ v^T, o_j = sum_i q_i z_ij, out = o W_o + b_o."""
    INTERNAL_SITES = ["hook_shift_out", "hook_ssm_out"]
    MAP_SITE = "hook_o"

    def __init__(self, d_model, layer_idx=0, n_layers=2, reference=False, *, h3_d_state=1024,
                 h3_head_dim=2, **options):
        super().__init__(reference)
        d, n, w, h = d_model, h3_d_state, h3_head_dim, d_model // h3_head_dim
        if d % w or n % 2:
            raise ValueError(f"H3: h3_head_dim={w} must divide d_model={d}, h3_d_state={n} be even")
        self.d_state, self.head_dim, self.n_heads = n, w, h
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        # Shift SSM per channel: state = down-shift(state) + B^s k_t, output C^s . state
        self.shift_B = nn.Parameter(torch.eye(n)[0].repeat(d, 1))  # (d,n) one-hot: K^s = C^s[:,:l]
        self.shift_C = nn.Parameter(torch.empty(d, n).uniform_(-n ** -0.5, n ** -0.5))  # (d, n)
        self.shift_D = nn.Parameter(torch.randn(d))                                  # D^k
        # Diagonal S4D-Lin SSM per head: n/2 complex modes (their conjugates are the factor 2)
        self.log_dt = nn.Parameter(torch.empty(h).uniform_(math.log(1e-3), math.log(1e-1)))
        self.log_neg_A_real = nn.Parameter(torch.full((h, n // 2), math.log(0.5)))  # Re A = -1/2
        self.A_imag = nn.Parameter(math.pi * torch.arange(n // 2).float().repeat(h, 1))  # Im: pi n
        self.diag_B = nn.Parameter(torch.tensor([1.0, 0.0]).repeat(h, n // 2, 1))  # 1 + 0i (re, im)
        self.diag_C = nn.Parameter(torch.randn(h, n // 2, 2) * math.sqrt(0.5))  # complex N(0, 1)
        self.diag_D = nn.Parameter(torch.randn(h))                                  # D^d
        self.output_linear = nn.Linear(d, d)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()  # (b, l, d)
        self.hook_shift_kernel, self.hook_shift_out = HookPoint(seq_dim=None), HookPoint()
        self.hook_k_tilde, self.hook_kv, self.hook_y = HookPoint(), HookPoint(), HookPoint()
        self.hook_ssm_kernel, self.hook_ssm_out = HookPoint(seq_dim=None), HookPoint()  # K^d; z
        self.hook_o = HookPoint()                                       # o (b, l, h, w), per head

    def shift_kernel(self, length):
        """K^s (l, d), the shift SSM's response: K^s[lag, c] = sum_n B^s[c, n] C^s[c, n + lag]."""
        n = self.d_state
        if length > n:
            raise ValueError(f"H3: sequence length {length} exceeds d_state={n}; raise h3_d_state")
        B, C = self.shift_B, self.shift_C
        if self.reference:
            return torch.stack([(B[:, :n - lag] * C[:, lag:]).sum(-1) for lag in range(length)])
        # Cross-correlation by FFT; padding to 2n keeps lags 0..n-1 free of wrap-around.
        work = torch.promote_types(B.dtype, torch.float32)  # no half-precision FFT on CPU
        spectrum = torch.fft.rfft(C.to(work), n=2 * n) * torch.fft.rfft(B.to(work), n=2 * n).conj()
        return torch.fft.irfft(spectrum, n=2 * n)[:, :length].T.to(B.dtype)          # (l, d)

    def diag_modes(self):
        """(A_bar, W) (h, n/2) complex, discretised bilinearly: A_bar = (1 + dt A/2) / (1 - dt A/2),
        W = C B dt / (1 - dt A/2), so that K^d[lag] = 2 Re sum_n W A_bar^lag."""
        up = lambda p: p.to(torch.promote_types(p.dtype, torch.float32))  # no bfloat16 complex
        dt = up(self.log_dt).exp()[:, None]                                         # (h, 1)
        A = torch.complex(-up(self.log_neg_A_real).exp(), up(self.A_imag))          # (h, n/2)
        half = dt * A / 2
        B, C = torch.view_as_complex(up(self.diag_B)), torch.view_as_complex(up(self.diag_C))
        return (1 + half) / (1 - half), C * B * dt / (1 - half)

    def ssm_kernel(self, length):
        """K^d (l, h) = 2 Re sum_n W A_bar^lag: by cumprod (reference) or vandermonde_kernel."""
        A_bar, W = self.diag_modes()                                                # (h, n/2) each
        if self.reference:
            powers = torch.cumprod(A_bar[..., None].expand(-1, -1, length), -1) / A_bar[..., None]
            return (2 * torch.einsum("hn,hnl->lh", W, powers).real).to(self.log_dt.dtype)  # (l, h)
        return vandermonde_kernel(A_bar, W, length).to(self.log_dt.dtype)            # (l, h)

    def mix(self, x):
        b, l, d = x.shape
        h, w = self.n_heads, self.head_dim
        q, k = self.hook_q(self.q_proj(x)), self.hook_k(self.k_proj(x))            # (b, l, d)
        v = self.hook_v(self.v_proj(x))
        shift_kernel = self.hook_shift_kernel(self.shift_kernel(l))                 # (l, d)
        shift_out = self.hook_shift_out(long_conv(k, shift_kernel, reference=self.reference))
        k_tilde = self.hook_k_tilde(shift_out + self.shift_D * k)                   # (b, l, d)
        # channel c = head*w + i; kv[h, i, j] = k~_{h,i} v_{h,j}: w*w signals per head
        kv = self.hook_kv(k_tilde.view(b, l, h, w, 1) * v.view(b, l, h, 1, w))  # (b, l, h, w, w)
        ssm_kernel = self.hook_ssm_kernel(self.ssm_kernel(l))                       # (l, h)
        per_signal = ssm_kernel[:, :, None].expand(l, h, w * w).reshape(l, h * w * w)  # per head
        z = long_conv(kv.reshape(b, l, h * w * w), per_signal, self.reference).view(b, l, h, w, w)
        z = self.hook_ssm_out(z + self.diag_D[:, None, None] * kv)  # (b, l, h, w, w)
        o = self.hook_o(torch.einsum("blhi,blhij->blhj", q.view(b, l, h, w), z))  # read out with q
        y = o.transpose(2, 3).reshape(b, l, d)                  # channel j*h + head
        return self.output_linear(self.hook_y(y))

    def effective_map(self, x):
        """Per head, (q_t . k~_s) (K^d[t-s] + D^d [t = s]) on v (b,h,l,w);
        the shift SSM is inside k~."""
        b, l, d = x.shape
        a = self.capture(x, "hook_q", "hook_k_tilde", "hook_v", "hook_ssm_kernel")
        q, k, v = (a[n].view(b, l, self.n_heads, -1) for n in ("hook_q", "hook_k_tilde", "hook_v"))
        ssm_kernel = a["hook_ssm_kernel"]                                            # (l,h)
        kernel = torch.cat([ssm_kernel[:1] + self.diag_D, ssm_kernel[1:]])          # (l,h)
        scores = torch.einsum("bthi,bshi->bhts", q, k)                               # (b,h,l,l)
        return scores * toeplitz(kernel), v.transpose(1, 2)


class HyenaFilter(nn.Module):
    """Hyena's implicit long filter h (l, d): h[t] = (W_4 g_3) * exp(-tau_t alpha),
    g_i = sin(omega (W_i g_{i-1} + b_i)), g_0 = Z[t]; o = order, the filter MLP's width."""

    def __init__(self, d_model, order, n_positions):
        super().__init__()
        self.z = nn.Parameter(hyena_positional_features(n_positions))      # (n_positions, 3)
        self.register_buffer("tau", torch.linspace(0, 1, n_positions))     # (n_positions,) tau_t
        self.lin1 = nn.Linear(3, order)
        self.lin2, self.lin3 = nn.Linear(order, order), nn.Linear(order, order)
        self.lin_out = nn.Linear(order, d_model, bias=False)
        self.freq = nn.Parameter(torch.ones(order))  # omega, ONE for all three sines, as upstream
        # alpha: fixed decay rates 15.35..3.07 per channel (window 1e-2 at 30%..150% of
        # n_positions)
        target = math.log(1e-2)
        self.register_buffer("decay", torch.linspace(target / 1.5, target / 0.3, d_model).abs())

    def forward(self, length):
        g = self.z[:length]                                             # (l, 3)
        for lin in (self.lin1, self.lin2, self.lin3):
            g = torch.sin(self.freq * lin(g))                           # (l, o)
        window = torch.exp(-self.tau[:length, None] * self.decay)       # (l, d)
        return self.lin_out(g) * window                                 # (l, o) -> (l, d)


class Hyena(Mixer):
    """Hyena, order 2 (zoology/mixers/hyena.py): [x1 | x2 | v] = SC(x W_in + b_in) (kernel size 3),
    s = v x1, y = LC(s; h) + 0 beta s (the paper's; hyena_skip: beta s),
    out = (y x2) W_out + b_out."""
    FIXED_LENGTH = True     # its implicit filter is a table of n_positions rows
    INTERNAL_SITES = ["hook_short", "hook_longconv"]
    DOWN_SCALED = "out_proj"
    MAP_SITE = "hook_postgate"

    def __init__(self, d_model, layer_idx=0, n_layers=2, reference=False, *, n_positions=1024,
                 hyena_order=64, hyena_skip=False, **options):
        super().__init__(reference)
        d = d_model
        self.n_positions, self.use_skip = n_positions, hyena_skip
        self.in_proj = nn.Linear(d, 3 * d)
        self.short_filter = nn.Conv1d(3 * d, 3 * d, kernel_size=3, groups=3 * d)  # for short_conv
        self.filter = HyenaFilter(d, hyena_order, n_positions)
        self.skip = nn.Parameter(torch.randn(d))   # beta
        self.out_proj = nn.Linear(d, d)
        self.hook_in_proj, self.hook_short = HookPoint(), HookPoint()  # (b, l, 3d) each
        self.hook_pregate, self.hook_filter = HookPoint(), HookPoint(seq_dim=None)  # s; h (l,d)
        self.hook_longconv, self.hook_postgate = HookPoint(), HookPoint()          # (b, l, d) each

    def mix(self, x):
        b, l, d = x.shape
        if l > self.n_positions:
            raise ValueError(f"Hyena: sequence length {l} exceeds n_positions={self.n_positions}")
        u = self.hook_in_proj(self.in_proj(x))  # (b, l, 3d)
        u = self.hook_short(self.short_conv(u, self.short_filter.weight, self.short_filter.bias))
        x1, x2, v = u.split(d, dim=-1)  # (b, l, d) each
        s = self.hook_pregate(v * x1)
        kernel = self.hook_filter(self.filter(l))                                    # (l, d)
        skip = self.skip if self.use_skip else 0 * self.skip  # the paper's inert skip (no gradient)
        y = self.hook_longconv(long_conv(s, kernel, reference=self.reference) + skip * s)  # (b,l,d)
        return self.out_proj(self.hook_postgate(y * x2))

    def effective_map(self, x):
        """The filter h (+ the skip beta at lag 0) gated by x2, per channel,
        on v = s = v x1 (b,d,l,1)."""
        a = self.capture(x, "hook_short", "hook_filter", "hook_pregate")
        skip = self.skip if self.use_skip else 0 * self.skip
        kernel = torch.cat([a["hook_filter"][:1] + skip, a["hook_filter"][1:]])     # (l, d)
        x2 = a["hook_short"].split(x.shape[-1], dim=-1)[1]                         # (b, l, d)
        return toeplitz(kernel, x2), a["hook_pregate"].transpose(1, 2)[..., None]


class MambaBlock(nn.Module):
    """r += Mamba(RMSNorm(r)); no MLP (zoology's MambaBlock)."""
    GPT2_INIT = False       # LM's init pass: mamba_ssm's rules (the Linears keep their own init)

    def __init__(self, d_model, mixer):
        super().__init__()
        self.hook_resid_pre = HookPoint()
        self.norm, self.mixer = RMSNorm(d_model), mixer
        self.hook_resid_post = HookPoint()

    def forward(self, r):
        r = self.hook_resid_pre(r)
        return self.hook_resid_post(r + self.mixer(self.norm(r)))


class Mamba(Mixer):
    """Mamba's selective SSM (mamba_ssm/modules/mamba_simple.py, 2.2.4), per token t, state h_t:
      [xi | z] = x W_in^T; u = SiLU(SC(xi)); [dt | B | C] = u W_x^T; Delta = softplus(W_dt dt + b);
      h_t = exp(Delta_t A) h_{t-1} + Delta_t B_t u_t;  y = (sum_n C_t h_t + D u) * SiLU(z);
      out = y W_out^T, A = -exp(A_log) (e, n): selective_scan_reference. d_conv=0: no short conv."""
    INTERNAL_SITES = ["hook_conv_out", "hook_ssm_out", "hook_gate"]
    MAP_SITE = "hook_y"
    READS = {"conv@next_key": ("hook_conv_out", "next_key")}   # the conv carrying the key forward
    D_CONV = range(5)                                          # 0: no conv
    BLOCK = MambaBlock
    DOWN_SCALED = "out_proj"

    def __init__(self, d_model, layer_idx, n_layers, reference=False, d_conv=4, d_state=16,
                 expand=2, **options):
        super().__init__(reference)
        e, n = expand * d_model, d_state
        self.d_conv, self.d_state = 4 if d_conv is None else d_conv, d_state
        self.dt_rank = math.ceil(d_model / 16)
        self.in_proj = nn.Linear(d_model, 2 * e, bias=False)
        if self.d_conv:  # weights for short_conv
            self.conv1d = nn.Conv1d(e, e, self.d_conv, groups=e, padding=self.d_conv - 1)
        else:   # no conv, but the random draws of the one d_conv 0 used to build, dropped: every
            nn.Conv1d(e, e, 4, groups=e)   # other weight stays as in the runs of results/
        self.x_proj = nn.Linear(e, self.dt_rank + 2 * n, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, e)
        # W_dt ~ U(+-1/sqrt(dt_rank)); b_dt = softplus^-1(Delta_0),
        # Delta_0 log-uniform in [1e-3, 1e-1]
        nn.init.uniform_(self.dt_proj.weight, -self.dt_rank ** -0.5, self.dt_rank ** -0.5)
        dt = torch.exp(torch.empty(e).uniform_(math.log(1e-3), math.log(1e-1))).clamp(min=1e-4)
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus
        self.A_log = nn.Parameter(torch.arange(1, n + 1).float().log().repeat(e, 1))  # S4D-real
        self.D = nn.Parameter(torch.ones(e))
        self.out_proj = nn.Linear(e, d_model, bias=False)
        self.hook_x, self.hook_z = HookPoint(), HookPoint()         # xi, z (b,l,e)
        self.hook_conv_out, self.hook_u = HookPoint(), HookPoint()  # SC(xi), u (b,l,e)
        self.hook_delta, self.hook_B, self.hook_C = HookPoint(), HookPoint(), HookPoint()
        self.hook_ssm_out, self.hook_gate, self.hook_y = HookPoint(), HookPoint(), HookPoint()

    def mix(self, x):
        xi, z = self.in_proj(x).chunk(2, dim=-1)                  # (b,l,e) each
        xi, z = self.hook_x(xi), self.hook_z(z)
        conv_out = self.short_conv(xi, self.conv1d.weight, self.conv1d.bias) if self.d_conv else xi
        u = self.hook_u(F.silu(self.hook_conv_out(conv_out)))
        dt, B, C = self.x_proj(u).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = self.hook_delta(F.softplus(self.dt_proj(dt)))    # (b,l,e)
        B, C = self.hook_B(B), self.hook_C(C)                     # (b,l,n) each
        work = torch.promote_types(x.dtype, torch.float32)  # the recurrence in float32 at least
        delta, B, C, u_w = delta.to(work), B.to(work), C.to(work), u.to(work)
        A = -torch.exp(self.A_log.to(work))                       # (e,n)
        ssm_out = selective_scan(u_w, delta, A, B, C, reference=self.reference)  # sum_n C_t h_t
        y = self.hook_ssm_out(ssm_out.to(x.dtype)) + self.D * u
        return self.out_proj(self.hook_y(y * self.hook_gate(F.silu(z))))  # (b,l,e) -> (b,l,d)

    def effective_map(self, x):
        """The selective scan as a matrix per channel e ("The Hidden Attention of Mamba Models",
        Ali, Zimerman, Wolf 2024), with D and the gate: on v = u (b,e,l,1),
        M[e, t, s] = SiLU(z_t) (sum_n C_t exp(A (Delta_{s+1} + .. + Delta_t)) B_s Delta_s
                                + D [t = s])."""
        a = self.capture(x, "hook_u", "hook_delta", "hook_B", "hook_C", "hook_gate")
        u, delta, l = a["hook_u"], a["hook_delta"], x.shape[1]
        cum = delta.cumsum(1).transpose(1, 2)                                        # (b, e, l)
        future = torch.ones(l, l, dtype=torch.bool, device=x.device).triu(1)[..., None]
        A = -torch.exp(self.A_log)                                                   # (e, n)
        decay = ((cum[..., :, None] - cum[..., None, :])[..., None] * A[:, None, None]).masked_fill(
            future, float("-inf")).exp()                                             # (b,e,l,l,n)
        # L . C B^T (b,e,l,l)
        M = torch.einsum("betsn,btn,bsn->bets", decay, a["hook_C"], a["hook_B"])
        M = M * delta.transpose(1, 2)[:, :, None]                                  # x Delta_s
        M = M + torch.diag_embed(self.D[:, None].expand(-1, l))                     # + D [t = s]
        return M * a["hook_gate"].transpose(1, 2)[..., None], u.transpose(1, 2)[..., None]


def l2_normalize(x):
    """x / sqrt(|x|^2 + 1e-6) over the last dim (fla's qk_norm='l2')."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


class DeltaNet(Mixer):
    """DeltaNet (fla/layers/delta_net.py; 1 head, size-4 convs, beta, no gate: README,
    difference 15): q, k, v = SiLU(SC(x W)), q, k L2-normalised per head; beta = sigmoid(x W_beta);
    the delta rule stores key -> value pairs; per-head RMSNorm (one weight); W_o.
    d_conv: conv size (default 4)."""
    D_CONV = range(2**31)   # 0 removes the convs
    INTERNAL_SITES = ["hook_k", "hook_v", "hook_o"]
    MAP_SITE = "hook_o"

    def __init__(self, d_model, layer_idx=0, n_layers=2, reference=False, *, n_heads=1, d_conv=None,
                 **options):
        super().__init__(reference)
        d, h = d_model, n_heads
        self.n_heads, self.conv_size = h, 4 if d_conv is None else d_conv
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.b_proj = nn.Linear(d, h, bias=False)
        if self.conv_size > 0:  # weights only, for short_conv; torch-default init
            convs = (nn.Conv1d(d, d, self.conv_size, groups=d, bias=False) for _ in range(3))
            self.q_conv, self.k_conv, self.v_conv = convs
        self.o_norm = RMSNorm(d // h)  # per head, one weight shared by the heads
        self.o_proj = nn.Linear(d, d, bias=False)
        self.hook_q, self.hook_k = HookPoint(), HookPoint()    # (b,l,h,w), after SiLU and L2 norm
        self.hook_v, self.hook_beta, self.hook_o = HookPoint(), HookPoint(), HookPoint()

    def mix(self, x):
        d, h = x.shape[-1], self.n_heads
        # q, k, v and beta's logits by one matmul, q, k, v by one 3d-channel conv (fewer ops)
        weight = torch.cat([p.weight for p in (self.q_proj, self.k_proj, self.v_proj, self.b_proj)])
        qkv, beta = F.linear(x, weight).split([3 * d, h], -1)  # (b,l,3d), (b,l,h)
        if self.conv_size > 0:
            weight = torch.cat([self.q_conv.weight, self.k_conv.weight, self.v_conv.weight])
            qkv = self.short_conv(qkv, weight)
        q, k, v = (t.unflatten(-1, (h, -1)) for t in F.silu(qkv).split(d, dim=-1))  # (b,l,h,w) each
        q, k, v = self.hook_q(l2_normalize(q)), self.hook_k(l2_normalize(k)), self.hook_v(v)
        beta = self.hook_beta(torch.sigmoid(beta))
        delta_rule = delta_rule_recurrent if self.reference else delta_rule_parallel
        o = self.hook_o(delta_rule(q, k, v, beta, *self.log_decay(x)))             # (b, l, h, w)
        return self.o_proj(self.readout(o, x).flatten(-2))  # heads concatenated

    def log_decay(self, x):
        return ()  # DeltaNet's state never decays

    def readout(self, o, x):
        return self.o_norm(o)  # per-head RMSNorm

    def effective_map(self, x):
        """Per head the lower-triangular M of o = M V (the UT transform of delta_rule_parallel): the
        output for the values V = I, value j the unit vector e_j."""
        a = self.capture(x, "hook_q", "hook_k", "hook_v", "hook_beta")
        b, l, h, _ = a["hook_q"].shape
        eye = torch.eye(l, dtype=x.dtype, device=x.device)
        eye = eye.expand(b, h, l, l).transpose(1, 2)                              # (b,l,h,l)
        M = delta_rule_parallel(a["hook_q"], a["hook_k"], eye, a["hook_beta"], *self.log_decay(x))
        return M.transpose(1, 2), a["hook_v"].transpose(1, 2)          # (b,h,l,l), (b,h,l,w)


class GatedDeltaNet(DeltaNet):
    """Gated DeltaNet (Yang, Kautz, Hatamizadeh, ICLR 2025; fla/layers/gated_deltanet.py): DeltaNet
    whose state decays, S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T
    (S as value x key), alpha_t = exp(-exp(A_log) softplus(x W_a + dt_bias)) per head (Mamba-2's),
    and whose output is gated: RMSNorm(o) * SiLU(x W_g) (fla's FusedRMSNormGated). fla's head
    widths are 0.75d (keys) and 1.5d (values); ours d and d, one head by default, as our DeltaNet
    (README, difference 15)."""

    def __init__(self, d_model, *args, n_heads=1, d_conv=None, **options):
        super().__init__(d_model, *args, n_heads=n_heads, d_conv=d_conv, **options)
        d, h = d_model, n_heads
        self.a_proj, self.g_proj = nn.Linear(d, h, bias=False), nn.Linear(d, d, bias=False)
        self.A_log = nn.Parameter(torch.empty(h).uniform_(0, 16).log())  # exp(A_log) ~ U(0, 16)
        dt = torch.exp(torch.empty(h).uniform_(math.log(1e-3), math.log(1e-1))).clamp(min=1e-4)
        # softplus^-1(dt), as Mamba's
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        # log alpha (b,l,h); SiLU(x W_g) (b,l,d)
        self.hook_log_alpha, self.hook_gate = HookPoint(), HookPoint()

    def log_decay(self, x):
        """(log alpha (b, l, h),): log alpha_t = -exp(A_log) softplus(x W_a + dt_bias) < 0."""
        return (self.hook_log_alpha(-self.A_log.exp() * F.softplus(self.a_proj(x) + self.dt_bias)),)

    def readout(self, o, x):
        gate = self.hook_gate(F.silu(self.g_proj(x))).unflatten(-1, (self.n_heads, -1))  # (b,l,h,w)
        return self.o_norm(o) * gate


# ================================= 4. TransformerBlock, the LM and its init (zoology/model.py)

class TransformerBlock(nn.Module):
    """Pre-norm block over the residual stream r: r += mixer(LN1(r)); r += MLP(LN2(r))."""
    GPT2_INIT = True        # LM's init pass: zoology's (GPT-2's) rules

    def __init__(self, d_model, mixer):
        super().__init__()
        self.hook_resid_pre = HookPoint()   # block input
        self.ln1, self.mixer = nn.LayerNorm(d_model), mixer
        self.hook_resid_mid = HookPoint()   # after the mixer's residual add
        self.ln2, self.mlp = nn.LayerNorm(d_model), MLP(d_model)
        self.hook_resid_post = HookPoint()  # block output

    def forward(self, r, rows=None):
        """rows (b,): only those positions go through the MLP, out (b, 1, d)."""
        r = self.hook_resid_pre(r)
        r = self.hook_resid_mid(r + self.mixer(self.ln1(r)))
        if rows is not None:
            r = r[torch.arange(r.shape[0], device=r.device), rows][:, None]  # (b,l,d) -> (b,1,d)
        return self.hook_resid_post(r + self.mlp(self.ln2(r)))


def check_tokens(tokens, vocab_size, n_positions=None):
    """ValueError unless tokens is a (b, l) tensor of integer ids in [0, vocab_size), l at most
    n_positions (None: any l)."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.is_floating_point() \
            or tokens.is_complex() or tokens.dtype == torch.bool:
        got = (f"{tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, torch.Tensor)
               else type(tokens).__name__)
        raise ValueError("tokens must be a (batch, length) tensor of integer token ids; "
                         f"got {got}.")
    if tokens.device.type == "cpu" and tokens.numel() and not torch.compiler.is_compiling():
        try:                          # the range read on a CPU only: no GPU sync
            low, high = (x.item() for x in torch.aminmax(tokens))
        except RuntimeError:          # vmap over the tokens: no .item()
            low, high = 0, 0
        if low < 0 or high >= vocab_size:
            raise ValueError(f"tokens must be ids in [0, {vocab_size}) (the model's vocabulary); "
                             f"got {low if low < 0 else high}.")
    if n_positions is not None and tokens.shape[1] > n_positions:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds n_positions={n_positions}.")


def hooked(modules):
    """Whether a forward hook (a global one, or one on any of `modules`) would see these modules."""
    hooks = nn.modules.module            # torch keeps the global hooks here (private state)
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks
                or any(m._forward_hooks or m._forward_pre_hooks for m in modules))


class LM(nn.Module):
    """Token (+ learned position) embedding, blocks, final LayerNorm, head tied to the embedding."""

    def __init__(self, vocab_size, d_model, blocks, pos_emb=False, n_positions=1024):
        """Then the init pass, as the classes declare it, in module order, DOWN_SCALED weights last.
        GPT2_INIT blocks (zoology's _init_weights, GPT-2's): embeddings and Linears N(0, 0.02^2),
        biases 0, DOWN_SCALED N(0, (0.02/sqrt(2 n_layers))^2). Else (MambaBlock, mamba_ssm's):
        embeddings N(0, 0.02^2), DOWN_SCALED torch's default / sqrt(n_layers), others theirs."""
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(n_positions, d_model) if pos_emb else None
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(d_model)
        self.build_args = {}  # filled by build_model, enough to rebuild this model
        gpt2, n_layers = all(block.GPT2_INIT for block in blocks), len(blocks)
        for module in self.modules():
            if isinstance(module, nn.Embedding) or gpt2 and isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
            if gpt2 and isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for module in self.modules():
            if getattr(module, "DOWN_SCALED", None):
                weight = getattr(module, module.DOWN_SCALED).weight
                if gpt2:
                    nn.init.normal_(weight, std=0.02 / math.sqrt(2 * n_layers))
                else:   # torch's default Linear init, U(+-1/sqrt(fan_in)), scaled down
                    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
                    with torch.no_grad():
                        weight.div_(math.sqrt(n_layers))

    def forward(self, tokens, readout=None):
        """tokens (b, l) integer ids of the vocabulary -> logits (b, l, v), or (b, v) at readout
        (b,) positions. Speed: with readout, the last block's MLP sees those rows only (~1/6 of a
        Transformer step on AR), unless something hooks its side (it would see (b, 1, d))."""
        positions = self.pos_emb
        check_tokens(tokens, self.embed.num_embeddings, positions and positions.num_embeddings)
        r = self.embed(tokens)                                     # (b,l) -> (b,l,d)
        if positions is not None:                                  # positions start at 0
            r = r + positions(torch.arange(tokens.shape[1], device=tokens.device))
        last = self.blocks[-1] if len(self.blocks) else None
        rows_only = readout is not None and isinstance(last, TransformerBlock) and not hooked(
            [last.ln2, *last.mlp.modules(), last.hook_resid_post])
        for block in self.blocks[:-1] if rows_only else self.blocks:
            r = block(r)                                           # (b,l,d)
        if rows_only:
            return self.logits(last(r, readout)[:, 0])             # (b,1,d) -> (b,v)
        return self.logits(r, readout)

    def logits(self, r, readout=None):
        if readout is not None:
            r = r[torch.arange(r.shape[0], device=r.device), readout]  # (b,l,d) -> (b,d)
        return F.linear(self.ln_f(r), self.embed.weight)            # tied head: (.., d) -> (.., v)


def check_dataset(model, dataset, name="dataset"):
    """ValueError unless dataset has the model's vocabulary and task
    (model.task, from mechsm.load)."""
    needed = ("task", "vocab_size", "tokens", "positions", "answers")
    if not all(hasattr(dataset, a) for a in needed):
        raise ValueError(f"{name} must be a tasks.Dataset (e.g. mechsm.make_data(cfg).eval); "
                         f"got {type(dataset).__name__}.")
    embed = getattr(model, "embed", None)
    built = getattr(model, "build_args", {})
    vocab = built.get("vocab_size", getattr(embed, "num_embeddings", None))
    task = getattr(model, "task", None)
    if task is not None and dataset.task != task:
        raise ValueError(f"{name} holds {dataset.task} documents, but the model was trained "
                         f"on {task}.")
    if vocab is not None and dataset.vocab_size != vocab:
        raise ValueError(f"{name} has a vocabulary of {dataset.vocab_size} tokens "
                         f"({dataset.task}), but the model's has {vocab}: the data is not the "
                         "task the model was built for.")


def count_parameters(model, trainable_only=False):
    """Number of distinct parameters (the tied head once; frozen ones unless trainable_only)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def based_layer(d_model, layer_idx, n_layers, reference=False, **options):
    """based: BaseConv on even layers (kernel size 3, or d_conv, or long),
    linear attention on odd ones."""
    mixer = BaseConv if layer_idx % 2 == 0 else BasedAttention
    return mixer(d_model, layer_idx, n_layers, reference, **options)


# its **options
based_layer.builds, based_layer.D_CONV = (BaseConv, BasedAttention), BaseConv.D_CONV

ARCHS = {}          # arch name -> one-line description (run.py's help, mechsm.Config's check)
# arch name -> Mixer subclass or factory, called as (d_model, layer_idx, n_layers, ...)
MIXER_CLASSES = {}
# arch name -> the keywords (with defaults) its mixer takes: build_model's **options
MIXER_OPTIONS = {}


def register(name, mixer, description):
    """Make `mixer` buildable as arch `name`: a Mixer subclass, or a factory called like one (it
    gets the Mixer class attributes it does not set, so MIXER_CLASSES[name].POS_EMB etc. always
    exist). A factory's options are its keywords and those of the classes it builds
    (its `builds`)."""
    if not (isinstance(name, str) and name.isidentifier() and name not in MIXER_CLASSES):
        raise ValueError(f"register: the arch name must be a new identifier; got {name!r}.")
    for attr, default in vars(Mixer).items():
        if attr.isupper() and not hasattr(mixer, attr):
            setattr(mixer, attr, default)
    MIXER_CLASSES[name], ARCHS[name] = mixer, description
    MIXER_OPTIONS[name] = {                                     # {option: its default}
        p.name: p.default for f in (mixer, *getattr(mixer, "builds", ()))
        for p in inspect.signature(f).parameters.values()
        if p.default is not p.empty and p.name not in ("layer_idx", "n_layers", "reference")}


# The built-in architectures (the paper's six, then DeltaNet and Gated DeltaNet), in table order.
register("attention", Attention, "causal softmax multi-head attention (zoology MHA) + MLP")
register("base_conv", BaseConv, "a projection gated by short and implicit long convs + MLP")
register("based", based_layer, "BaseConv alternating with Taylor-feature linear attention + MLP")
register("h3", H3, "shift SSM on keys, diagonal SSM on key-value products, query readout + MLP")
register("hyena", Hyena, "short filter, gated implicit long convolution + MLP")
register("mamba", Mamba, "short conv, selective SSM scan, SiLU gate; no MLP")
register("deltanet", DeltaNet, "linear attention with the delta-rule update, short convs + MLP")
register("gated_deltanet", GatedDeltaNet, "DeltaNet with a decaying state and a gated output + MLP")
BUILT_IN_ARCHS = tuple(ARCHS)


def mixer_options(arch=None):
    """The keywords arch's mixer takes, or those of every registered mixer
    (build_model's **options)."""
    return frozenset(MIXER_OPTIONS[arch] if arch else frozenset().union(*MIXER_OPTIONS.values()))


def check_build_args(arch, vocab_size, d_model, n_layers, pos_emb, n_positions, n_heads, d_conv,
                     long_only, kernels, seed, options):
    """build_model's arguments: a one-line ValueError naming the first bad one."""
    if not isinstance(arch, str) or arch not in MIXER_CLASSES:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}; got {arch!r}.")
    sizes = MIXER_CLASSES[arch].D_CONV
    whole = lambda v, low: isinstance(v, int) and not isinstance(v, bool) and v >= low
    sizes_text = sizes and (f"{sizes.start}..{sizes.stop - 1}" if sizes.stop < 2**31
                            else f">= {sizes.start}")
    for name, value, ok, allowed in [
            ("vocab_size", vocab_size, whole(vocab_size, 1), "a positive int"),
            ("d_model", d_model, whole(d_model, 1), "a positive int"),
            ("n_layers", n_layers, whole(n_layers, 1), "a positive int"),
            ("n_heads", n_heads, whole(n_heads, 1) and whole(d_model, 1) and d_model % n_heads == 0,
             f"a positive int dividing d_model={d_model}"),
            ("n_positions", n_positions, whole(n_positions, 2), "an int >= 2"),
            ("kernels", kernels, kernels in ("fast", "reference"), "'fast' or 'reference'"),
            ("d_conv", d_conv,
             d_conv is None or sizes is None or whole(d_conv, 0) and d_conv in sizes,
             f"an int {sizes_text} for {arch}"),
            ("long_only", long_only, isinstance(long_only, bool)
             and not (long_only and d_conv is not None), "True or False, False when d_conv is set"),
            ("pos_emb", pos_emb, pos_emb is None or isinstance(pos_emb, bool),
             "None, True or False"),
            ("seed", seed, seed is None or whole(seed, 0) and seed < 2**63,
             "None or an int in [0, 2**63)")]:
        if not ok:
            raise ValueError(f"{name} must be {allowed}; got {value!r}.")
    unknown = sorted(set(options).difference(*MIXER_OPTIONS.values()))
    if unknown:
        known = sorted({"pos_emb", "kernels", "seed"}.union(*MIXER_OPTIONS.values()))
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = (f" (did you mean {close[0]!r}?)" if close
                else f"; expected one of {', '.join(known)}")
        raise ValueError(f"build_model: unknown option {unknown[0]!r}{hint}")
    defaults = {k: v for opts in MIXER_OPTIONS.values() for k, v in opts.items()}
    foreign = [k for k, v in options.items() if k not in mixer_options(arch) and v != defaults[k]]
    if foreign:                             # another mixer's option, not at its default: refused
        raise ValueError(f"{foreign[0]}: {arch} has no such option; got {options[foreign[0]]!r}.")
    kinds = {k: type(v) for k, v in defaults.items()}
    for name, value in options.items():                  # a mixer's option: of its default's kind
        kind = kinds[name]
        if kind is bool and not isinstance(value, bool) or kind is int and not whole(value, 1):
            allowed = "True or False" if kind is bool else "a positive int"
            raise ValueError(f"{name} must be {allowed}; got {value!r}.")


def build_model(arch, vocab_size, d_model=64, n_layers=2, *, pos_emb=None, n_positions=1024,
                n_heads=1, d_conv=None, long_only=False, kernels="fast", seed=None, **options):
    """The language model for `arch`, the paper's defaults. pos_emb: learned positions (None: the
    mixer's POS_EMB); d_conv: short-conv size; long_only: long convs only; kernels: "fast" or
    "reference"; seed: the init's own RNG. Bad arguments: a one-line ValueError naming the first."""
    check_build_args(arch, vocab_size, d_model, n_layers, pos_emb, n_positions, n_heads, d_conv,
                     long_only, kernels, seed, options)
    mixer = MIXER_CLASSES[arch]
    pos_emb = mixer.POS_EMB if pos_emb is None else pos_emb
    build_args = dict(arch=arch, vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
                      pos_emb=pos_emb, n_positions=n_positions, n_heads=n_heads, d_conv=d_conv,
                      long_only=long_only, kernels=kernels, seed=seed, **options)
    Block = mixer.BLOCK or TransformerBlock
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        try:  # drawn in this order: the mixers layer by layer, the embeddings, LM's init pass
            blocks = []
            for i in range(n_layers):       # each block's mixer, then its MLP
                layer = mixer(d_model, i, n_layers, kernels == "reference", n_heads=n_heads,
                              d_conv=d_conv, long_only=long_only, n_positions=n_positions,
                              **options)
                blocks.append(Block(d_model, layer))
            model = LM(vocab_size, d_model, blocks, pos_emb=pos_emb, n_positions=n_positions)
        except (RuntimeError, MemoryError) as e:  # an allocation failure: bad input, not a crash
            text = " ".join(str(e).split())
            if not (isinstance(e, MemoryError) or re.search("alloc|out of memory", text, re.I)):
                raise
            asked = re.search(r"allocate (\d+) bytes", text)
            size = f" (one tensor of {int(asked.group(1)) / 2**30:,.1f} GiB)" if asked else ""
            raise ValueError(f"vocab_size={vocab_size}, d_model={d_model}, n_layers={n_layers}, "
                             f"d_conv={d_conv}: the {arch} model is too large to allocate{size}"
                             ) from None
    model.build_args = build_args
    return model


# ============================================ 5. Fast kernels and their dispatchers

@contextlib.contextmanager
def _one_thread():
    """Loops of small CPU ops on one thread: hand-offs cost more (Mamba 13.6 steps/s, 11.5 on 2)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _fold_into_batch(info, in_dims, tensors):
    """Tensors vmapped at in_dims (None: expanded) -> (r*b, ...), member-major, for a vmap rule."""
    members = [x.movedim(dim, 0) if dim is not None else x.expand(info.batch_size, *x.shape)
               for x, dim in zip(tensors, in_dims)]                          # (r, b, ...) each
    return [x.reshape(-1, *x.shape[2:]) for x in members]                    # (r*b, ...) each


def parallel_scan(a, b):
    """sequential_scan by odd-even reduction: steps 2k, 2k+1 compose into one affine map,
    h -> (a_{2k+1} a_{2k}) h + (a_{2k+1} b_{2k} + b_{2k+1}); solve for the odd positions
    recursively, then h_2k = a_2k h_{2k-1} + b_2k.
    Speed: ~log2(l) levels of whole-tensor ops on a GPU instead of l steps, O(l) work."""
    length = a.shape[1]
    if length == 1:
        return b
    if length % 2:  # pad with an identity step (a = 1, b = 0), dropped at the end
        a = torch.cat([a, torch.ones_like(a[:, :1])], dim=1)
        b = torch.cat([b, torch.zeros_like(b[:, :1])], dim=1)
    a_even, a_odd = a[:, 0::2], a[:, 1::2]  # steps 0, 2, 4, ... and 1, 3, 5, ...
    b_even, b_odd = b[:, 0::2], b[:, 1::2]
    h_odd = parallel_scan(a_odd * a_even, torch.addcmul(b_odd, a_odd, b_even))  # h_1, h_3, h_5, ...
    h_even = torch.addcmul(b_even, a_even, _shift_right(h_odd, 1))  # h_0, h_2, ... (h_{-1} = 0)
    return torch.stack([h_even, h_odd], dim=2).flatten(1, 2)[:, :length]  # interleave: (b, l, ...)


class _ParallelScanFn(torch.autograd.Function):
    """parallel_scan whose backward is parallel_scan right to left (autograd keeps ~2.5x more
    tensors): with g = dL/dh, the gradient into h_t is c_t = g_t + a_{t+1} c_{t+1}, reversed in
    time (s = l-1-t) the scan c'_s = a'_s c'_{s-1} + g'_s with a'_s = a_{l-s};
    then dL/db_t = c_t, dL/da_t = c_t h_{t-1}. vmap: folded into b."""

    @staticmethod
    def forward(a, b):
        return parallel_scan(a, b) if a.shape[1] > 1 else b.clone()  # never b itself

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx, grad_h):
        a, h = ctx.saved_tensors
        a_reversed = _shift_right(a.flip(1), 1)                             # a'_s = a_{l-s}
        grad_b = parallel_scan(a_reversed, grad_h.flip(1)).flip(1)          # c_t
        grad_a = grad_b * _shift_right(h, 1)                                # dL/da_t = c_t h_{t-1}
        return grad_a, grad_b

    @staticmethod
    def vmap(info, in_dims, a, b):
        h = _ParallelScanFn.apply(*_fold_into_batch(info, in_dims, (a, b)))  # (r*b, l, ...)
        return h.unflatten(0, (info.batch_size, -1)), 0                     # (r, b, l, ...)


parallel_scan_custom_grad = _ParallelScanFn.apply  # `scan` and `selective_scan` on a GPU


def scan(a, b, reference=False):
    """h_t = a_t h_{t-1} + b_t: sequential_scan on a CPU or if reference, else the parallel scan."""
    return sequential_scan(a, b) if reference or a.is_cpu else parallel_scan_custom_grad(a, b)


def _selective_states(u, delta, A, B):
    """decay = exp(Δ A) and h_t = decay_t h_{t-1} + Δ_t u_t B_t, (b,l,e,n); A (e,n) or (b,e,n)."""
    decay = (delta[..., None] * (A if A.dim() == 2 else A[:, None])).exp_()  # (b,l,e,n)
    states = (delta * u)[..., None] * B[:, :, None, :]  # drive (b,l,e,n), becomes h
    h, a = states.unbind(1), decay.unbind(1)  # views, taken once: no select per step
    for t in range(1, u.shape[1]):
        h[t].addcmul_(a[t], h[t - 1])  # h_t = drive_t + decay_t h_{t-1}
    return decay, states


def _sum_over_e(x, states):
    """sum_e x_t h_t: (b, l, e), (b, l, e, n) -> (b, l, n), one bmm."""
    b, l, e, n = states.shape
    return torch.bmm(x.reshape(b * l, 1, e), states.view(b * l, e, n)).view(b, l, n)


def row_chunks(shape, floats=1 << 17, most=8):
    """At most `most` batch slices whose (rows, l, e, n) tensors hold ~`floats` floats. Speed: in L2
    cache, several times faster than passes over memory; a slice costs ~90 ops (vmap: most=2)."""
    b = shape[0]
    rows = max(1, floats // math.prod(shape[1:]), -(-b // most))
    return [slice(i, min(i + rows, b)) for i in range(0, b, rows)]


class _SelectiveScanLoopFn(torch.autograd.Function):
    """selective_scan_reference, one in-place op per step, a batch slice at a time (row_chunks:
    in cache), only the inputs saved (the backward recomputes the states in cache).
    Backward: g_t = C_t dy_t + decay_{t+1} g_{t+1} in place, then batched:
    dC_t = sum_e dy_t h_t, dB_t = sum_e Δ_t u_t g_t, d(Δ_t u_t) = sum_n g_t B_t,
    d(Δ_t A) = g_t h_{t-1} decay_t -> dA, dΔ. ~15 in-cache passes (unsliced: ~33 over memory,
    3.5x slower)."""

    @staticmethod
    def forward(u, delta, A, B, C, most):
        y = torch.empty_like(u)                                           # (b,l,e)
        with _one_thread():
            for rows in row_chunks((*u.shape, A.shape[-1]), most=most):
                A_rows = A if A.dim() == 2 else A[rows]
                _, states = _selective_states(u[rows], delta[rows], A_rows, B[rows])
                # sum_n C_t h_t (1.5-2.5x faster than bmm)
                y[rows] = (states * C[rows][:, :, None, :]).sum(-1)
        return y

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:5])
        ctx.most = inputs[5]

    @staticmethod
    def backward(ctx, grad_y):
        u, delta, A, B, C = ctx.saved_tensors
        grad_u, grad_delta, grad_B, grad_C = (torch.empty_like(x) for x in (u, delta, B, C))
        grad_A = torch.zeros_like(A)
        with _one_thread():
            for rows in row_chunks((*u.shape, A.shape[-1]), most=ctx.most):
                per_row = A.dim() == 3  # A (b, e, n): dL/dA per row
                A_rows, grad_A_rows = (A[rows], grad_A[rows]) if per_row else (A, grad_A)
                dy, du, d_delta = grad_y[rows], u[rows] * delta[rows], delta[rows]
                # (r,l,e,n) each
                decay, states = _selective_states(u[rows], d_delta, A_rows, B[rows])
                g = dy[..., None] * C[rows][:, :, None, :]  # C_t dy_t (r,l,e,n), becomes g
                g_t, a = g.unbind(1), decay.unbind(1)
                for t in range(u.shape[1] - 2, -1, -1):
                    g_t[t].addcmul_(a[t + 1], g_t[t + 1])  # g_t += decay_{t+1} g_{t+1}
                grad_C[rows] = _sum_over_e(dy, states)
                grad_B[rows] = _sum_over_e(du, g)
                grad_drive = (g * B[rows][:, :, None, :]).sum(-1)         # sum_n g B (r,l,e)
                g[:, 1:].mul_(states[:, :-1])                             # g becomes dL/d(Δ A):
                g[:, 0].zero_()  #   g_t h_{t-1} decay_t, h_{-1} = 0
                g.mul_(decay)
                # multiply and sum, not einsum (bmm/gemv over e: 3-15x slower)
                grad_A_rows += (g * d_delta[..., None]).sum(1 if per_row else (0, 1))
                grad_delta_A = (g * (A_rows[:, None] if per_row else A_rows)).sum(-1)
                grad_delta[rows] = grad_delta_A.addcmul_(grad_drive, u[rows])
                grad_u[rows] = grad_drive * d_delta
        return grad_u, grad_delta, grad_A, grad_B, grad_C, None

    @staticmethod
    def vmap(info, in_dims, u, delta, A, B, C, most):
        r = info.batch_size
        # (r*b, l, .) each
        u, delta, B, C = _fold_into_batch(info, in_dims[:2] + in_dims[3:], (u, delta, B, C))
        if in_dims[2] is not None:  # one A per member: one per row
            A = A.movedim(in_dims[2], 0).repeat_interleave(u.shape[0] // r, dim=0)  # (r*b, e, n)
        y = _SelectiveScanLoopFn.apply(u, delta, A, B, C, 2)  # 2 slices: few ops per member
        return y.unflatten(0, (r, -1)), 0                                  # (r, b, l, e)


def selective_scan(u, delta, A, B, C, reference=False):
    """_SelectiveScanLoopFn on a CPU, else the reference through parallel_scan_custom_grad."""
    if u.is_cpu and not reference:
        return _SelectiveScanLoopFn.apply(u, delta, A, B, C, 8)  # in at most 8 slices
    plain_scan = sequential_scan if reference else parallel_scan_custom_grad
    return selective_scan_reference(u, delta, A, B, C, plain_scan)


def _powers(A, length):
    """A^0 .. A^(l-1): (h, n/2) complex -> (h, n/2, l) by doubling, P[k:2k] = P[:k] A^k
    (a complex cumprod: ~5x slower)."""
    P = A.new_empty(*A.shape, length)
    P[..., 0] = 1
    k, A_k = 1, A                                                           # A_k = A^k
    while k < length:
        n = min(k, length - k)
        torch.mul(P[..., :n], A_k[..., None], out=P[..., k:k + n])
        k, A_k = 2 * k, A_k * A_k
    return P


class _VandermondeFn(torch.autograd.Function):
    """K (l, h) = 2 Re sum_modes W A^lag, hand-written backward: only A, W saved (autograd keeps
    ~10 (h, n/2, l) tensors), each direction one complex bmm over the powers P:
    K^T = 2 Re (W^T P), dW = 2 conj(P G), dA = 2 conj(W P G') with G = dL/dK^T,
    G'[lag] = (lag+1) G[lag+1]. vmap: the members are more heads."""

    @staticmethod
    def forward(A, W, length):
        return 2 * torch.bmm(W[:, None, :], _powers(A, length))[:, 0].real.T.contiguous()  # (l, h)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], inputs[1])
        ctx.length = inputs[2]

    @staticmethod
    def backward(ctx, grad_K):
        A, W = ctx.saved_tensors
        G = grad_K.T                                                        # (h, l)
        lags = torch.arange(1, ctx.length, device=G.device, dtype=G.dtype)
        G_next = F.pad(G[:, 1:] * lags, (0, 1))  # G'[lag] = (lag+1) G[lag+1]
        both = torch.stack([G, G_next], -1).to(A.dtype)                     # (h, l, 2)
        S, T = torch.bmm(_powers(A, ctx.length), both).unbind(-1)            # (h, n/2) each
        # conj() is lazy, copied slowly later
        return 2 * (W * T).conj_physical(), 2 * S.conj_physical(), None

    @staticmethod
    def vmap(info, in_dims, A, W, length):
        K = _VandermondeFn.apply(*_fold_into_batch(info, in_dims[:2], (A, W)), length)  # (l, r*h)
        return K.unflatten(1, (info.batch_size, -1)), 1  # (l, r, h), members at dim 1


# H3's diagonal-SSM kernel (l, h) from modes A, W (h, n/2) complex
vandermonde_kernel = _VandermondeFn.apply


def fft_conv(u, k):
    """direct_conv by real FFT, O(l log l), zero-padded to 2l (no wrap-around),
    length on the contiguous axis."""
    length, n = u.shape[1], 2 * u.shape[1]
    work = torch.promote_types(u.dtype, torch.float32)    # no half-precision FFT on CPU
    u_f = torch.fft.rfft(u.to(work).transpose(1, 2), n=n)  # (b, d, l+1) complex
    k_f = torch.fft.rfft(k.to(work).t(), n=n)              # (d, l+1) complex
    return torch.fft.irfft(u_f * k_f, n=n)[..., :length].transpose(1, 2).to(u.dtype)  # (b, l, d)


def long_conv(u, k, reference=False):
    return direct_conv(u, k) if reference else fft_conv(u, k)


def short_conv(x, weight, bias=None):
    """short_conv_reference as `size` multiply-adds over one padded copy of x
    (~2x F.conv1d's CPU speed)."""
    length, kernel = x.shape[1], weight.shape[-1]
    padded = F.pad(x, (0, 0, kernel - 1, 0))  # (b, l+size-1, c): size-1 zeros in front
    taps = weight[:, 0].t()  # (size, c); tap j looks size-1-j steps back
    first = padded[:, :length]
    y = first * taps[0] if bias is None else torch.addcmul(bias, first, taps[0])
    for j in range(1, kernel):
        y = torch.addcmul(y, padded[:, j:j + length], taps[j])      # y += w_j x_{t-(size-1)+j}
    return y                                                        # (b, l, c)


def decay_matrix(log_alpha):
    """D[t, j] = alpha_{j+1} ... alpha_t = exp(G_t - G_j) for j <= t (G = cumsum log alpha), 0 above
    the diagonal: how much of what was written at j survives at t.
    log_alpha (b, l, h) -> (b, h, l, l)."""
    G = log_alpha.transpose(1, 2).cumsum(-1)                                       # (b, h, l)
    future = torch.ones(G.shape[-1], G.shape[-1], dtype=torch.bool, device=G.device).triu(1)
    return (G[..., :, None] - G[..., None, :]).masked_fill(future, float("-inf")).exp()


def delta_rule_parallel(q, k, v, beta, log_alpha=None):
    """delta_rule_recurrent with no loop: with S_t = sum_{j<=t} k_j u_j^T,
    u_t = beta_t v_t - beta_t sum_{j<t} (k_t.k_j) u_j, one unit-triangular solve
    (I + strict_tril(diag(beta) K K^T)) U = diag(beta) V; o = tril(Q K^T) U / sqrt(d_k).
    Gated: S_t = sum_{j<=t} D[t, j] k_j u_j^T, so both K K^T and Q K^T are weighted by
    D = decay_matrix."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))                               # (b, h, l, w)
    beta = beta.transpose(1, 2)[..., None]                                         # (b, h, l, 1)
    # (b, h, l, l): k_t . k_j, q_t . k_j
    gram, scores = k @ k.transpose(-1, -2), q @ k.transpose(-1, -2)
    if log_alpha is not None:
        decay = decay_matrix(log_alpha)
        gram, scores = gram * decay, scores * decay
    system = torch.tril(beta * gram, diagonal=-1)  # (b,h,l,l); unit diagonal
    work = torch.promote_types(v.dtype, torch.float32)  # the solver has no half-precision kernels
    u = torch.linalg.solve_triangular(system.to(work), (beta * v).to(work), upper=False,
                                      unitriangular=True).to(v.dtype)               # (b, h, l, w)
    o = torch.tril(scores) @ u / math.sqrt(k.shape[-1])                           # (b, h, l, w)
    return o.transpose(1, 2)                                                       # (b, l, h, w)
