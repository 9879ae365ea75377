"""The flip budget: how far a faithful bf16 kernel may stray from the numerics golden.

The per-element tolerance of the bf16 faithfulness tests (tests/_tolerances.py,
"Faithfulness"): an implementation with the same rounding points as
:func:`numbafa.golden.attention_bwd_rounded` but other float32 summation orders
(and another float32 exp) is within ``FINAL_ULPS * ulp(e) + budget`` of it on
every element of dq, dk, dv (and dsinks). The budget sums, per element
(docs/numerics.md, "How far two faithful implementations differ", derives each
term):

* one bf16 ulp of the value rounded per *intermediate* rounding of the
  element's accumulator (a flip early in the chain is carried unchanged to the
  output): :class:`_Flips`;
* the flips within reach of the D, P and dS tiles, times the operand they
  multiply: :func:`_rowsum_spread`, :func:`_score_tile_spreads`;
* the output GEMMs' own float32 order: :func:`_output_spreads`;
* for dsinks, one ulp per rounding of its 128 lanes (bf16 accumulators), the
  spreads of ``p_sink`` and D, and the lanes' sum: :func:`_sink_spread`.

float32 inputs get the float32 order terms only. The budget is computed from
the tiles the golden shows an observer (:class:`numbafa.golden.Observer`); it
never recomputes them.
"""

from __future__ import annotations

import numpy as np

from numbafa import golden

from _tolerances import FINAL_ULPS, FLOAT32_SUM_ORDER, assert_close

_U = 2.0 ** -24       # float32 unit roundoff
_TINY = 2.0 ** -126   # smallest normal float32/bf16: oneDNN's bf16 units flush below it (DAZ, FTZ)
#: exp's error on both sides, in float32 ulps of the exact value: the kernel's expf is within
#: 1 ulp of the correctly rounded value (numbafa/kernels/fastexp.py), so 1.5 of the exact one;
#: NumPy's float32 exp (SIMD) was measured at most EXP_ULPS_NUMPY over [-104, 2], all inputs.
_EXP_ULPS_KERNEL = 1.5
_EXP_ULPS_NUMPY = 3.0
_EXP_ULPS = _EXP_ULPS_KERNEL + _EXP_ULPS_NUMPY
#: tanh's error on both sides (the soft cap), in float32 ulps of the value: the kernel's tanhf, 2
#: (measured within 1.28 ulp over 8 million inputs in [-50, 50] and down to 1e-30,
#: numbafa/kernels/fastexp.py); NumPy's float32 tanh, 4: its SIMD loops are Intel SVML's
#: low-accuracy tanh (bounded by 4 ulp) on every x86 target (AVX2+FMA3 and AVX-512 alike; measured
#: 1.36 ulp on Zen 3), and on other CPUs libm's, within that.
_TANH_ULPS = 6.0


def _gamma(n):
    """Higham's ``gamma_n = n u / (1 - n u)``: a float32 evaluation of a sum of exact terms with
    ``n`` roundings on the path to the result (``n - 1`` additions for ``n`` terms, in any order:
    sequential, blocked, pairwise) is within ``gamma_n * sum|term|`` of the exact sum."""
    return n * _U / (1.0 - n * _U)


def _abs_matmul(a, b):
    """An upper bound of ``|a| @ |b|`` in float64 (float32 product of the magnitudes, inflated
    by its own worst-case relative error, so it never under-estimates)."""
    n = a.shape[-1]
    prod = np.abs(a).astype(np.float32) @ np.abs(b).astype(np.float32)
    return prod.astype(np.float64) * (1.0 + 2.0 * _gamma(n + 2))


def _max_abs(*arrays):
    return max(float(np.abs(a).max(initial=0)) for a in arrays)


def _order_spread(abs_sum, n, max_abs_operand=0.0):
    """Largest difference between two float32 evaluations, with ``n`` roundings each, of a sum
    of exact products whose magnitudes sum to ``abs_sum``: each side is within
    ``gamma_n * abs_sum`` of the exact value, and a side that flushes bf16 subnormals (oneDNN's
    bf16 units) loses at most ``2^-126`` per addition and ``2^-126 * max|operand|`` per product
    (``max_abs_operand``; 0 where no such flush happens)."""
    return 2.0 * _gamma(n) * abs_sum + (n + 1) * _TINY * max_abs_operand


def _rounding_spread(x, radius, rounds, rnd=golden._bf16_round):
    """Largest ``|round(y) - round(x)|`` over float32 ``y`` with ``|y - x| <= radius`` (float64).

    ``x`` is the golden's float32 value before a rounding point, ``radius`` a bound on how far
    another implementation's value can be from it. Without a rounding (``rounds`` False: the tile
    is float32) the spread is the radius itself. With one, rounding to bf16 is monotone, so the
    extremes are the roundings of the interval's ends (taken outward to float32): the spread is
    zero unless the interval holds a bf16 rounding boundary, and then it is the bf16 step(s)
    crossed -- one ulp of the value for a small radius. ``rnd``: the rounding (bf16's, or fp16's
    for float16 inputs: also monotone).
    """
    radius = np.asarray(radius, np.float64)
    if not rounds:
        return radius
    x, radius = np.broadcast_arrays(np.asarray(x), radius)
    spread = np.zeros(radius.shape)
    live = radius > 0          # elsewhere nothing else is within reach: 0 (computed only where live)
    x, radius = x[live], radius[live]
    x64 = x.astype(np.float64)
    lo64, hi64 = x64 - radius, x64 + radius
    with np.errstate(over="ignore"):
        lo, hi = lo64.astype(np.float32), hi64.astype(np.float32)
    lo = np.where(lo > lo64, np.nextafter(lo, np.float32(-np.inf)), lo)
    hi = np.where(hi < hi64, np.nextafter(hi, np.float32(np.inf)), hi)
    centre = rnd(x).astype(np.float64)
    spread[live] = np.maximum(rnd(hi) - centre, centre - rnd(lo))
    return spread


def _rowsum_spread(prod, d_tile, round_partial, round_total, rnd):
    """How far another order can move ``D = rowsum(O * dO)`` (rounding points 4, 5), per row.

    The products are rounded elementwise (the same on both sides); each head-dim tile's
    partial is a float32 sum of ``d_tile`` of them, and ``D`` the float32 sum of the partials.
    """
    f32 = np.float32
    parts, part_spreads = [], []
    for i in range(0, prod.shape[1], d_tile):
        chunk = prod[:, i:i + d_tile]
        pre = chunk.sum(axis=1, dtype=f32)
        radius = _order_spread(np.abs(chunk).sum(axis=1, dtype=np.float64), chunk.shape[1] - 1)
        parts.append(rnd(pre) if round_partial else pre)
        part_spreads.append(_rounding_spread(pre, radius, round_partial, rnd))
    pre = np.sum(parts, axis=0, dtype=f32)
    part_spread = np.sum(part_spreads, axis=0)      # the other side's parts: within that of ours
    radius = (1.0 + _U) * part_spread + _order_spread(
        np.abs(np.asarray(parts, np.float64)).sum(axis=0) + part_spread, len(parts) - 1)
    return _rounding_spread(pre, radius, round_total, rnd)


def _score_tile_spreads(tiles, d_spread, setup):
    """How far another implementation's P and dS tiles can be from the golden's, per element.

    ``S = Q_s K^T`` and ``dP = dO V^T`` are float32 sums of ``d_head`` (``d_head_v``) exact products: the two
    sides' values are within :func:`_order_spread` of each other. That moves
    ``t = fl(S + (-LSE))`` (another float32 rounding each side), ``P = exp(t)`` by the factor
    ``e^|dt|`` and by both exps' last-bit errors, and ``dS = fl(fl(dP - D) * P)`` by the spreads
    of dP, D (``d_spread``) and the (rounded) P. Masked entries are exactly 0 on both sides: the
    spreads are computed on the allowed entries alone (as one flat array each; a causal or
    windowed tile holds a fraction of them) and are 0 elsewhere.
    With dropout (``tiles.mult``: the multipliers M; ``tiles.dp``: the golden's ``fl(dP * M)``),
    dP's spread is scaled by M, plus one float32 rounding of the product on each side.
    Returns ``(dev_p, dev_ds)``: float64 bounds on ``|P' - P|`` and ``|dS' - dS|`` after the
    kernel_dtype roundings -- zero except on elements whose value lies within that distance of
    a bf16 rounding boundary.
    """
    u32 = 2.0 ** -23   # float32 ulp relative to the value (at most)
    qs, kt, dyt, vt = tiles.qs, tiles.kt, tiles.dyt, tiles.vt
    allowed, rounds = setup.allowed, setup.rounding.rounds

    def on(x):
        """The allowed entries of a tile, flat (row by row)."""
        return x[allowed]

    def tile(flat):
        """A tile of 0 with ``flat`` at the allowed entries."""
        out = np.zeros(allowed.shape)
        out[allowed] = flat
        return out

    d = qs.shape[1]
    r_s = on(_order_spread(_abs_matmul(qs, kt.T), d - 1, 1.0 + _max_abs(qs, kt)))
    r_s, r_tanh = _variant_spreads(r_s, tiles, setup, on)
    r_s = np.where(np.isfinite(r_s), r_s, 0.0)   # a -inf bias: exactly -inf, P = 0, on both sides
    # t = -inf (a -inf bias): exactly that on both sides, P = 0
    t = on(tiles.t)
    visible = np.isfinite(t)
    r_t = np.where(visible, (1.0 + _U) * r_s + 2.0 * _U * np.abs(np.where(visible, t, 0.0).astype(np.float64)), 0.0)
    p_pre = on(tiles.p_pre)
    p64 = p_pre.astype(np.float64)
    r_p = p64 * (np.expm1(r_t) * (1.0 + _EXP_ULPS_KERNEL * u32) + _EXP_ULPS * u32) \
        / (1.0 - _EXP_ULPS_NUMPY * u32) + _EXP_ULPS * 2.0 ** -149
    rnd = setup.rounding.round
    dev_p = _rounding_spread(p_pre, r_p, rounds("p"), rnd)
    r_dp = on(_order_spread(_abs_matmul(dyt, vt.T), dyt.shape[1] - 1, 1.0 + _max_abs(dyt, vt)))   # over d_head_v
    m64 = on(tiles.m).astype(np.float64)
    if tiles.mult is not None:
        r_dp = (1.0 + _U) * r_dp * on(tiles.mult).astype(np.float64) + 2.0 * _U * np.abs(on(tiles.dp).astype(np.float64))
    r_m = (1.0 + _U) * (r_dp + d_spread[np.nonzero(allowed)[0]]) + 2.0 * _U * np.abs(m64)
    ds_pre = on(tiles.ds_pre)
    r_ds = (1.0 + 2.0 * _U) * (r_m * (np.abs(on(tiles.p).astype(np.float64)) + dev_p) + np.abs(m64) * dev_p) \
        + 2.0 * _U * np.abs(ds_pre.astype(np.float64))
    dev_ds = _rounding_spread(ds_pre, r_ds, rounds("ds"), rnd)
    dev_ds_mod = dev_ds
    if tiles.tanh is not None:   # dS = fl(dS' * fl(1 - fl(t * t))), rounded again
        tanh, ds_mod = on(tiles.tanh), on(tiles.ds_mod)
        tau = np.abs(tanh.astype(np.float64))
        factor = 1.0 - tau * tau
        r_f = (1.0 + _U) * (2.0 * tau + r_tanh) * r_tanh + 2.0 * _U * (tau * tau + factor)
        pre = ds_mod * (np.float32(1.0) - tanh * tanh)
        r_x = (1.0 + _U) * (dev_ds * (factor + r_f) + np.abs(ds_mod.astype(np.float64)) * r_f) \
            + 2.0 * _U * np.abs(pre.astype(np.float64))
        dev_ds = _rounding_spread(pre, r_x, rounds("ds"), rnd)
    return tile(dev_p), tile(dev_ds), tile(dev_ds_mod)


def _variant_spreads(r_s, tiles, setup, on):
    """How far the score variants (docs/numerics.md) carry the spread ``r_s`` of ``S``: ``(r, r_tanh)``,
    the spread of the modified scores and of the soft cap's tanh (0 without one); ``on`` takes a
    tile's entries that ``r_s`` holds.

    The soft cap: ``y = fl(S * inv)`` moves by ``inv * r_s`` and both sides' rounding, tanh
    (Lipschitz 1) by that plus both sides' tanh errors (:data:`_TANH_ULPS`), ``fl(cap * tanh)``
    by ``cap`` times that and both roundings. Each later step (``+ bias``, ``- ALiBi``: the same
    operands on both sides) adds both sides' rounding of its result.
    """
    u32 = 2.0 ** -23
    steps = list(tiles.steps)
    r_tanh = 0.0
    if tiles.tanh is not None:
        cap = float(setup.softcap)
        inv = float(np.float32(1.0 / cap))
        y = np.abs(on(tiles.s).astype(np.float64)) * inv
        r_y = (1.0 + _U) * inv * r_s + 2.0 * _U * y
        tau = np.abs(on(tiles.tanh).astype(np.float64))
        r_tanh = r_y + _TANH_ULPS * u32 * tau + 2.0 ** -148
        r_s = (1.0 + _U) * cap * r_tanh + 2.0 * _U * np.abs(on(steps.pop(0)).astype(np.float64))
    for x in steps:
        r_s = (1.0 + _U) * r_s + 2.0 * _U * np.abs(on(x).astype(np.float64))
    return r_s, r_tanh


def _output_spreads(dev_p, dev_ds, tiles, setup):
    """One q-head's share of the dQ^T, dK^T, dV^T budgets ``[rows, d]`` from the score tiles.

    A tile element that another implementation rounds differently (``dev_*`` > 0) moves each
    output it feeds by at most ``dev * |the other operand|``: ``dV += P^T dO`` (the P that dV
    takes, ``tiles.p_dv``), ``dK += dS^T Q_s``, ``dQ += dS K * scale``. On top, the output
    GEMMs are themselves float32 sums with ``n`` roundings on any term's path (``n_dq``:
    seqlen_k - 1 additions, plus the ``* scale`` and the addition into dQ of each K tile;
    ``n_dkv``: q-heads per KV head x seqlen_q terms) in an unknown order:
    ``2 gamma_n sum|term|``, the terms being at most ``|x| + dev`` on the other side.
    """
    def spread(dev, x, other, n):
        weight = (1.0 + 2.0 * _gamma(n)) * dev + 2.0 * _gamma(n) * np.abs(x.astype(np.float64))
        return _abs_matmul(weight, other) + (n + 1) * _TINY * (1.0 + _max_abs(other))

    seqlen_q, seqlen_k = tiles.qs.shape[0], tiles.kt.shape[0]
    n_dq = seqlen_k + 2 * -(-seqlen_k // 512)
    n_dkv = setup.n_rep * seqlen_q
    ds = tiles.ds
    dq = float(setup.scale) * (1.0 + _U) * spread(dev_ds, ds, tiles.kt, n_dq)
    dk = spread(dev_ds.T, ds.T, tiles.qs, n_dkv)
    dv = spread(dev_p.T, tiles.p_dv.T, tiles.dyt, n_dkv)
    return dq, dk, dv


def _sink_spread(sink, neg_lse, d_sum, d_spread, lanes, round_p, rnd):
    """How far another implementation's dsinks sum can be from this golden's, before the
    roundings of the lanes (counted one ulp each by the caller) and of the result.

    ``p_sink = exp(sink + (-LSE))`` may differ by both exps' last-bit errors and, when it is
    rounded (``round_p``), flip; ``D`` by ``d_spread``; each lane takes ``p_sink * D`` of its
    rows (a product and a difference, float32), and the 128 lanes are summed in float32.
    """
    u32 = 2.0 ** -23
    pre = np.exp(sink + neg_lse)
    p64 = pre.astype(np.float64)
    radius = p64 * _EXP_ULPS * u32 / (1.0 - _EXP_ULPS_NUMPY * u32) + _EXP_ULPS * 2.0 ** -149
    dev = _rounding_spread(pre, radius, round_p, rnd)
    p_sink = np.abs((rnd(pre) if round_p else pre).astype(np.float64))
    d_abs = np.abs(d_sum.astype(np.float64))
    per_row = (1.0 + 4.0 * _U) * (dev * (d_abs + d_spread) + p_sink * d_spread)
    return float(per_row.sum() + _order_spread(np.abs(lanes.astype(np.float64)).sum(), lanes.size - 1))


def bf16_ulp(x):
    """One bf16 ulp of each element of ``x`` (float64; subnormal spacing 2^-133 at the bottom)."""
    mag = np.abs(np.asarray(x, np.float64))
    exponent = np.floor(np.log2(np.maximum(mag, 2.0 ** -133)))
    return 2.0 ** (np.maximum(exponent, -126) - 7)


def _f32_ulp(x):
    """float32's ulp of ``|x|`` (float64 in, float64 out)."""
    return np.spacing(np.abs(np.asarray(x, np.float64)).astype(np.float32)).astype(np.float64)


def fp16_ulp(x):
    """One fp16 ulp of each element of ``x`` (float64; subnormal spacing 2^-24 at the bottom)."""
    mag = np.abs(np.asarray(x, np.float64))
    exponent = np.floor(np.log2(np.maximum(mag, 2.0 ** -24)))
    return 2.0 ** (np.maximum(exponent, -14) - 10)


def kernel_ulp(rounding):
    """The ulp function of the kernel dtype of a :class:`numbafa.golden.Rounding`."""
    return fp16_ulp if rounding.fp16 else bf16_ulp


class _Flips:
    """Sums one bf16 ulp per rounding of an accumulator, except its latest one.

    ``rounded(x)`` is called with each freshly rounded accumulator value; the
    ulp of the previous rounded value joins the budget then, so at the end the
    budget holds every rounding but the last (the output's own).
    """

    def __init__(self, shape, ulp=bf16_ulp):
        self.total = np.zeros(shape)
        self._last = np.zeros(shape)
        self._ulp = ulp

    def rounded(self, x):
        self.total += self._last
        self._last = self._ulp(x)

    def budget(self, last_too):
        """The ulps of every rounding but the last, and of the last too if ``last_too``."""
        return self.total + self._last if last_too else self.total


class _BudgetObserver(golden.Observer):
    """Builds the budgets of one golden call from what it is shown.

    ``shapes``: of dq, dk, dv and of the sinks as the golden holds them
    (``[bs, nheads, num_sinks]``); ``dbias_shape``: the bias's, as 4-D, when dbias is asked for.
    """

    def __init__(self, shapes, dbias_shape=None):
        self.budgets = tuple(np.zeros(shape) for shape in shapes)
        self.dbias = None if dbias_shape is None else np.zeros(dbias_shape)
        self.flips = {}          # (output, index) -> _Flips of that accumulator
        self.lane_ulps = {}      # dsinks index -> the ulps of its lanes' roundings, per lane
        self.rows = {}           # (b, h) -> -LSE, D and D's spread
        self.setup = None

    def start(self, setup):
        self.setup = setup

    def head(self, index, tiles):
        """The P and dS flips of one q-head, and the output GEMMs' float32 sums."""
        b, h = index
        hk = h // self.setup.n_rep
        rounds = self.setup.rounding.rounds
        d_spread = _rowsum_spread(tiles.prod, self.setup.d_tile, rounds("d_partial"), rounds("d_total"),
                                  self.setup.rounding.round)
        self.rows[index] = (tiles.neg_lse, tiles.d_sum, d_spread)
        dev_p, dev_ds, dev_ds_mod = _score_tile_spreads(tiles, d_spread, self.setup)
        if self.dbias is not None:
            self._add_dbias_spread(b, h, dev_ds_mod, tiles.ds_mod)
        if tiles.mult is not None:  # P~'s own rounding of a P that may differ
            dev_p = _rounding_spread(tiles.p * tiles.mult, dev_p * tiles.mult, rounds("p"), self.setup.rounding.round)
        head_q, head_k, head_v = _output_spreads(dev_p, dev_ds, tiles, self.setup)
        self.budgets[0][b, h] += head_q.T
        self.budgets[1][b, hk] += head_k.T
        self.budgets[2][b, hk] += head_v.T

    def _add_dbias_spread(self, b, h, dev_ds_mod, ds_mod):
        """dbias sums the rounded dS' of every (batch, head, row) sharing an element, in float32 in
        some order: the terms' spreads plus the sum's own order (``2 gamma_n sum|term|``)."""
        bs, nheads = self.budgets[0].shape[:2]
        full = (bs, nheads) + ds_mod.shape
        n = int(np.prod([f // s for f, s in zip(full, self.dbias.shape)]))
        weight = dev_ds_mod + 2.0 * _gamma(n) * np.abs(ds_mod.astype(np.float64))
        slab = self.dbias[b if self.dbias.shape[0] > 1 else 0, h if self.dbias.shape[1] > 1 else 0]
        slab += weight.sum(axis=0, keepdims=True) if slab.shape[0] == 1 else weight

    def accumulated(self, output, index, value, point):
        if not self.setup.rounding.rounds(point):
            return
        if output == "dsinks":   # every rounding of a lane precedes the final one (of the sum)
            lane_ulps = self.lane_ulps.setdefault(index, np.zeros(128))
            lane_ulps[:value.size] += kernel_ulp(self.setup.rounding)(value)
            return
        if (output, index) not in self.flips:
            self.flips[output, index] = _Flips(value.shape, kernel_ulp(self.setup.rounding))
        self.flips[output, index].rounded(value)

    def sink(self, index, logit, lanes):
        neg_lse, d_sum, d_spread = self.rows[index[:2]]
        lane_ulps = self.lane_ulps.get(index, np.zeros(128))
        self.budgets[3][index] = lane_ulps.sum() + _sink_spread(
            logit, neg_lse, d_sum, d_spread, lanes, self.setup.rounding.rounds("sinks"), self.setup.rounding.round)

    def finish(self):
        """Adds the accumulators' flips to the budgets and returns those of dq, dk, dv, dsinks.

        A float32 accumulator of a bf16 output (mixed_precision) is rounded once more, apart:
        then its last rounding is an intermediate one too.
        """
        rounding = self.setup.rounding
        apart = rounding.narrow and rounding.mixed_precision
        out = {"dq": 0, "dk": 1, "dv": 2}
        for (output, index), flips in self.flips.items():
            self.budgets[out[output]][index] += flips.budget(apart).T
        return self.budgets


def rounded_with_budget(**kwargs):
    """:func:`numbafa.golden.attention_bwd_rounded` of ``kwargs``, and its flip budget.

    Returns ``(dq, dk, dv[, dsinks], budgets)``: the golden's results, and
    ``budgets``, a tuple of float64 arrays shaped like dq, dk, dv (and dsinks):
    how far an implementation with the same rounding points but other float32
    summation orders (and another float32 exp) may stray beyond the final
    rounding's own ulp.
    """
    bs, nheads, d_head, seqlen_q = np.shape(kwargs["q_ref"])
    nheads_kv, seqlen_k = np.shape(kwargs["k_ref"])[1], np.shape(kwargs["k_ref"])[3]
    sinks = kwargs.get("sinks_ref")
    num_sinks = 0 if sinks is None else np.size(sinks) // (bs * nheads)
    bias_shape = None
    if kwargs.get("return_dbias"):
        shape = np.shape(kwargs["bias"])
        bias_shape = (1,) * (4 - len(shape)) + shape
    observer = _BudgetObserver([(bs, nheads, d_head, seqlen_q), (bs, nheads_kv, d_head, seqlen_k),
                                np.shape(kwargs["v_ref"])[:2] + (np.shape(kwargs["v_ref"])[2], seqlen_k),
                                (bs, nheads, num_sinks)], bias_shape)
    results = golden.attention_bwd_rounded(**kwargs, observer=observer)
    budgets = observer.finish()[:3]
    if sinks is not None:
        budgets += (observer.budgets[3].reshape(np.shape(sinks)),)
    if bias_shape is not None:
        budgets += (observer.dbias.reshape(np.shape(kwargs["bias"])),)
    return results + (budgets,)


def faithfulness(actual, expected, budget, ulp=bf16_ulp):
    """(fraction bit-identical, worst ``|a - e| / allowed`` over all elements).

    ``allowed = FINAL_ULPS * ulp(max(|a|, |e|)) + budget``: the output's own rounding may flip,
    and ``budget`` (from :func:`rounded_with_budget`) bounds everything before it: flips
    of the accumulator's intermediate roundings, of the P, dS and D tiles, and the output GEMMs'
    own float32 summation order (tests/_tolerances.py). ``ulp``: of the kernel dtype (bf16's,
    or :func:`fp16_ulp`).
    """
    a = np.asarray(actual, np.float32)
    e = np.asarray(expected, np.float32)
    if e.size == 0:
        return 1.0, 0.0
    identical = float(np.mean(a.view(np.uint32) == e.view(np.uint32)))
    a64, e64 = a.astype(np.float64), e.astype(np.float64)
    allowed = FINAL_ULPS * ulp(np.maximum(np.abs(a64), np.abs(e64))) + budget
    return identical, float((np.abs(a64 - e64) / allowed).max())


def assert_faithful(inputs, got, mixed, min_identical, ulp=bf16_ulp):
    """Assert that the kernel's ``got`` (dq, dk, dv[, dsinks]) for ``inputs`` (keyword arguments of
    ``attention_bwd``) with ``mixed_precision=mixed`` are faithful to the numerics golden: every
    element within its bound (:func:`faithfulness`) and at least ``min_identical`` of dq, dk, dv
    bit-identical. float32 dsinks (``mixed``) are a float32 sum, compared as such."""
    *emulated, budgets = rounded_with_budget(**inputs, mixed_precision=mixed)
    names = ("dq", "dk", "dv") + (("dsinks",) if inputs.get("sinks_ref") is not None else ()) \
        + (("dbias",) if inputs.get("return_dbias") else ())
    for name, g, e, budget in zip(names, got, emulated, budgets):
        if name == "dsinks" and mixed:
            assert_close(g, e, FLOAT32_SUM_ORDER, name)
            continue
        out_ulp = ulp
        if name == "dbias" and np.asarray(g).dtype == np.float32:   # a float32 sum: its own ulp
            out_ulp = _f32_ulp
        identical, excess = faithfulness(g.astype(np.float32), e, budget, out_ulp)
        if name not in ("dsinks", "dbias"):  # dsinks: a handful of elements; dbias: a float32 sum
            assert identical >= min_identical, f"{name}: only {identical:.4%} bit-identical"
        assert excess <= 1.0, f"{name}: {excess:.2f}x the flip bound"
