"""EngineThread: many caller threads, one engine thread."""

from __future__ import annotations

import threading

import pytest

from ember.engine.admission import QueueFull
from ember.engine.intake import InvalidRequest
from ember.engine.thread import EngineStopped, EngineThread
from ember.sampling.params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def engine_thread(make_tiny_engine):
    threads = []

    def make(**options) -> EngineThread:
        t = EngineThread(make_tiny_engine(**options)).start()
        threads.append(t)
        return t

    yield make
    for t in threads:
        t.shutdown(timeout=10)


def test_concurrent_callers_get_the_same_streams_as_sequential_runs(engine_thread):
    et = engine_thread()
    prompts = [[10 + i, 20 + i, 30 + i, 40] for i in range(12)]
    expected = [list(et.stream(p, PARAMS))[-1].token_ids for p in prompts]
    results: dict[int, list[int]] = {}
    steps_before = et.engine.stats["steps"]

    def call(i: int) -> None:
        outs = list(et.stream(prompts[i], PARAMS))
        assert "".join(o.delta_text for o in outs) == outs[-1].text
        results[i] = outs[-1].token_ids

    workers = [threading.Thread(target=call, args=(i,)) for i in range(12)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert [results[i] for i in range(12)] == expected
    # batched, not run one by one (12 requests × 8 tokens alone would take 96 steps)
    assert et.engine.stats["steps"] - steps_before < 12 * 8


def test_errors_reach_the_submitting_thread(engine_thread):
    et = engine_thread(max_queue=1, max_num_seqs=1, max_model_len=1024)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        et.submit([1] * 1020, SamplingParams(max_tokens=10), lambda out: None)
    running = et.stream([5, 6], SamplingParams(max_tokens=1000, ignore_eos=True))
    next(iter(running))  # admitted: it holds the only running seat for a while
    et.submit([5, 6], PARAMS, lambda out: None)  # waits in the queue behind it
    with pytest.raises(QueueFull):
        et.submit([5, 6], PARAMS, lambda out: None)
    et.abort(running.request_id)


def test_abort_from_another_thread_frees_blocks(engine_thread):
    et = engine_thread(enable_prefix_caching=False)
    stream = et.stream([7, 8, 9], SamplingParams(max_tokens=1500, ignore_eos=True))
    it = iter(stream)
    next(it)
    et.abort(stream.request_id)
    last = list(it)[-1]
    assert last.finish_reason == "abort"
    assert et.drain(timeout=5)
    assert et.engine.kv.num_used == 0


def test_shutdown_finishes_open_streams_and_refuses_new_work(engine_thread):
    et = engine_thread()
    stream = et.stream([7, 8, 9], SamplingParams(max_tokens=1500, ignore_eos=True))
    et.shutdown(timeout=10)
    assert list(stream)[-1].finished
    with pytest.raises(EngineStopped):
        et.submit([1, 2], PARAMS, lambda out: None)


@pytest.fixture
def blocked_engine(engine_thread):
    """An engine thread stuck at the start of a step (before it applies aborts) until
    ``release`` is set; ``left`` is set when the step goes on."""
    import threading as _threading

    et = engine_thread(max_queue=3)
    inside, release, left = _threading.Event(), _threading.Event(), _threading.Event()
    real = et.engine.step

    def step():
        if not left.is_set():
            inside.set()
            release.wait(5)
            left.set()
        return real()

    et.engine.step = step
    yield et, inside, release, left
    release.set()


def test_submission_never_waits_for_the_engine_step(blocked_engine):
    et, inside, release, left = blocked_engine
    first = et.stream([7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    assert inside.wait(10)  # the engine is now stuck in a step
    queued = et.stream([7, 8], PARAMS)  # returns although no step can take it
    queued2 = et.stream([7, 8], PARAMS)
    with pytest.raises(QueueFull):  # one waiting, two handed over: the queue of 3 is full
        et.submit([1, 2], PARAMS, lambda out: None)
    assert not left.is_set(), "submission waited for the engine's step"
    release.set()
    for s in (first, queued, queued2):
        assert list(s)[-1].finished


def test_an_abort_before_the_engine_took_the_request_still_aborts_it(blocked_engine):
    et, inside, release, _ = blocked_engine
    first = et.stream([7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    assert inside.wait(10)
    late = et.stream([7, 8], SamplingParams(max_tokens=50, ignore_eos=True))
    et.abort(late.request_id)  # still in the inbox: the engine has not seen it
    release.set()
    outs = list(late)
    assert outs[-1].finish_reason == "abort" and outs[-1].token_ids == []
    assert list(first)[-1].finish_reason == "length"
    assert et.drain(timeout=5) and et.engine.kv.num_used == 0


def test_n_choices_are_submitted_as_one_group(engine_thread):
    et = engine_thread()
    outs: list = []
    first = et.submit([5, 6, 7, 8], [SamplingParams(max_tokens=4, seed=s, ignore_eos=True)
                                     for s in (1, 2, 3)], outs.append)
    assert first
    assert et.drain(timeout=10)
    finished = {o.request_id for o in outs if o.finished}
    assert len(finished) == 3 and first in finished


def test_a_group_the_stopping_engine_cannot_take_stops_counting_as_on_its_way(
        engine_thread):
    """Prepared against the quote, then handed over as the engine stops: it will never
    reach the queue, so it must not count ahead of anyone for its 30 s expiry."""
    from ember.engine.intake import SLO

    thread = engine_thread()
    thread.call(lambda engine: engine.admission.publish_quote())  # a quote to check against
    with thread.slot() as slot:
        group = thread.engine.prepare([1, 2, 3, 4], SamplingParams(max_tokens=2),
                                      slo=SLO(ttft=60))
        assert thread.engine.admission.on_the_way() == {(0, ""): 4}
        thread.shutdown(timeout=5)
        with pytest.raises(EngineStopped):
            slot.submit(group, lambda out: None)
    assert thread.engine.admission.on_the_way() == {}
