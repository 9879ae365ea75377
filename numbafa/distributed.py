"""The forward and the backward on a Dask cluster, bitwise equal to the single-process call.

``attention_fwd(client, ...)`` and ``attention_bwd(client, ...)`` take a
``dask.distributed.Client`` the caller made, then the arguments of
:func:`numbafa.attention_fwd` / :func:`numbafa.attention_bwd`, and return
what those return:

* NumPy inputs: validated here, cut into shares of whole work units (batch,
  KV head: the q-heads of its GQA group with their K and V; small units
  grouped into contiguous blocks, ``MIN_TASK_WORK``), each share
  scattered once to one worker, straight from the client, one task per share
  run on one thread, results gathered straight from the workers as they
  complete and put in place. NumPy outputs.
* Dask arrays (chunked along batch and heads only, head chunks holding whole
  GQA groups): one task per block of chunks, validated on the worker; lazy
  Dask arrays out, chunked as the inputs.

Results are bitwise those of the single-process call, whatever the number of
workers: every task runs the in-process work items with the plan of the
whole problem (``numbafa.pipeline.shards``), and the backward of a unit split into
Q chunks (an odd number of units below 9: batch 1 MQA, one long sequence) is
merged by the kernel's own fixed-order reduction. With attention dropout,
every task is given the absolute batch and q-head of its share's first element
(``numbafa.pipeline.shards.at_origin``), so it draws the whole problem's mask. See
``docs/distributed.md``.

Requires the ``dask`` extra (``pip install ".[dask]"`` from a clone); Dask is
imported only when a function here is called.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from concurrent.futures import CancelledError

import numpy as np

from .pipeline import shards
from .pipeline.core import check_lse_layout, lse_out, user_dbias, user_dsinks
from .conventions.dtypes import accumulator_dtype
from .kernels.bundles import BwdInputs, FwdInputs, make_plan
from .kernels.scores import make_scores
from .kernels.loops import n_q_groups
from .checks.options import KERNEL_CALLER, AttentionOptions
from .pipeline.ranges import check, unscaled_output
from .conventions.tiling import Q_TILE
from .checks.validation import check_options, validate_bwd_inputs, validate_fwd_inputs

__all__ = ["attention_fwd", "attention_bwd"]

#: How many times a share is run again after its inputs or results were lost with a worker.
MAX_ATTEMPTS = 3

#: The least work a task of NumPy inputs is given, in visible (query, key) pairs times
#: ``head_dim`` times q-heads (a backward unit of S2048 d128 is 2**29 full, about 2**28
#: causal: about 90 and 45 ms on one Zen 4 core): units are grouped into blocks up to it
#: while that leaves at least two tasks per worker thread. Each task costs a few
#: milliseconds of the scheduler's, the client's and the worker's time besides its kernel,
#: on the cores that compute on one machine. 2**31 (8 causal units per task here) was
#: faster than 2**30 in one loaded run, slower in another, and took more of the workers'
#: CPU (docs/distributed.md, "Measured").
MIN_TASK_WORK = 2 ** 30



def _dask():
    """``(dask.array, distributed)``, or an ImportError saying how to install them."""
    try:
        import dask.array as da
        import distributed
    except ImportError as exc:  # pragma: no cover - the test extra installs Dask
        raise ImportError("numbafa.distributed needs Dask: pip install '.[dask]' from numbafa's clone "
                          "(dask[distributed])") from exc
    return da, distributed


def _check_client(client) -> None:
    _, distributed = _dask()
    if not isinstance(client, distributed.Client):
        raise TypeError(f"client must be a dask.distributed.Client, got {type(client).__name__}")
    if client.asynchronous:
        raise TypeError("client must be a synchronous dask.distributed.Client, got an "
                        "asynchronous one (Client(..., asynchronous=True))")
    if client.status != "running":
        raise ValueError(f"client must be running, got a client with status {client.status!r}; "
                         f"make a new Client")


def _warm(client, kernel: str, dtype, dropout: bool, variants: bool = False) -> None:
    """Load the kernel (with dropout or score variants, or without) on every worker once
    (``client.run``) and check that the workers would compute the client's bits (same numbafa
    sources, Numba and GEMM path)."""
    expected = shards.fingerprint()
    found_by_worker = _retried(lambda: client.run(shards.warm, kernel, np.dtype(dtype).name, dropout, variants),
                               "loading the kernels on the workers")
    for worker, found in found_by_worker.items():
        if tuple(found) != expected:
            raise RuntimeError(f"worker {worker} runs numbafa sources/Numba/GEMM path {tuple(found)}, the "
                               f"client {expected}: its results would not be bitwise those of the "
                               f"single-process call; install the same numbafa on every worker")


def _is_dask(x) -> bool:
    da, _ = _dask()
    return isinstance(x, da.Array)


def _dask_mode(named: dict) -> bool:
    """True if the big arrays are Dask arrays (all of them), False if none is."""
    kinds = {name: _is_dask(x) for name, x in named.items()}
    if any(kinds.values()) and not all(kinds.values()):
        first = next(name for name, d in kinds.items() if d)
        other = next(name for name, d in kinds.items() if not d)
        raise TypeError(f"{other} must be a dask.array.Array like {first}, got "
                        f"{type(named[other]).__name__} (pass all of {', '.join(named)} as Dask "
                        f"arrays, or all as NumPy arrays)")
    return all(kinds.values())


def _direct(client) -> bool:
    """Scatter and gather between the client and the workers directly, unless the client was
    made with ``direct_to_workers=False``. (Outside a worker Dask's default is through the
    scheduler, which then receives and sends every byte again: twice the traffic, and the
    scheduler's CPU time, for nothing when the client can reach the workers.)"""
    return client.direct_to_workers is not False


#: Seconds to wait, times the attempt, before sending again to a cluster that lost a worker
#: (the scheduler needs a moment to see the loss and stop offering that worker).
RETRY_WAIT = 0.25


def _retried(call, what: str):
    """``call()``, again on the workers there are then when a worker is lost under it (a broken
    connection: ``CommClosedError``, an ``OSError``; or a ``KeyError`` from the scheduler, which
    replicates a broadcast to a worker that has just left), up to ``MAX_ATTEMPTS`` times."""
    for attempt in range(MAX_ATTEMPTS - 1):
        try:
            return call()
        except (OSError, KeyError):
            time.sleep(RETRY_WAIT * (attempt + 1))
    try:
        return call()
    except (OSError, KeyError) as exc:
        raise RuntimeError(f"{what} failed {MAX_ATTEMPTS} times: a worker was lost each time ({exc})") from exc


def _scatter(client, data: list, direct: bool, broadcast: bool = False) -> list:
    """``client.scatter`` that survives a worker lost while the data travels (:func:`_retried`)."""
    return _retried(lambda: client.scatter(data, broadcast=broadcast, hash=False, direct=direct),
                    "scattering the call's inputs")


def _gather(client, future, direct: bool):
    """``client.gather`` of one future; a connection broken by a lost worker is retried, and a
    result lost with it raises ``CancelledError`` (the share is then run again)."""
    for attempt in range(MAX_ATTEMPTS):
        try:
            return client.gather(future, direct=direct)
        except OSError:
            time.sleep(RETRY_WAIT * (attempt + 1))
            if future.status in ("cancelled", "lost"):
                break
    raise CancelledError(f"the result of {future.key} was lost with a worker")


def _run_shares(client, plan, shares, submit, on_result) -> None:
    """Scatter every share once, submit its task(s), put each result in place as it arrives.

    ``shares`` is a list of tuples of input pieces (one piece per task of the
    share); ``submit(plan_future, i, piece_futures, attempt)`` returns the
    share's final future; ``on_result(i, result)`` stores it. A share whose
    inputs or results were lost with a worker (its future is cancelled) is
    scattered and run again, up to ``MAX_ATTEMPTS`` times; a worker lost while
    data travels to or from it is retried (:func:`_scatter`, :func:`_gather`);
    any other error propagates.
    """
    _, distributed = _dask()
    if not shares:
        return
    started = time.time()
    direct = _direct(client)
    plan_future = _scatter(client, [plan], direct, broadcast=True)[0]
    running = {}
    # Two scatters: one share per worker thread first, so that the workers compute while
    # the client sends the rest (one list per scatter: Dask spreads it over the workers).
    first = min(len(shares), max(1, sum(client.nthreads().values())))
    for wave in (range(first), range(first, len(shares))):
        if not wave:
            continue
        flat = _scatter(client, [piece for i in wave for piece in shares[i]], direct)
        for i in wave:
            pieces, flat = flat[:len(shares[i])], flat[len(shares[i]):]
            running[submit(plan_future, i, pieces, 0)] = (i, 0)
    pending = distributed.as_completed(list(running))
    for future in pending:
        i, attempt = running.pop(future)
        try:
            result = _gather(client, future, direct)
        except CancelledError as exc:
            if attempt + 1 >= MAX_ATTEMPTS:
                raise RuntimeError(f"share {i} of the call was lost with a worker {MAX_ATTEMPTS} times (its "
                                   f"inputs or result were on a worker that died or left); giving up. "
                                   f"{_worker_deaths(client, started)}") from exc
            if plan_future.status != "finished":
                plan_future = _scatter(client, [plan], direct, broadcast=True)[0]
            retry = submit(plan_future, i, _scatter(client, list(shares[i]), direct), attempt + 1)
            running[retry] = (i, attempt + 1)
            pending.add(retry)
            continue
        on_result(i, result)
        del result


#: How long the error of a lost share waits for the nannies to be asked (seconds): the scheduler
#: knows a nanny only while its worker is registered, and a worker killed again and again may be
#: between two lives when the share is given up.
DEATHS_WAIT = 10.0


def _worker_deaths(client, since: float, wait: float = DEATHS_WAIT) -> str:
    """What the workers' nannies logged since ``since`` (``time.time()``) about worker processes
    that ended (their exit status or signal: 134 is an abort in native code, 137 or signal 9 a
    kill), for the error of a share that could not run; the workers' own stderr says more. Asks
    again every half second for up to ``wait`` seconds while no nanny has logged an exit."""
    deadline = time.monotonic() + wait
    while True:
        try:
            found = _exits_logged(client.get_worker_logs(n=200, nanny=True), since)
        except Exception as exc:   # a broken cluster: say so rather than hide the first error
            return f"(the nannies' logs could not be read: {exc})"
        if found or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if not found:
        return "The nannies logged no worker exit; the workers' logs (client.get_worker_logs()) may say more."
    return ("What the nannies logged meanwhile: " + "; ".join(m for _, m in sorted(found)[-4:])
            + " (the workers' stderr says why).")


def _exits_logged(logs: dict, since: float) -> list:
    """``(time, message)`` of the worker exits in nanny logs (``get_worker_logs``'s answer)
    logged since ``since`` (or undated)."""
    import datetime

    found = []
    for entries in logs.values():
        for _, message in entries:
            if not any(word in message for word in ("exited with status", "killed by signal")):
                continue
            try:   # logging's default format starts with the local time
                when = datetime.datetime.strptime(message[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except ValueError:
                when = since
            if when >= since - 1.0:
                found.append((when, message.split(" - ")[-1]))
    return found


def _units_per_task(plan, prob, n_slots: int) -> int:
    """Work units per task: enough for ``MIN_TASK_WORK``, at most ``units / (2 *
    n_slots)``; 1 when units are split into Q chunks (each chunk is a task of its own)."""
    bs, nheads, d_head, _ = prob.q.shape
    n_units = bs * prob.k.shape[1]
    if plan.tiling.q_chunks > 1 or n_units == 0:
        return 1
    visible = int(np.maximum(plan.mask.key_hi.astype(np.int64) - plan.mask.key_lo, 0).sum())
    unit_work = max(1, visible * (d_head + prob.v.shape[2]) // 2 * (nheads // prob.k.shape[1]))
    return max(1, min(-(-MIN_TASK_WORK // unit_work), n_units // (2 * max(n_slots, 1))))


def _units(bs: int, nheads_kv: int, n_rep: int, per_task: int = 1, scores=None) -> list:
    """``(batch slice, q-head slice, KV-head slice)`` of every task's block of work units, in
    unit order: runs of ``per_task`` KV heads of one batch, or of whole batches when
    ``per_task >= nheads_kv`` (so that every block is a contiguous slice of the arrays). When a
    bias's gradient is summed over batches or KV heads (``scores.serial_batch`` /
    ``serial_heads``), a block spans all of them: the kernel's own groups of units."""
    if scores is not None and (scores.serial_batch or scores.serial_heads):
        batches = [slice(0, bs)] if scores.serial_batch else [slice(b, b + 1) for b in range(bs)]
        groups = [slice(0, nheads_kv)] if scores.serial_heads else [slice(g, g + 1) for g in range(nheads_kv)]
        return [(b, slice(g.start * n_rep, g.stop * n_rep), g) for b in batches for g in groups]
    if per_task >= nheads_kv:
        nb = per_task // nheads_kv
        return [(slice(b, min(b + nb, bs)), slice(0, nheads_kv * n_rep), slice(0, nheads_kv))
                for b in range(0, bs, nb)]
    return [(slice(b, b + 1), slice(g * n_rep, min(g + per_task, nheads_kv) * n_rep),
             slice(g, min(g + per_task, nheads_kv)))
            for b in range(bs) for g in range(0, nheads_kv, per_task)]


def _fwd_row_chunks(plan, seqlen_q: int, n_units: int, n_slots: int) -> int:
    """Row chunks per unit in the forward: the in-process split, or more when there are fewer
    units than worker threads (rows are independent, so any split gives the same bits)."""
    n_groups = n_q_groups.py_func(seqlen_q, plan.tiling)
    wanted = max(plan.tiling.q_chunks, -(-n_slots // max(n_units, 1)))
    return max(1, min(wanted, (n_groups + 1) // 2))


def attention_fwd(client, q_ref, k_ref, v_ref, sinks_ref=None, bound_min=None, bound_max=None,
                  use_causal_mask=False, mixed_precision=False, softmax_scale=None,
                  sliding_window=None, lse_layout="neuron", dropout_p=0.0, seed=None, seed_offset=0,
                  bias=None, alibi_slopes=None, softcap=None):
    """:func:`numbafa.attention_fwd` on a Dask cluster: same arguments after ``client``, same bits.

    Parameters
    ----------
    client : dask.distributed.Client
        A running, synchronous client the caller made (``LocalCluster`` or any cluster).
    q_ref, k_ref, v_ref, sinks_ref, bound_min, bound_max, use_causal_mask, mixed_precision
        As in :func:`numbafa.attention_fwd`; NumPy arrays, or Dask arrays chunked along batch
        and heads only (the q-head chunks holding whole GQA groups, the KV-head chunks the
        matching KV heads; ``sinks_ref`` NumPy or chunked as ``q_ref``; the bounds NumPy or
        Dask, computed here: they are ``[seqlen_q]``).
    softmax_scale, sliding_window, lse_layout
        As in :func:`numbafa.attention_fwd`.
    dropout_p, seed, seed_offset
        As in :func:`numbafa.attention_fwd`: the same keep mask as the single-process call
        (each task draws it at its share's absolute batch and q-heads).
    bias, alibi_slopes, softcap
        As in :func:`numbafa.attention_fwd`; the bias and slopes NumPy arrays (also with Dask
        q, k, v): each task gets its block's slice of them.

    Returns
    -------
    o, lse
        As :func:`numbafa.attention_fwd` returns them, bit for bit: NumPy arrays for NumPy
        inputs, lazy Dask arrays chunked as ``q_ref`` for Dask inputs.

    Raises
    ------
    TypeError
        ``client`` is not a ``dask.distributed.Client``; some but not all of q, k, v are Dask
        arrays; any error :func:`numbafa.attention_fwd` raises.
    ValueError
        The client is closed; Dask chunks split head_dim or seq, or do not line up across
        the arrays; any error :func:`numbafa.attention_fwd` raises (for Dask inputs, errors
        about the values are raised by the worker, at compute time).
    """
    _check_client(client)
    check_lse_layout(lse_layout)
    options = AttentionOptions(sinks=sinks_ref, bound_min=bound_min, bound_max=bound_max,
                               use_causal_mask=use_causal_mask, mixed_precision=mixed_precision,
                               softmax_scale=softmax_scale, sliding_window=sliding_window, dropout_p=dropout_p,
                               seed=seed, seed_offset=seed_offset, bias=bias, alibi_slopes=alibi_slopes,
                               softcap=softcap)
    named = dict(q_ref=q_ref, k_ref=k_ref, v_ref=v_ref)
    if _dask_mode(named):
        return _fwd_dask(client, named, options, lse_layout)
    prob = validate_fwd_inputs(q_ref, k_ref, v_ref, options)
    bs, nheads, d_head, seqlen_q = prob.q.shape
    check_lse_layout(lse_layout, seqlen_q)
    e = check(prob, KERNEL_CALLER, backward=False)
    nheads_kv = prob.k.shape[1]
    n_slots = sum(client.nthreads().values())
    plan = make_plan(prob, backward=False)
    plan = shards.with_q_chunks(plan, _fwd_row_chunks(plan, seqlen_q, bs * nheads_kv, n_slots))
    scores = plan.scores if plan.scores.active else None     # (each share carries its block's)
    plan = plan._replace(scores=make_scores(None, plan.acc.dtype))
    n_chunks = plan.tiling.q_chunks
    rows = [shards.owned_rows(seqlen_q, plan.tiling, c) for c in range(n_chunks)]
    o = np.empty((bs, nheads, prob.v.shape[2], seqlen_q), dtype=prob.dtype)
    lse = np.empty((bs, nheads, seqlen_q), dtype=plan.acc.dtype)
    units = _units(bs, nheads_kv, nheads // nheads_kv, _units_per_task(plan, prob, n_slots))
    shares = [(FwdInputs(shards.pack_rows(prob.q[b, heads], rows[c]), prob.k[b, kv], prob.v[b, kv],
                         prob.sinks[b, heads]), shards.block_scores(scores, b, heads, kv.stop - kv.start))
              for b, heads, kv in units for c in range(n_chunks)]
    token = uuid.uuid4().hex[:12]

    def submit(plan_future, i, pieces, attempt):
        b, heads, _ = units[i // n_chunks]
        return client.submit(shards.fwd_chunk, plan_future, pieces[0], True, seqlen_q, i % n_chunks,
                             prob.dtype, (b.start, heads.start), 1, pieces[1], exponent=e,
                             key=f"numbafa-fwd-{token}-{i}-{attempt}")

    def on_result(i, result):
        b, heads, _ = units[i // n_chunks]
        cols = rows[i % n_chunks]
        cols = slice(None) if cols is None else cols
        o[b, heads][..., cols] = result[0]
        lse[b, heads][..., cols] = result[1]

    if shares:
        _warm(client, "forward", prob.dtype, prob.dropout_p > 0, scores is not None)
    _run_shares(client, plan, shares, submit, on_result)
    return unscaled_output(o, e, "o"), lse_out(lse, lse_layout)


def attention_bwd(client, q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref=None,
                  bound_min=None, bound_max=None, use_causal_mask=False, mixed_precision=False,
                  softmax_scale=None, sliding_window=None, dropout_p=0.0, seed=None, seed_offset=0,
                  bias=None, alibi_slopes=None, softcap=None, return_dbias=False):
    """:func:`numbafa.attention_bwd` on a Dask cluster: same arguments after ``client``, same bits.

    One task per block of work units (batch, KV head: the q-heads of its GQA
    group; units grouped up to ``MIN_TASK_WORK`` while that leaves at least
    two tasks per worker thread), so dQ, dK and dV need only be put in place. A problem the
    single-process call splits into Q chunks (an odd number of units below 9,
    ``seqlen_q > 512``, not bf16 accumulators) runs one task per (unit, chunk)
    and one merge task per unit that sums the float32 dK/dV partials in chunk
    order and computes dsinks, as the kernel does: the results are bitwise
    those of the single-process call for any number of workers. At most ``bs *
    nheads_kv`` (times the chunks) tasks run at once.

    Parameters
    ----------
    client : dask.distributed.Client
        A running, synchronous client the caller made.
    q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref, bound_min, bound_max
        As in :func:`numbafa.attention_bwd`; NumPy arrays, or Dask arrays chunked along
        batch and heads only, alike for q, o, dy, lse (and sinks, which may be NumPy),
        the q-head chunks holding whole GQA groups and k, v chunked along the matching KV
        heads; the bounds NumPy or Dask (computed here).
    use_causal_mask, mixed_precision, softmax_scale, sliding_window
        As in :func:`numbafa.attention_bwd`.
    dropout_p, seed, seed_offset
        As in :func:`numbafa.attention_bwd` (the forward's mask, drawn again by every task at
        its share's absolute batch and q-heads).
    bias, alibi_slopes, softcap, return_dbias
        As in :func:`numbafa.attention_bwd`; the bias and slopes NumPy arrays (also with Dask
        inputs). With ``return_dbias``, the units that share a slab of the bias (its batch or
        head dim 1) go to one task, run in the kernel's order, so every element of dbias comes
        from one task, bitwise the single-process one (Dask inputs are joined into one chunk
        along that axis for the pass, and the gradients given back in the inputs' chunks;
        dbias is a Dask array in the bias's shape).

    Returns
    -------
    dq, dk, dv (, dsinks) (, dbias)
        As :func:`numbafa.attention_bwd` returns them, bit for bit: NumPy arrays for NumPy
        inputs, lazy Dask arrays chunked as the inputs for Dask inputs.

    Raises
    ------
    TypeError, ValueError
        As for :func:`numbafa.distributed.attention_fwd`.
    RuntimeError
        A worker runs another numbafa, Numba or GEMM path than the client; a share was
        lost with a worker ``MAX_ATTEMPTS`` (3) times.
    """
    _check_client(client)
    options = AttentionOptions(sinks=sinks_ref, bound_min=bound_min, bound_max=bound_max,
                               use_causal_mask=use_causal_mask, mixed_precision=mixed_precision,
                               softmax_scale=softmax_scale, sliding_window=sliding_window, dropout_p=dropout_p,
                               seed=seed, seed_offset=seed_offset, bias=bias, alibi_slopes=alibi_slopes,
                               softcap=softcap, return_dbias=return_dbias)
    named = dict(q_ref=q_ref, k_ref=k_ref, v_ref=v_ref, o_ref=o_ref, dy_ref=dy_ref, lse_ref=lse_ref)
    if _dask_mode(named):
        return _bwd_dask(client, named, options)
    prob = validate_bwd_inputs(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, options)
    e = check(prob, KERNEL_CALLER, backward=True)
    bs, nheads, d_head, seqlen_q = prob.q.shape
    nheads_kv, seqlen_k = prob.k.shape[1], prob.k.shape[3]
    plan = make_plan(prob, backward=True)
    scores = plan.scores if plan.scores.active else None     # (each share carries its block's)
    plan = plan._replace(scores=make_scores(None, plan.acc.dtype))
    n_chunks = plan.tiling.q_chunks
    rows = [shards.owned_rows(seqlen_q, plan.tiling, c) for c in range(n_chunks)]
    dq = np.empty((bs, nheads, d_head, seqlen_q), dtype=prob.dtype)
    dk = np.empty((bs, nheads_kv, d_head, seqlen_k), dtype=prob.dtype)
    dv = np.empty((bs, nheads_kv, prob.v.shape[2], seqlen_k), dtype=prob.dtype)
    dsinks = np.empty(prob.sinks.shape, dtype=prob.sinks.dtype)
    units = _units(bs, nheads_kv, nheads // nheads_kv,
                   _units_per_task(plan, prob, sum(client.nthreads().values())), scores)
    dbias = None if scores is None or not scores.dbias.size else np.empty(scores.dbias.shape, scores.dbias.dtype)

    def piece(b, heads, kv, c):
        def rows_of(x):
            return shards.pack_rows(x[b, heads], rows[c])
        return BwdInputs(q=rows_of(prob.q), k=prob.k[b, kv], v=prob.v[b, kv], o=rows_of(prob.o),
                         dy=rows_of(prob.dy), lse=rows_of(prob.lse), sinks=prob.sinks[b, heads])

    shares = [tuple(piece(b, heads, kv, c) for c in range(n_chunks))
              + (shards.block_scores(scores, b, heads, kv.stop - kv.start),) for b, heads, kv in units]
    token = uuid.uuid4().hex[:12]

    def submit(plan_future, i, pieces, attempt):
        key = f"numbafa-bwd-{token}-{i}-{attempt}"
        b, heads, _ = units[i]
        parts = [client.submit(shards.bwd_chunk, plan_future, pieces[c], True, seqlen_q, c,
                               prob.dtype, (b.start, heads.start), 1, pieces[-1], exponent=e, key=f"{key}-chunk{c}")
                 for c in range(n_chunks)]
        if n_chunks == 1:
            return parts[0]
        return client.submit(shards.bwd_merge, plan_future, prob.sinks[b, heads], parts,
                             seqlen_q, prob.dtype, key=f"{key}-merge")

    def on_result(i, result):
        b, heads, kv = units[i]
        dq[b, heads] = result[0]
        dk[b, kv] = result[1]
        dv[b, kv] = result[2]
        dsinks[b, heads] = result[3]
        if dbias is not None:   # the block's slab(s): whole shared dims (see _units)
            dbias[shards._slice_of(dbias, 0, b), shards._slice_of(dbias, 1, heads)] = result[4]

    if shares:
        _warm(client, "backward", prob.dtype, prob.dropout_p > 0, scores is not None)
    _run_shares(client, plan, shares, submit, on_result)
    grads = tuple(unscaled_output(x, e, name) for x, name in ((dq, "dq"), (dk, "dk"), (dv, "dv")))
    if prob.sinks_shape is not None:
        grads += (user_dsinks(unscaled_output(dsinks, e, "dsinks"), prob.sinks_shape, prob.sinks_dtype),)
    if dbias is not None:
        grads += (user_dbias(prob, unscaled_output(dbias, e, "dbias")),)
    return grads


# --- Dask arrays in, Dask arrays out -------------------------------------------------------

def _standin(x) -> np.ndarray:
    """A NumPy stand-in of a Dask array for the checks: its dtype and axes, batch 0 (no data)."""
    return np.empty((0,) + tuple(x.shape[1:]), dtype=x.dtype)


def _shape_only(shape: tuple, dtype) -> np.ndarray:
    """A read-only array of ``shape`` holding no data (``make_plan`` reads only shapes)."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype=dtype), shape=shape,
                                           strides=(0,) * len(shape), writeable=False)


def _dask_sinks(sinks, q):
    """The sinks as a Dask array chunked as ``q_ref`` along batch and heads; NumPy ``[nheads]``
    sinks (shared by the batch) as float32 ``[bs, nheads]`` (float64 for float64 inputs; their
    gradient is summed back in :func:`_batch_sum`, as the single-process call sums it)."""
    da, _ = _dask()
    if sinks is None or _is_dask(sinks):
        return sinks
    if sinks.ndim == 1:
        sinks = np.broadcast_to(sinks.astype(accumulator_dtype(np.dtype(q.dtype))), (q.shape[0], sinks.shape[0]))
    return da.from_array(sinks, chunks=q.chunks[:2] + tuple((n,) for n in sinks.shape[2:]))


def _validate_dask(client, named: dict, options: AttentionOptions, validate):
    """Check Dask inputs on their metadata; return ``(problem with batch 0, checked scalar options,
    sinks, bounds)``.

    Everything is checked by ``validate`` (the single-process checks) on batch-0 stand-ins
    first, then the batch sizes here; the values are checked by the workers, block by block.
    NumPy sinks become Dask arrays chunked as ``q_ref`` (:func:`_dask_sinks`); Dask bounds are
    computed (they are ``[seqlen_q]``).
    """
    sinks = options.sinks
    if sinks is not None and not (_is_dask(sinks) or isinstance(sinks, np.ndarray)):
        raise TypeError(f"sinks_ref must be a numpy.ndarray or a dask.array.Array, got {type(sinks).__name__}")
    if _is_dask(sinks) and sinks.ndim == 1:
        raise ValueError(f"sinks_ref of shape {sinks.shape} [nheads] must be a numpy.ndarray (a Dask array "
                         f"of sinks must be [bs, nheads] or [bs, nheads, num_sinks], chunked as q_ref)")
    bounds = [None if b is None else np.asarray(client.compute(b).result()) if _is_dask(b) else b
              for b in (options.bound_min, options.bound_max)]
    for name, x in (("bias", options.bias), ("alibi_slopes", options.alibi_slopes)):
        if _is_dask(x):
            raise TypeError(f"{name} must be a numpy.ndarray (each task gets its block's slice), got a "
                            f"dask.array.Array; compute it first")
    checked = check_options(dataclasses.replace(options, sinks=None, bound_min=None, bound_max=None))
    standin_sinks = None if sinks is None else sinks if sinks.ndim == 1 and not _is_dask(sinks) else _standin(sinks)
    bs = named["q_ref"].shape[0]
    try:
        prob = validate(*(_standin(x) for x in named.values()),
                        dataclasses.replace(checked, sinks=standin_sinks, bound_min=bounds[0], bound_max=bounds[1],
                                            bias=_batch0(checked.bias, 4, bs),
                                            alibi_slopes=_batch0(checked.alibi_slopes, 2, bs)))
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{exc} (Dask inputs: checked on their metadata, shapes shown with "
                        f"batch 0)") from None
    q = named["q_ref"]
    for name, x in list(named.items()) + [("sinks_ref", sinks)]:
        if x is not None and x.ndim > 1 and x.shape[0] != q.shape[0]:
            raise ValueError(f"{name} must have batch size {q.shape[0]} (q_ref.shape[0]), got shape "
                             f"{tuple(x.shape)}")
    return prob, checked, _dask_sinks(sinks, q), bounds


def _shape4(bias) -> tuple:
    """The shape of a bias as the kernels see it: padded with leading 1s to 4 dims."""
    return (1,) * (4 - np.ndim(bias)) + np.shape(bias)


def _batch0(x, ndim: int, bs: int):
    """A bias (``ndim`` 4) or slopes (2) with a batch dim of ``bs``, cut to batch 0 for the
    checks on batch-0 stand-ins (another one, or None, as it is)."""
    if x is None or np.ndim(x) != ndim or np.shape(x)[0] != bs:
        return x
    return np.asarray(x)[:0]


def _variants_of_block(options: AttentionOptions, batches: slice, heads: slice) -> tuple:
    """``(bias, alibi_slopes)`` of the block of ``batches`` and q-``heads``: the bias as 4-D and
    the slopes sliced along the dims they have (None where absent)."""
    bias, alibi = options.bias, options.alibi_slopes
    if bias is not None:
        bias = np.asarray(bias).reshape(_shape4(bias))
        bias = bias[shards._slice_of(bias, 0, batches), shards._slice_of(bias, 1, heads)]
    if alibi is not None:
        alibi = np.asarray(alibi)
        alibi = alibi[heads] if alibi.ndim == 1 else alibi[shards._slice_of(alibi, 0, batches), heads]
    return bias, alibi


def _joined_for_dbias(named: dict, sinks, options: AttentionOptions, nheads_kv: int) -> tuple:
    """``(named, sinks, joined axes)``: with ``return_dbias`` and a bias shared by the batches
    (or the KV heads), the arrays joined into one chunk along that axis, so that the units
    sharing a slab of dbias run in one task, in the kernel's order."""
    bias = options.bias
    if not options.return_dbias or bias is None:
        return named, sinks, ()
    bias4 = _shape4(bias)
    q = named["q_ref"]
    axes = tuple(axis for axis, shared in ((0, bias4[0] == 1 and q.shape[0] > 1), (1, bias4[1] == 1 and nheads_kv > 1))
                 if shared)
    if not axes:
        return named, sinks, ()
    join = {axis: -1 for axis in axes}
    return ({name: x.rechunk(join) for name, x in named.items()},
            None if sinks is None else sinks.rechunk(join), axes)


def _batch_sum(dsinks, sinks):
    """dsinks of ``[nheads]`` sinks: the float32 ``[bs, nheads]`` gradient summed over the batch in one
    block (the single-process order), in the sinks' dtype; other sinks: unchanged."""
    if sinks is None or sinks.ndim != 1:
        return dsinks
    whole = dsinks.rechunk(dsinks.shape)
    return whole.map_blocks(user_dsinks, sinks.shape, sinks.dtype, drop_axis=0, chunks=(sinks.shape,),
                            dtype=sinks.dtype)


def _check_chunks(named: dict, kv_names: tuple, n_rep: int) -> None:
    """Chunks along batch and heads only; q-head chunks of whole GQA groups; all aligned."""
    q = named["q_ref"]
    for name, x in named.items():
        for axis in range(2, x.ndim):
            if len(x.chunks[axis]) > 1:
                raise ValueError(f"{name} must be chunked along batch and heads only: expected "
                                 f"chunks {(x.shape[axis],)} along axis {axis}, got {x.chunks[axis]}")
        if x.chunks[0] != q.chunks[0]:
            raise ValueError(f"{name} must be chunked along batch as q_ref is: expected "
                             f"{q.chunks[0]}, got {x.chunks[0]}")
    if any(c % n_rep for c in q.chunks[1]):
        raise ValueError(f"q_ref's chunks along heads must hold whole GQA groups of {n_rep} "
                         f"q-heads (nheads // nheads_kv): expected multiples of {n_rep}, got "
                         f"{q.chunks[1]}")
    kv_chunks = tuple(c // n_rep for c in q.chunks[1])
    for name, x in named.items():
        expected = kv_chunks if name in kv_names else q.chunks[1]
        if x.chunks[1] != expected:
            why = (f"the KV heads of q_ref's head chunks {q.chunks[1]}, {n_rep} q-heads per KV head"
                   if name in kv_names else "as q_ref")
            raise ValueError(f"{name} must be chunked along heads {why}: expected {expected}, got "
                             f"{x.chunks[1]}")


def _blocks(x):
    """``(i, j) -> Delayed`` block of a Dask array chunked along its first two axes only."""
    if x is None:
        return lambda i, j: None
    delayed_blocks = x.to_delayed()
    return lambda i, j: delayed_blocks[(i, j) + (0,) * (x.ndim - 2)]


def _per_block(q, arrays, block) -> list:
    """``results[i][j] = block(blocks, origin, extent)`` for every block ``(i, j)`` of ``q_ref``'s
    chunks: ``blocks`` the Delayed blocks ``(i, j)`` of ``arrays`` (None for a None array),
    ``origin`` its absolute ``(batch0, head0)`` (:func:`_origin`), ``extent`` its ``(batches,
    q-heads)`` slices."""
    get = [_blocks(x) for x in arrays]

    def extent(i, j):
        (b0, h0), (nb, nh) = _origin(q.chunks, i, j), (q.chunks[0][i], q.chunks[1][j])
        return slice(b0, b0 + nb), slice(h0, h0 + nh)
    return [[block([g(i, j) for g in get], _origin(q.chunks, i, j), extent(i, j)) for j in range(len(q.chunks[1]))]
            for i in range(len(q.chunks[0]))]


def _origin(chunks: tuple, i: int, j: int) -> tuple:
    """``(batch0, head0)``: the absolute batch and q-head of block ``(i, j)``'s first element
    (``chunks``: ``q_ref.chunks``)."""
    return int(sum(chunks[0][:i])), int(sum(chunks[1][:j]))


def _assemble(results: list, index: int, chunks: tuple, dtype, label: str):
    """The Dask array whose block ``(i, j)`` is item ``index`` of the tuple that the Delayed
    ``results[i][j]`` computes: one ``getitem`` task per block, on the block's worker. (Built
    as ``da.from_delayed`` per block and ``da.block`` it took three tasks per block, each a
    round trip through the scheduler.)"""
    import operator

    from dask.array import Array
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph
    flat = [r for row in results for r in row]
    name = f"numbafa-{label}-{tokenize([r.key for r in flat], index)}"
    rest = (0,) * (len(chunks) - 2)
    layer = {(name, i, j) + rest: (operator.getitem, r.key, index)
             for i, row in enumerate(results) for j, r in enumerate(row)}
    graph = HighLevelGraph.from_collections(name, layer, dependencies=flat)
    return Array(graph, name, chunks, dtype=dtype)


def _dask_plan(client, named, sinks, prob, backward: bool):
    """The checks and the plan shared by both passes on Dask arrays: chunks, the whole
    problem's plan (from shapes only) and the workers' warm-up; the plan as a delayed value."""
    from dask import delayed
    q, k = named["q_ref"], named["k_ref"]
    n_rep = q.shape[1] // k.shape[1]
    _check_chunks(dict(named, **({} if sinks is None else {"sinks_ref": sinks})), ("k_ref", "v_ref"), n_rep)
    plan = make_plan(dataclasses.replace(prob, q=_shape_only(q.shape, prob.q.dtype),
                                         k=_shape_only(k.shape, prob.k.dtype)), backward=backward)
    plan = plan._replace(scores=make_scores(None, plan.acc.dtype))    # (each block makes its own)
    _warm(client, "backward" if backward else "forward", q.dtype, prob.dropout_p > 0, prob.has_score_mods)
    return plan, delayed(plan, traverse=False)


def _fwd_dask(client, named, options, lse_layout):
    from dask import delayed
    prob, checked, sinks, bounds = _validate_dask(client, named, options, validate_fwd_inputs)
    q = named["q_ref"]
    seqlen_q = q.shape[3]
    d_v = named["v_ref"].shape[2]
    check_lse_layout(lse_layout, seqlen_q)
    plan, plan_d = _dask_plan(client, named, sinks, prob, backward=False)
    bounds_d = [None if b is None else delayed(b, traverse=False) for b in bounds]
    n_chunks = plan.tiling.q_chunks

    checked = dataclasses.replace(checked, bias=None, alibi_slopes=None)   # each block gets its slices

    def block(blocks, origin, extent):
        variants = [None if x is None else delayed(x, traverse=False) for x in _variants_of_block(options, *extent)]
        parts = [delayed(shards.fwd_block, pure=True, nout=2)(plan_d, (c, origin), checked, lse_layout,
                                                               tuple(blocks[:3]), (blocks[3], *bounds_d, *variants))
                 for c in range(n_chunks)]
        return parts[0] if n_chunks == 1 else delayed(shards.fwd_block_merge, pure=True, nout=2)(
            plan_d, parts, seqlen_q, lse_layout)

    results = _per_block(q, (q, named["k_ref"], named["v_ref"], sinks), block)
    lse_rest = ((Q_TILE,), (seqlen_q // Q_TILE,)) if lse_layout == "neuron" else ((seqlen_q,),)
    return (_assemble(results, 0, q.chunks[:2] + ((d_v,), (seqlen_q,)), q.dtype, "o"),
            _assemble(results, 1, q.chunks[:2] + lse_rest, plan.acc.dtype, "lse"))


def _bwd_dask(client, named, options):
    from dask import delayed
    prob, checked, sinks, bounds = _validate_dask(client, named, options, validate_bwd_inputs)
    given = {name: x.chunks for name, x in named.items()}
    given_sinks = None if sinks is None else sinks.chunks
    named, sinks, joined = _joined_for_dbias(named, sinks, options, named["k_ref"].shape[1])
    q, k = named["q_ref"], named["k_ref"]
    nheads, d_head, seqlen_q = q.shape[1:]
    nheads_kv, seqlen_k = k.shape[1], k.shape[3]
    n_rep = nheads // nheads_kv
    plan, plan_d = _dask_plan(client, named, sinks, prob, backward=True)
    bounds_d = [None if b is None else delayed(b, traverse=False) for b in bounds]
    n_chunks = plan.tiling.q_chunks
    checked = dataclasses.replace(checked, bias=None, alibi_slopes=None)   # each block gets its slices

    def block(blocks, origin, extent):
        variants = [None if x is None else delayed(x, traverse=False) for x in _variants_of_block(options, *extent)]
        parts = [delayed(shards.bwd_block, pure=True, nout=5)(plan_d, (c, origin), checked, tuple(blocks[:6]),
                                                               (blocks[6], *bounds_d, *variants))
                 for c in range(n_chunks)]
        return parts[0] if n_chunks == 1 else delayed(shards.bwd_block_merge, pure=True, nout=5)(
            plan_d, parts, blocks[6], seqlen_q, q.dtype)

    results = _per_block(q, list(named.values()) + [sinks], block)
    kv_heads = (q.chunks[0], tuple(c // n_rep for c in q.chunks[1]))
    grads = (_assemble(results, 0, q.chunks[:2] + ((d_head,), (seqlen_q,)), q.dtype, "dq"),
             _assemble(results, 1, kv_heads + ((d_head,), (seqlen_k,)), q.dtype, "dk"),
             _assemble(results, 2, kv_heads + ((named["v_ref"].shape[2],), (seqlen_k,)), q.dtype, "dv"))
    if joined:   # back in the chunks the inputs came in
        grads = tuple(x.rechunk(given[name]) for x, name in zip(grads, ("q_ref", "k_ref", "v_ref")))
    if sinks is not None:
        dsinks = _assemble(results, 3, q.chunks[:2] + tuple((n,) for n in sinks.shape[2:]), sinks.dtype, "dsinks")
        grads += (_batch_sum(dsinks.rechunk(given_sinks) if joined else dsinks, options.sinks),)
    if prob.return_dbias:
        grads += (_dbias(results, q.chunks, options.bias),)
    return grads


def _dbias(results: list, chunks: tuple, bias):
    """The Dask array of dbias, in the bias's shape and dtype, from the blocks' slices (item 4 of
    each block's result; a dim the bias broadcasts is one chunk: the blocks along it were joined)."""
    bias = np.asarray(bias)
    bias4 = _shape4(bias)
    dbias_chunks = tuple((1,) if bias4[axis] == 1 else chunks[axis] for axis in (0, 1)) + tuple((n,) for n in bias4[2:])
    return _assemble(results, 4, dbias_chunks, bias.dtype, "dbias").reshape(bias.shape)
