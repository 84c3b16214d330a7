"""parallel.ep_overlap=microbatch: inside DualPipeV's overlapped forward-backward actions, one micro-batch's expert
all-to-all is in flight while the other micro-batch computes (k3train.parallel.microbatch_overlap).

4 forked gloo processes (pp2 x dp2 x ep2, DualPipeV, 4 micro-batches, float64, every receive buffer poisoned with NaN
until its wait; the harness's layouts and one-process reference, tests/distributed/harness.py): the run equals one
process to 1e-10 (losses, gradient norms, every parameter), with and without whole-layer recompute; each rank's
recorded trace shows all-to-alls of micro-batch i issued before, and waited for after, compute of micro-batch j != i,
and the two ranks of each EP group issue the same collectives in the same order. Forked, not spawned, so a mutation
of the parent process (tools/mutants.py) reaches the ranks."""

from __future__ import annotations

import contextlib
import functools
import threading
import time

import pytest
from test_parallel_pieces import _harness, run_forked

from k3train.distributed import comm
from k3train.parallel.microbatch_overlap import Baton

H = _harness()
OVERLAP = {"pp": 2, "vpp": 2, "dp": 2, "ep": 2, "microbatches": 4, "schedule": "dualpipev", "ep_overlap": "microbatch"}
LAYOUTS = {
    "keep": H.Layout(name="pp2_ep2_dualpipev_mb_overlap", record_overlap_trace=True, **OVERLAP),
    "recompute": H.Layout(
        name="pp2_ep2_dualpipev_mb_overlap_recompute", activation="recompute", record_overlap_trace=True, **OVERLAP
    ),
}
_RUNS: dict = {}


def _worker(layout, rank: int) -> dict:
    return H.run_layout(layout, "", rank)


def run(policy: str, tmp_path, monkeypatch) -> list[dict]:
    """The layout's records on 4 forked ranks (each policy's run once per test session)."""
    if policy not in _RUNS:
        monkeypatch.setenv(comm.POISON_ENV, "1")  # the forked ranks inherit it
        _RUNS[policy] = run_forked(functools.partial(_worker, LAYOUTS[policy]), tmp_path, world=4)
    return _RUNS[policy]


@pytest.mark.slow
@pytest.mark.parametrize("policy", LAYOUTS)
def test_overlapped_microbatches_train_like_one_process(tmp_path, monkeypatch, policy):
    layout = LAYOUTS[policy]
    recs = run(policy, tmp_path, monkeypatch)
    H.report(layout, H.compare(H.reference_for(layout), recs))
    # The two sides' compute is counted once: a rank is never busier than the schedule's wall time.
    for rec in recs:
        assert all(busy <= sched for _, busy, sched in rec["times"]), rec["times"]


def actions(trace: list) -> list[list[tuple]]:
    """The trace cut into its overlapped actions (each begins with F's start)."""
    out = []
    for ev in trace:
        if ev[0] == "F" and ev[3] == "start":
            out.append([])
        out[-1].append(ev)
    return out


def hidden_all_to_alls(action: list[tuple]) -> list[tuple]:
    """(side, its micro-batch, the other side's micro-batch, what) for each expert all-to-all that one side issued,
    then handed the baton over, and waited for only after the other side computed (and issued an all-to-all of its
    own) in between."""
    out = []
    for i, (side, _, mb, event, what) in enumerate(action):
        if event != "issue" or not what.startswith("ep/all_to_all"):
            continue
        rest = action[i + 1 :]
        hand = next((k for k, e in enumerate(rest) if e[0] == side and e[3] == "hand"), len(rest))
        wait = next((k for k, e in enumerate(rest) if e[0] == side and e[3] == "wait"), -1)
        between = rest[hand + 1 : wait]
        other = [e for e in between if e[0] != side]
        if any(e[3] == "issue" and e[4].startswith("ep/all_to_all") for e in other):
            out.append((side, mb, other[0][2], what))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("policy", LAYOUTS)
def test_trace_shows_each_side_hiding_the_others_all_to_all(tmp_path, monkeypatch, policy):
    recs = run(policy, tmp_path, monkeypatch)
    for rank, rec in enumerate(recs):
        acts = actions(rec["overlap_trace"])
        assert acts, f"rank {rank} ran no overlapped action"
        assert len(acts) == rec["overlap_actions"] / H.STEPS
        for act in acts:
            hidden = hidden_all_to_alls(act)
            sides = {h[0] for h in hidden}
            # Both directions: the forward's tokens hide behind the backward's compute and the reverse.
            assert sides == {"F", "B"}, (rank, act)
            assert all(mine != theirs for _, mine, theirs, _ in hidden), hidden
            # Only one side runs at a time: between a side's hand and its wait, it records nothing.
            for side in "FB":
                open_ = False
                for ev in act:
                    if ev[0] == side and ev[3] in ("hand", "wait"):
                        open_ = ev[3] == "hand"
                    elif ev[0] == side:
                        assert not open_, (rank, side, act)


@pytest.mark.slow
@pytest.mark.parametrize("policy", LAYOUTS)
def test_ep_ranks_issue_the_same_collectives_in_the_same_order(tmp_path, monkeypatch, policy):
    recs = run(policy, tmp_path, monkeypatch)

    def collectives(rec):
        return [
            (side, stage, mb, ev, what) for side, stage, mb, ev, what in rec["overlap_trace"] if ev in ("issue", "call")
        ]

    # Ranks (pp, dp_cp): 0, 1 hold the first pipeline rank's stages and form one EP group; 2, 3 the other.
    for a, b in ((0, 1), (2, 3)):
        assert collectives(recs[a]) == collectives(recs[b])
        assert any(w.startswith("ep/all_to_all") for *_, w in collectives(recs[a]))


def test_baton_alternates_and_a_finished_side_keeps_it_away():
    baton, log, handed = Baton(), [], {"F": [], "B": []}

    def side(name: str, steps: int) -> None:
        baton.take(name)
        for i in range(steps):
            log.append(f"{name}{i}")
            handed[name].append(baton.hand_over(name))
        baton.finish(name)

    t = threading.Thread(target=side, args=("F", 3))
    t.start()
    side("B", 5)
    t.join()
    # F starts and the sides alternate at each hand-over; once F is done, B's hand-overs return at once (False).
    assert log == ["F0", "B0", "F1", "B1", "F2", "B2", "B3", "B4"]
    assert handed == {"F": [True] * 3, "B": [True] * 3 + [False] * 2}


def test_the_forward_side_takes_and_gives_back_the_callers_state_while_it_holds_the_baton():
    """The forward side's thread enters the caller's state (dispatch modes, counting scopes) after it takes the baton
    and leaves it before it gives the baton away for good: the other side computes nothing meanwhile (leaving a
    fake-tensor mode pops the mode's own stack, shared by both threads). A slow exit would otherwise run beside
    the backward side's compute."""
    from k3train.parallel.microbatch_overlap import _Exchange, _run_side

    exchange, log, errors = _Exchange(Baton(), {"F": (0, 0), "B": (1, 1)}, None), [], []

    @contextlib.contextmanager
    def state():
        log.append("F enters")
        yield
        time.sleep(0.05)
        log.append("F leaves")

    def forward_side():
        exchange.forward_thread = threading.get_ident()
        _run_side(exchange, "F", lambda: log.append("F computes"), errors, state)

    t = threading.Thread(target=forward_side)
    t.start()
    _run_side(exchange, "B", lambda: log.append("B computes"), errors)
    t.join()
    assert errors == [] and log == ["F enters", "F computes", "F leaves", "B computes"]


def test_an_overlapped_action_is_one_busy_span(monkeypatch):
    """Inside an overlapped action the two sides' own spans overlap in time (each covers its wait for the baton):
    the stages' busy clocks count the action once, not each side's span. A controlled clock: two nested side spans
    over 1 s count 1 s, on every stage's distinct clock."""
    from types import SimpleNamespace

    from k3train.parallel import pipeline
    from k3train.parallel.microbatch_overlap import _timed_once

    now = [0.0]
    monkeypatch.setattr(pipeline.time, "perf_counter", lambda: now[0])
    a, b = pipeline.BusyClock(), pipeline.BusyClock()
    stages = [SimpleNamespace(clock=a), SimpleNamespace(clock=b), SimpleNamespace(clock=a)]
    with _timed_once(stages):
        with a.span(), b.span():  # the forward side's span, with the backward side's inside it
            with a.span():
                now[0] += 1.0
    assert a.seconds == 1.0 and b.seconds == 0.0  # one span, on the first stage's clock
    with a.span():
        now[0] += 0.5
    assert a.seconds == 1.5  # outside an action every span counts
