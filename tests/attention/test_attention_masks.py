"""Attention family: masks. Masks known only at run time (checked by value), masks made by another graph (proven),
the mask prover on unit graphs and random masks, and tk::attention_masked."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tk_inductor
from tk_inductor.ops import attention_masked as A
from tk_inductor.patterns import attention as P

from attention_helpers import OPTS, _check, _qkv, _compile, _kept, _inputs, Fn, _kernel_built

# ---------------------------------------------------------------------------- masks known only at run time

def _sdpa_sliced_mask(q, k, v, m):  # transformers slices the mask handed to each layer to the key length
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m[..., : k.shape[-2]])


def _eager_added_mask(q, k, v, m):
    s = (q @ k.transpose(-1, -2)) * 0.25 + m
    return F.softmax(s.float(), dim=-1).to(q.dtype) @ v


def _eager_capped_added_mask(q, k, v, m):  # Gemma-2's eager attention: capped scores, then the mask
    s = torch.tanh((q @ k.transpose(-1, -2)) * 0.25 / 0.7) * 0.7 + m
    return F.softmax(s.float(), dim=-1).to(q.dtype) @ v


def _masks(n: int, m: int) -> dict:
    causal = torch.ones(n, m, dtype=torch.bool).tril()
    pad = causal.clone()
    pad[:, 0] = False
    pad[:, 1] = True  # no empty rows
    neg = torch.finfo(torch.float32).min
    window = causal & ~torch.ones(n, m, dtype=torch.bool).tril(-3)  # i - 3 < j <= i
    return {"causal": causal, "full": torch.ones(n, m, dtype=torch.bool), "padding": pad, "window": window,
            "window_additive": torch.zeros(n, m).masked_fill(~window, neg),
            "random": torch.rand(n, m) > 0.3,
            "causal_additive": torch.zeros(n, m).masked_fill(~causal, neg),
            "padding_additive": torch.zeros(n, m).masked_fill(~pad, neg), "bias": torch.randn(n, m)}


@pytest.mark.parametrize("form", ["sdpa", "eager", "eager_softcap"])
@pytest.mark.parametrize("kind", ["causal", "full", "padding", "random", "causal_additive", "padding_additive", "bias",
                                  "window", "window_additive"])
def test_graph_input_mask_checked_at_run_time(form, kind):
    """A mask handed into the graph (DDP/FSDP graph splits, per-layer compile) goes to tk::attention_masked,
    which equals the original graph, forward and gradients, whatever the mask's values (softcapped scores too)."""
    mask = _masks(8, 8)[kind]
    if form != "sdpa" and mask.dtype == torch.bool:
        pytest.skip("eager attention adds float masks")
    fn = {"sdpa": _sdpa_sliced_mask, "eager": _eager_added_mask, "eager_softcap": _eager_capped_added_mask}[form]
    qkv = [x.requires_grad_() for x in _inputs()]
    out = _compile(Fn(fn))(*qkv, mask)
    assert tk_inductor.report().replaced == {"attention": 1}, str(tk_inductor.report())
    ref = fn(*qkv, mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((out * w).sum(), qkv), torch.autograd.grad((ref * w).sum(), qkv)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _written_zeros(N):  # zeros, then the second half of the keys hidden in place
    mask = torch.zeros(N, N)
    mask[:, N // 2:] = torch.finfo(torch.float32).min
    return mask


def _written_tril(N):  # causal, then the first two keys hidden in place through a view
    mask = torch.ones(N, N, dtype=torch.bool).tril()
    mask[:, :2].fill_(False)
    return mask


def _written_full(N):  # the finite fill, then HF's older causal masks: masked_fill_ of the allowed part to 0
    mask = torch.full((N, N), torch.finfo(torch.float32).min)
    idx = torch.arange(N)
    mask.masked_fill_(idx[None, :] <= idx[:, None], 0.0)
    return mask


@pytest.mark.parametrize("build", [_written_zeros, _written_tril, _written_full])
@pytest.mark.parametrize("form", ["sdpa", "eager"])
def test_mask_written_in_place_kept(build, form):
    """A mask the graph writes in place holds other values than the op that made it (zeros, ones.tril(), a full
    fill): kept with the reason, never proven from the op that made it."""
    def fn(q, k, v):
        mask = build(q.shape[2])
        if form == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        fill = torch.finfo(torch.float32).min
        bias = mask if mask.dtype != torch.bool else torch.zeros(mask.shape).masked_fill(~mask, fill)
        return (q @ k.transpose(-1, -2) * 0.25 + bias).softmax(-1) @ v

    reasons = _kept(Fn(fn), *_inputs())
    assert any("written in place" in r for r in reasons), reasons


def _blocks_mask(N, blocks, bool_mask=False, gap=False):
    """Pixtral's block mask: a full fill, then each block of positions written visible in place."""
    mask = torch.full((N, N), False) if bool_mask else torch.full((N, N), torch.finfo(torch.float32).min)
    start = 0
    for n in blocks:
        if not (gap and start):  # gap: the second block left hidden
            mask[start:start + n, start:start + n] = True if bool_mask else 0
        start += n
    return mask[None, None].expand(2, 1, -1, -1)


@pytest.mark.parametrize("bool_mask", [False, True])
def test_static_blocks_written_in_place_are_packed_sequences(bool_mask):
    """Images packed in one sequence (Pixtral): a block-diagonal mask written in place from a full fill runs as
    packed sequences with static ids (tk::attention_varlen), forward and backward equal to eager."""
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_blocks_mask(q.shape[2], (3, 4, 1), bool_mask))

    q, k, v = (t.requires_grad_() for t in _inputs())
    _check(Fn(fn), q, k, v, replaced=1, grad=True)


@pytest.mark.parametrize("gap", [True, False])
def test_static_blocks_that_do_not_tile_kept(gap):
    """Blocks that leave a position hidden, or writes that are not a block of the diagonal, are kept."""
    def fn(q, k, v):
        if gap:
            mask = _blocks_mask(q.shape[2], (3, 4, 1), gap=True)
        else:
            mask = torch.full((8, 8), torch.finfo(torch.float32).min)
            mask[0:4, 0:4] = 0
            mask[4:8, 0:8] = 0  # the last rows see every key
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    reasons = _kept(Fn(fn), *_inputs())
    assert any("written in place" in r for r in reasons), reasons


def test_hf_pixtral_images_in_one_sequence():
    """HF Pixtral's vision encoder on several images: their patches in one sequence under a block mask."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.PixtralVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=64, patch_size=16, head_dim=16,
                                           attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.PixtralVisionModel(cfg).train()
    imgs, sizes = torch.randn(3, 3, 64, 64), torch.tensor([[64, 32], [32, 64], [48, 48]])
    _check(Fn(lambda x: model(x, image_sizes=sizes).last_hidden_state), imgs, replaced=2, grad=True)


def test_learned_bias_input_kept():
    bias = torch.randn(4, 8, 8, requires_grad=True)
    assert "requires grad" in _kept(Fn(_eager_added_mask), *_inputs(), bias)[0]


def test_mask_kind():
    masks = _masks(5, 7)
    kinds = {name: A.mask_kind(m, 5, 7) for name, m in masks.items()}
    runs = {name: kinds.pop(name) for name in ("padding", "padding_additive")}  # one run of keys per row
    assert all(isinstance(t, A._varlen.Intervals) for t in runs.values())
    assert runs["padding"].row_keys.tolist() == [[[1, 1], [1, 1], [1, 2], [1, 3], [1, 4]]]
    assert kinds == {"causal": "causal", "full": "full", "random": None, "window": 3, "window_additive": 3,
                     "causal_additive": "causal", "bias": None}
    assert A.mask_kind(masks["window"][:2], 2, 7) == "causal"  # two rows of a window of 3: plain causal there
    # rows 3 and 4 see one key and no key of these two: interval tables for a bool mask, SDPA for an additive one
    assert A.mask_kind(masks["window"][:, :2], 5, 2).row_keys[0, 3:].tolist() == [[1, 1], [0, -1]]
    assert A.mask_kind(masks["window_additive"][:, :2], 5, 2) is None
    # broadcast views, leading dims, and an in-place change after the answer was cached
    m = masks["causal"][None, None].expand(3, 4, 5, 7)
    assert A.mask_kind(m, 5, 7) == "causal"
    owner = masks["causal"].clone()
    assert A.mask_kind(owner[None, None], 5, 7) == "causal"
    owner[4, 2] = False  # a hole, not a window
    assert A.mask_kind(owner[None, None], 5, 7) is None
    assert A.mask_kind(masks["causal_additive"] * 0.5, 5, 7) == "causal"  # still 0 / <= fp16 min
    assert A.mask_kind(masks["causal_additive"] / 1e35, 5, 7) is None  # hidden values too mild


@pytest.mark.parametrize("B", [1, 3])
def test_mask_kind_row_intervals(B):
    """A run-time mask whose rows each see one run of keys (a static KV cache's decode mask: keys up to the position,
    after left padding; its prefill, whose padded rows see no key) becomes the kernels' interval tables: each query's
    keys, and each key's queries exactly as the mask says (a key's range may span rows without keys, which the
    kernels give P = 0); a hole, runs that move backwards, heads that differ, or a row without keys in an additive
    mask (eager softmax averages every key there) leave it to SDPA."""
    N, M = 5, 9
    start = torch.tensor([0, 2, 3])[:B]
    pos = torch.tensor([3, 4, 6, 6, 8])  # the last visible key of each query row, nondecreasing
    j = torch.arange(M)
    mask = (j >= start[:, None, None]) & (j <= pos[None, :, None])  # (B, N, M)
    empty = mask.clone()
    empty[:, 0] = False  # left padding's prefill: the first rows see no key
    empty[:, 2] = False  # and one between rows whose runs overlap
    for m in (mask, empty):
        tables = A.mask_kind(m[:, None], N, M, B)
        assert isinstance(tables, A._varlen.Intervals)
        first, last = tables.row_keys.long().unbind(-1)
        lo, hi = tables.key_rows.long().unbind(-1)
        for b in range(B):
            for i in range(N):
                keys = m[b, i].nonzero().flatten().tolist()
                assert ((first[b, i].item(), last[b, i].item()) == (keys[0], keys[-1]) if keys
                        else first[b, i] > last[b, i])
            seen_rows = m[b].any(-1)
            for key in range(M):
                spanned = torch.zeros(N, dtype=torch.bool)
                spanned[max(lo[b, key].item(), 0):hi[b, key].item() + 1] = True
                assert torch.equal(spanned & seen_rows, m[b, :, key])
    holed = mask.clone()
    holed[..., 3, start[0] + 1] = False
    backwards = mask.flip(1)
    heads = torch.stack((mask, mask.roll(1, -1)), 1)
    additive_empty = torch.zeros(empty.shape).masked_fill(~empty, torch.finfo(torch.float32).min)
    for other in (holed, backwards, additive_empty):
        assert A.mask_kind(other[:, None], N, M, B) is None
    assert A.mask_kind(heads, N, M, B) is None
    assert isinstance(A.mask_kind(torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)[:, None],
                                  N, M, B), A._varlen.Intervals)


def _bottom_right(q, k, v):
    N, M = q.shape[-2], k.shape[-2]
    mask = torch.arange(M)[None, :] <= torch.arange(N)[:, None] + (M - N)  # causal, aligned to the last key
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)


@pytest.mark.parametrize("grad", [False, True])
def test_mask_aligned_to_the_end_of_the_keys(grad):
    """A causal mask whose diagonal sits at a symbolic offset (M - N: new queries against a cache, dynamic shapes) is
    not a compile-time kind. In inference its values are read at run time (tk::attention_masked: its rows are runs,
    so the kernels run); in training it is kept (where the values are not runs the op's SDPA backward is slower)."""
    compiled = torch.compile(Fn(_bottom_right), backend="thunderkittens", options=OPTS, dynamic=True)
    for M in (9, 13):
        q, k, v = _qkv(2, 4, 4, 3, M, 16, grad=grad)
        with torch.set_grad_enabled(grad):
            torch.testing.assert_close(compiled(q, k, v), _bottom_right(q, k, v))
        report = tk_inductor.report()
        if grad:
            assert report.kept and "symbolic size" in report.kept[0][1], str(report)
        else:
            assert report.replaced == {"attention": 1}, str(report)
    mask = torch.arange(13)[None, :] <= torch.arange(3)[:, None] + 10
    assert isinstance(A.mask_kind(mask, 3, 13), A._varlen.Intervals)


def _fresh_paths():
    A.masked_paths.clear()
    return A.masked_paths


@pytest.mark.parametrize("make, kind", [
    (lambda q: torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).tril(), "causal"),
    (lambda q: torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).tril()[None, None]
     .expand(q.shape[0], 1, -1, -1), "causal"),
    (lambda q: torch.where(torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril(), 0.0, float("-inf")), "causal"),
    (lambda q: torch.ones(q.shape[2], q.shape[2], dtype=torch.bool), "full"),
    (lambda q: torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(), None),  # anti-causal: values decide
    (lambda q: q[0, 0] > 0, None),  # from the data
])
def test_mask_made_by_another_graph_is_proven(make, kind):
    """A mask output by one compiled graph (as across DDP's graph splits) carries its proof to the graph that
    takes it as input: its kind is known without reading its values; other outputs carry none."""
    q = _inputs()[0]
    paths = _fresh_paths()
    mask = _compile(Fn(lambda x: (make(x), x * 2)))(q)[0]
    n = q.shape[2]
    view = mask[..., :n - 1]  # transformers slices the mask to the key length
    got = A.mask_kind(view, n, n - 1)
    assert paths["proven"] == (kind is not None) and paths["value checks"] == (kind is None)
    if kind is not None:
        assert got == kind
        A._kinds.clear()
        A._proofs.clear()
        assert A.mask_kind(view, n, n - 1) == got  # the values agree with the proof


def test_mask_proof_crosses_ddp_graph_split(monkeypatch):
    """Under DDP's graph splitting (DDPOptimizer, one bucket per parameter), the mask made in one submodule
    reaches the attention of the next as an input, with its proof: its kind is known without its values."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    from tk_inductor import backend

    class TwoLayers(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, q, k, v):
            n = q.shape[2]
            mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            o = F.scaled_dot_product_attention(self.l1(q), k, v, attn_mask=mask)
            return F.scaled_dot_product_attention(self.l2(o), k, v, attn_mask=mask[..., :n])

    seen = []
    masked_path = A._masked_path

    def spy(q, k, v, mask):
        seen.append(A._proven_kind(mask, q.shape[2], k.shape[2]))
        return masked_path(q, k, v, mask)

    monkeypatch.setattr(A, "_masked_path", spy)
    tk_inductor.reset()
    torch._dynamo.reset()
    ddp = DDPOptimizer(1, lambda gm, ex: backend.thunderkittens(gm, ex, options=OPTS), first_bucket_cap=1)
    model = TwoLayers()
    q, k, v = _inputs()
    out = torch.compile(model, backend=ddp.compile_fn)(q, k, v)
    torch.testing.assert_close(out, model(q, k, v), rtol=1e-5, atol=1e-5)
    assert seen == ["causal"], seen  # the second layer's mask crossed the split, proven


def test_proven_mask_views():
    """Only views whose every plane is a top-left corner of a proven plane take the proof."""
    base = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    cases = {  # view -> taken from the proof?
        "same": (base, 6, 6, True),
        "keys sliced": (base[..., :4], 6, 4, True),
        "corner": (base[:, :, :3, :5], 3, 5, True),
        "one key": (base[..., :1], 6, 1, True),
        "heads expanded": (base.expand(2, 3, 6, 6), 6, 6, True),
        "one batch entry": (base[1:], 6, 6, False),  # another storage offset: values decide
        "rows shifted": (base[:, :, 1:], 5, 6, False),
        "transposed": (base.transpose(-1, -2), 6, 6, False),
    }
    for name, (view, n, m, proven) in cases.items():
        A._kinds.clear()
        A._proofs.clear()
        A.prove_mask(base, "causal")
        paths = _fresh_paths()
        got = A.mask_kind(view, n, m)
        assert paths["proven"] == proven, name
        A._kinds.clear()
        A._proofs.clear()
        again = A.mask_kind(view, n, m)
        if isinstance(got, A._varlen.Intervals):  # a mask of one run per row (the transposed one): compare the tables
            got, again = got.row_keys.tolist(), again.row_keys.tolist()
        assert again == got, name  # the proof never disagrees with the values
    A.prove_mask(base, "causal")
    base[..., 5, 2] = False  # changed in place after the proof: values decide
    paths = _fresh_paths()
    assert A.mask_kind(base, 6, 6) is None and paths["value checks"] == 1
    with pytest.raises(ValueError, match="kind"):
        A.prove_mask(base, "padding")


def test_attention_masked_bad_mask():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="does not broadcast"):
        torch.ops.tk.attention_masked(q, k, v, torch.ones(3, 8, dtype=torch.bool), 0.25)
    with pytest.raises(TypeError, match="bool or floating"):
        torch.ops.tk.attention_masked(q, k, v, torch.ones(8, 8, dtype=torch.long), 0.25)


def test_attention_masked_opcheck():
    q, k, v = _inputs()
    torch.library.opcheck(torch.ops.tk.attention_masked.default, (q, k, v, _masks(8, 8)["padding"], 0.25))


def test_offset_causal_kept():
    def fn(q, k, v):  # bottom-right aligned causal (keys = cache + new tokens): not the op's top-left
        N, M = q.shape[-2], k.shape[-2]
        allowed = torch.ones(N, M, dtype=torch.bool).tril(diagonal=M - N)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

    assert "diagonal offset of 3" in _kept(Fn(fn), *_inputs(N=5, M=8))[0]


def test_alibi_bias_kept():
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]).view(1, 4, 1, 1)

    def fn(q, k, v):
        N = q.shape[-2]
        rel = (torch.arange(N)[None, :] - torch.arange(N)[:, None]).float()
        s = (q @ k.transpose(-1, -2)) * 0.25 + slopes * rel
        return F.softmax(s, dim=-1) @ v

    reasons = _kept(Fn(fn), *_inputs())
    assert "not provably causal" in reasons[0] or "bias" in reasons[0], reasons


def test_weak_fill_value_kept():
    def fn(q, k, v):
        N = q.shape[-2]
        s = (q @ k.transpose(-1, -2)) * 0.25
        return s.masked_fill(torch.ones(N, N).tril() == 0, -1e4).softmax(-1) @ v

    assert "does not vanish" in _kept(Fn(fn), *_inputs())[0]


def test_in_place_mask_kept():
    def fn(q, k, v):
        N = q.shape[-2]
        s = (q @ k.transpose(-1, -2)) * 0.25
        s.masked_fill_(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf"))
        return s.softmax(-1) @ v

    assert "in place" in _kept(Fn(fn), *_inputs())[0]


# ---------------------------------------------------------------------------- mask proofs (unit)

def _mask_graph(fn, *shapes):
    """The node computing fn's result in the Dynamo graph of fn(*zeros(shapes))."""
    seen = {}

    def backend(gm, example_inputs):
        seen["out"] = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
        seen["gm"] = gm  # keep the graph alive
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*[torch.zeros(s) for s in shapes])
    return seen["out"]


@pytest.mark.parametrize("fn, expect", [
    (lambda x: torch.ones(5, 7, dtype=torch.bool).tril(), True),
    (lambda x: torch.ones(5, 7).triu(1) == 0, True),
    (lambda x: torch.arange(5)[:, None] >= torch.arange(7), True),
    (lambda x: torch.arange(7)[None, :] < torch.arange(5)[:, None] + 1, True),
    (lambda x: torch.ones(5, 7, dtype=torch.bool), False),
    (lambda x: x.new_full((5, 7), -math.inf).triu(1) == 0, True),
    (lambda x: torch.arange(start=0, end=7)[None, :] <= torch.arange(start=0, end=5)[:, None], True),
])
def test_mask_proofs(fn, expect):
    node = _mask_graph(fn, (1,))
    assert P._mask_kind(P._as_pred(P._MaskEval()(node)), (5, 7)) == P.MaskKind(expect)


def _band(i, j):
    return i[:, None] - j[None, :]


@pytest.mark.parametrize("fn", [
    lambda x: _band(torch.arange(9), torch.arange(9)).abs() <= 2,  # transformers' bidirectional sliding window
    lambda x: torch.abs(_band(torch.arange(9), torch.arange(9))) < 3,
    lambda x: abs(_band(torch.arange(9), torch.arange(9))) <= 2,
    lambda x: 2 >= (torch.arange(9)[None, :] - torch.arange(9)[:, None]).abs(),
    lambda x: ~(_band(torch.arange(9), torch.arange(9)).abs() > 2),
    lambda x: torch.zeros(9, 9).masked_fill(_band(torch.arange(9), torch.arange(9)).abs() > 2, -math.inf) == 0,
    lambda x: torch.where(_band(torch.arange(9), torch.arange(9)).abs() > 2, -math.inf, 0.0) == 0,
    lambda x: torch.ones(9, 9, dtype=torch.bool).tril(2) & torch.ones(9, 9, dtype=torch.bool).triu(-2),
])
def test_two_sided_window_proofs(fn):
    """|i - j| <= 2 in the spellings the prover models: a non-causal window of 3 (each query sees two keys on each
    side)."""
    node = _mask_graph(fn, (1,))
    assert P._mask_kind(P._as_pred(P._MaskEval()(node)), (9, 9)) == P.MaskKind(False, 3)


def _chunked(n, chunk):  # transformers' chunked_causal_mask_function (Llama-4), without left padding
    left = torch.zeros(2, dtype=torch.long)
    i, j = torch.arange(n)[None, :, None], torch.arange(n)[None, None, :]
    same = (j - left[:, None, None]) // chunk == (i - left[:, None, None]) // chunk
    return (same & (j <= i))[:, None]


@pytest.mark.parametrize("chunk, kind", [(16, P.MaskKind(True)), (9, P.MaskKind(True)), (4, P.MaskKind(True, chunk=4)),
                                         (3, P.MaskKind(True, chunk=3))])
def test_chunked_attention_proofs(chunk, kind):
    """i // C == j // C under a causal mask: plain causal where every position lies in one chunk, else the chunk."""
    node = _mask_graph(lambda x: _chunked(9, chunk), (1,))
    assert P._mask_kind(P._as_pred(P._MaskEval()(node)), (2, 4, 9, 9)) == kind


def _chunked_left(pad, chunk, left_of=None, at_batch=True, positional=False):  # HF's chunked mask, left padding
    n = pad.shape[1]
    src = pad if left_of is None else left_of
    left = (src.cumsum(-1) == 0).sum(-1) if positional else (src.cumsum(dim=-1) == torch.zeros_like(src)).sum(dim=-1)
    b = torch.arange(2)[:, None, None, None]
    i, j = torch.arange(n)[None, None, :, None], torch.arange(n)[None, None, None, :]
    lb = left[b] if at_batch else left[torch.zeros_like(b)] + 0 * b
    return ((j - lb) // chunk == (i - lb) // chunk) & (j <= i) & pad[b, j]


def _mask_graph_of(fn, *inputs):
    """The node computing fn's result, and the graph's placeholders, in the Dynamo graph of fn(*inputs)."""
    seen = {}

    def backend(gm, example_inputs):
        seen["out"] = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
        seen["gm"] = gm
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    return seen["out"]


@pytest.mark.parametrize("positional", [False, True])
def test_chunked_attention_counted_from_the_left_padding(positional):
    """(j - L_b) // C == (i - L_b) // C with L_b the padding mask's leading-False count (HF's Llama-4 mask under left
    padding, or the same count spelled with positional dims and a literal 0): chunks of 3 counted from each row's
    first token, the padding mask read at [batch, key]."""
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, :4] = False
    node = _mask_graph_of(lambda m: _chunked_left(m, 3, positional=positional), pad)
    kind = P._mask_kind(P._as_pred(P._MaskEval()(node)), (2, 4, 9, 9))
    assert (kind.causal, kind.window, kind.chunk, kind.chunk_from_pad, kind.segments) == (True, 0, 3, True, None)
    assert kind.pad is not None and kind.pad[1] == 0


@pytest.mark.parametrize("variant, why", [
    ("other_mask", "left padding of a mask other than"),  # the count of another run-time mask
    ("shifted", "left-padding count is read at other than the batch index"),
])
def test_chunked_attention_left_padding_refusals(variant, why):
    pad = torch.ones(2, 9, dtype=torch.bool)
    other = torch.ones(2, 9, dtype=torch.bool)
    if variant == "other_mask":
        node = _mask_graph_of(lambda m, o: _chunked_left(m, 3, left_of=o), pad, other)
    else:
        node = _mask_graph_of(lambda m: _chunked_left(m, 3, at_batch=False), pad)
    with pytest.raises(P.Keep, match=why):
        P._mask_kind(P._as_pred(P._MaskEval()(node)), (2, 4, 9, 9))


def test_left_padding_count_outside_chunk_ids_is_kept():
    """The count compared directly with an index (not as chunk ids) is not modelled: kept, never misread."""
    pad = torch.ones(2, 9, dtype=torch.bool)

    def fn(m):
        left = (m.cumsum(dim=-1) == torch.zeros_like(m)).sum(dim=-1)
        b, j = torch.arange(2)[:, None, None, None], torch.arange(9)[None, None, None, :]
        return (j >= left[b]) & (j <= torch.arange(9)[None, None, :, None])

    node = _mask_graph_of(fn, pad)
    with pytest.raises(P.Keep):
        P._mask_kind(P._as_pred(P._MaskEval()(node)), (2, 4, 9, 9))


def test_chunked_attention_refusals():
    node = _mask_graph(lambda x: (torch.arange(9)[:, None] + 1) // 4 == torch.arange(9)[None, :] // 4, (1,))
    with pytest.raises(P.Keep, match="chunked attention"):
        P._mask_kind(P._as_pred(P._MaskEval()(node)), (2, 4, 9, 9))
    node = _mask_graph(lambda x: torch.arange(9)[:, None] // 4 != torch.arange(9)[None, :] // 4, (1,))
    with pytest.raises(P.Keep):
        P._mask_kind(P._as_pred(P._MaskEval()(node)), (2, 4, 9, 9))


@pytest.mark.parametrize("fn, why", [
    (lambda x: (_band(torch.arange(9), torch.arange(9)) - 1).abs() <= 2, "not a plain causal"),  # off-centre
    (lambda x: _band(torch.arange(9), torch.arange(9)).abs() == 2, "absolute value by eq"),
    (lambda x: _band(torch.arange(9), torch.arange(9)).abs() > 2, "union of regions"),  # everything but the band
])
def test_two_sided_window_refusals(fn, why):
    node = _mask_graph(fn, (1,))
    with pytest.raises(P.Keep, match=why):
        P._mask_kind(P._as_pred(P._MaskEval()(node)), (9, 9))


@pytest.mark.parametrize("fn, why", [
    (lambda x: torch.ones(5, 7, dtype=torch.bool).tril(1), "diagonal offset"),
    (lambda x: torch.arange(5)[:, None] * 2 >= torch.arange(7), "not a plain causal"),
    (lambda x: x > 0, "graph input"),
    (lambda x: torch.rand(5, 7) > 0.5, "rand"),
])
def test_mask_refusals(fn, why):
    node = _mask_graph(fn, (5, 7))
    with pytest.raises(P.Keep, match=why):
        P._mask_kind(P._as_pred(P._MaskEval()(node)), (5, 7))


# ============================================================================ on the GPU (skipped without CUDA)

def _random_mask_fn(rng):
    """A random boolean mask spelled with the ops the prover models, and its concrete evaluation."""
    N, M = rng.randint(1, 9), rng.randint(1, 9)
    a, b, c = rng.randint(-2, 2), rng.randint(-2, 2), rng.randint(-2, 2)
    kind = rng.randrange(7)

    def fn(x):
        i = torch.arange(N)[:, None] + a
        j = torch.arange(M)[None, :] + b
        if kind == 0:
            m = j <= i + c
        elif kind == 1:
            m = i - j >= c
        elif kind == 2:
            m = torch.ones(N, M, dtype=torch.bool).tril(c)
        elif kind == 3:
            m = torch.ones(N, M).triu(c + 1) == 0
        elif kind == 4:
            m = (j <= i) & (j > i - 3 + c)
        elif kind == 5:
            m = (i - j).abs() <= c + 2
        else:
            m = ~(j > i + c) & (torch.zeros(N, M) == 0)
        return m.view(1, 1, N, M).expand(2, 1, N, M)

    return fn, (N, M)


def test_mask_prover_is_sound_on_random_masks():
    """Whatever the prover concludes must hold on the concrete mask (soundness), and every one of these
    spellings that is concretely causal, a causal window or all-visible on its box is proven (completeness here)."""
    import random

    rng = random.Random(0)
    proven = 0
    for _ in range(60):
        fn, (N, M) = _random_mask_fn(rng)
        concrete = fn(torch.zeros(1))[0, 0]
        node = _mask_graph(fn, (1,))
        i, j = torch.arange(N)[:, None], torch.arange(M)[None, :]
        try:
            kind = P._mask_kind(P._as_pred(P._MaskEval()(node)), (2, 4, N, M))
        except P.Keep as e:
            for w in range(1, N + 1):  # no causal window that leaves every row a key, or plain causal mask, is refused
                window = (j <= i) & (i - j < w)
                assert not (torch.equal(concrete, window) and window.any(-1).all()), (N, M, w, str(e))
            assert not concrete.all(), (N, M, str(e))
            continue
        proven += 1
        expected = (j <= i) if kind.causal else torch.ones(N, M, dtype=torch.bool)
        if kind.window:
            expected = expected & ((i - j < kind.window) if kind.causal else ((i - j).abs() < kind.window))
        assert torch.equal(concrete, expected), (N, M, kind, concrete)
    assert proven >= 15  # most random spellings of causal/all-visible masks are proven, not refused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["window_additive", "padding_additive", "bias"])
def test_gpu_attention_masked_softcap(kind):
    """Softcapped scores with a run-time mask: a window or a padding mask (one run of keys per row) runs the capped
    kernel (lse computed), a bias the reference formulas; forward and gradients equal the written-out attention
    either way."""
    if not _kernel_built():
        pytest.skip("the attention kernels need an sm_90 GPU")
    N = 300
    q, k, v = (t.cuda().bfloat16().requires_grad_() for t in _qkv(2, 8, 2, N, N, 128, dtype=torch.float32))
    mask = _masks(N, N)[kind].cuda()
    o, lse = torch.ops.tk.attention_masked(q, k, v, mask[None, None].bfloat16(), 0.3, 2.0)
    assert (lse.abs().sum() > 0) == (kind != "bias")
    qf, kf, vf = q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1)
    ref = torch.softmax(2.0 * torch.tanh(qf @ kf.transpose(-1, -2) * 0.3 / 2.0) + mask, -1) @ vf
    assert (o.float() - ref).norm() / ref.norm() < 1e-2
    do = torch.randn_like(o)
    for g, w in zip(torch.autograd.grad(o, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do.float())):
        assert (g.float() - w.float()).norm() / w.float().norm() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["causal", "full", "padding", "padding_prefill", "causal_additive", "bias", "window",
                                  "window_additive"])
def test_gpu_attention_masked_paths(kind):
    """A causal, sliding-window or all-visible run-time mask runs the kernel (lse computed), as does one whose rows
    each see one run of keys (interval tables; left padding's prefill, whose first rows see no key: o = 0 and no
    gradient there, as SDPA's safe softmax); any other runs SDPA; forward and gradients equal SDPA's math backend
    with the mask either way; one check per mask tensor (cached)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not _kernel_built():
        pytest.skip("the attention kernels need an sm_90 GPU")
    N = M = 300
    q, k, v = (t.cuda().bfloat16().requires_grad_() for t in _qkv(2, 8, 2, N, M, 128, dtype=torch.float32))
    masks = _masks(N, M)
    masks["padding_prefill"] = masks["causal"] & (torch.arange(M) >= 3)  # left padding of 3 keys
    mask = masks[kind].cuda()
    if mask.is_floating_point():
        mask = mask.bfloat16()
    o, lse = torch.ops.tk.attention_masked(q, k, v, mask[None, None], 0.0883)
    assert (lse.abs().sum() > 0) == (kind != "bias")
    got = A.mask_kind(mask[None, None], N, M, 2)
    if kind.startswith("padding"):  # one run of keys per row: the interval tables
        assert isinstance(got, A._varlen.Intervals)
    else:
        assert got == {"causal": "causal", "full": "full", "causal_additive": "causal", "window": 3,
                       "window_additive": 3}.get(kind)
    if kind == "padding_prefill":
        assert o[:, :, :3].abs().sum() == 0 and torch.isinf(lse[:, :, :3]).all()
    kk, vv = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q.float(), kk.float(), vv.float(),
                                             attn_mask=mask if mask.dtype == torch.bool else mask.float(), scale=0.0883)
    assert (o.float() - ref).norm() / ref.norm() < 1e-2
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), do)
    want = torch.autograd.grad(ref, (q, k, v), do.float())
    for g, w in zip(got, want):
        assert (g.float() - w.float()).norm() / w.float().norm() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_attention_masked_under_cuda_graph_capture_takes_sdpa_path():
    if not _kernel_built():
        pytest.skip("the attention kernels need an sm_90 GPU")
    q, k, v = (t.cuda().bfloat16() for t in _qkv(1, 4, 4, 64, 64, 64, dtype=torch.float32))
    mask = torch.ones(64, 64, dtype=torch.bool, device="cuda").tril()
    torch.ops.tk.attention_masked(q, k, v, mask, 0.125)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = torch.ops.tk.attention_masked(q, k, v, mask, 0.125)
    mask[10, 0] = False  # the captured graph must honour the new values: it runs SDPA with the mask
    graph.replay()
    torch.cuda.synchronize()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)
    torch.testing.assert_close(o, ref, rtol=2e-2, atol=2e-2)


def test_attention_masked_warns_once_when_the_kernel_cannot_take_the_mask(monkeypatch):
    """Where the kernel would run but the mask is general, the SDPA fallback says so, once."""
    monkeypatch.setattr(A, "_kernel_ok", lambda *tensors, backward=False: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(A, "masked_paths", __import__("collections").Counter())
    monkeypatch.setattr(A, "_warned_sdpa", False)
    q, k, v = _inputs()
    masks = _masks(8, 8)
    with pytest.warns(UserWarning, match="neither causal"):
        out, _ = torch.ops.tk.attention_masked(q, k, v, masks["bias"], 0.25)
    torch.testing.assert_close(out, A._masked_sdpa(q, k, v, masks["bias"], 0.25))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.ops.tk.attention_masked(q, k, v, masks["random"], 0.25)  # said already
    assert A.masked_paths["sdpa"] == 2 and A.masked_paths["value checks"] == 2
