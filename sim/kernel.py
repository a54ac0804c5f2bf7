"""The compiled engine's event loop, compiled to machine code (numba).

Everything about *executing* a compiled pipeline program over arrays lives
here: the operations of every simulated rank, messages, collectives and the
fluid sharing of ports, with the arithmetic of ``sim.engine`` (the reference
engine, kept in Python) operation for operation, so the two record the very
same times. What is random or depends on the device and link models is priced
before or outside the loop (``sim.waves``): a compute's duration is read from
its event's slot in ``ends`` (written there in bulk by ``Device.durations``),
a transfer's slowdown from its send event's slot, a collective's slowest-edge
multiplier from its ring's table.

State lives in arrays (``State``), so the loop can stop and go on: it returns
``PRICE`` when a rank on a device whose durations depend on the start time
(throttle windows) needs one priced (``need_rank``/``need_start``: the rank
is parked and nothing is taken from the heap until it is priced), ``PROGRESS``
every ``progress_every`` operations, ``GROW`` when a table is full, and
``DONE``. Flow starts and completions go through one heap in (time, post
order); ranks run until they block before the next entry is taken, as in the
reference engine.
"""
from __future__ import annotations

import numba
import numpy as np

# operation codes: megatronapp.program.compiled
COMPUTE, SEND, RECV, WAIT, COLLECTIVE, RECV_WAIT, ASYNC_COLLECTIVE, COLLECTIVE_WAIT = range(8)
DONE, PRICE, PROGRESS, GROW, EXCHANGE = range(5)
# scalar registers (State.reg)
R_READY, R_HEAP, R_SEQ, R_FREE_FLOW, R_NEXT_FLOW, R_FREE_RV, R_NEXT_RV, R_FREE_MEM, R_NEXT_MEM, \
    R_EXECUTED, R_NEED, R_STAMP, R_AWAITED, R_FINISH = range(14)
N_REG = 14


@numba.njit(cache=True)
def _heap_less(ht, hs, i, j):  # pragma: no cover
    """Entry ``i`` is due before entry ``j``: earlier, or posted earlier at the same instant."""
    return ht[i] < ht[j] or (ht[i] == ht[j] and hs[i] < hs[j])


@numba.njit(cache=True)
def _heap_swap(ht, hs, hf, hv, i, j):  # pragma: no cover
    ht[i], ht[j] = ht[j], ht[i]
    hs[i], hs[j] = hs[j], hs[i]
    hf[i], hf[j] = hf[j], hf[i]
    hv[i], hv[j] = hv[j], hv[i]


@numba.njit(cache=True)
def _heap_push(ht, hs, hf, hv, size, seq, when, flow, version):  # pragma: no cover
    i = size
    ht[i], hs[i], hf[i], hv[i] = when, seq, flow, version
    while i > 0:
        parent = (i - 1) >> 1
        if _heap_less(ht, hs, parent, i):
            break
        _heap_swap(ht, hs, hf, hv, parent, i)
        i = parent


@numba.njit(cache=True)
def _heap_pop(ht, hs, hf, hv, size):  # pragma: no cover
    """Remove the root; ``size`` is the size before."""
    last = size - 1
    ht[0], hs[0], hf[0], hv[0] = ht[last], hs[last], hf[last], hv[last]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= last:
            break
        if child + 1 < last and _heap_less(ht, hs, child + 1, child):
            child += 1
        if _heap_less(ht, hs, i, child):
            break
        _heap_swap(ht, hs, hf, hv, child, i)
        i = child


@numba.njit(cache=True)
def _allocate(reg, free, bump, links):  # pragma: no cover
    """An entry of a pool: the first on its free list (chained through ``links``,
    its head in ``reg[free]``), else the next never used (``reg[bump]``)."""
    x = reg[free]
    if x >= 0:
        reg[free] = links[x]
    else:
        x = reg[bump]
        reg[bump] = x + 1
    return x


@numba.njit(cache=True)
def _full(reg, free, bump, capacity):  # pragma: no cover
    """Whether a pool has no entry left to ``_allocate``."""
    return reg[free] < 0 and reg[bump] >= capacity


@numba.njit(cache=True)
def _release(reg, free, links, x):  # pragma: no cover
    links[x] = reg[free]
    reg[free] = x


@numba.njit(cache=True)
def _port_add(head, count, nxt, prv, port, flow, side):  # pragma: no cover
    """Put side ``side`` (0: its first port, 1: its second) of ``flow`` on ``port``'s list."""
    node = 2 * flow + side
    first = head[port]
    nxt[node] = first
    prv[node] = -1
    if first >= 0:
        prv[first] = node
    head[port] = node
    count[port] += 1


@numba.njit(cache=True)
def _port_remove(head, count, nxt, prv, port, flow, side):  # pragma: no cover
    node = 2 * flow + side
    if prv[node] >= 0:
        nxt[prv[node]] = nxt[node]
    else:
        head[port] = nxt[node]
    if nxt[node] >= 0:
        prv[nxt[node]] = prv[node]
    count[port] -= 1


@numba.njit(cache=True)
def _ports_flows(head, nxt, a, b, mark, stamp, out):  # pragma: no cover
    """The flows on port ``a`` or ``b`` (each once) into ``out``; their number."""
    k = 0
    for port in (a, b):
        node = head[port]
        while node >= 0:
            f = node >> 1
            if mark[f] != stamp:
                mark[f] = stamp
                out[k] = f
                k += 1
            node = nxt[node]
    return k


@numba.njit(cache=True)
def run_kernel(prog, net, coll, st):  # pragma: no cover (compiled; tested through sim.kernel_run)
    """Run until done or until the caller must act (see the module's doc)."""
    (op_code, op_ev, op_x, op_nbytes, op_nth, op_steps, op_cost, op_lo, op_hi, ev_base,
     slot_base, send_ev, recv_ev, msg_src, msg_dst, stage_of, pp, overhead, progress_every) = prog
    (link_of, lat_of, port_a, port_b, port_bw, fixed_p2p) = net
    (coll_key, ring_of, need, cross, n_keys, ring_n, ring_minbw, ring_lat, ring_fixed, ring_lo,
     ring_pos, ring_worst, ring_const) = coll
    (reg, pc, clock, starts, ends, arrive, posted, wait1, wait2, ready, need_rank, need_start,
     ht, hs, hf, hv, f_rem, f_rate, f_last, f_ver, f_a, f_b, f_slot, f_sender, f_msg,
     f_lat, p_head, p_count, p_next, p_prev, mark, scratch, ck_open, rv_left, rv_latest,
     rv_head, rv_tail, mem_rank, mem_ev, mem_next, rv_nth, rv_next, coll_wait, busy, mem_op,
     awaited, horizon, finish_rv, finish_at) = st
    for x in range(reg[R_FINISH]):  # awaited rendezvous whose members elsewhere have arrived
        rv = finish_rv[x]
        m = rv_head[rv]
        j = mem_rank[m] if mem_rank[m] >= 0 else ~mem_rank[m]
        k = mem_op[m]
        _complete(j, k, finish_at[x], rv, coll_key[j * 4 + op_x[k]], op_x, op_nbytes, op_steps,
                  ring_of, ring_n, ring_minbw, ring_lat, ring_fixed, ring_lo, ring_pos, ring_worst,
                  ring_const, busy, ck_open, rv_next, rv_latest, rv_head, mem_rank, mem_ev,
                  mem_next, coll_wait, clock, pc, ends, ev_base, ready, reg[R_READY], reg)
        count = reg[R_AWAITED]
        for y in range(count):
            if awaited[y] == rv:
                awaited[y] = awaited[count - 1]
                reg[R_AWAITED] = count - 1
                break
    reg[R_FINISH] = 0
    stamp = reg[R_STAMP]
    n_ready = reg[R_READY]
    heap = reg[R_HEAP]
    seq = reg[R_SEQ]
    executed = reg[R_EXECUTED]
    n_parked = reg[R_NEED]
    while True:
        # ---------------------------------------- every ready rank until it blocks
        while n_ready > 0:
            n_ready -= 1
            i = ready[n_ready]
            lo = op_lo[stage_of[i]]
            n = op_hi[stage_of[i]] - lo
            p = pc[i]
            t = clock[i]
            eb = ev_base[i]
            sb = slot_base[i]
            start_pc = p
            grow = False
            while p < n:
                k = lo + p
                code = op_code[k]
                before = t  # the clock to go back to when this op must wait its turn
                if overhead != 0.0 and code != WAIT and code != COLLECTIVE_WAIT:
                    t = t + overhead
                if code == COMPUTE:
                    e = eb + op_ev[k]
                    starts[e] = t  # written before its duration is read: see ``sim.spill``
                    d = ends[e]
                    if d != d:  # NaN: the device prices it only now (its start matters)
                        need_rank[n_parked] = i
                        need_start[n_parked] = t
                        n_parked += 1
                        t = before  # it is issued again once priced (its start written again)
                        break
                    t = t + d
                    ends[e] = t
                elif code == COLLECTIVE or code == ASYNC_COLLECTIVE:
                    grow = (_full(reg, R_FREE_RV, R_NEXT_RV, rv_left.shape[0])
                            or _full(reg, R_FREE_MEM, R_NEXT_MEM, mem_rank.shape[0]))
                    if grow:  # issued again once the tables have room
                        t = before
                        break
                    e = eb + op_ev[k]
                    starts[e] = t
                    ck = coll_key[i * 4 + op_x[k]]
                    nth = op_nth[k]
                    rv = ck_open[ck]  # the communicator's open rendezvous (few: the posted ones)
                    while rv >= 0 and rv_nth[rv] != nth:
                        rv = rv_next[rv]
                    member = i if code == COLLECTIVE else ~i
                    if rv >= 0 and rv_left[rv] > 1:
                        rv_left[rv] -= 1
                        if t > rv_latest[rv]:
                            rv_latest[rv] = t
                    elif rv < 0 and (need[ck] > 1 or cross[ck]):
                        rv = _allocate(reg, R_FREE_RV, R_NEXT_RV, rv_head)
                        rv_nth[rv] = nth
                        rv_next[rv] = ck_open[ck]
                        ck_open[ck] = rv
                        rv_left[rv] = need[ck] - 1
                        rv_latest[rv] = t
                        rv_head[rv] = -1
                        rv_tail[rv] = -1
                    elif cross[ck]:  # the last one here: the members elsewhere are awaited
                        rv_left[rv] = 0
                        if t > rv_latest[rv]:
                            rv_latest[rv] = t
                    else:
                        done = _complete(i, k, t, rv, ck, op_x, op_nbytes, op_steps,
                                         ring_of, ring_n, ring_minbw, ring_lat,
                                         ring_fixed, ring_lo, ring_pos, ring_worst, ring_const,
                                         busy, ck_open, rv_next, rv_latest, rv_head, mem_rank,
                                         mem_ev, mem_next, coll_wait, clock, pc, ends,
                                         ev_base, ready, n_ready, reg)
                        n_ready = reg[R_READY]
                        ends[e] = done
                        if code == COLLECTIVE:
                            t = done
                        p += 1
                        continue
                    m = _allocate(reg, R_FREE_MEM, R_NEXT_MEM, mem_next)
                    mem_rank[m] = member
                    mem_ev[m] = op_ev[k]
                    mem_op[m] = k
                    mem_next[m] = -1
                    if rv_tail[rv] >= 0:
                        mem_next[rv_tail[rv]] = m
                    else:
                        rv_head[rv] = m
                    rv_tail[rv] = m
                    if cross[ck] and rv_left[rv] == 0:  # every member here has arrived
                        awaited[reg[R_AWAITED]] = rv
                        reg[R_AWAITED] += 1
                    if code == COLLECTIVE:
                        break
                    ends[e] = np.nan  # in flight: its end comes with its last member
                elif code == RECV_WAIT or code == RECV:
                    e = eb + op_ev[k]
                    starts[e] = t
                    slot = sb + op_x[k]
                    a = arrive[slot]
                    if a >= 0.0:
                        if a > t:
                            if code == RECV_WAIT:
                                t = a
                            ends[e] = a
                        else:
                            ends[e] = t
                    else:
                        posted[slot] = 1
                        if code == RECV_WAIT:
                            if wait1[slot] < 0:
                                wait1[slot] = i
                            else:
                                wait2[slot] = i
                            break
                elif code == SEND:
                    grow = op_nbytes[k] > 0 and fixed_p2p < 0.0 and (
                        heap + 1 >= ht.shape[0] or _full(reg, R_FREE_FLOW, R_NEXT_FLOW,
                                                         f_rem.shape[0]))
                    if grow:
                        t = before
                        break
                    e = eb + op_ev[k]
                    starts[e] = t
                    m_ = op_x[k]
                    slot = sb + m_
                    d_stage = msg_dst[m_]
                    link = link_of[i * pp + d_stage]
                    slow = ends[e]
                    latency = lat_of[link]
                    if fixed_p2p >= 0.0:
                        _deliver(slot, i, m_, t + fixed_p2p * slow, arrive, ends, starts, ev_base,
                                 send_ev, recv_ev, msg_src, msg_dst, posted, wait1, wait2, clock,
                                 pc, ready, reg, n_ready)
                        n_ready = reg[R_READY]
                    elif op_nbytes[k] <= 0:
                        _deliver(slot, i, m_, t + latency, arrive, ends, starts, ev_base, send_ev,
                                 recv_ev, msg_src, msg_dst, posted, wait1, wait2, clock, pc,
                                 ready, reg, n_ready)
                        n_ready = reg[R_READY]
                    else:
                        f = _allocate(reg, R_FREE_FLOW, R_NEXT_FLOW, f_slot)
                        f_rem[f] = op_nbytes[k] * slow
                        f_rate[f] = 0.0
                        f_last[f] = 0.0
                        f_a[f] = port_a[link]
                        f_b[f] = port_b[link]
                        f_slot[f] = slot
                        f_sender[f] = i
                        f_msg[f] = m_
                        f_lat[f] = latency
                        _heap_push(ht, hs, hf, hv, heap, seq, t, f, -1)
                        heap += 1
                        seq += 1
                elif code == WAIT:
                    slot = sb + op_x[k]
                    a = arrive[slot]
                    if a < 0.0:
                        if wait1[slot] < 0:
                            wait1[slot] = i
                        else:
                            wait2[slot] = i
                        break
                    if a > t:
                        t = a
                else:  # COLLECTIVE_WAIT
                    e = eb + op_ev[k]
                    if ends[e] == ends[e]:  # ended (not NaN)
                        if ends[e] > t:
                            t = ends[e]
                    else:
                        coll_wait[i] = op_ev[k]
                        break
                p += 1
            executed += p - start_pc
            pc[i] = p
            clock[i] = t if p < n else np.inf
            if grow:
                ready[n_ready] = i  # runs again once there is room
                _save(reg, n_ready + 1, heap, seq, executed, n_parked, stamp)
                return GROW
        _save(reg, n_ready, heap, seq, executed, n_parked, stamp)
        if n_parked > 0:
            return PRICE
        if executed >= progress_every:
            return PROGRESS
        if heap == 0:
            return EXCHANGE if reg[R_AWAITED] > 0 else DONE
        # ---------------------------------------- the next due flow start or completion
        if heap + reg[R_NEXT_FLOW] + 2 >= ht.shape[0]:  # room for every live flow's repost
            return GROW
        if reg[R_AWAITED] > 0 and not _may_pop(ht[0], awaited, reg[R_AWAITED], rv_latest,
                                                horizon[0]):
            return EXCHANGE
        now = ht[0]
        f = hf[0]
        version = hv[0]
        _heap_pop(ht, hs, hf, hv, heap)
        heap -= 1
        a = f_a[f]
        b = f_b[f]
        if version < 0:  # a start
            f_last[f] = now
            k = 0
            if p_count[a] > 0 or p_count[b] > 0:  # those already there go on at a new rate
                stamp += 1
                k = _ports_flows(p_head, p_next, a, b, mark, stamp, scratch)
                _settle(k, scratch, f_rem, f_rate, f_last, now)
            _port_add(p_head, p_count, p_next, p_prev, a, f, 0)
            _port_add(p_head, p_count, p_next, p_prev, b, f, 1)
            if k:
                stamp += 1
                k = _ports_flows(p_head, p_next, a, b, mark, stamp, scratch)
            else:  # alone: its rate is the slower port's (bandwidth / 1, bit for bit)
                scratch[0] = f
                k = 1
            heap, seq = _rates(k, scratch, f_a, f_b, port_bw, p_count, f_rate, f_ver, f_rem,
                               now, ht, hs, hf, hv, heap, seq)
        elif version == f_ver[f]:  # a completion (else stale: its rate changed since)
            _port_remove(p_head, p_count, p_next, p_prev, a, f, 0)
            _port_remove(p_head, p_count, p_next, p_prev, b, f, 1)
            if p_count[a] > 0 or p_count[b] > 0:
                stamp += 1
                k = _ports_flows(p_head, p_next, a, b, mark, stamp, scratch)
                _settle(k, scratch, f_rem, f_rate, f_last, now)
                heap, seq = _rates(k, scratch, f_a, f_b, port_bw, p_count, f_rate, f_ver, f_rem,
                                   now, ht, hs, hf, hv, heap, seq)
            f_ver[f] += 1  # versions only grow, so entries of an earlier use of ``f`` are stale
            slot, sender, m_ = f_slot[f], f_sender[f], f_msg[f]
            when = now + f_lat[f]
            _release(reg, R_FREE_FLOW, f_slot, f)
            _deliver(slot, sender, m_, when, arrive, ends, starts, ev_base, send_ev, recv_ev,
                     msg_src, msg_dst, posted, wait1, wait2, clock, pc, ready, reg, n_ready)
            n_ready = reg[R_READY]


@numba.njit(cache=True)
def _may_pop(due, awaited, count, rv_latest, horizon):  # pragma: no cover
    """Whether an entry due at ``due`` may be taken while rendezvous are awaited
    from elsewhere: their members here resume no earlier than their latest
    arrival here, nor than ``horizon`` (the earliest instant due anywhere, when
    every part has stopped)."""
    if due <= horizon:
        return True
    for j in range(count):
        if due >= rv_latest[awaited[j]]:
            return False
    return True


@numba.njit(cache=True)
def _save(reg, n_ready, heap, seq, executed, n_parked, stamp):  # pragma: no cover
    """The loop's scalar state into its registers (it goes on from there)."""
    reg[R_READY] = n_ready
    reg[R_HEAP] = heap
    reg[R_SEQ] = seq
    reg[R_EXECUTED] = executed
    reg[R_NEED] = n_parked
    reg[R_STAMP] = stamp


@numba.njit(cache=True)
def _settle(k, flows, f_rem, f_rate, f_last, now):  # pragma: no cover
    """``FluidPorts._settle``: what ``flows[:k]`` sent since their last change."""
    for j in range(k):
        g = flows[j]
        f_rem[g] -= f_rate[g] * (now - f_last[g])
        f_last[g] = now


@numba.njit(cache=True)
def _rates(k, flows, f_a, f_b, port_bw, p_count, f_rate, f_ver, f_rem, now, ht, hs, hf, hv,
           heap, seq):  # pragma: no cover
    """``FluidPorts._rates`` of ``flows[:k]``: each its share of its most crowded
    port, its completion posted for its new version."""
    for j in range(k):
        g = flows[j]
        ra = port_bw[f_a[g]] / p_count[f_a[g]]
        rb = port_bw[f_b[g]] / p_count[f_b[g]]
        f_rate[g] = ra if ra <= rb else rb
        f_ver[g] += 1
        eta = (f_rem[g] if f_rem[g] > 0.0 else 0.0) / f_rate[g]
        _heap_push(ht, hs, hf, hv, heap, seq, now + eta, g, f_ver[g])
        heap += 1
        seq += 1
    return heap, seq


@numba.njit(cache=True)
def _deliver(slot, sender, m, when, arrive, ends, starts, ev_base, send_ev, recv_ev, msg_src,
             msg_dst, posted, wait1, wait2, clock, pc, ready, reg, n_ready):  # pragma: no cover
    """Message ``m`` (slot ``slot``) of rank ``sender`` has arrived at ``when``."""
    arrive[slot] = when
    ends[ev_base[sender] + send_ev[m]] = when
    if posted[slot]:
        receiver = sender - msg_src[m] + msg_dst[m]
        e = ev_base[receiver] + recv_ev[m]
        ends[e] = when  # written before its start is read: see ``sim.spill``
        if starts[e] > when:
            ends[e] = starts[e]
    for w in (wait1[slot], wait2[slot]):
        if w >= 0:
            if when > clock[w]:
                clock[w] = when
            pc[w] += 1
            ready[n_ready] = w
            n_ready += 1
    wait1[slot] = -1
    wait2[slot] = -1
    reg[R_READY] = n_ready


@numba.njit(cache=True)
def _ring_seconds(r, nbytes, steps, ring_n, ring_minbw, ring_lat, ring_fixed, ring_lo, ring_pos,
                  ring_worst, ring_const):  # pragma: no cover
    """``Ring.seconds`` with the next slowest-edge multiplier of ring ``r`` (its
    constant one where it draws no jitter: ``ring_lo`` < 0)."""
    n = ring_n[r]
    if n == 1:
        return 0.0
    if ring_lo[r] < 0:
        worst = ring_const[r]
    else:
        worst = ring_worst[ring_lo[r] + ring_pos[r]]
        ring_pos[r] += 1
    if ring_fixed[r] >= 0.0:
        return ring_fixed[r] * worst
    bw = ring_minbw[r] / worst
    return steps * ((n - 1) / n * nbytes / bw + ring_lat[r])


@numba.njit(cache=True)
def _complete(i, k, t, rv, ck, op_x, op_nbytes, op_steps, ring_of, ring_n, ring_minbw,
              ring_lat, ring_fixed, ring_lo, ring_pos, ring_worst, ring_const, busy, ck_open,
              rv_next, rv_latest, rv_head, mem_rank, mem_ev, mem_next, coll_wait, clock, pc, ends,
              ev_base, ready, n_ready, reg):  # pragma: no cover
    """Rank ``i`` is the last to arrive (at ``t``) at a collective: its end,
    with every rank that waited for it resumed (and every rank that posted it
    and went on given its end)."""
    r = ring_of[i * 4 + op_x[k]]
    latest = t
    if rv >= 0 and rv_latest[rv] > t:
        latest = rv_latest[rv]
    ring_s = _ring_seconds(r, op_nbytes[k], op_steps[k], ring_n, ring_minbw, ring_lat, ring_fixed,
                           ring_lo, ring_pos, ring_worst, ring_const)
    b = busy[ck]
    end = (b if b > latest else latest) + ring_s
    busy[ck] = end
    done = latest + (end - latest)
    if rv < 0:
        reg[R_READY] = n_ready
        return done
    if ck_open[ck] == rv:  # unlinked from its communicator's open rendezvous
        ck_open[ck] = rv_next[rv]
    else:
        prev = ck_open[ck]
        while rv_next[prev] != rv:
            prev = rv_next[prev]
        rv_next[prev] = rv_next[rv]
    m = rv_head[rv]
    while m >= 0:
        j = mem_rank[m]
        e = mem_ev[m]
        if j < 0:  # posted it and went on: resumed only if now waiting for it
            j = ~j
            ends[ev_base[j] + e] = done
            if coll_wait[j] == e:
                coll_wait[j] = -1
                if done > clock[j]:
                    clock[j] = done
                pc[j] += 1
                ready[n_ready] = j
                n_ready += 1
        else:
            ends[ev_base[j] + e] = done
            clock[j] = done
            pc[j] += 1
            ready[n_ready] = j
            n_ready += 1
        nxt = mem_next[m]
        _release(reg, R_FREE_MEM, mem_next, m)
        m = nxt
    _release(reg, R_FREE_RV, rv_head, rv)
    reg[R_READY] = n_ready
    return done
