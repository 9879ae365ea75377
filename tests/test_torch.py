"""numbafa.torch: the custom operators, their gradients, bf16 bridging, compile, errors.

References: PyTorch's SDPA math backend in float64 where it applies (full,
causal, GQA) and numbafa's float64 golden for sinks, windows and packing;
both are float64 references of the same inputs, so float32 results are held
to the project's FLOAT32 rule and bf16 results to BF16_MIXED
(tests/_tolerances.py).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install '.[torch]')")

import ml_dtypes  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import numbafa  # noqa: E402
import numbafa.torch as nt  # noqa: E402
from numbafa import golden, layout as nl  # noqa: E402

from _tolerances import BF16_MIXED, FLOAT32, assert_close  # noqa: E402

B, H, HKV, S, D = 2, 4, 2, 160, 32   # S: not a multiple of the 128-row Q tile


def make(layout="bhsd", dtype=torch.float32, b=B, h=H, hkv=HKV, s=S, d=D, seed=0, grad=True, dv=None):
    """q, k, v, do in ``layout`` (leaves that require grad) from one seed; v and do with head dim
    ``dv`` (default ``d``)."""
    g = torch.Generator().manual_seed(seed)

    def t(heads, dim=d):
        shape = (b, heads, s, dim) if layout == "bhsd" else (b, s, heads, dim)
        return torch.randn(shape, generator=g).to(dtype).requires_grad_(grad)

    dv = d if dv is None else dv
    q, k, v = t(h), t(hkv), t(hkv, dv)
    return q, k, v, t(h, dv).detach()


def neuron(t, layout):
    """A Neuron-layout NumPy view of a tensor in ``layout``."""
    return nl.to_neuron(nt.to_numpy(t), layout)


def grads(o, do, *inputs):
    return torch.autograd.grad(o, inputs, do)


def golden_of(q, k, v, do, layout, sinks=None, **kw):
    """Float64 golden o and gradients, in the Neuron layout."""
    args = [neuron(x, layout) for x in (q, k, v)]
    s = None if sinks is None else nt.to_numpy(sinks)
    if s is not None and s.ndim == 1:
        s = np.broadcast_to(s, (q.shape[0], s.shape[0]))
    o, _ = golden.attention_fwd(*args, sinks=s, **kw)
    g = golden.attention_bwd(*args, None, neuron(do, layout), None, sinks_ref=s, **kw)
    return o, g


def sdpa64(q, k, v, causal, mask=None):
    """SDPA's math backend in float64 (GQA by repeating the KV heads), bhsd."""
    rep = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(rep, dim=1) for x in (k, v))
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask,
                                                                is_causal=causal)


# ---------------------------------------------------------------------------
# Core package
# ---------------------------------------------------------------------------

def test_import_numbafa_imports_no_framework():
    code = "import sys, numbafa; bad = {'torch', 'jax'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------
# The operators
# ---------------------------------------------------------------------------

def _op_args(dtype, sinks, window, packing, dropout=(0.0, None, 0), dv=None, variants=False):
    """The operators' arguments; ``variants``: a ``[heads, s, s]`` bias (with its gradient), ALiBi
    slopes and a soft cap."""
    q, k, v, do = make(dtype=dtype, s=96, dv=dv)
    perm = (0, 1, 3, 2)
    qn, kn, vn = (x.detach().permute(perm).requires_grad_() for x in (q, k, v))
    s = torch.randn(B, H, dtype=torch.float32, requires_grad=True) if sinks else None
    bmin = bmax = None
    if packing:
        bmin, bmax = nt.cu_seqlens_to_bounds(torch.tensor([0, 40, 96]))
    bias = torch.randn(H, 96, 96, requires_grad=True) if variants else None
    slopes = torch.rand(H) * 0.1 if variants else None
    softcap = 7.0 if variants else 0.0
    fwd = (qn, kn, vn, s, bmin, bmax, bias, slopes, True, window, 0.0, "bhsd") + tuple(dropout) + (softcap,)
    o, lse = torch.ops.numbafa.attention_fwd(*fwd)
    s = None if s is None else s.detach()   # the backward op has no autograd formula (no double backward)
    bias = None if bias is None else bias.detach()
    bwd = (qn.detach(), kn.detach(), vn.detach(), o.detach(), do.permute(perm), lse, s, bmin, bmax, bias, slopes,
           True, window, 0.0, "bhsd") + tuple(dropout) + (softcap, variants)
    return fwd, bwd


@pytest.mark.parametrize("dtype, sinks, window, packing, dropout", [
    (torch.float32, False, 0, False, (0.0, None, 0)),
    (torch.float32, True, 32, True, (0.0, None, 0)),
    (torch.bfloat16, True, 0, False, (0.0, None, 0)),
    (torch.float32, True, 0, False, (0.25, 7, 3)),
], ids=["float32", "float32-sinks-window-packing", "bf16-sinks", "float32-dropout"])
def test_opcheck(dtype, sinks, window, packing, dropout):
    fwd, bwd = _op_args(dtype, sinks, window, packing, dropout)
    torch.library.opcheck(torch.ops.numbafa.attention_fwd.default, fwd)
    torch.library.opcheck(torch.ops.numbafa.attention_bwd.default, bwd)


def test_opcheck_with_score_variants():
    fwd, bwd = _op_args(torch.float32, True, 32, False, variants=True)
    torch.library.opcheck(torch.ops.numbafa.attention_fwd.default, fwd)
    torch.library.opcheck(torch.ops.numbafa.attention_bwd.default, bwd)


def test_opcheck_with_a_value_head_dim_of_its_own():
    """The fake (meta) functions give o v's head dim, as the kernels do."""
    fwd, bwd = _op_args(torch.float32, True, 0, False, dv=20)
    assert fwd[2].shape[2] == 20 and fwd[0].shape[2] == D
    torch.library.opcheck(torch.ops.numbafa.attention_fwd.default, fwd)
    torch.library.opcheck(torch.ops.numbafa.attention_bwd.default, bwd)


# ---------------------------------------------------------------------------
# Against SDPA (float64 math backend)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hkv", [H, HKV], ids=["mha", "gqa"])
def test_matches_sdpa(layout, causal, hkv):
    q, k, v, do = make(layout, hkv=hkv)
    o = nt.attention(q, k, v, causal=causal, layout=layout)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert_matches_sdpa(o, grads(o, do, q, k, v), (q, k, v, do), causal, layout)


def assert_matches_sdpa(o, got, inputs, causal, layout):
    """``o`` and the gradients ``got`` of q, k, v (in ``layout``) against SDPA's float64 math backend."""
    def bhsd(x):
        return x if layout == "bhsd" else x.transpose(1, 2)

    q, k, v, do = inputs
    qs, ks, vs = (bhsd(x.detach()).double().requires_grad_() for x in (q, k, v))
    ref = sdpa64(qs, ks, vs, causal)
    expected = grads(ref, bhsd(do).double(), qs, ks, vs)
    assert_close(bhsd(o).detach(), ref.detach(), FLOAT32, "o")
    for name, g, e, x in zip(("dq", "dk", "dv"), got, expected, (q, k, v)):
        assert g.shape == x.shape, name
        assert_close(bhsd(g), e, FLOAT32, name)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_a_value_head_dim_of_its_own_matches_sdpa(layout):
    """v, o, do with head_dim_v != head_dim (SDPA's math backend takes them too); GQA, causal."""
    q, k, v, do = make(layout, d=48, dv=24, seed=4)
    o = nt.attention(q, k, v, causal=True, layout=layout)
    assert o.shape == q.shape[:-1] + (24,)
    with torch.no_grad():   # the no-grad path gives the same o
        torch.testing.assert_close(nt.attention(q, k, v, causal=True, layout=layout), o.detach(), rtol=0, atol=0)
    assert_matches_sdpa(o, grads(o, do, q, k, v), (q, k, v, do), True, layout)


def test_window_matches_sdpa_with_a_dense_mask():
    q, k, v, do = make()
    w = 17
    o = nt.attention(q, k, v, causal=True, window=w)
    i = torch.arange(S)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w)
    qs, ks, vs = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = sdpa64(qs, ks, vs, False, mask)
    assert_close(o.detach(), ref.detach(), FLOAT32, "o")
    for name, g, e in zip(("dq", "dk", "dv"), grads(o, do, q, k, v), grads(ref, do.double(), qs, ks, vs)):
        assert_close(g, e, FLOAT32, name)


# ---------------------------------------------------------------------------
# Against the float64 golden: sinks, windows, packing
# ---------------------------------------------------------------------------

CASES = {
    "sinks-heads": dict(sinks=(H,), causal=True),
    "sinks-batch-heads-window": dict(sinks=(B, H), causal=True, window=40),
    "sinks2-full": dict(sinks=(B, H, 2)),
    "packing-causal-window": dict(cu_seqlens=(0, 50, 61, 160), causal=True, window=30),
    "packing-full-sinks-scale": dict(cu_seqlens=(0, 100, 160), sinks=(H,), softmax_scale=0.3),
}


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_golden(case, layout):
    spec = dict(CASES[case])
    q, k, v, do = make(layout, seed=1)
    kw = dict(causal=spec.get("causal", False), window=spec.get("window"),
              softmax_scale=spec.get("softmax_scale"))
    gkw = dict(use_causal_mask=kw["causal"], sliding_window=kw["window"], softmax_scale=kw["softmax_scale"])
    sinks = None
    if "sinks" in spec:
        sinks = torch.randn(spec["sinks"], generator=torch.Generator().manual_seed(2)).requires_grad_()
    if "cu_seqlens" in spec:
        kw["bound_min"], kw["bound_max"] = nt.cu_seqlens_to_bounds(torch.tensor(spec["cu_seqlens"]))
        gkw["bound_min"], gkw["bound_max"] = (b.numpy() for b in (kw["bound_min"], kw["bound_max"]))
    o = nt.attention(q, k, v, sinks=sinks, layout=layout, **kw)
    inputs = (q, k, v) + ((sinks,) if sinks is not None else ())
    got = grads(o, do, *inputs)
    o_exp, expected = golden_of(q, k, v, do, layout, sinks=sinks, **gkw)
    assert_close(neuron(o, layout), o_exp, FLOAT32, "o")
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert_close(neuron(g, layout), e, FLOAT32, name)
    if sinks is not None:
        e = expected[3].sum(axis=0) if sinks.dim() == 1 else expected[3]
        assert got[3].shape == sinks.shape
        assert_close(got[3], e, FLOAT32, "dsinks")


def test_sinks_parameter_trains():
    """A module's sinks Parameter gets the golden's gradient and moves under an optimizer."""

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sinks = torch.nn.Parameter(torch.zeros(H))

        def forward(self, q, k, v):
            return nt.attention(q, k, v, causal=True, window=48, sinks=self.sinks)

    model = Attention()
    q, k, v, do = make(seed=3, grad=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (model(q, k, v) * do).sum().backward()
    _, expected = golden_of(q, k, v, do, "bhsd", sinks=model.sinks, use_causal_mask=True, sliding_window=48)
    assert_close(model.sinks.grad, expected[3].sum(axis=0), FLOAT32, "sinks.grad")
    before = model.sinks.detach().clone()
    opt.step()
    torch.testing.assert_close(model.sinks.detach(), before - 0.1 * model.sinks.grad, rtol=0, atol=0)


def test_to_numpy_views_tensors_that_require_grad_or_not():
    """A tensor that requires grad (a leaf, or a result of one) and one that does not both come
    out as views of their memory; only the first is detached on the way (NumPy refuses it)."""
    leaf = torch.arange(6, dtype=torch.float32).reshape(2, 3).requires_grad_()
    for t in (leaf, leaf * 2, leaf.detach(), torch.ones(3, 2, dtype=torch.float64).t()):
        a = nt.to_numpy(t)
        assert a.ctypes.data == t.data_ptr() and a.strides == tuple(s * t.element_size() for s in t.stride())
        np.testing.assert_array_equal(a, t.detach().numpy())
    assert leaf.requires_grad and leaf.grad_fn is None    # the caller's tensor is left as it was


# ---------------------------------------------------------------------------
# bfloat16
# ---------------------------------------------------------------------------

def test_bf16_bridge_is_a_view_and_bit_exact():
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    t = bits.view(torch.bfloat16)
    a = nt.to_numpy(t)
    assert a.dtype == ml_dtypes.bfloat16 and np.shares_memory(a, bits.numpy())
    np.testing.assert_array_equal(a.view(np.int16), bits.numpy())
    back = nt.from_numpy(a)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == t.data_ptr()
    assert torch.equal(back.view(torch.int16), bits)
    strided = t.reshape(256, 256).t()          # non-contiguous: strides are kept
    np.testing.assert_array_equal(nt.to_numpy(strided).view(np.int16), bits.reshape(256, 256).t().numpy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_bf16_and_fp16_are_numbafa_bit_for_bit(layout, dtype):
    """The op's bf16 (fp16) o and gradients are numbafa's on the same bits (mixed_precision=True)."""
    q, k, v, do = make(layout, dtype=dtype, seed=4)
    sinks = torch.randn(B, H).requires_grad_()
    o = nt.attention(q, k, v, causal=True, window=64, sinks=sinks, layout=layout)
    assert o.dtype == dtype
    got = grads(o, do, q, k, v, sinks)
    kw = dict(sinks=nt.to_numpy(sinks), use_causal_mask=True, sliding_window=64, mixed_precision=True,
              layout=layout)
    o_np, ctx = numbafa.attention(*(nt.to_numpy(x) for x in (q, k, v)), **kw)
    expected = ctx.backward(nt.to_numpy(do))
    np.testing.assert_array_equal(nt.to_numpy(o).view(np.uint16), o_np.view(np.uint16))
    for name, g, e in zip(("dq", "dk", "dv", "dsinks"), got, expected):
        assert g.dtype == (torch.float32 if name == "dsinks" else dtype), name
        np.testing.assert_array_equal(nt.to_numpy(g).view(np.uint16 if name != "dsinks" else np.uint32),
                                      e.view(np.uint16 if name != "dsinks" else np.uint32), err_msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_dropout_is_numbafa_bit_for_bit(dtype):
    """Dropout: the op draws numbafa's mask in both passes, so o and every gradient are numbafa's."""
    q, k, v, do = make("bshd", dtype=dtype, seed=6)
    sinks = torch.randn(B, H).requires_grad_()
    drop = dict(dropout_p=0.2, seed=11, seed_offset=4)
    o = nt.attention(q, k, v, causal=True, sinks=sinks, layout="bshd", **drop)
    got = grads(o, do, q, k, v, sinks)
    o_np, ctx = numbafa.attention(*(nt.to_numpy(x) for x in (q, k, v)), sinks=nt.to_numpy(sinks),
                                  use_causal_mask=True, mixed_precision=True, layout="bshd", **drop)
    expected = ctx.backward(nt.to_numpy(do))
    bits = np.uint16 if dtype == torch.bfloat16 else np.uint32
    np.testing.assert_array_equal(nt.to_numpy(o).view(bits), o_np.view(bits))
    for name, g, e in zip(("dq", "dk", "dv", "dsinks"), got, expected):
        b = np.uint32 if name == "dsinks" else bits
        np.testing.assert_array_equal(nt.to_numpy(g).view(b), e.view(b), err_msg=name)
    o_plain = nt.attention(q, k, v, causal=True, sinks=sinks, layout="bshd")
    assert not torch.equal(o, o_plain)


def test_dropout_errors_name_the_argument():
    q, k, v, _ = make()
    with pytest.raises(ValueError, match="seed is required with dropout_p=0.1"):
        nt.attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got 1.5"):
        nt.attention(q, k, v, dropout_p=1.5, seed=1)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*63\)"):
        nt.attention(q, k, v, dropout_p=0.1, seed=2 ** 63)


def test_bf16_accuracy_against_golden():
    q, k, v, do = make(dtype=torch.bfloat16, seed=5)
    o = nt.attention(q, k, v, causal=True)
    got = grads(o, do, q, k, v)
    o_exp, expected = golden_of(q, k, v, do, "bhsd", use_causal_mask=True)
    assert_close(neuron(o, "bhsd").astype(np.float32), o_exp, BF16_MIXED, "o")
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert_close(neuron(g, "bhsd").astype(np.float32), e, BF16_MIXED, name)


# ---------------------------------------------------------------------------
# no_grad, torch.compile
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dropout", [{}, dict(dropout_p=0.3, seed=5, seed_offset=2)], ids=["masks", "dropout"])
def test_float64_passes_gradcheck(dropout):
    """float64 runs in float64 end to end, so torch.autograd.gradcheck's finite differences agree:
    causal, window, packing bounds, sinks ([heads], a gradient summed over the batch), GQA, a value
    head dim of its own, and dropout with a fixed seed (the same mask in every call)."""
    g = torch.Generator().manual_seed(8)

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    q, k, v, sinks = t(2, 2, 12, 4), t(2, 1, 12, 4), t(2, 1, 12, 3), t(2)
    bmin, bmax = nt.cu_seqlens_to_bounds(torch.tensor([0, 5, 12]))

    def f(q, k, v, sinks):
        return nt.attention(q, k, v, causal=True, window=4, sinks=sinks, bound_min=bmin, bound_max=bmax, **dropout)

    assert f(q, k, v, sinks).dtype == torch.float64
    assert torch.autograd.gradcheck(f, (q, k, v, sinks))


def test_float64_opcheck():
    q, k, v, do = (x.detach().permute(0, 1, 3, 2).double() for x in make(s=96, dv=24))
    fwd = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), None, None, None, None, None, True, 0, 0.0,
           "bhsd", 0.0, None, 0, 0.0)
    o, lse = torch.ops.numbafa.attention_fwd(*fwd)
    assert o.dtype == lse.dtype == torch.float64
    torch.library.opcheck(torch.ops.numbafa.attention_fwd.default, fwd)
    bwd = (q.detach(), k.detach(), v.detach(), o.detach(), do, lse, None, None, None, None, None, True, 0, 0.0,
           "bhsd", 0.0, None, 0, 0.0, False)
    torch.library.opcheck(torch.ops.numbafa.attention_bwd.default, bwd)


def test_no_grad():
    q, k, v, _ = make()
    with torch.no_grad():
        o = nt.attention(q, k, v, causal=True)
    assert o.grad_fn is None and not o.requires_grad
    torch.testing.assert_close(o, nt.attention(q, k, v, causal=True).detach(), rtol=0, atol=0)


def test_compile_gives_the_eager_results():
    """Under torch.compile (AOT autograd, fake tensors, one graph) the op is called as in eager."""
    q, k, v, do = make(layout="bshd", seed=6)
    sinks = torch.randn(H).requires_grad_()

    def f(q, k, v, sinks):
        return nt.attention(q * 1.0, k, v, causal=True, window=33, sinks=sinks, layout="bshd") * 2.0

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    eager_o = f(q, k, v, sinks)
    eager = grads(eager_o, do, q, k, v, sinks)
    comp_o = compiled(q, k, v, sinks)
    comp = grads(comp_o, do, q, k, v, sinks)
    torch.testing.assert_close(comp_o, eager_o, rtol=0, atol=0)
    for g, e in zip(comp, eager):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


# ---------------------------------------------------------------------------
# torch.func: grad, vjp, jacrev, vmap (reverse mode; no forward mode, no double backward)
# ---------------------------------------------------------------------------

def _tiny(seed=9):
    """q, k, v ``[1, 2, 8, 4]`` (bhsd, no grad), sinks ``[2]`` and a gradient ``do``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in ((1, 2, 8, 4),) * 3 + ((2,), (1, 2, 8, 4))]


def _eager_grads(q, k, v, sinks, do, **kw):
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    nt.attention(*leaves[:3], sinks=leaves[3], **kw).backward(do)
    return [x.grad for x in leaves]


@pytest.mark.filterwarnings("error:There is a performance drop:UserWarning")   # batching rules
def test_func_grad_and_vjp_give_the_eager_gradients_bit_for_bit():
    q, k, v, sinks, do = _tiny()
    kw = dict(causal=True, window=5)
    eager = _eager_grads(q, k, v, sinks, do, **kw)

    def loss(q, k, v, sinks):
        return (nt.attention(q, k, v, sinks=sinks, **kw) * do).sum()

    grads = torch.func.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    o, pullback = torch.func.vjp(lambda *a: nt.attention(*a[:3], sinks=a[3], **kw), q, k, v, sinks)
    torch.testing.assert_close(o, nt.attention(q, k, v, sinks=sinks, **kw), rtol=0, atol=0)
    for got in (grads, pullback(do)):
        for g, e in zip(got, eager):
            torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.filterwarnings("error:There is a performance drop:UserWarning")   # batching rules
def test_func_jacrev_is_the_eager_jacobian():
    """jacrev (vmap over the backward) against the Jacobian built row by row with eager backwards."""
    q, k, v, sinks, _ = _tiny(seed=10)

    def f(q, sinks):
        return nt.attention(q, k, v, causal=True, sinks=sinks)

    jac = torch.func.jacrev(f, argnums=(0, 1))(q, sinks)
    eager = torch.autograd.functional.jacobian(f, (q, sinks))
    assert jac[0].shape == q.shape + q.shape and jac[1].shape == q.shape + sinks.shape
    for j, e in zip(jac, eager):
        torch.testing.assert_close(j, e, rtol=0, atol=0)


@pytest.mark.filterwarnings("error:There is a performance drop:UserWarning")   # batching rules
def test_vmap_gives_each_call_and_its_gradient():
    """Folded into the batch axis (k, v and sinks mapped too), each element gets its own call's bits."""
    q, k, v, sinks, do = _tiny(seed=11)
    qs, ks, vs = torch.stack([q, 2 * q, -q]), torch.stack([k, k.flip(2), -k]), torch.stack([v, v, 3 * v])
    sinks_b = torch.stack([sinks, -sinks, sinks + 1])

    def loss(q, k, v, sinks):
        return (nt.attention(q, k, v, causal=True, sinks=sinks) * do).sum()

    out = torch.vmap(lambda *a: nt.attention(*a[:3], causal=True, sinks=a[3]))(qs, ks, vs, sinks_b)
    dqs = torch.vmap(torch.func.grad(loss, argnums=(0, 1, 2, 3)))(qs, ks, vs, sinks_b)
    for i in range(3):
        args = (qs[i], ks[i], vs[i], sinks_b[i])
        torch.testing.assert_close(out[i], nt.attention(*args[:3], causal=True, sinks=args[3]), rtol=0, atol=0)
        for got, e in zip(dqs, _eager_grads(*args, do, causal=True)):
            torch.testing.assert_close(got[i], e, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["dropout", "bounds", "op with [heads] sinks"])
def test_vmap_loops_where_folding_would_change_the_result(case):
    """Dropout's mask depends on the batch index, bounds mapped along the axis differ per element,
    and the operators' [heads] sinks have a gradient summed over the batch: one call per element."""
    q, k, v, sinks, do = _tiny(seed=13)
    qs = torch.stack([q, 2 * q])
    if case == "dropout":
        def f(q):
            return nt.attention(q, k, v, causal=True, dropout_p=0.3, seed=5)
        args, in_dims = (qs,), 0
    elif case == "bounds":
        bounds = [nt.cu_seqlens_to_bounds(torch.tensor(cu)) for cu in ([0, 3, 8], [0, 5, 8])]
        bmin, bmax = (torch.stack(b) for b in zip(*bounds))

        def f(q, bmin, bmax):
            return nt.attention(q, k, v, causal=True, bound_min=bmin, bound_max=bmax)
        args, in_dims = (qs, bmin, bmax), 0
    else:
        def f(q):
            return torch.ops.numbafa.attention_bwd(q, k, v, q, do, q[:, :, 0], sinks, None, None, None, None, False,
                                                   0, 0.0, "bhsd", 0.0, None, 0, 0.0, False)[3]
        args, in_dims = (qs,), 0
    out = torch.vmap(f, in_dims=in_dims)(*args)
    for i in range(2):
        torch.testing.assert_close(out[i], f(*(a[i] for a in args)), rtol=0, atol=0)


@pytest.mark.parametrize("transform", ["jvp", "hessian", "create_graph"])
def test_forward_mode_and_double_backward_are_refused(transform):
    """Documented in docs/frameworks.md: no forward mode (jvp, jacfwd, hessian), no double backward."""
    q, k, v, _, _ = _tiny(seed=12)
    if transform == "jvp":
        with pytest.raises(NotImplementedError, match="implement the jvp function"):
            torch.func.jvp(lambda q: nt.attention(q, k, v), (q,), (torch.ones_like(q),))
    elif transform == "hessian":
        with pytest.raises(NotImplementedError, match="implement the jvp function"):
            torch.func.hessian(lambda q: nt.attention(q, k, v).sum())(q)
    else:
        q.requires_grad_()
        dq, = torch.autograd.grad(nt.attention(q, k, v).square().sum(), q, create_graph=True)
        with pytest.raises(NotImplementedError, match=r"^numbafa\.torch\.attention has no double backward"):
            dq.sum().backward()


# ---------------------------------------------------------------------------
# Errors name the user's argument
# ---------------------------------------------------------------------------

def _bad_calls():
    q, k, v, _ = make(grad=False)
    return [
        ("q not a tensor", dict(q=q.numpy()), TypeError, r"^q must be a torch\.Tensor, got ndarray$"),
        ("q int32", dict(q=q.int()), TypeError, r"^q must be float32, float64, float16 or bfloat16, got int32$"),
        ("k float64", dict(k=k.double()), TypeError, r"^k must have the dtype of q \(float32\), got float64$"),
        ("v dtype", dict(v=v.bfloat16()), TypeError, r"^v must have the dtype of q \(float32\), got bfloat16$"),
        ("q 3-D", dict(q=q[0]), ValueError,
         r"^q must be 4-D \[batch, heads, seq, head_dim\] for layout='bhsd', got shape \(4, 160, 32\)$"),
        ("k head_dim", dict(k=k[..., :16]), ValueError,
         r"^k must have shape \(2, heads_kv, seq_k, 32\) to match q, got \(2, 2, 160, 16\)$"),
        ("k heads", dict(k=k[:, :1].expand(B, 3, S, D), v=v[:, :1].expand(B, 3, S, D)), ValueError,
         r"^heads \(4\) must be a multiple of heads_kv \(k\.shape\[1\]\), got heads_kv=3$"),
        ("v shape", dict(v=v[:, :, :100]), ValueError,
         r"^v must have shape \(2, 2, 160, head_dim_v\) to match k, got \(2, 2, 100, 32\)$"),
        ("causal seq", dict(k=k[:, :, :100], v=v[:, :, :100], causal=True), ValueError,
         r"^causal=True requires seq == seq_k, got seq=160, seq_k=100$"),
        ("causal type", dict(causal=1), TypeError, r"^causal must be a bool, got int 1$"),
        ("window without causal", dict(window=8), ValueError, r"^window=8 requires causal=True"),
        ("window type", dict(window=8.0, causal=True), TypeError, r"^window must be an int or None, got float"),
        ("sinks shape", dict(sinks=torch.zeros(3)), ValueError,
         r"^sinks must have shape \(4,\) \[heads\], \(2, 4\) \[batch, heads\] or \(2, 4, num_sinks >= 1\)"),
        ("sinks dtype", dict(sinks=torch.zeros(4, dtype=torch.float64)), TypeError,
         r"^sinks must be float32 or bfloat16 \(float64 or float16 only for inputs of that dtype\), got float64$"),
        ("bounds alone", dict(bound_min=torch.zeros(S)), ValueError,
         r"^bound_min and bound_max must be given together, got only bound_min$"),
        ("bound shape", dict(bound_min=torch.zeros(S + 1), bound_max=torch.zeros(S + 1)), ValueError,
         r"^bound_min must have shape \(160,\) \(one bound per query row: \[seq\]\), got \(161,\)$"),
        ("scale", dict(softmax_scale=float("nan")), ValueError, r"^softmax_scale must be finite in float32"),
        ("layout", dict(layout="sbhd"), ValueError, r"^layout must be one of \('bhsd', 'bshd'\), got 'sbhd'$"),
        ("nan in k", dict(k=k.clone().index_fill_(2, torch.tensor([3]), float("nan"))), ValueError,
         r"^k must be finite, got 128 NaN/inf element\(s\) of 20480$"),
        ("inf in sinks", dict(sinks=torch.tensor([0.0, float("inf"), 0.0, 0.0])), ValueError,
         r"^sinks must be finite"),
    ]


@pytest.mark.parametrize("name, change, error, message", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_errors_name_the_argument(name, change, error, message):
    q, k, v, _ = make(grad=False)
    args = {**dict(q=q, k=k, v=v), **change}
    with pytest.raises(error, match=message) as info:
        nt.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    text = str(info.value)
    assert "_ref" not in text and "use_causal_mask" not in text and "sliding_window" not in text


def test_backward_error_names_do():
    q, k, v, do = make()
    o = nt.attention(q, k, v, causal=True, layout="bhsd")
    do = do.clone()
    do[1, 2, 3, 4] = float("nan")
    with pytest.raises(ValueError, match=r"^do must be finite, got 1 NaN/inf element\(s\) of 40960$"):
        o.backward(do)


# ---------------------------------------------------------------------------
# The training example
# ---------------------------------------------------------------------------

def test_training_example_loss_falls():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_torch.py"
    spec = importlib.util.spec_from_file_location("train_torch", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses, _, _, model = example.train(example.numbafa_attention, steps=25, seq=64, window=16, log_every=0)
    assert np.mean(losses[-5:]) < losses[0] - 0.5, losses
    assert model.blocks[0].sinks.detach().abs().sum() > 0   # the sinks trained
    sdpa_losses, *_ = example.train(example.sdpa_attention, steps=3, seq=64, window=16, log_every=0)
    assert abs(sdpa_losses[0] - losses[0]) < 1e-3           # same model and data at step 0


def test_training_example_says_its_last_loss_is_a_mean(capsys):
    """The table's second loss is the mean of the last 10 steps, and says so; so does the page quoting it."""
    import importlib.util
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("train_torch", root / "examples" / "train_torch.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--steps", "12", "--seq", "64", "--window", "16", "--no-sdpa"])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("attention"))
    assert header.split()[3:6] == ["last", "10", "mean"] and "last loss" not in out, header
    assert "last 10 mean: the loss averaged over the last 10 steps" in out
    page = " ".join((root / "docs" / "frameworks.md").read_text().split())
    quoted = page[page.index("the loss fell from"):][:200]
    assert "mean of the last 10 steps" in quoted, quoted


def test_a_window_beyond_int64_is_the_whole_sequence():
    """A window wider than the keys is capped at them, as the NumPy API caps it (it used to reach
    the int64 operator argument: "Expected a value of type 'int' ... found type 'int'")."""
    q, k, v, _ = make(grad=False)
    expected = nt.attention(q, k, v, causal=True, window=S)
    for window in (S + 1, 2 ** 63, 2 ** 80):
        torch.testing.assert_close(nt.attention(q, k, v, causal=True, window=window), expected, rtol=0, atol=0)


def test_eager_calls_skip_the_dispatcher_unless_a_dispatch_mode_watches():
    """Plain eager calls run the operators' bodies directly (the dispatcher costs ~0.1 ms a
    call); under a TorchDispatchMode the operators are dispatched, so the mode sees them; the
    results are the same bits either way, gradients included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v, do = make(seed=8)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    direct = nt.attention(*leaves, causal=True)
    direct_grads = torch.autograd.grad(direct, leaves, do)
    with Seen() as seen:
        watched = nt.attention(*leaves, causal=True)
        watched_grads = torch.autograd.grad(watched, leaves, do)
    assert any("numbafa.attention_fwd" in op for op in seen.ops), seen.ops
    assert any("numbafa.attention_bwd" in op for op in seen.ops), seen.ops
    with Seen() as quiet:
        pass
    assert quiet.ops == []
    for a, b in zip((direct,) + direct_grads, (watched,) + watched_grads):
        assert torch.equal(a, b)


def test_a_repeated_call_is_remembered_without_building_its_options(monkeypatch, no_remembered_calls):
    """The operators' bodies look a call up from their arguments as given
    (numbafa.pipeline.core.remembered_fwd / remembered_bwd): a repeat of a call builds no options
    and gives the same bits, gradients included; a call with sinks builds them (the full path)."""
    def boom(*args, **kwargs):
        raise AssertionError("the full path ran")

    q, k, v, do = make(seed=9)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    first = nt.attention(*leaves, causal=True, window=64)
    first_grads = torch.autograd.grad(first, leaves, do)
    monkeypatch.setattr(nt, "_host_options", boom)
    again = nt.attention(*leaves, causal=True, window=64)
    again_grads = torch.autograd.grad(again, leaves, do)
    for a, b in zip((first,) + first_grads, (again,) + again_grads):
        assert torch.equal(a, b)
    with pytest.raises(AssertionError, match="the full path ran"):
        nt.attention(*leaves, causal=True, window=64, sinks=torch.zeros(q.shape[1]))
    with pytest.raises(AssertionError, match="the full path ran"):   # another window: not remembered
        nt.attention(*leaves, causal=True, window=32)


def test_a_plain_eager_call_has_no_permutes_in_its_graph():
    """In plain eager mode the layout changes are NumPy views inside the one autograd node (four
    permutes in the graph cost a small model's step ~40 us): o's node takes q, k and v's
    gradients straight to their leaves, and o has the strides of the dispatched operator's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watching(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    for layout in ("bhsd", "bshd"):
        q, k, v, _ = make(layout, seed=10)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        o = nt.attention(*leaves, causal=True, layout=layout)
        assert type(o.grad_fn).__name__ == "_EagerAttentionBackward", o.grad_fn
        assert [type(f).__name__ for f, _ in o.grad_fn.next_functions[:3]] == ["AccumulateGrad"] * 3
        with Watching():
            dispatched = nt.attention(*leaves, causal=True, layout=layout)
        assert o.shape == dispatched.shape and o.stride() == dispatched.stride() and torch.equal(o, dispatched)


def test_the_eager_backward_converts_only_do_and_still_sees_in_place_changes(monkeypatch):
    """The plain-eager node keeps the forward's NumPy views of q, k, v, o and lse for its backward
    (one tensor converted there: do) and then lets them go, gives the gradients of the dispatched
    path bit for bit (a second backward of a retained graph too), and still lets autograd refuse
    a backward after q or o changed in place."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watching(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    q, k, v, do = make("bshd", seed=12)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with Watching():
        expected = torch.autograd.grad(nt.attention(*leaves, causal=True, layout="bshd"), leaves, do)
    o = nt.attention(*leaves, causal=True, layout="bshd")
    converted = []
    to_numpy = nt.to_numpy
    monkeypatch.setattr(nt, "to_numpy", lambda t: converted.append(t) or to_numpy(t))
    got = torch.autograd.grad(o, leaves, do, retain_graph=True)
    assert len(converted) == 1 and converted[0] is do
    assert o.grad_fn.arrays is None   # the views let go, as the saved tensors would be
    again = torch.autograd.grad(o, leaves, do)   # (retain_graph: from the saved tensors)
    for g, g2, e in zip(got, again, expected):
        assert g.stride() == e.stride() and torch.equal(g, e) and torch.equal(g2, e)
    for change in ("q", "o"):
        q_used = leaves[0] * 1.0
        o = nt.attention(q_used, leaves[1], leaves[2], causal=True, layout="bshd")
        (q_used if change == "q" else o).add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            o.backward(do)


def test_a_repeated_plain_call_skips_its_checks_but_not_the_tensors_type_and_device(monkeypatch):
    """A call of plain CPU tensors without option tensors or dropout remembers its checks
    (nt._PLAIN_CALLS); another scalar option, a tensor on another device or not a tensor at all
    is checked again, with the usual error."""
    monkeypatch.setattr(nt, "_PLAIN_CALLS", type(nt._PLAIN_CALLS)())   # what earlier calls left: gone
    q, k, v, _ = make(grad=False, seed=11)
    expected = nt.attention(q, k, v, causal=True, window=64)
    checked = nt._checked_call

    def boom(*args, **kwargs):
        raise AssertionError("checked again")

    monkeypatch.setattr(nt, "_checked_call", boom)
    torch.testing.assert_close(nt.attention(q.clone(), k, v, causal=True, window=64), expected, rtol=0, atol=0)
    with pytest.raises(AssertionError, match="checked again"):
        nt.attention(q, k, v, causal=True, window=32)
    with pytest.raises(AssertionError, match="checked again"):
        nt.attention(q, k, v, causal=1, window=64)
    monkeypatch.setattr(nt, "_checked_call", checked)
    with pytest.raises(ValueError, match="^q must be on the CPU"):
        nt.attention(q.to("meta"), k, v, causal=True, window=64)
    with pytest.raises(TypeError, match="^k must be a torch.Tensor, got ndarray"):
        nt.attention(q, k.numpy(), v, causal=True, window=64)
