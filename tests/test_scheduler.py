"""Token-budget packing of queued requests (no torch)."""

from pergola.engine.scheduler import AGING, WorkQueue


def packed(q: WorkQueue) -> list[list[tuple]]:
    return [[(s.request, s.index) for s in st.seqs] for st in q.steps()]


def test_the_request_with_least_work_left_goes_first():
    q = WorkQueue(max_batch_tokens=100, max_batch_seqs=8)
    q.add("bulk", [30, 30, 30])
    q.add("query", [50])
    assert packed(q) == [[("query", 0), ("bulk", 0)], [("bulk", 1), ("bulk", 2)]]


def test_a_query_arriving_mid_request_takes_the_next_step():
    q = WorkQueue(max_batch_tokens=64, max_batch_seqs=8)
    q.add("bulk", [32] * 8)
    first = q.next_step()
    assert [s.request for s in first.seqs] == ["bulk", "bulk"]
    q.add("query", [16])  # arrives while the bulk request is being encoded
    second = q.next_step()
    assert [(s.request, s.index) for s in second.seqs] == [("query", 0), ("bulk", 2)]


def test_equal_bulk_requests_finish_in_arrival_order():
    q = WorkQueue(max_batch_tokens=64, max_batch_seqs=8)
    q.add("a", [32] * 4)
    q.next_step()  # a begins: it now has less left than b
    q.add("b", [32] * 4)
    order = [s.request for st in q.steps() for s in st.seqs]
    assert order == ["a", "a", "b", "b", "b", "b"]


def test_stops_at_first_sequence_that_does_not_fit():
    q = WorkQueue(max_batch_tokens=100, max_batch_seqs=8)
    q.add(0, [60, 50, 10])
    # within a request, strict order: the 10-token sequence does not jump ahead of the 50-token one
    assert [[s.length for s in st.seqs] for st in q.steps()] == [[60], [50, 10]]


def test_large_request_is_split_and_offsets_are_kept():
    q = WorkQueue(max_batch_tokens=64, max_batch_seqs=4)
    q.add(0, [10] * 10)
    steps = list(q.steps())
    assert [len(st.seqs) for st in steps] == [4, 4, 2]  # the sequence cap binds first
    seqs = [s for st in steps for s in st.seqs]
    assert [s.start for s in seqs] == list(range(0, 100, 10))
    assert [s.index for s in seqs] == list(range(10))


def test_oversized_sequence_runs_alone():
    q = WorkQueue(max_batch_tokens=16, max_batch_seqs=4)
    q.add(0, [5, 40, 5])
    assert [[s.length for s in st.seqs] for st in q.steps()] == [[5], [40], [5]]
    assert not q and q.next_step() is None


def test_queued_tokens_and_removal():
    q = WorkQueue(max_batch_tokens=64, max_batch_seqs=8)
    q.add("a", [40, 40])
    q.add("b", [10])
    assert q.queued_tokens == 90
    q.next_step()  # b (10) and a's first (40)
    assert q.queued_tokens == 40
    q.remove("a")  # cancelled: its unscheduled sequence is dropped
    assert q.queued_tokens == 0 and not q
    q.remove("a")  # twice is harmless


def test_a_key_is_queued_once():
    import pytest

    q = WorkQueue(max_batch_tokens=64, max_batch_seqs=8)
    q.add("a", [4])
    with pytest.raises(KeyError):
        q.add("a", [4])


def test_a_large_request_is_not_starved_by_a_stream_of_smaller_ones():
    """Least work first alone never runs "big" while a 90-token request arrives before each step;
    with aging it waits for at most AGING times its own work of later requests, and admission
    (work_ahead) counts it ahead of a new request as soon as the order does."""
    q = WorkQueue(max_batch_tokens=100, max_batch_seqs=8)
    q.add("big", [100] * 3)
    waited = 0  # tokens of later requests run while "big" waited
    for i in range(100):
        q.add(i, [90])
        ahead = q.work_ahead(90)
        step = q.next_step()
        if any(s.request == "big" for s in step.seqs):
            assert ahead >= 300  # a new 90-token request would have waited for "big" too
            break
        waited += step.num_tokens
    else:
        raise AssertionError("the large request never got a step")
    assert 0 < waited <= AGING * 300
