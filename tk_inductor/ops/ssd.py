"""`tk::ssd`: Mamba-2 state-space duality (SSD) scan.

Per batch and head, with x (b, l, nh, p), dt (b, l, nh) (already biased / softplus-ed / clamped),
A (nh,), B and C (b, l, ng, n) (head h reads group h // (nh / ng), as mamba_ssm and HF Mamba2),
optional D (nh,) and optional initial state h_0 (b, nh, p, n):

    h_t = exp(dt_t · A) h_{t-1} + dt_t · x_t B_tᵀ          (h_t is (p, n))
    y_t = h_t C_t + D x_t

Returns (y, final_state): y (b, l, nh, p) contiguous in x's dtype, final_state = h_l (b, nh, p, n)
contiguous fp32 (fp64 for fp64 inputs, reference only). Everything is computed in fp32 (inputs are upcast), as HF's torch path and
mamba_ssm's `ssd_minimal_discrete` do.

The reference is the chunked SSD algorithm (chunk `chunk_size`, default 64): intra-chunk
"attention" with the decay matrix exp(segsum(dt·A)), per-chunk states, a sequential inter-chunk
recurrence of the states (the kernel keeps that state in registers) and the state→output term.
`chunk_size` does not change the result beyond rounding; kernels may use their own.
Non-finite inputs: in the reference a NaN/inf at position t reaches only outputs from t on (as in the recurrence).
The CUDA kernels keep that across their 64-position chunks; inside a chunk it can reach earlier outputs through
the tile product with masked-out (zero) decays, as it does in mamba_ssm's kernels and HF's chunked torch path.
Autograd: `tk::ssd_backward` returns (dx, ddt, dA, dB, dC, dD, dinitial_state), the optional ones as
empty tensors when absent: the CUDA kernels scan the chunks forwards (dC) and backwards (dX, dB, dh0) and the
binding forms the rest; the reference recomputes the forward and differentiates it.
"""
from __future__ import annotations


import torch

from . import _dispatch, _state_parts
from ._state_parts import Axes

FAMILY = "ssd"

# The CUDA kernels (csrc/kernels/ssd/ssd.cu, ssd_backward.cu) compute with bf16 tensor-core products and fp32 states
# (inputs in other dtypes are converted by their binding). They hold state sizes n 16, 32, 64 or 128 and head dims p
# that are multiples of 64; the op runs other n, and p a multiple of 32, as parts of those (_state_parts.py).
# The backward kernels (csrc/kernels/ssd/ssd_backward.cu) are validated on the GPU by tests/test_ssd_gpu.py.
# False: the backward op and the matcher fall back to the reference (while a changed kernel awaits its GPU run).
BACKWARD_KERNEL_VALIDATED = True


def kernel_supports(n, p) -> str | None:
    """None if the CUDA kernels compute this state size and head dim, else why not (also used by the matcher)."""
    return _state_parts.supports(n, p)


# How the raw ops' arguments and outputs split when the state runs in parts (_state_parts.py): D·x goes to one part.
FORWARD_PARTS = _state_parts.Plan(
    cut={0: Axes(p=-1), 3: Axes(n=-1), 4: Axes(n=-1), 6: Axes(n=-1, p=-2)}, once=(5,),
    outs=(("sum", Axes(p=-1)), ("cat", Axes(n=-1, p=-2))))
BACKWARD_PARTS = _state_parts.Plan(
    cut={0: Axes(p=-1), 1: Axes(n=-1, p=-2), 2: Axes(p=-1), 5: Axes(n=-1), 6: Axes(n=-1), 8: Axes(n=-1, p=-2)},
    once=(7,),
    outs=(("sum", Axes(p=-1)), ("sum", Axes()), ("sum", Axes()), ("cat", Axes(n=-1)), ("cat", Axes(n=-1)),
          ("first", Axes()), ("cat", Axes(n=-1, p=-2))))


def _acc(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _validate(x, dt, A, B, C, D, initial_state, chunk_size) -> None:
    check = _dispatch.check
    named = [("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("initial_state", initial_state)]
    for name, t in named:
        if t is None and name in ("D", "initial_state"):
            continue
        check(isinstance(t, torch.Tensor), lambda: f"tk::ssd: {name} must be a tensor", TypeError)
        check(t.dtype in _dispatch.FLOATS, lambda: f"tk::ssd: {name} dtype {t.dtype} is not a float type", TypeError)
        check(t.device == x.device, lambda: f"tk::ssd: {name} is on {t.device}, x on {x.device}")
    check(x.dim() == 4, lambda: f"tk::ssd: x must be (b, l, nh, p), got shape {tuple(x.shape)}")
    b, l, nh, p = x.shape
    check(dt.shape == (b, l, nh), lambda: f"tk::ssd: dt must be (b, l, nh) = {(b, l, nh)}, got {tuple(dt.shape)}")
    check(A.shape == (nh,), lambda: f"tk::ssd: A must be (nh,) = ({nh},), got {tuple(A.shape)}")
    check(B.dim() == 4 and B.shape[:2] == (b, l),
          lambda: f"tk::ssd: B must be (b, l, ng, n) with (b, l) = {(b, l)}, got {tuple(B.shape)}")
    check(C.shape == B.shape, lambda: f"tk::ssd: C {tuple(C.shape)} must have B's shape {tuple(B.shape)}")
    ng, n = B.shape[2], B.shape[3]
    check(ng >= 1 and nh % ng == 0, lambda: f"tk::ssd: nh={nh} must be a multiple of the group count ng={ng}")
    if D is not None:
        check(D.shape == (nh,), lambda: f"tk::ssd: D must be (nh,) = ({nh},), got {tuple(D.shape)}")
    if initial_state is not None:
        check(initial_state.shape == (b, nh, p, n),
              lambda: f"tk::ssd: initial_state must be (b, nh, p, n) = {(b, nh, p, n)}, "
                      f"got {tuple(initial_state.shape)}")
    check(isinstance(chunk_size, int) and chunk_size >= 1,
          lambda: f"tk::ssd: chunk_size must be a positive int, got {chunk_size}")


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """[..., i, j] = Σ_{j<t≤i} a[..., t] for i ≥ j, -inf above the diagonal (masked cumsum, no
    difference of large cumulative sums)."""
    T = a.shape[-1]
    lower = torch.ones(T, T, dtype=torch.bool, device=a.device).tril(-1)
    seg = a.unsqueeze(-1).expand(*a.shape, T).masked_fill(~lower, 0.0).cumsum(dim=-2)
    return seg.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=a.device).tril(), float("-inf"))


def chunked_scan(X, a, B, C, h0=None, chunk_size: int = 64):
    """The chunked scan behind the SSD and simple GLA, in X's dtype: per batch and head,
    h_t = exp(a_t) h_{t-1} + X_t B_tᵀ and y_t = h_t C_t, from h_0 (zero when None). X (b, l, nh, p), a (b, l, nh),
    B and C (b, l, nh, n), h0 (b, nh, p, n); returns y (b, l, nh, p) and h_l (b, nh, p, n). Differentiable (the
    references' backward is its autograd)."""
    b, l, nh, p = X.shape
    n = B.shape[-1]
    # The result does not depend on the chunk length: a chunk longer than the sequence only pads it, and the decay
    # matrices grow with its square.
    chunk_size = max(1, min(chunk_size, l))
    pad = (-l) % chunk_size  # zero padding at the end: no decay, no input, so h_l is unchanged
    nc = (l + pad) // chunk_size

    def chunks(t):
        t = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(b, nc, chunk_size, *t.shape[2:])

    Xc = chunks(X)  # (b, c, l, h, p)
    a = chunks(a).permute(0, 3, 1, 2)  # (b, h, c, l)
    Bc, Cc = chunks(B), chunks(C)  # (b, c, l, h, n)
    a_cum = a.cumsum(dim=-1)

    # 1. within each chunk: y = (C Bᵀ ∘ decay) X
    decay = torch.exp(_segsum(a))  # (b, h, c, l, s)
    y = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Cc, Bc, decay, Xc)
    # 2. each chunk's own contribution to the state at its end
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # (b, h, c, l)
    chunk_states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bc, to_end, Xc)
    # 3. inter-chunk recurrence, batched over chunks (no loop: the backward runs this as its autograd): the state
    #    at the start of chunk z is Σ_{c<z} (the decay from chunk c's end to z's start) · chunk c's contribution,
    #    with the initial state as a contribution "before chunk 0"
    h0 = X.new_zeros(b, nh, p, n) if h0 is None else h0
    contributions = torch.cat([h0.unsqueeze(1), chunk_states], dim=1)  # (b, c + 1, h, p, n)
    chunk_log_decay = torch.nn.functional.pad(a_cum[..., -1], (1, 0))  # (b, h, c + 1): nothing before chunk 0
    between = torch.exp(_segsum(chunk_log_decay))  # (b, h, z, c): contribution c's decay up to chunk z's start
    states = torch.einsum("bhzc,bchpn->bzhpn", between, contributions)  # state at the start of each chunk, + final
    starts, state = states[:, :-1], states[:, -1]
    # 4. the state at each chunk start, decayed to each position and read out through C
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", Cc, starts, torch.exp(a_cum))
    return y.reshape(b, nc * chunk_size, nh, p)[:, :l], state


def ssd_reference(x, dt, A, B, C, D=None, initial_state=None, chunk_size: int = 64):
    """Chunked SSD in fp32 (differentiable; the backward reference is its autograd)."""
    b, l, nh, p = x.shape
    heads_per_group = nh // B.shape[2]
    acc = _acc(x)
    x32, dt32 = x.to(acc), dt.to(acc)
    Bh = B.to(acc).repeat_interleave(heads_per_group, dim=2)
    Ch = C.to(acc).repeat_interleave(heads_per_group, dim=2)
    # Non-finite inputs reach only later positions (_dispatch.nan_from): x, dt, B enter the state, C one output.
    feeds = ~(x32.isfinite().all(-1) & dt32.isfinite() & Bh.isfinite().all(-1))  # (b, l, nh)
    reads = ~Ch.isfinite().all(-1)  # (b, l, nh)
    x32, dt32 = x32.masked_fill(feeds[..., None], 0.0), dt32.masked_fill(feeds, 0.0)
    Bh, Ch = Bh.masked_fill(feeds[..., None], 0.0), Ch.masked_fill(reads[..., None], 0.0)
    h0 = None if initial_state is None else initial_state.to(acc)
    y, state = chunked_scan(x32 * dt32.unsqueeze(-1), dt32 * A.to(acc), Bh, Ch, h0, chunk_size)
    if D is not None:
        y = y + D.to(acc)[:, None] * x32
    y = y + _dispatch.nan_from(feeds, reads, 1, acc)[..., None]
    if l:
        state = state + _dispatch.nan_from(feeds, None, 1, acc)[:, -1, :, None, None]
    return y.to(x.dtype).contiguous(), state.contiguous()


def ssd_recurrence(x, dt, A, B, C, D=None, initial_state=None):
    """The plain sequential recurrence, token by token in fp32 (the ground truth for tests)."""
    b, l, nh, p = x.shape
    ng, n = B.shape[2], B.shape[3]
    acc = _acc(x)
    Bh = B.to(acc).repeat_interleave(nh // ng, dim=2)
    Ch = C.to(acc).repeat_interleave(nh // ng, dim=2)
    x32, dt32, A32 = x.to(acc), dt.to(acc), A.to(acc)
    h = x32.new_zeros(b, nh, p, n) if initial_state is None else initial_state.to(acc)
    ys = []
    for t in range(l):
        dA = torch.exp(dt32[:, t] * A32)  # (b, h)
        h = dA[..., None, None] * h + (dt32[:, t, :, None] * x32[:, t])[..., None] * Bh[:, t, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", h, Ch[:, t])
        if D is not None:
            y = y + D.to(acc)[:, None] * x32[:, t]
        ys.append(y)
    y = torch.stack(ys, dim=1) if ys else x32.new_zeros(b, 0, nh, p)
    return y.to(x.dtype), h


# ---------------------------------------------------------------------------- the ops

# Explicit schemas: the contract `tk_cuda::` kernels register verbatim (a plain `int` chunk size, not
# the SymInt that inference would give).
SCHEMA = ("(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D=None, Tensor? initial_state=None, "
          "int chunk_size=64) -> (Tensor, Tensor)")
BACKWARD_SCHEMA = ("(Tensor grad_y, Tensor grad_state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, "
                   "Tensor? initial_state, int chunk_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


@torch.library.custom_op("tk::ssd", mutates_args=(), schema=SCHEMA)
def ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
        D: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
        chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    _validate(x, dt, A, B, C, D, initial_state, chunk_size)
    if x.dtype != torch.float64 and kernel_supports(B.shape[-1], x.shape[-1]) is None \
            and _dispatch.use_kernel(FAMILY, x, dt, A, B, C, D, initial_state):
        return _state_parts.run(_dispatch.kernel("ssd"), (x, dt, A, B, C, D, initial_state, chunk_size),
                                B.shape[-1], x.shape[-1], FORWARD_PARTS)
    return ssd_reference(x, dt, A, B, C, D, initial_state, chunk_size)


@ssd.register_fake
def _(x, dt, A, B, C, D=None, initial_state=None, chunk_size=64):
    _validate(x, dt, A, B, C, D, initial_state, chunk_size)
    b, l, nh, p = x.shape
    return x.new_empty(x.shape), x.new_empty((b, nh, p, B.shape[3]), dtype=_acc(x))


@torch.library.custom_op("tk::ssd_backward", mutates_args=(), schema=BACKWARD_SCHEMA)
def ssd_backward(grad_y: torch.Tensor, grad_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                 A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
                 initial_state: torch.Tensor | None, chunk_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, ddt, dA, dB, dC, dD, dinitial_state); dD / dinitial_state are empty without D / initial_state."""
    _validate(x, dt, A, B, C, D, initial_state, chunk_size)
    b, l, nh, p = x.shape
    state_shape = (b, nh, p, B.shape[3])
    _dispatch.check_grad("tk::ssd_backward", "grad_y", grad_y, x.shape, "x's shape")
    _dispatch.check_grad("tk::ssd_backward", "grad_state", grad_state, state_shape, "the state's shape")
    if BACKWARD_KERNEL_VALIDATED and x.dtype != torch.float64 and kernel_supports(B.shape[-1], x.shape[-1]) is None \
            and _dispatch.use_kernel(FAMILY, grad_y, x, dt, A, B, C, D, initial_state) \
            and _dispatch.has_kernel("ssd_backward"):
        return _state_parts.run(_dispatch.kernel("ssd_backward"),
                                (grad_y, grad_state, x, dt, A, B, C, D, initial_state, chunk_size),
                                B.shape[-1], x.shape[-1], BACKWARD_PARTS)
    return _reference_grads(grad_y, grad_state, x, dt, A, B, C, D, initial_state, chunk_size)


def _reference_grads(grad_y, grad_state, x, dt, A, B, C, D, initial_state, chunk_size):
    """The reference's gradients, (dx, ddt, dA, dB, dC, dD, dinitial_state), absent ones empty."""
    grads = _dispatch.reference_vjp(lambda *t: ssd_reference(*t, chunk_size), (x, dt, A, B, C, D, initial_state),
                                    (grad_y, grad_state))
    return tuple(x.new_empty(0) if g is None else g for g in grads)


@ssd_backward.register_fake
def _(grad_y, grad_state, x, dt, A, B, C, D, initial_state, chunk_size):
    return tuple(x.new_empty(0) if t is None else t.new_empty(t.shape) for t in (x, dt, A, B, C, D, initial_state))


def _setup_context(ctx, inputs, output):
    x, dt, A, B, C, D, initial_state, chunk_size = inputs
    ctx.save_for_backward(x, dt, A, B, C, D, initial_state)
    ctx.chunk_size = chunk_size
    ctx.state_shape = output[1].shape


def _backward(ctx, grad_y, grad_state):
    x, dt, A, B, C, D, initial_state = ctx.saved_tensors
    if grad_y is None:
        grad_y = torch.zeros_like(x)
    if grad_state is None:
        grad_state = x.new_zeros(ctx.state_shape, dtype=_acc(x))
    dx, ddt, dA, dB, dC, dD, dinit = torch.ops.tk.ssd_backward(
        grad_y.contiguous(), grad_state.contiguous(), x, dt, A, B, C, D, initial_state, ctx.chunk_size)
    return dx, ddt, dA, dB, dC, dD if D is not None else None, dinit if initial_state is not None else None, None


ssd.register_autograd(_backward, setup_context=_setup_context)
