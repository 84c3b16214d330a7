"""Pipeline receive buffers exist only for the micro-batches in flight (k3train.parallel.pipeline, K3PipelineStage).

Two forked gloo ranks train the tiny K3 in float64 under pp=2 with 16 micro-batches of one row, for two steps, under
each schedule that keeps micro-batches in flight (1F1B, interleaved 1F1B, DualPipeV, and the split-backward
interleaved ZB and ZBV). Under the multi-stage ones, an output sent to another rank keeps its data only until the
point k3train.parallel.pipeline_order.sent_output_release gives (checked at every watched call; the backward needs
its graph, not its values). Every receive buffer a stage ever holds (its input, its output's gradient; on a V rank also
the input handed over by the stage beside it) is followed by a weak reference, so what is counted is what is still
alive, whoever holds it. At every receive post, forward and backward, a rank's live buffers must fit in the
micro-batches in flight on it (received or run forward, backward not finished): at most one input and one output
gradient each, in count and in bytes, plus one finished micro-batch per stage (torch's single-stage schedules hold
the last receive's ops until the next receive is posted). In flight stays at most 2 x pp x vpp, well under the 16 micro-batches, and
nothing is alive between steps. Each schedule's losses equal the one-process engine on the same 16 micro-batches.
"""

from __future__ import annotations

import functools
import weakref

import pytest
from selection import selected_values
from test_parallel_pieces import _harness, run_forked

M = 16
STEPS = 2
SCHEDULES = {"1f1b": 1, "interleaved_1f1b": 2, "dualpipev": 2, "interleaved_zb": 2, "zbv": 2}
"""schedule -> vpp (pp = 2)."""
OPENS = ("get_fwd_recv_ops", "set_local_fwd_input", "forward_one_chunk")
WATCHED = (*OPENS, "get_bwd_recv_ops", "backward_one_chunk", "backward_weight_one_chunk")


def _nbytes(metas) -> int:
    return sum(m.shape.numel() * m.dtype.itemsize for m in metas or ())


class BufferWatch:
    """Wraps a rank's stages: after each watched call, the live receive buffers (count, bytes) beside the bound
    that the micro-batches in flight allow."""

    def __init__(self, stages):
        self.stages = stages
        self.seen: dict[int, tuple] = {}  # id -> (weak reference, bytes)
        self.open: set[tuple[int, int]] = set()  # (stage, micro-batch) in flight
        # each in-flight micro-batch may hold its received input and its output's gradient
        self.per_mb = {
            s.stage_index: (0 if s.is_first else _nbytes(s._user_meta.inputs))
            + (0 if s.is_last else _nbytes(s._user_meta.outputs))
            for s in stages
        }
        self.samples: list[dict] = []
        self.last_forward: dict[int, int] = {}
        for st in stages:
            for name in WATCHED:
                setattr(st, name, self._wrap(st.stage_index, name, getattr(st, name)))

    def _wrap(self, stage: int, name: str, fn):
        def call(*a, **k):
            mb = a[1] if name == "set_local_fwd_input" else a[0]
            if name in OPENS:
                self.open.add((stage, mb))
            if name == "forward_one_chunk":
                self.last_forward[stage] = mb
            out = fn(*a, **k)
            split = name == "backward_one_chunk" and k.get("full_backward") is False
            if name == "backward_weight_one_chunk" or (name == "backward_one_chunk" and not split):
                self.open.discard((stage, mb))  # a split backward's weight pass still holds the I pass's inputs
            self.sample(name)
            return out

        return call

    def sample(self, what: str) -> None:
        for st in self.stages:
            for infos in (*st.args_recv_info.values(), *st.grad_recv_info.values()):
                for info in infos:
                    b = info.buffer
                    if b is not None and id(b) not in self.seen:
                        self.seen[id(b)] = (weakref.ref(b), b.untyped_storage().nbytes())
        live = [n for ref, n in self.seen.values() if ref() is not None]
        held = sent = 0  # outputs sent to another rank: all of them, and those holding their data past their time
        for st in self.stages:
            remote = not st.is_last and st.stage_index_to_group_rank[st.stage_index + 1] != st.group_rank
            if not remote or st.sent is None:
                continue
            for chunk, (outs, _) in st.fwd_cache.items():
                sent += 1
                if (st.stage_index, chunk) in st.sent.pending or chunk == self.last_forward.get(st.stage_index):
                    continue  # its send may be on its way, or is not yet posted
                held += sum(t.untyped_storage().nbytes() > t.element_size() for t in outs)
        self.samples.append(
            {
                "what": what,
                "held_outputs": held,
                "sent_outputs": sent,
                "live": len(live),
                "live_bytes": sum(live),
                "open": len(self.open),
                # torch's single-stage schedules keep the last receive's ops (and their buffers) in a local
                # variable until the next receive is posted: one finished micro-batch per stage more
                "bound_bytes": sum(self.per_mb[s] for s, _ in self.open) + sum(self.per_mb.values()),
            }
        )


def _worker(schedules: tuple[str, ...], rank: int) -> dict:
    H = _harness()
    from k3train.parallel.engine import build_engine

    out = {}
    for schedule in schedules:
        vpp = SCHEDULES[schedule]
        dims = H.Layout(name=schedule, pp=2, vpp=vpp, microbatches=M, schedule=schedule).dims()
        engine = build_engine(
            H.model_args(), dims, H.optim_config(), seed=H.SEED, device="cpu", seq_len_hint=H.SEQ, precision="fp64"
        )
        engine.pipeline.ensure(1, H.SEQ)  # the stages of one-row micro-batches, built once
        watch = BufferWatch(engine.pipeline.stages)
        losses, between = [], []
        for s in range(STEPS):
            mbs = H.local_microbatches(H.step_data(s, rows=M), dp=1, dp_rank=0, microbatches=M)
            losses.append(engine.train_step(mbs)["loss"])
            watch.sample("between steps")
            between.append(watch.samples[-1]["live"])
        out[schedule] = {
            "samples": watch.samples,
            "losses": losses,
            "between": between,
            "buffers": len(watch.seen),
            "stages": engine.stage_ids,
            "let_go": engine.pipeline.stages[0].sent.let_go if engine.pipeline.stages[0].sent else 0,
        }
    return out


def _one_process_losses() -> list[float]:
    H = _harness()
    from k3train.parallel.engine import build_engine

    with H.one_thread():
        dims = H.Layout(name="one", microbatches=M).dims()
        engine = build_engine(
            H.model_args(), dims, H.optim_config(), seed=H.SEED, device="cpu", seq_len_hint=H.SEQ, precision="fp64"
        )
        mbs = [H.local_microbatches(H.step_data(s, rows=M), dp=1, dp_rank=0, microbatches=M) for s in range(STEPS)]
        return [engine.train_step(b)["loss"] for b in mbs]


_RUNS: dict = {}
"""schedule -> both ranks' records."""


def _runs(request, tmp_path, schedules=tuple(SCHEDULES)) -> list[dict]:
    """Both ranks' records of `schedules`. One forked run steps every schedule that this session's tests of this
    file read (each test of it alone, as a mutation's run takes it, steps only its own)."""
    if any(s not in _RUNS for s in schedules):
        wanted = set(schedules) | set(selected_values(request, "schedule", SCHEDULES))
        todo = tuple(s for s in SCHEDULES if s in wanted and s not in _RUNS)
        recs = run_forked(functools.partial(_worker, todo), tmp_path)
        for schedule in todo:
            _RUNS[schedule] = [rec[schedule] for rec in recs]
    return [{s: _RUNS[s][rank] for s in schedules} for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_receive_buffers_follow_the_microbatches_in_flight(request, tmp_path, schedule):
    vpp = SCHEDULES[schedule]
    for rank, rec in enumerate(_runs(request, tmp_path, (schedule,))):
        run = rec[schedule]
        samples = [s for s in run["samples"] if s["what"] != "between steps"]
        assert run["buffers"] > 0 and max(s["live"] for s in samples) > 0, (rank, "no buffer was ever received")
        for s in samples:
            assert s["live"] <= 2 * (s["open"] + len(run["stages"])), (rank, s)
            assert s["live_bytes"] <= s["bound_bytes"], (rank, s)
        in_flight = max(s["open"] for s in samples)
        assert in_flight <= 2 * 2 * vpp < M, (rank, in_flight)
        assert run["between"] == [0] * STEPS, (rank, run["between"])  # nothing kept from one step to the next
        # multi-stage schedules: an output sent to another rank keeps its storage only while its send is in flight
        # (1F1B: torch's loop posts and holds the sends itself)
        if schedule != "1f1b":
            assert max(s["sent_outputs"] for s in samples) > 0, rank
            assert all(s["held_outputs"] == 0 for s in samples), (rank, schedule)
            assert run["let_go"] > 0, (rank, schedule)  # outputs let go before their backward


@pytest.mark.slow
def test_schedules_with_buffers_in_flight_train_like_one_process(request, tmp_path):
    H = _harness()
    ref = _one_process_losses()
    for schedule in SCHEDULES:
        got = [rec[schedule]["losses"] for rec in _runs(request, tmp_path)]
        for a, b in zip(got[0], ref):  # every rank reports the step's global loss
            assert H.rel_inf(a, b) <= H.FP64_BOUND, (schedule, got[0], ref)
        assert got[0] == got[1], schedule
