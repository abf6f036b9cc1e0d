"""mixers_b.py: the Hyena, H3 and DeltaNet sequence mixers (a section of models.py, written apart and merged later).

Follows "Mechanistic evaluation of Transformers and state space models" (Arora et al. 2025, arXiv 2505.15105)
through the upstream modules as ARCHITECTURES.md specifies them:
  [1] ARCHITECTURES.md §3.4  Hyena: gated short filter + implicit long filter (sine MLP, exponential window)
  [2] ARCHITECTURES.md §3.5  H3: shift SSM on the keys, then a diagonal S4D-Lin SSM on per-head k v^T
  [3] ARCHITECTURES.md §3.7, §7.8  DeltaNet: delta-rule fast weights, recurrent and parallel forms
  [4] ARCHITECTURES.md §4 parameter counts, §5.2 intervention sites

Importing this module registers the three mixers in models.MIXER_CLASSES.

Shape glossary: b batch, l sequence length, d d_model, h heads, k head width, m H3 head width (2),
n SSM state size, o Hyena filter-MLP width, P position budget (1024).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import models
from models import HookPoint, Mixer, RMSNorm, long_conv, short_conv, short_conv_reference


# ----------------------------------------------------------------------------------------------
# Hyena (ARCHITECTURES.md §3.4)
# ----------------------------------------------------------------------------------------------

def hyena_positional_features(n_positions):
    """Z (P, 3): the filter MLP's input, one row per position n: (n/(P-1), cos w_n, -sin w_n).

    w_n = 2*pi*1e-4*n/P: Hyena's complex-exponential feature with a single band at frequency 1e-4,
    so in practice Z[n] ~ (n/(P-1), 1, 0). The grid is fixed at P and never rescaled to the current l.
    """
    n = torch.arange(n_positions, dtype=torch.float32)
    angle = 2 * math.pi * 1e-4 * n / n_positions
    return torch.stack([n / (n_positions - 1), torch.cos(angle), -torch.sin(angle)], dim=1)


class HyenaFilter(nn.Module):
    """Hyena's implicit long filter h (l, d): a sine MLP on positional features, times a decay window.

    h[n] = (W_4 g_3) * exp(-tau_n * alpha), g_i = sin(omega * (W_i g_{i-1} + b_i)), g_0 = Z[n].
    """

    def __init__(self, d_model, order=64, n_positions=1024):
        super().__init__()
        # Trainable: upstream tags it lr 1e-5, but the paper's optimizer ignored the tag (§2.6).
        self.z = nn.Parameter(hyena_positional_features(n_positions))      # (P, 3)
        self.register_buffer("tau", torch.linspace(0, 1, n_positions))     # (P,) tau_n = n/(P-1)
        self.lin1 = nn.Linear(3, order)
        self.lin2 = nn.Linear(order, order)
        self.lin3 = nn.Linear(order, order)
        self.lin_out = nn.Linear(order, d_model, bias=False)
        # omega: ONE vector shared by all three sines, because upstream reuses a single Sin module.
        self.freq = nn.Parameter(torch.ones(order))
        # alpha: per-channel decay rates, fast (15.35) to slow (3.07), so the window reaches 1e-2 at
        # 30%..150% of the P grid. A buffer: never trained.
        target = math.log(1e-2)
        self.register_buffer("decay", torch.linspace(target / 1.5, target / 0.3, d_model).abs())  # (d,)

    def forward(self, length):
        g = torch.sin(self.freq * self.lin1(self.z[:length]))           # (l, 3) -> (l, o)
        g = torch.sin(self.freq * self.lin2(g))                         # (l, o)
        g = torch.sin(self.freq * self.lin3(g))                         # (l, o)
        window = torch.exp(-self.tau[:length, None] * self.decay)       # (l, d)
        return self.lin_out(g) * window                                 # (l, o) -> (l, d)


class Hyena(Mixer):
    """Hyena operator of order 2 (zoology Hyena, the paper's config).

    U = x W_in + b_in, U^ = SC_3(U), [x1 | x2 | v] = U^, s = v*x1, y = LC(s; h), out = (y*x2) W_out + b_out.
    Upstream adds a skip beta*s inside the filter, but the paper's `bias=False` multiplied beta by 0: beta is
    a counted, inert parameter (ARCHITECTURES.md §7.2). hyena_skip=True turns it on.
    """

    INTERNAL_SITES = ["hook_short", "hook_longconv"]

    def __init__(self, d_model, layer_idx=0, n_layers=2, reference=False, *, n_positions=1024,
                 hyena_order=64, hyena_skip=False, **options):
        super().__init__(reference)  # options meant for other mixers are ignored
        d = d_model
        self.n_positions = n_positions
        self.use_skip = hyena_skip
        self.in_proj = nn.Linear(d, 3 * d)
        # Only the weights are used (by short_conv); Conv1d keeps torch's default init and upstream's layout.
        self.short_filter = nn.Conv1d(3 * d, 3 * d, kernel_size=3, groups=3 * d)
        self.filter = HyenaFilter(d, hyena_order, n_positions)
        self.skip = nn.Parameter(torch.randn(d))   # beta
        self.out_proj = nn.Linear(d, d)             # named out_proj so the global init pass down-scales it (§2.6)
        self.hook_in_proj = HookPoint()             # (b, l, 3d)
        self.hook_short = HookPoint()               # (b, l, 3d): short-filter output, the token-shift carrier
        self.hook_pregate = HookPoint()             # (b, l, d)
        self.hook_filter = HookPoint(seq_dim=None)  # (l, d): derived from parameters only
        self.hook_longconv = HookPoint()            # (b, l, d)
        self.hook_postgate = HookPoint()            # (b, l, d)

    def mix(self, x):
        b, l, d = x.shape
        if l > self.n_positions:
            raise ValueError(f"Hyena: sequence length {l} exceeds n_positions={self.n_positions}")
        u = self.hook_in_proj(self.in_proj(x))                                            # (b, l, 3d)
        conv = short_conv_reference if self.reference else short_conv
        u = self.hook_short(conv(u, self.short_filter.weight, self.short_filter.bias))    # (b, l, 3d)
        x1, x2, v = u.split(d, dim=-1)                                                    # (b, l, d) each
        s = self.hook_pregate(v * x1)
        kernel = self.hook_filter(self.filter(l))                                         # (l, d)
        skip = self.skip if self.use_skip else 0 * self.skip  # 0*beta: the paper's inert skip (zero gradient)
        y = self.hook_longconv(long_conv(s, kernel, reference=self.reference) + skip * s)  # (b, l, d)
        return self.out_proj(self.hook_postgate(y * x2))


# ----------------------------------------------------------------------------------------------
# H3 (ARCHITECTURES.md §3.5)
# ----------------------------------------------------------------------------------------------

class H3(Mixer):
    """H3: a shift SSM on the keys, then per head a diagonal SSM over the m x m outer products k~ v^T.

    k~ = LC(k; K^s) + D^k*k, w_{h,i,j} = LC(k~_{h,i} v_{h,j}; K^d_h) + D^d_h k~_{h,i} v_{h,j},
    o_{h,j} = sum_i q_{h,i} w_{h,i,j}, out = o W_o + b_o, with o's channels in the order j*H + h.
    Read as attention: w_t is a per-head m x m fast-weight memory that decays through the SSM, queried by q_t.
    Both kernels are recomputed from the parameters on every forward, for the current l.
    """

    INTERNAL_SITES = ["hook_shift_out", "hook_ssm_out"]

    def __init__(self, d_model, layer_idx=0, n_layers=2, reference=False, *, h3_d_state=1024, h3_head_dim=2,
                 **options):
        super().__init__(reference)  # options meant for other mixers are ignored
        d, n, m = d_model, h3_d_state, h3_head_dim
        if d % m or n % 2:
            raise ValueError(f"H3 needs d_model % h3_head_dim == 0 and an even d_state (got {d}, {m}, {n})")
        self.d_state, self.head_dim, self.n_heads = n, m, d // m
        h = self.n_heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        # Shift SSM, one per channel: state = down-shift(state) + B^s k_t, output C^s . state.
        shift_B = torch.zeros(d, n)
        shift_B[:, 0] = 1.0                                  # at init K^s = C^s[:, :l]
        self.shift_B = nn.Parameter(shift_B)                                        # (d, n)
        self.shift_C = nn.Parameter(torch.empty(d, n).uniform_(-n ** -0.5, n ** -0.5))  # (d, n)
        self.shift_D = nn.Parameter(torch.randn(d))                                 # D^k
        # Diagonal S4D-Lin SSM, one per head: n/2 complex modes (their conjugates are the factor 2).
        self.log_dt = nn.Parameter(torch.empty(h).uniform_(math.log(1e-3), math.log(1e-1)))
        self.log_neg_A_real = nn.Parameter(torch.full((h, n // 2), math.log(0.5)))  # rho: Re A = -1/2
        self.A_imag = nn.Parameter(math.pi * torch.arange(n // 2).float().repeat(h, 1))  # theta: pi*n
        diag_B = torch.zeros(h, n // 2, 2)
        diag_B[..., 0] = 1.0                                                        # B^d = 1 + 0i
        self.diag_B = nn.Parameter(diag_B)                                          # (h, n/2, re/im)
        self.diag_C = nn.Parameter(torch.randn(h, n // 2, 2) * math.sqrt(0.5))      # standard complex normal
        self.diag_D = nn.Parameter(torch.randn(h))                                  # D^d
        self.output_linear = nn.Linear(d, d)  # not called out_proj upstream, so NOT down-scaled (§2.6)
        self.hook_q = HookPoint()                         # (b, l, d)
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.hook_shift_kernel = HookPoint(seq_dim=None)  # (l, d): K^s
        self.hook_shift_out = HookPoint()                 # (b, l, d): LC(k; K^s), the token shift
        self.hook_k_tilde = HookPoint()                   # (b, l, d)
        self.hook_kv = HookPoint()                        # (b, l, h, m, m)
        self.hook_ssm_kernel = HookPoint(seq_dim=None)    # (l, h): K^d
        self.hook_ssm_out = HookPoint()                   # (b, l, h, m, m): w, incl. the D^d skip
        self.hook_y = HookPoint()                         # (b, l, d): before output_linear

    def shift_kernel(self, length):
        """K^s (l, d): K^s[lag, c] = sum_n B^s[c, n] C^s[c, n + lag], the shift SSM's impulse response."""
        n = self.d_state
        if length > n:
            raise ValueError(f"H3: sequence length {length} exceeds d_state={n}; raise h3_d_state")
        B, C = self.shift_B, self.shift_C
        if self.reference:
            lags = [(B[:, :n - lag] * C[:, lag:]).sum(-1) for lag in range(length)]  # l x (d,)
            return torch.stack(lags, dim=0)                                          # (l, d)
        # Cross-correlation by FFT; padding to 2n keeps lags 0..n-1 free of wrap-around.
        spectrum = torch.fft.rfft(C, n=2 * n) * torch.fft.rfft(B, n=2 * n).conj()    # (d, n+1)
        return torch.fft.irfft(spectrum, n=2 * n)[:, :length].T.to(B.dtype)          # (l, d)

    def diag_modes(self):
        """(A_bar, W), each (h, n/2) complex: the bilinear (Tustin) discretisation of the S4D-Lin modes.

        A_bar = (1 + dt A/2) / (1 - dt A/2), W = C B dt / (1 - dt A/2), so K^d[lag] = 2 Re sum_n W A_bar^lag.
        Complex64 from float32 parameters, complex128 from float64 ones.
        """
        dt = self.log_dt.exp()[:, None]                                             # (h, 1)
        A = torch.complex(-self.log_neg_A_real.exp(), self.A_imag)                  # (h, n/2)
        half = dt * A / 2
        B = torch.view_as_complex(self.diag_B)
        C = torch.view_as_complex(self.diag_C)
        return (1 + half) / (1 - half), C * B * dt / (1 - half)

    def ssm_kernel(self, length):
        """K^d (l, h) = 2 Re sum_n W A_bar^lag, with A_bar^lag = exp(lag log A_bar) (a Vandermonde product).

        The reference path takes the powers as a running product instead (same numbers, no log).
        """
        A_bar, W = self.diag_modes()                                                # (h, n/2) each
        if self.reference:
            powers = torch.cumprod(A_bar[..., None].expand(*A_bar.shape, length), dim=-1) / A_bar[..., None]
        else:
            lags = torch.arange(length, device=A_bar.device, dtype=self.log_dt.dtype)
            powers = torch.exp(torch.log(A_bar)[..., None] * lags)                  # (h, n/2, l)
        return 2 * torch.einsum("hn,hnl->lh", W, powers).real                       # (l, h)

    def mix(self, x):
        b, l, d = x.shape
        h, m = self.n_heads, self.head_dim
        q = self.hook_q(self.q_proj(x))                                             # (b, l, d)
        k = self.hook_k(self.k_proj(x))
        v = self.hook_v(self.v_proj(x))
        shift_kernel = self.hook_shift_kernel(self.shift_kernel(l))                 # (l, d)
        shift_out = self.hook_shift_out(long_conv(k, shift_kernel, reference=self.reference))
        k_tilde = self.hook_k_tilde(shift_out + self.shift_D * k)                   # (b, l, d)
        # Channel c = head*m + i (head outer). z[h, i, j] = k~_{h,i} v_{h,j}: m*m signals per head.
        kv = self.hook_kv(k_tilde.view(b, l, h, m, 1) * v.view(b, l, h, 1, m))      # (b, l, h, m, m)
        ssm_kernel = self.hook_ssm_kernel(self.ssm_kernel(l))                       # (l, h)
        per_signal = ssm_kernel[:, :, None].expand(l, h, m * m).reshape(l, h * m * m)  # one kernel per head
        w = long_conv(kv.reshape(b, l, h * m * m), per_signal, reference=self.reference).view(b, l, h, m, m)
        w = self.hook_ssm_out(w + self.diag_D[:, None, None] * kv)                  # (b, l, h, m, m)
        o = torch.einsum("blhi,blhij->blhj", q.view(b, l, h, m), w)                 # read out with the query
        y = self.hook_y(o.transpose(2, 3).reshape(b, l, d))  # (b,l,h,m) -> (b,l,m,h) -> (b,l,d): channel j*H+h
        return self.output_linear(y)

    def init_state(self, batch, device=None, dtype=None):
        """Recurrent state: the shift register (b, d, n) and the diagonal SSM's modes (b, h, m, m, n/2), complex."""
        d, n, h, m = self.shift_B.shape[0], self.d_state, self.n_heads, self.head_dim
        dtype = dtype or self.shift_B.dtype
        complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
        return {"shift": torch.zeros(batch, d, n, device=device, dtype=dtype),
                "diag": torch.zeros(batch, h, m, m, n // 2, device=device, dtype=complex_dtype)}

    def step(self, x_t, state):
        """One token: x_t (b, d) -> (y_t (b, d), next state). Hooks are not applied in step mode.

        Shift SSM: state <- down-shift(state) + B^s k_t, shift_out = sum_n C^s state.
        Diagonal SSM, per mode: state <- A_bar state + z_t, w = 2 Re sum_n W state + D^d z_t.
        """
        b, d = x_t.shape
        h, m = self.n_heads, self.head_dim
        q, k, v = self.q_proj(x_t), self.k_proj(x_t), self.v_proj(x_t)                # (b, d)
        shift = F.pad(state["shift"][..., :-1], (1, 0)) + self.shift_B * k[..., None]  # (b, d, n)
        k_tilde = (self.shift_C * shift).sum(-1) + self.shift_D * k                    # (b, d)
        kv = k_tilde.view(b, h, m, 1) * v.view(b, h, 1, m)                             # (b, h, m, m)
        A_bar, W = self.diag_modes()                                                   # (h, n/2)
        diag = A_bar[:, None, None] * state["diag"] + kv[..., None]                    # (b, h, m, m, n/2)
        w = 2 * (W[:, None, None] * diag).sum(-1).real + self.diag_D[:, None, None] * kv  # (b, h, m, m)
        o = torch.einsum("bhi,bhij->bhj", q.view(b, h, m), w)                          # (b, h, m)
        y = o.transpose(1, 2).reshape(b, d)                                            # channel j*H + h
        return self.output_linear(y), {"shift": shift, "diag": diag}


# ----------------------------------------------------------------------------------------------
# DeltaNet (ARCHITECTURES.md §3.7; defaults of §7.8: 1 head, K=4 convs, beta on, no gate)
# ----------------------------------------------------------------------------------------------

def l2_normalize(x, eps=1e-6):
    """x / sqrt(|x|^2 + eps) over the last dim (fla's qk_norm='l2')."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def delta_rule_step(state, q_t, k_t, v_t, beta_t):
    """One delta-rule update. state (b, h, k, k); q_t, k_t, v_t (b, h, k); beta_t (b, h)."""
    retrieved = torch.einsum("bhkv,bhk->bhv", state, k_t)                          # S^T k_t
    state = state + beta_t[..., None, None] * torch.einsum("bhk,bhv->bhkv", k_t, v_t - retrieved)
    o_t = torch.einsum("bhkv,bhk->bhv", state, q_t) / math.sqrt(k_t.shape[-1])
    return o_t, state


def delta_rule_recurrent(q, k, v, beta):
    """Reference delta rule, a loop over tokens. q, k, v (b, l, h, k), beta (b, l, h).

    S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T   (write: move S^T k_t towards v_t),
    o_t = S_t^T q_t / sqrt(d_k)                          (read after the write).
    Returns o (b, l, h, k).
    """
    b, l, h, dk = k.shape
    state = k.new_zeros(b, h, dk, v.shape[-1])                                     # S_{-1} = 0: (b, h, k, k)
    outputs = []
    for q_t, k_t, v_t, beta_t in zip(q.unbind(1), k.unbind(1), v.unbind(1), beta.unbind(1)):
        o_t, state = delta_rule_step(state, q_t, k_t, v_t, beta_t)
        outputs.append(o_t)
    return torch.stack(outputs, dim=1)


def delta_rule_parallel(q, k, v, beta):
    """The same outputs as delta_rule_recurrent with no loop over tokens.

    Write S_t = sum_{j<=t} k_j u_j^T. The update says u_t = beta_t (v_t - S_{t-1}^T k_t)
    = beta_t v_t - beta_t sum_{j<t} (k_t . k_j) u_j, i.e. the unit lower-triangular system
    (I + strict_tril(diag(beta) K K^T)) U = diag(beta) V, one triangular solve per head.
    Then o_t = sum_{j<=t} (q_t . k_j) u_j / sqrt(d_k) = tril(Q K^T) U / sqrt(d_k).
    """
    dk = k.shape[-1]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))                               # (b, h, l, k)
    beta = beta.transpose(1, 2)[..., None]                                         # (b, h, l, 1)
    gram = k @ k.transpose(-1, -2)                                                 # (b,h,l,k) @ (b,h,k,l) -> (b,h,l,l)
    system = torch.tril(beta * gram, diagonal=-1)      # the solver reads a unit diagonal, so 0 here is fine
    u = torch.linalg.solve_triangular(system, beta * v, upper=False, unitriangular=True)  # (b, h, l, k)
    scores = torch.tril(q @ k.transpose(-1, -2))                                   # (b, h, l, l): q_t . k_j, j <= t
    return (scores @ u / math.sqrt(dk)).transpose(1, 2)                            # (b, h, l, k) -> (b, l, h, k)


class DeltaNet(Mixer):
    """DeltaNet (zoology's fla DeltaNet, defaults of ARCHITECTURES.md §7.8).

    q, k, v = SiLU(SC_4(x W)) each; q, k L2-normalised per head; beta = sigmoid(x W_beta) per head;
    the delta rule (delta_rule_recurrent); per-head RMSNorm with one weight shared by the heads; W_o.
    The short convs give each key and value a view of the previous tokens, the delta rule stores and
    retrieves key -> value associations. mix() uses delta_rule_parallel, or the loop when reference.
    d_conv sets the conv size (default 4; 0 removes the three convs, an ablation like Mamba's).
    """

    INTERNAL_SITES = ["hook_k", "hook_v", "hook_o"]

    def __init__(self, d_model, layer_idx=0, n_layers=2, reference=False, *, n_heads=1, d_conv=None,
                 **options):
        super().__init__(reference)  # options meant for other mixers are ignored
        d, h = d_model, n_heads
        if d % h:
            raise ValueError(f"DeltaNet: d_model={d} is not divisible by n_heads={h}")
        if not (d_conv is None or (isinstance(d_conv, int) and d_conv >= 0)):
            raise ValueError(f"DeltaNet: d_conv must be None or an int >= 0 (0 removes the convs); got {d_conv!r}")
        self.n_heads, self.conv_size = h, 4 if d_conv is None else d_conv
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.b_proj = nn.Linear(d, h, bias=False)
        if self.conv_size > 0:  # weights only, applied by short_conv; torch-default init U(+-1/sqrt(K))
            self.q_conv = nn.Conv1d(d, d, self.conv_size, groups=d, bias=False)
            self.k_conv = nn.Conv1d(d, d, self.conv_size, groups=d, bias=False)
            self.v_conv = nn.Conv1d(d, d, self.conv_size, groups=d, bias=False)
        self.o_norm = RMSNorm(d // h)                          # per head, one weight shared by the heads
        self.o_proj = nn.Linear(d, d, bias=False)              # not down-scaled by the init pass (§2.6)
        self.hook_q = HookPoint()     # (b, l, h, k): after conv, SiLU and L2 norm
        self.hook_k = HookPoint()     # (b, l, h, k): after conv, SiLU and L2 norm
        self.hook_v = HookPoint()     # (b, l, h, k): after conv and SiLU
        self.hook_beta = HookPoint()  # (b, l, h): write strength
        self.hook_o = HookPoint()     # (b, l, h, k): delta-rule readout, before the RMSNorm

    def _convs(self):
        return (self.q_conv, self.k_conv, self.v_conv) if self.conv_size > 0 else (None, None, None)

    def _heads(self, q, k, v, beta):
        """(..., d) -> (..., h, k), L2 norm on q and k; beta logits -> sigmoid."""
        h = self.n_heads
        q, k, v = (t.unflatten(-1, (h, -1)) for t in (q, k, v))
        return l2_normalize(q), l2_normalize(k), v, torch.sigmoid(beta)

    def _norm_out(self, o):
        """Per-head RMSNorm (eps 1e-5), heads concatenated, then W_o. o (..., h, k) -> (..., d)."""
        return self.o_proj(self.o_norm(o).flatten(-2))

    def mix(self, x):
        b, l, d = x.shape
        features, conv_fn = [], short_conv_reference if self.reference else short_conv
        for proj, conv in zip((self.q_proj, self.k_proj, self.v_proj), self._convs()):
            z = proj(x)                                                                 # (b, l, d)
            features.append(F.silu(conv_fn(z, conv.weight) if conv is not None else z))
        q, k, v, beta = self._heads(*features, self.b_proj(x))                          # (b, l, h, k), (b, l, h)
        q, k, v, beta = self.hook_q(q), self.hook_k(k), self.hook_v(v), self.hook_beta(beta)
        delta_rule = delta_rule_recurrent if self.reference else delta_rule_parallel
        o = self.hook_o(delta_rule(q, k, v, beta))                                      # (b, l, h, k)
        return self._norm_out(o)                                                        # (b, l, d)

    def init_state(self, batch, device=None, dtype=None):
        """Recurrent state: S (b, h, k, k) and the last K-1 projected inputs of each conv (b, K-1, d)."""
        d, h = self.o_proj.in_features, self.n_heads
        dtype = dtype or self.o_proj.weight.dtype
        state = {"S": torch.zeros(batch, h, d // h, d // h, device=device, dtype=dtype)}
        for name in ("q", "k", "v"):
            state[name] = torch.zeros(batch, max(self.conv_size - 1, 0), d, device=device, dtype=dtype)
        return state

    def step(self, x_t, state):
        """One token: x_t (b, d) -> (y_t (b, d), next state). Hooks are not applied in step mode."""
        next_state, features = {}, []
        for name, proj, conv in zip("qkv", (self.q_proj, self.k_proj, self.v_proj), self._convs()):
            z = proj(x_t)                                                               # (b, d)
            if conv is not None:
                window = torch.cat([state[name], z[:, None]], dim=1)                    # (b, K, d), oldest first
                next_state[name] = window[:, 1:]
                z = (window * conv.weight[:, 0].T).sum(1)  # tap K-1 hits the current token, as in short_conv
            else:
                next_state[name] = state[name]
            features.append(F.silu(z))
        q, k, v, beta = self._heads(*features, self.b_proj(x_t))                        # (b, h, k), (b, h)
        o, next_state["S"] = delta_rule_step(state["S"], q, k, v, beta)                # (b, h, k)
        return self._norm_out(o), next_state


models.MIXER_CLASSES.update(hyena=Hyena, h3=H3, deltanet=DeltaNet)
