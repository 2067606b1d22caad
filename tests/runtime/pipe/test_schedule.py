"""Pipeline schedules as data: the 1F1B order, buffer counts, and a simulation of every stage
that checks each send meets its receive in the same step, in the same order, carrying the right
micro-batch, and that no buffer is overwritten while in use."""

from __future__ import annotations

import itertools

import pytest

from shardspeed.runtime.pipe import schedule as S

GRID = [(m, p) for m in (1, 2, 3, 4, 8) for p in (1, 2, 3, 4)]


def one_f_one_b(m: int, p: int, s: int) -> list[tuple[str, int]]:
    """The documented 1F1B order of stage ``s``: ``min(p - s, m)`` forwards, then one backward
    and one forward alternately, then the remaining backwards."""
    warm = min(p - s, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("B", i), ("F", warm + i)]
    order += [("B", i) for i in range(m - warm, m)]
    return order


def compute_order(sched: S.PipeSchedule) -> list[tuple[str, int]]:
    """(F|B, n) of each compute instruction: the n-th forward or backward of the stage (the
    simulation below checks the n-th one works on micro-batch n)."""
    order = []
    forwards = backwards = 0
    for step in sched.steps():
        for cmd in step:
            if isinstance(cmd, S.ForwardPass):
                order.append(("F", forwards))
                forwards += 1
            elif isinstance(cmd, S.BackwardPass):
                order.append(("B", backwards))
                backwards += 1
    return order


@pytest.mark.parametrize(("m", "p"), GRID)
def test_train_schedule_is_1f1b(m, p):
    for s in range(p):
        sched = S.TrainSchedule(m, p, s)
        assert compute_order(sched) == one_f_one_b(m, p, s)
        assert sched.num_pipe_buffers() == max(2, min(p - s, m))
        steps = list(sched.steps())
        assert len(steps) == 2 * (m + p - 1)
        assert steps[-1][-3:] == [S.ReduceTiedGrads(), S.ReduceGrads(), S.OptimizerStep()]


def test_two_stage_stream_as_documented():
    """The full instruction stream of 4 micro-batches on 2 stages (stage 0 and stage 1)."""
    f, b, ld = S.ForwardPass, S.BackwardPass, S.LoadMicroBatch
    sa, ra, sg, rg = S.SendActivation, S.RecvActivation, S.SendGrad, S.RecvGrad
    tail = [S.ReduceTiedGrads(), S.ReduceGrads(), S.OptimizerStep()]
    stage0 = [
        [ld(0), f(0)],
        [sa(0)],
        [ld(1), f(1)],
        [rg(0), sa(1), b(0)],
        [ld(0), f(0)],
        [rg(1), sa(0), b(1)],
        [ld(1), f(1)],
        [rg(0), sa(1), b(0)],
        [],
        [rg(1), b(1), *tail],
    ]
    stage1 = [
        [],
        [ra(0), ld(0), f(0)],
        [b(0)],
        [sg(0), ra(1), ld(1), f(1)],
        [b(1)],
        [sg(1), ra(0), ld(0), f(0)],
        [b(0)],
        [sg(0), ra(1), ld(1), f(1)],
        [b(1)],
        [sg(1), *tail],
    ]
    assert list(S.TrainSchedule(4, 2, 0).steps()) == stage0
    assert list(S.TrainSchedule(4, 2, 1).steps()) == stage1


def simulate(kind: type[S.PipeSchedule], m: int, p: int) -> dict[int, int]:
    """Run every stage's schedule step by step on symbolic data; returns the peak number of
    buffers in use per stage. Asserts pairing, ordering and buffer safety."""
    scheds = [kind(m, p, s) for s in range(p)]
    streams = [list(sc.steps()) for sc in scheds]
    assert len({len(st) for st in streams}) == 1, "stages must have the same number of steps"
    buffers: list[dict[int, dict[str, int]]] = [{} for _ in range(p)]
    loads = [0] * p
    done_f = [0] * p
    done_b = [0] * p
    peak = dict.fromkeys(range(p), 0)
    for t in range(len(streams[0])):
        # blocking point-to-point calls of this step must pair up in order between neighbours
        for s in range(p - 1):
            down = [c for c in streams[s][t] if isinstance(c, S.SendActivation | S.RecvGrad)]
            up = [c for c in streams[s + 1][t] if isinstance(c, S.RecvActivation | S.SendGrad)]
            pairs = {S.SendActivation: S.RecvActivation, S.RecvGrad: S.SendGrad}
            assert [pairs[type(c)] for c in down] == [type(c) for c in up], (t, s)
        outbox: dict[tuple[int, str], list[int]] = {}
        for s in range(p):
            for cmd in streams[s][t]:
                if isinstance(cmd, S.SendActivation):
                    outbox.setdefault((s + 1, "act"), []).append(buffers[s][cmd.buffer_id]["out"])
                elif isinstance(cmd, S.SendGrad):
                    outbox.setdefault((s - 1, "grad"), []).append(buffers[s][cmd.buffer_id]["in"])
        for s in range(p):
            for cmd in streams[s][t]:
                buf = buffers[s]
                if isinstance(cmd, S.LoadMicroBatch):
                    if s == 0:
                        assert cmd.buffer_id not in buf or "in" not in buf[cmd.buffer_id]
                        buf[cmd.buffer_id] = {"in": loads[s]}
                    loads[s] += 1
                elif isinstance(cmd, S.RecvActivation):
                    assert cmd.buffer_id not in buf, f"stage {s} buffer {cmd.buffer_id} in use"
                    buf[cmd.buffer_id] = {"in": outbox[(s, "act")].pop(0)}
                elif isinstance(cmd, S.ForwardPass):
                    mb = buf[cmd.buffer_id]["in"]
                    assert mb == done_f[s], "forwards run in micro-batch order"
                    if s == p - 1:
                        assert loads[s] - 1 == mb, "labels loaded for this micro-batch"
                    buf[cmd.buffer_id]["out"] = mb
                    done_f[s] += 1
                elif isinstance(cmd, S.RecvGrad):
                    assert outbox[(s, "grad")].pop(0) == buf[cmd.buffer_id]["out"]
                elif isinstance(cmd, S.BackwardPass):
                    assert buf[cmd.buffer_id]["out"] == done_b[s]
                    done_b[s] += 1
                    if s == 0 or kind is S.DataParallelSchedule:
                        del buf[cmd.buffer_id]
                elif isinstance(cmd, S.SendGrad):
                    del buf[cmd.buffer_id]
            if kind is S.InferenceSchedule:
                # a forward-only buffer is free once sent (or on the last stage once computed)
                for cmd in streams[s][t]:
                    if isinstance(cmd, S.SendActivation) or (
                        isinstance(cmd, S.ForwardPass) and s == p - 1
                    ):
                        buffers[s].pop(cmd.buffer_id, None)
            peak[s] = max(peak[s], len(buffers[s]))
        assert all(not v for v in outbox.values()), "every message was received in its step"
    assert done_f == [m] * p
    if kind is not S.InferenceSchedule:
        assert done_b == [m] * p
    return peak


@pytest.mark.parametrize(("m", "p"), GRID)
def test_train_schedule_simulates(m, p):
    peak = simulate(S.TrainSchedule, m, p)
    for s in range(p):
        assert peak[s] <= S.TrainSchedule(m, p, s).num_pipe_buffers()
        assert peak[s] <= min(p - s, m) + (1 if s else 0)


@pytest.mark.parametrize(("m", "p"), GRID)
def test_inference_schedule_simulates(m, p):
    simulate(S.InferenceSchedule, m, p)
    assert all(S.InferenceSchedule(m, p, s).num_pipe_buffers() == 2 for s in range(p))
    for s in range(p):
        computes = [c for st in S.InferenceSchedule(m, p, s).steps() for c in st]
        assert sum(isinstance(c, S.ForwardPass) for c in computes) == m
        assert not any(isinstance(c, S.BackwardPass) for c in computes)


@pytest.mark.parametrize("m", [1, 3])
def test_data_parallel_schedule(m):
    sched = S.DataParallelSchedule(m, 1, 0)
    assert sched.num_pipe_buffers() == 1
    steps = list(sched.steps())
    assert steps[0][:3] == [S.LoadMicroBatch(0), S.ForwardPass(0), S.BackwardPass(0)]
    assert steps[-1][-2:] == [S.ReduceGrads(), S.OptimizerStep()]
    simulate(S.DataParallelSchedule, m, 1)


def test_instructions_are_plain_data():
    cmd = S.ForwardPass(3)
    assert (
        cmd.buffer_id == 3 and cmd.name == "ForwardPass" and repr(cmd) == "ForwardPass(buffer_id=3)"
    )
    assert S.ForwardPass(3) == S.ForwardPass(3) != S.BackwardPass(3)
    assert S.PipeInstruction(a=1).a == 1
    sched = S.TrainSchedule(4, 3, 1)
    assert (sched.stage, sched.num_stages, sched.num_micro_batches) == (1, 3, 4)
    assert not sched.is_first_stage and not sched.is_last_stage
    with pytest.raises(ValueError, match="stage_id"):
        S.TrainSchedule(4, 2, 2)
    # atomic steps: a barrier between any two steps cannot deadlock, since each step's calls pair
    # within that step (checked by the simulation); here every stage has the same step count
    for m, p in itertools.product((1, 5), (1, 2, 5)):
        assert len({len(list(S.TrainSchedule(m, p, s).steps())) for s in range(p)}) == 1
