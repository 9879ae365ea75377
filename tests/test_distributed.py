"""numbafa.distributed on a real Dask cluster: bitwise the single-process results.

One ``LocalCluster`` of 2 worker processes (1 thread each) serves the whole
module. Before it starts, every kernel is run once in this process, so the
workers load the compiled code from the on-disk cache instead of compiling.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

distributed = pytest.importorskip("dask.distributed")
da = pytest.importorskip("dask.array")
ml_dtypes = pytest.importorskip("ml_dtypes")

import numbafa  # noqa: E402
import numbafa.distributed as nd  # noqa: E402
from numbafa.pipeline import shards  # noqa: E402
from _problems import Case, forward_options, make_inputs, validated  # noqa: E402

BF16 = ml_dtypes.bfloat16

# (id, case, dtype, mixed_precision). The units a call has decide its split: 1, 3 or 5 units
# with seqlen_q > 256 split every unit in two Q chunks (float32, or bf16 with mixed_precision).
CASES = [
    ("mha", Case(bs=2, nheads=2, nheads_kv=2, d_head=32), np.float32, False),
    ("gqa-causal", Case(bs=1, nheads=4, nheads_kv=2, d_head=32, causal=True), np.float32, False),
    ("mqa-batch1-split", Case(bs=1, nheads=4, nheads_kv=1, d_head=32, seqlen_q=1024, seqlen_k=1024,
                              causal=True), np.float32, False),
    ("window-split", Case(bs=1, nheads=2, nheads_kv=1, d_head=32, seqlen_q=640, seqlen_k=640,
                          causal=True, window=200), np.float32, False),
    ("sinks-3-units-split", Case(bs=3, nheads=2, nheads_kv=1, d_head=16, seqlen_q=640, seqlen_k=640,
                                 num_sinks=2), np.float32, False),
    ("packing", Case(bs=1, nheads=2, nheads_kv=2, d_head=32, packing=(100, 156)), np.float32, False),
    ("bf16-mixed-split-sinks", Case(bs=1, nheads=2, nheads_kv=1, d_head=32, seqlen_q=640,
                                    seqlen_k=640, causal=True, num_sinks=1), BF16, True),
    ("bf16-not-mixed-sinks", Case(bs=1, nheads=4, nheads_kv=2, d_head=32, causal=True, num_sinks=1),
     BF16, False),
    # Small units, grouped into blocks per task (_units_per_task): 3 + 1 KV heads of a batch,
    # and 2 whole batches.
    ("blocks-of-kv-heads", Case(bs=3, nheads=8, nheads_kv=4, d_head=16, seqlen_q=128, seqlen_k=128,
                                causal=True, num_sinks=1), np.float32, False),
    ("blocks-of-batches", Case(bs=9, nheads=2, nheads_kv=1, d_head=16, seqlen_q=128, seqlen_k=128),
     np.float32, False),
    # v, o, dy with a head dim of their own (48) next to q and k's (32)
    ("head-dims-split-sinks", Case(bs=1, nheads=2, nheads_kv=1, d_head=32, d_head_v=48, seqlen_q=640,
                                   seqlen_k=640, causal=True, num_sinks=1), np.float32, False),
    ("float64-sinks-split", Case(bs=1, nheads=4, nheads_kv=1, d_head=16, seqlen_q=640, seqlen_k=640,
                                 causal=True, num_sinks=2), np.float64, False),
]


def assert_bitwise(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        g = np.asarray(g)
        assert g.shape == e.shape and g.dtype == e.dtype
        assert np.array_equal(g.view(np.uint8), e.view(np.uint8)), "results differ in their bits"


def _fwd_kwargs(inputs, mixed):
    return dict(forward_options(inputs), mixed_precision=mixed)


@pytest.fixture(scope="module")
def client():
    # Compile (or load) every kernel here first: the workers then load it from the cache.
    for dtype in (np.float32, BF16):
        for kernel in ("forward", "backward"):
            for dropout in (False, True):
                shards.warm(kernel, np.dtype(dtype).name, dropout)
    for kernel in ("forward", "backward"):   # and the float32 kernels with score variants
        shards.warm(kernel, "float32", False, True)
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       dashboard_address=None)
    with distributed.Client(cluster) as c:
        yield c
    cluster.close()


#: Seconds to wait for the nannies' replacements of killed workers: a fresh process importing numba,
#: dask and numbafa and loading the kernels from the cache, which took more than 60 s on a 2-core
#: machine busy with a compile (a timeout only ends a wait that would otherwise hang).
_RESTART_WAIT = 600


def _dask_inputs(inputs, n_rep, head_chunk):
    """The arrays of ``inputs`` as Dask arrays, one batch and ``head_chunk`` q-heads per chunk."""
    out = dict(inputs)
    for key in ("q_ref", "o_ref", "dy_ref", "lse_ref"):
        out[key] = da.from_array(inputs[key], chunks=(1, head_chunk) + inputs[key].shape[2:])
    for key in ("k_ref", "v_ref"):
        out[key] = da.from_array(inputs[key], chunks=(1, head_chunk // n_rep) + inputs[key].shape[2:])
    return out


@pytest.mark.parametrize("name, case, dtype, mixed", CASES, ids=[c[0] for c in CASES])
def test_numpy_inputs_give_the_single_process_bits(client, name, case, dtype, mixed):
    inputs = make_inputs(case, dtype)
    fwd = _fwd_kwargs(inputs, mixed)
    qkv = (inputs["q_ref"], inputs["k_ref"], inputs["v_ref"])
    assert_bitwise(nd.attention_fwd(client, *qkv, **fwd), numbafa.attention_fwd(*qkv, **fwd))
    expected = numbafa.attention_bwd(**inputs, mixed_precision=mixed)
    assert_bitwise(nd.attention_bwd(client, **inputs, mixed_precision=mixed), expected)


@pytest.mark.parametrize("name, case, dtype, mixed, head_chunk", [
    ("gqa-causal", CASES[1][1], np.float32, False, 2),
    ("mqa-batch1-split", CASES[2][1], np.float32, False, 4),
    ("sinks-3-units-split", CASES[4][1], np.float32, False, 2),
    ("bf16-not-mixed-sinks", CASES[7][1], BF16, False, 4),
    ("head-dims-split-sinks", CASES[10][1], np.float32, False, 2),
    ("float64-sinks-split", CASES[11][1], np.float64, False, 4),
], ids=["gqa-causal", "mqa-batch1-split", "sinks-3-units-split", "bf16-not-mixed-sinks", "head-dims-split-sinks",
        "float64-sinks-split"])
def test_dask_inputs_give_lazy_dask_arrays_with_the_single_process_bits(client, name, case, dtype,
                                                                        mixed, head_chunk):
    inputs = make_inputs(case, dtype)
    lazy_in = _dask_inputs(inputs, case.nheads // case.nheads_kv, head_chunk)
    expected = numbafa.attention_bwd(**inputs, mixed_precision=mixed)
    lazy = nd.attention_bwd(client, **lazy_in, mixed_precision=mixed)
    assert all(isinstance(x, da.Array) for x in lazy)
    assert lazy[0].chunks == lazy_in["q_ref"].chunks and lazy[1].chunks == lazy_in["k_ref"].chunks
    assert lazy[2].chunks == lazy_in["v_ref"].chunks
    assert_bitwise(client.compute(list(lazy), sync=True), expected)

    fwd = _fwd_kwargs(inputs, mixed)
    qkv = [lazy_in[k] for k in ("q_ref", "k_ref", "v_ref")]
    for layout in ("neuron", "natural"):
        expected = numbafa.attention_fwd(*(inputs[k] for k in ("q_ref", "k_ref", "v_ref")), **fwd,
                                         lse_layout=layout)
        lazy = nd.attention_fwd(client, *qkv, **fwd, lse_layout=layout)
        assert_bitwise(client.compute(list(lazy), sync=True), expected)


def _exit_once(marker):
    """A function for ``client.run``: the next ``shards.bwd_chunk`` call in any worker (the
    first to create ``marker``) ends its process; later calls run normally."""
    def install():
        import os as os_
        import numbafa.pipeline.shards as shards_
        original = getattr(shards_.bwd_chunk, "original", shards_.bwd_chunk)

        def bwd_chunk(*args, **kwargs):
            try:
                os_.close(os_.open(marker, os_.O_CREAT | os_.O_EXCL))
            except FileExistsError:
                return original(*args, **kwargs)
            os_._exit(1)
        bwd_chunk.original = original
        shards_.bwd_chunk = bwd_chunk
    return install


def _restore():
    import numbafa.pipeline.shards as shards_
    shards_.bwd_chunk = getattr(shards_.bwd_chunk, "original", shards_.bwd_chunk)


@pytest.mark.parametrize("inputs_kind", ["numpy", "dask"])
def test_a_worker_killed_mid_run_still_gives_the_complete_result(client, tmp_path, inputs_kind):
    case = Case(bs=2, nheads=4, nheads_kv=2, d_head=32, causal=True, num_sinks=1)
    inputs = make_inputs(case)
    expected = numbafa.attention_bwd(**inputs)
    marker = str(tmp_path / "killed")
    client.run(_exit_once(marker))
    try:
        if inputs_kind == "numpy":
            got = nd.attention_bwd(client, **inputs)
        else:
            got = client.compute(list(nd.attention_bwd(client, **_dask_inputs(inputs, 2, 2))), sync=True)
    finally:
        client.run(_restore)
    assert os.path.exists(marker), "no worker was killed"
    assert_bitwise(got, expected)
    client.wait_for_workers(2, timeout=_RESTART_WAIT)


def _exit_at_call(directory, handler, n):
    """A function for ``client.run``: the ``n``-th call of the worker RPC ``handler`` (counted
    over every worker: ``update_data`` receives scattered data) ends its worker's process, as a
    SIGKILL would, in the middle of the client's send; every other call runs normally."""
    def install(dask_worker):
        import os as os_
        original = dask_worker.handlers[handler]

        def handle(*args, **kwargs):
            k = 1
            while True:   # this call's number, over all workers: the first free file name
                try:
                    os_.close(os_.open(os_.path.join(directory, f"call-{k}"), os_.O_CREAT | os_.O_EXCL))
                    break
                except FileExistsError:
                    k += 1
            if k == n:
                os_._exit(1)
            return original(*args, **kwargs)
        handle.original = original
        dask_worker.handlers[handler] = handle
    return install


def _restore_handler(handler):
    def restore(dask_worker):
        dask_worker.handlers[handler] = getattr(dask_worker.handlers[handler], "original",
                                                dask_worker.handlers[handler])
    return restore


@pytest.mark.parametrize("kernel, n", [("forward", 1), ("forward", 2), ("forward", 3), ("backward", 2)],
                         ids=["fwd-plan-broadcast", "fwd-first-wave", "fwd-second-wave", "bwd-first-wave"])
def test_a_worker_killed_during_the_scatter_still_gives_the_single_process_bits(client, tmp_path, kernel, n):
    """A worker lost while the client sends it the plan or a share (the connection resets under
    the client's scatter): the call sends again to the workers there are, same bits."""
    case = Case(bs=2, nheads=4, nheads_kv=2, d_head=32, seqlen_q=1024, seqlen_k=1024, causal=True)
    inputs = make_inputs(case)
    qkv = [inputs[key] for key in ("q_ref", "k_ref", "v_ref")]
    client.wait_for_workers(2, timeout=_RESTART_WAIT)
    client.run(_exit_at_call(str(tmp_path), "update_data", n))
    try:
        if kernel == "forward":
            expected, got = numbafa.attention_fwd(*qkv), nd.attention_fwd(client, *qkv)
        else:
            expected, got = numbafa.attention_bwd(**inputs), nd.attention_bwd(client, **inputs)
    finally:
        client.run(_restore_handler("update_data"))
    assert os.path.exists(tmp_path / f"call-{n}"), "no worker was killed"
    assert_bitwise(got, expected)
    client.wait_for_workers(2, timeout=_RESTART_WAIT)


@pytest.fixture(scope="module")
def small():
    return make_inputs(Case(bs=2, nheads=4, nheads_kv=2, d_head=32))


def test_a_closed_client_is_a_value_error(client, small):
    closed = distributed.Client(client.cluster)
    closed.close()
    with pytest.raises(ValueError, match=r"client must be running, got a client with status 'closed'"):
        nd.attention_bwd(closed, **small)
    with pytest.raises(ValueError, match="client must be running"):
        nd.attention_fwd(closed, small["q_ref"], small["k_ref"], small["v_ref"])


def test_a_non_client_is_a_type_error(small):
    with pytest.raises(TypeError, match=r"client must be a dask.distributed.Client, got str"):
        nd.attention_bwd("tcp://127.0.0.1:8786", **small)


def test_invalid_numpy_inputs_get_the_single_process_errors(client, small):
    bad = dict(small, k_ref=small["k_ref"][:, :, :16])
    with pytest.raises(ValueError, match="k_ref must have shape"):
        nd.attention_bwd(client, **bad)


def _rechunked(small, **chunks):
    lazy = _dask_inputs(small, 2, 2)
    for key, c in chunks.items():
        lazy[key] = lazy[key].rechunk(c)
    return lazy


@pytest.mark.parametrize("chunks, match", [
    ({"q_ref": (1, 2, 16, 256)},
     r"q_ref must be chunked along batch and heads only: expected chunks \(32,\) along axis 2, got \(16, 16\)"),
    ({"lse_ref": (1, 2, 128)}, r"lse_ref must be chunked along batch and heads only"),
    ({"o_ref": (2, 2, 32, 256)}, r"o_ref must be chunked along batch as q_ref is: expected \(1, 1\), got \(2,\)"),
    ({"q_ref": (1, 1, 32, 256), "o_ref": (1, 1, 32, 256), "dy_ref": (1, 1, 32, 256), "lse_ref": (1, 1, 256)},
     r"q_ref's chunks along heads must hold whole GQA groups of 2 q-heads .* got \(1, 1, 1, 1\)"),
    ({"k_ref": (1, 2, 32, 256)},
     r"k_ref must be chunked along heads the KV heads of q_ref's head chunks \(2, 2\), 2 q-heads per "
     r"KV head: expected \(1, 1\), got \(2,\)"),
    ({"dy_ref": (1, 4, 32, 256)}, r"dy_ref must be chunked along heads as q_ref: expected \(2, 2\), got \(4,\)"),
])
def test_mismatched_dask_chunks_are_value_errors(client, small, chunks, match):
    with pytest.raises(ValueError, match=match):
        nd.attention_bwd(client, **_rechunked(small, **chunks))


def test_dask_and_numpy_big_arrays_do_not_mix(client, small):
    lazy = dict(_dask_inputs(small, 2, 2), k_ref=small["k_ref"])
    with pytest.raises(TypeError, match=r"k_ref must be a dask.array.Array like q_ref, got ndarray"):
        nd.attention_bwd(client, **lazy)


def test_invalid_dask_metadata_gets_the_single_process_error(client, small):
    lazy = _dask_inputs(small, 2, 2)
    with pytest.raises(ValueError, match=r"sliding_window.*use_causal_mask"):
        nd.attention_bwd(client, **dict(lazy, sliding_window=8))
    lazy["v_ref"] = lazy["v_ref"].astype(np.float64)
    with pytest.raises(TypeError, match=r"v_ref must have the dtype of q_ref"):
        nd.attention_bwd(client, **lazy)


def test_dask_sinks_not_an_array_and_a_3d_q_are_named(client, small):
    """A list of sinks is a TypeError naming sinks_ref (not an AttributeError); a 3-D q_ref is
    blamed on q_ref, not on k_ref."""
    lazy = _dask_inputs(small, 2, 2)
    with pytest.raises(TypeError, match=r"^sinks_ref must be a numpy.ndarray or a dask.array.Array, got list"):
        nd.attention_bwd(client, **dict(lazy, sinks_ref=[[0.0] * 4] * 2))
    with pytest.raises(ValueError, match=r"^q_ref must be 4-D"):
        nd.attention_fwd(client, lazy["q_ref"][0], lazy["k_ref"], lazy["v_ref"])


@pytest.mark.parametrize("dask_inputs", [False, True], ids=["numpy", "dask"])
def test_per_head_sinks_give_the_single_process_bits(client, small, dask_inputs):
    """Sinks ``[nheads]`` (shared by the batch) on the cluster: the single-process o and grads,
    dsinks ``[nheads]`` summed over the batch as the single-process call sums it."""
    sinks = np.linspace(-1.0, 1.0, 4).astype(np.float32)
    inputs = dict(small, sinks_ref=sinks)
    qkv = [inputs[k] for k in ("q_ref", "k_ref", "v_ref")]
    expected_fwd = numbafa.attention_fwd(*qkv, sinks_ref=sinks)
    expected = numbafa.attention_bwd(**inputs)
    assert expected[3].shape == (4,)
    run = dict(_dask_inputs(small, 2, 2), sinks_ref=sinks) if dask_inputs else inputs
    got_fwd = nd.attention_fwd(client, *(run[k] for k in ("q_ref", "k_ref", "v_ref")), sinks_ref=sinks)
    got = nd.attention_bwd(client, **run)
    if dask_inputs:
        got_fwd, got = client.compute(list(got_fwd), sync=True), client.compute(list(got), sync=True)
    assert_bitwise(got_fwd, expected_fwd)
    assert_bitwise(got, expected)


@pytest.mark.parametrize("dask_inputs", [False, True], ids=["numpy", "dask"])
def test_values_beyond_float32_on_the_cluster(client, small, dask_inputs):
    """The forward's accumulator and the backward's gradients beyond float32 (v, dy times 2**125):
    the single-process bits, rescaled exactly on the workers; scores beyond float32: the error."""
    big_v = dict(small, v_ref=np.ldexp(small["v_ref"], 125))
    big_dy = dict(small, dy_ref=np.ldexp(small["dy_ref"], 124))
    expected_fwd = numbafa.attention_fwd(*(big_v[k] for k in ("q_ref", "k_ref", "v_ref")))
    expected = numbafa.attention_bwd(**big_dy)
    assert float(np.abs(small["v_ref"]).max()) * 2.0 ** 125 * 256 > float(np.finfo(np.float32).max)   # beyond it
    run_v, run = ((_dask_inputs(x, 2, 2) if dask_inputs else x) for x in (big_v, big_dy))
    got_fwd = nd.attention_fwd(client, *(run_v[k] for k in ("q_ref", "k_ref", "v_ref")))
    got = nd.attention_bwd(client, **run)
    if dask_inputs:
        got_fwd, got = client.compute(list(got_fwd), sync=True), client.compute(list(got), sync=True)
    assert np.isfinite(np.asarray(got_fwd[0])).all()
    assert_bitwise(got_fwd, expected_fwd)
    assert_bitwise(got, expected)
    huge = dict(run, q_ref=run["q_ref"] * np.float32(1e19), k_ref=run["k_ref"] * np.float32(1e19))
    with pytest.raises(FloatingPointError, match="overflow float32"):
        out = nd.attention_fwd(client, huge["q_ref"], huge["k_ref"], huge["v_ref"])
        if dask_inputs:
            client.compute(list(out), sync=True)


def test_a_merged_gradient_beyond_float32_is_the_single_process_error(client):
    """Equal keys, dy = 2**127 everywhere: dv of key 0 is 2**127 * (1 + 1/2 + ... + 1/128). The
    shares run on dy * 2**-e; the client's rescale of the merged dv (the entry's compiled one)
    raises the single-process call's error."""
    q = np.random.default_rng(3).standard_normal((1, 2, 32, 128)).astype(np.float32)
    k, v = np.zeros_like(q), np.ones_like(q)
    o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=True)
    dy = np.full(q.shape, 2.0 ** 127, np.float32)
    with pytest.raises(FloatingPointError, match=r"^dv overflows float32") as single:
        numbafa.attention_bwd(q, k, v, o, dy, lse, use_causal_mask=True)
    with pytest.raises(FloatingPointError, match=r"^dv overflows float32") as cluster:
        nd.attention_bwd(client, q, k, v, o, dy, lse, use_causal_mask=True)
    assert str(cluster.value) == str(single.value)


def test_an_lse_far_below_the_scores_is_the_single_process_error(client, small):
    """The shares leave their gradients unchecked; the client's scan of the merged ones raises
    the single-process call's error."""
    bad = dict(small, lse_ref=small["lse_ref"] - np.float32(200))
    with pytest.raises(ValueError, match=r"^lse_ref must be the log-sum-exp") as single:
        numbafa.attention_bwd(**bad)
    with pytest.raises(ValueError, match=r"^lse_ref must be the log-sum-exp") as cluster:
        nd.attention_bwd(client, **bad)
    assert str(cluster.value) == str(single.value)


# --- the shares without a cluster: blocks of units, any forward row split, the backward merge ----

def test_tasks_get_contiguous_blocks_of_units_in_unit_order():
    assert nd._units(2, 4, 2, 3) == [
        (slice(0, 1), slice(0, 6), slice(0, 3)), (slice(0, 1), slice(6, 8), slice(3, 4)),
        (slice(1, 2), slice(0, 6), slice(0, 3)), (slice(1, 2), slice(6, 8), slice(3, 4))]
    assert nd._units(5, 1, 2, 2) == [(slice(0, 2), slice(0, 2), slice(0, 1)),
                                     (slice(2, 4), slice(0, 2), slice(0, 1)),
                                     (slice(4, 5), slice(0, 2), slice(0, 1))]
    assert nd._units(1, 2, 1) == [(slice(0, 1), slice(0, 1), slice(0, 1)),
                                  (slice(0, 1), slice(1, 2), slice(1, 2))]


@pytest.mark.parametrize("name, expected", [("blocks-of-kv-heads", 3), ("blocks-of-batches", 2),
                                            ("mha", 1), ("mqa-batch1-split", 1)])
def test_small_units_are_grouped_up_to_two_tasks_per_worker_thread(name, expected):
    from numbafa.kernels.bundles import make_plan
    case = dict((c[0], c[1]) for c in CASES)[name]
    prob = validated(make_inputs(case))
    assert nd._units_per_task(make_plan(prob, backward=True), prob, n_slots=2) == expected


@pytest.mark.parametrize("n_chunks", [1, 2, 3])
def test_any_forward_row_split_gives_the_single_process_bits(n_chunks):
    from numbafa.kernels.bundles import FwdInputs, make_plan
    from numbafa.checks.options import AttentionOptions
    from numbafa.checks.validation import validate_fwd_inputs
    case = Case(bs=1, nheads=1, nheads_kv=1, d_head=16, seqlen_q=2560, seqlen_k=2560, causal=True,
                num_sinks=1)   # 5 Q groups: 3 chunks each own some
    inputs = make_inputs(case)
    args = (inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], inputs["sinks_ref"])
    expected = numbafa.attention_fwd(*args, use_causal_mask=True, lse_layout="natural")
    prob = validate_fwd_inputs(*args[:3], AttentionOptions(sinks=args[3], use_causal_mask=True))
    plan = shards.with_q_chunks(make_plan(prob, backward=False), n_chunks)
    parts = []
    for chunk in range(n_chunks):
        q = shards.pack_rows(prob.q, shards.owned_rows(case.seqlen_q, plan.tiling, chunk))
        parts.append(shards.fwd_chunk(plan, FwdInputs(q, prob.k, prob.v, prob.sinks), True,
                                      case.seqlen_q, chunk, prob.dtype))
    got = [shards.place_rows([p[i] for p in parts], plan.tiling, case.seqlen_q) for i in (0, 1)]
    assert_bitwise(got, expected)


def test_the_backward_merge_of_chunks_gives_the_single_process_bits():
    from numbafa.kernels.bundles import BwdInputs, make_plan
    case = Case(bs=1, nheads=2, nheads_kv=1, d_head=16, seqlen_q=1024, seqlen_k=1024, causal=True,
                num_sinks=2)
    inputs = make_inputs(case)
    expected = numbafa.attention_bwd(**inputs)
    prob = validated(inputs)
    plan = make_plan(prob, backward=True)
    assert plan.tiling.q_chunks == 2
    parts = []
    for chunk in range(2):
        rows = shards.owned_rows(case.seqlen_q, plan.tiling, chunk)
        packed = [shards.pack_rows(x, rows) for x in (prob.q, prob.o, prob.dy, prob.lse)]
        ins = BwdInputs(packed[0], prob.k, prob.v, *packed[1:], prob.sinks)
        parts.append(shards.bwd_chunk(plan, ins, True, case.seqlen_q, chunk, prob.dtype))
    dq, dk, dv, dsinks = shards.bwd_merge(plan, prob.sinks, parts, case.seqlen_q, prob.dtype)
    assert_bitwise((dq, dk, dv, dsinks.reshape(prob.sinks_shape)), expected)


# --- attention dropout: every share draws the whole problem's mask at its origin ------------

DROPOUT = dict(dropout_p=0.25, seed=2024, seed_offset=3)

# Several batches and heads per call, so that a share's origin matters. (id, case, dtype, mixed)
DROPOUT_CASES = [
    ("mha-batch2", Case(bs=2, nheads=2, nheads_kv=2, d_head=32), np.float32, False),
    ("gqa-causal-batch2", Case(bs=2, nheads=4, nheads_kv=2, d_head=32, causal=True, num_sinks=1),
     np.float32, False),
    ("mqa-batch1-split", CASES[2][1], np.float32, False),
    ("bf16-gqa-causal", Case(bs=2, nheads=4, nheads_kv=2, d_head=32, causal=True), BF16, False),
    ("bf16-mixed-split", CASES[6][1], BF16, True),
    ("blocks-of-kv-heads", CASES[8][1], np.float32, False),
    ("blocks-of-batches", CASES[9][1], BF16, False),
]


def _dropout_inputs(case, dtype, mixed):
    """``make_inputs`` with o and lse from the single-process forward *with* dropout."""
    inputs = make_inputs(case, dtype)
    fwd = _fwd_kwargs(inputs, mixed)
    qkv = (inputs["q_ref"], inputs["k_ref"], inputs["v_ref"])
    o, lse = numbafa.attention_fwd(*qkv, **fwd, **DROPOUT, lse_layout="natural")
    return dict(inputs, o_ref=o, lse_ref=lse), fwd


@pytest.mark.parametrize("name, case, dtype, mixed", DROPOUT_CASES, ids=[c[0] for c in DROPOUT_CASES])
def test_dropout_gives_the_single_process_bits(client, name, case, dtype, mixed):
    inputs, fwd = _dropout_inputs(case, dtype, mixed)
    qkv = (inputs["q_ref"], inputs["k_ref"], inputs["v_ref"])
    assert_bitwise(nd.attention_fwd(client, *qkv, **fwd, **DROPOUT),
                   numbafa.attention_fwd(*qkv, **fwd, **DROPOUT))
    expected = numbafa.attention_bwd(**inputs, mixed_precision=mixed, **DROPOUT)
    assert_bitwise(nd.attention_bwd(client, **inputs, mixed_precision=mixed, **DROPOUT), expected)
    # The mask matters: with another seed the gradients differ.
    other = nd.attention_bwd(client, **inputs, mixed_precision=mixed, **dict(DROPOUT, seed=2025))
    assert not np.array_equal(other[0], expected[0])


@pytest.mark.parametrize("name, case, dtype, mixed, head_chunk", [
    ("gqa-causal-batch2", DROPOUT_CASES[1][1], np.float32, False, 2),
    ("mqa-batch1-split", DROPOUT_CASES[2][1], np.float32, False, 2 * 2),
    ("bf16-gqa-causal", DROPOUT_CASES[3][1], BF16, False, 2),
], ids=["gqa-causal-batch2", "mqa-batch1-split", "bf16-gqa-causal"])
def test_dropout_with_dask_inputs_gives_the_single_process_bits(client, name, case, dtype, mixed,
                                                                head_chunk):
    inputs, fwd = _dropout_inputs(case, dtype, mixed)
    lazy_in = _dask_inputs(inputs, case.nheads // case.nheads_kv, head_chunk)
    expected = numbafa.attention_bwd(**inputs, mixed_precision=mixed, **DROPOUT)
    lazy = nd.attention_bwd(client, **lazy_in, mixed_precision=mixed, **DROPOUT)
    assert_bitwise(client.compute(list(lazy), sync=True), expected)
    qkv = [lazy_in[k] for k in ("q_ref", "k_ref", "v_ref")]
    expected = numbafa.attention_fwd(*(inputs[k] for k in ("q_ref", "k_ref", "v_ref")), **fwd, **DROPOUT)
    lazy = nd.attention_fwd(client, *qkv, **fwd, **DROPOUT)
    assert_bitwise(client.compute(list(lazy), sync=True), expected)


@pytest.mark.parametrize("kernel", ["forward", "backward"])
def test_a_share_needs_its_own_origin_with_dropout(kernel):
    """Batch 1, q-heads 2-3 (its second KV head) alone: with its origin (1, 2) it computes the
    single-process bits of those heads; given the origin (0, 0) of the arrays it holds it
    draws another mask and differs."""
    from numbafa.kernels.bundles import BwdInputs, FwdInputs, make_plan
    case = DROPOUT_CASES[1][1]
    inputs, fwd = _dropout_inputs(case, np.float32, False)
    prob = validated(inputs, **DROPOUT)
    plan = make_plan(prob, backward=kernel == "backward")
    assert plan.tiling.q_chunks == 1
    b, heads, kv = 1, slice(2, 4), slice(1, 2)
    if kernel == "forward":
        o, lse = numbafa.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], **fwd, **DROPOUT,
                                       lse_layout="natural")
        expected = (o[b:b + 1, heads], lse[b:b + 1, heads])
        share = FwdInputs(*(x[b:b + 1, s] for x, s in zip((prob.q, prob.k, prob.v, prob.sinks),
                                                           (heads, kv, kv, heads))))

        def run(origin):
            return shards.fwd_chunk(plan, share, False, case.seqlen_q, 0, prob.dtype, origin)
    else:
        grads = numbafa.attention_bwd(**inputs, **DROPOUT)
        expected = (grads[0][b:b + 1, heads], grads[1][b:b + 1, kv], grads[2][b:b + 1, kv])
        share = BwdInputs(*(x[b:b + 1, s] for x, s in zip(
            (prob.q, prob.k, prob.v, prob.o, prob.dy, prob.lse, prob.sinks),
            (heads, kv, kv, heads, heads, heads, heads))))

        def run(origin):
            return shards.bwd_chunk(plan, share, False, case.seqlen_q, 0, prob.dtype, origin)[:3]
    assert_bitwise(run((b, heads.start)), expected)
    wrong = run((0, 0))
    assert not np.array_equal(wrong[0], expected[0])


# (id, case, variants): a bias shared by the batch (one task for every batch of a KV head), by
# everything (one task), per batch and head with a split unit (bias without dbias), ALiBi.
VARIANT_CASES = [
    ("bias-shared-by-the-batch", Case(bs=2, nheads=4, nheads_kv=2, d_head=16, seqlen_q=256, seqlen_k=256,
                                      causal=True), dict(bias=(4, 256, 256), dbias=True, softcap=5.0)),
    ("bias-shared-by-all", Case(bs=2, nheads=2, nheads_kv=2, d_head=16, seqlen_q=128, seqlen_k=192,
                                num_sinks=1), dict(bias=(1, 1, 1, 192), dbias=True, alibi=(2,))),
    ("bias-split-unit", Case(bs=1, nheads=2, nheads_kv=1, d_head=16, seqlen_q=640, seqlen_k=640, causal=True),
     dict(bias=(1, 2, 640, 640), alibi=(1, 2), softcap=3.0)),
    ("blocks-bias-full-dbias", Case(bs=3, nheads=4, nheads_kv=2, d_head=16, seqlen_q=128, seqlen_k=128),
     dict(bias=(3, 4, 128, 128), dbias=True)),
]


@pytest.mark.parametrize("name, case, spec", VARIANT_CASES, ids=[c[0] for c in VARIANT_CASES])
def test_score_variants_give_the_single_process_bits(client, name, case, spec):
    from test_score_variants import forward_kwargs, variant_inputs
    inputs = variant_inputs(case, spec)
    qkv = (inputs["q_ref"], inputs["k_ref"], inputs["v_ref"])
    fwd = forward_kwargs(inputs)
    expected = numbafa.attention_fwd(*qkv, **fwd)
    assert_bitwise(nd.attention_fwd(client, *qkv, **fwd), expected)
    expected = numbafa.attention_bwd(**inputs)
    got = nd.attention_bwd(client, **inputs)
    assert len(expected) == 3 + (case.num_sinks > 0) + bool(spec.get("dbias"))
    assert_bitwise(got, expected)


@pytest.mark.parametrize("name, case, spec", VARIANT_CASES, ids=[c[0] for c in VARIANT_CASES])
def test_score_variants_with_dask_inputs_give_the_single_process_bits(client, name, case, spec):
    """Dask q, k, v (one batch and one GQA group per chunk) with a NumPy bias and slopes: each
    block gets its slices; a dbias shared by the batch (or the KV heads) joins those chunks
    for the pass, and the gradients come back in the inputs' chunks."""
    from test_score_variants import forward_kwargs, variant_inputs
    inputs = variant_inputs(case, spec)
    n_rep = case.nheads // case.nheads_kv
    lazy_in = _dask_inputs(inputs, n_rep, n_rep)
    qkv = [lazy_in[k] for k in ("q_ref", "k_ref", "v_ref")]
    fwd = forward_kwargs(inputs)
    expected = numbafa.attention_fwd(*(inputs[k] for k in ("q_ref", "k_ref", "v_ref")), **fwd)
    lazy = nd.attention_fwd(client, *qkv, **forward_kwargs(lazy_in))
    assert lazy[0].chunks == lazy_in["q_ref"].chunks
    assert_bitwise(client.compute(list(lazy), sync=True), expected)
    expected = numbafa.attention_bwd(**inputs)
    lazy = nd.attention_bwd(client, **lazy_in)
    assert all(isinstance(x, da.Array) for x in lazy) and len(lazy) == len(expected)
    assert [x.chunks for x in lazy[:3]] == [lazy_in[k].chunks for k in ("q_ref", "k_ref", "v_ref")]
    assert_bitwise(client.compute(list(lazy), sync=True), expected)


def test_a_dask_bias_is_a_clear_error(client, small):
    lazy = [da.from_array(x, chunks=(1,) + x.shape[1:]) for x in (small["q_ref"], small["k_ref"], small["v_ref"])]
    seqlen = small["q_ref"].shape[3]
    bias = da.zeros((seqlen, seqlen), dtype=np.float32, chunks=seqlen)
    with pytest.raises(TypeError, match="bias must be a numpy.ndarray .* got a dask.array.Array"):
        nd.attention_fwd(client, *lazy, bias=bias)


def _kill_every_bwd_chunk():
    """A Dask worker plugin (set up again on every restarted worker): each ``shards.bwd_chunk``
    call kills its worker process, so a share can never run."""
    class Killer(distributed.WorkerPlugin):
        name = "numbafa-test-killer"

        def setup(self, worker):
            import signal
            import numbafa.pipeline.shards as shards_

            def bwd_chunk(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)
            bwd_chunk.original = getattr(shards_.bwd_chunk, "original", shards_.bwd_chunk)
            shards_.bwd_chunk = bwd_chunk

        def teardown(self, worker):
            import numbafa.pipeline.shards as shards_
            shards_.bwd_chunk = getattr(shards_.bwd_chunk, "original", shards_.bwd_chunk)
    return Killer()


class _Nannies:
    """A client whose nannies' logs (``get_worker_logs(nanny=True)``) are ``answers``, one per call."""

    def __init__(self, *answers):
        self.answers, self.calls = list(answers), 0

    def get_worker_logs(self, n, nanny):
        self.calls += 1
        answer = self.answers[min(self.calls, len(self.answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_a_lost_shares_error_waits_for_a_nanny_between_two_lives_of_its_worker():
    """The scheduler knows a nanny only while its worker is registered: the first ask may find no
    exit (CI met it: the error said "no worker exit" for a worker killed three times); the error
    asks again until a nanny answers, for a bounded time."""
    since = time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S,000", time.localtime(since + 1))
    killed = {"tcp://n1": [("INFO", f"{stamp} - distributed.nanny - INFO - Worker process 123 was killed by signal 9")]}
    quiet = {"tcp://n1": [("INFO", f"{stamp} - distributed.nanny - INFO - Start Nanny at: 'tcp://n1'")]}
    nannies = _Nannies({}, quiet, killed)
    text = nd._worker_deaths(nannies, since, wait=5.0)
    assert nannies.calls == 3 and "Worker process 123 was killed by signal 9" in text
    nannies = _Nannies(quiet)
    start = time.monotonic()
    assert "logged no worker exit" in nd._worker_deaths(nannies, since, wait=1.0)
    assert 1.0 <= time.monotonic() - start < 3.0 and nannies.calls >= 2
    assert "could not be read: gone" in nd._worker_deaths(_Nannies(OSError("gone")), since, wait=1.0)


def test_a_share_that_kills_its_worker_every_time_says_what_happened(client):
    """Every worker that runs a share dies (as one whose kernel aborts would): after three attempts
    the error says the share was lost with its workers, and what the nannies logged. On a cluster
    of its own (``client`` has warmed the kernel cache its workers load): a nanny may give up on a
    worker killed this often, and no other test should meet a cluster with one worker less."""
    inputs = make_inputs(Case(bs=2, nheads=4, nheads_kv=2, d_head=32, causal=True))
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    try:
        with distributed.Client(cluster) as own:
            own.register_plugin(_kill_every_bwd_chunk())
            try:
                with pytest.raises(RuntimeError, match=r"lost with a worker 3 times.*killed by signal 9"):
                    nd.attention_bwd(own, **inputs)
            finally:
                # Unregistering runs the plugin's teardown on the live workers and keeps it from
                # the ones the nannies start next.
                for _ in range(20):   # workers may still be dying under the call
                    try:
                        own.unregister_worker_plugin("numbafa-test-killer")
                        break
                    except OSError:
                        time.sleep(0.5)
                    except (ValueError, KeyError):   # an earlier attempt removed it
                        break
            own.wait_for_workers(1, timeout=_RESTART_WAIT)
            # the workers left (or started since) compute the single-process bits again
            assert_bitwise(nd.attention_bwd(own, **inputs), numbafa.attention_bwd(**inputs))
    finally:
        cluster.close()


@pytest.mark.parametrize("error", [OSError("connection closed"), KeyError("tcp://127.0.0.1:1")])
def test_a_scatter_that_meets_a_leaving_worker_is_sent_again(monkeypatch, error):
    """A broken connection, or the scheduler's KeyError for a worker that left while it
    replicated a broadcast: the call is made again, and after MAX_ATTEMPTS it says so."""
    from numbafa import distributed as dist

    monkeypatch.setattr(dist, "RETRY_WAIT", 0.0)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < dist.MAX_ATTEMPTS:
            raise error
        return "sent"
    assert dist._retried(flaky, "scattering") == "sent" and len(calls) == dist.MAX_ATTEMPTS

    def broken():
        raise error
    with pytest.raises(RuntimeError, match=f"^scattering failed {dist.MAX_ATTEMPTS} times: a worker was lost"):
        dist._retried(broken, "scattering")
