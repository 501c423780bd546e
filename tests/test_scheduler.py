"""Token-budget FCFS packing (no torch)."""

from pergola.engine.scheduler import TokenBudgetScheduler


def test_packs_in_arrival_order_under_the_budget():
    s = TokenBudgetScheduler(max_batch_tokens=100, max_batch_seqs=8)
    s.add(0, [30, 30, 30])
    s.add(1, [50])
    steps = list(s.steps())
    assert [[(q.request, q.index) for q in st.seqs] for st in steps] == [[(0, 0), (0, 1), (0, 2)], [(1, 0)]]
    assert [st.num_tokens for st in steps] == [90, 50]


def test_stops_at_first_sequence_that_does_not_fit():
    s = TokenBudgetScheduler(max_batch_tokens=100, max_batch_seqs=8)
    s.add(0, [60, 50, 10])
    steps = list(s.steps())
    # strict FCFS: the 10-token sequence does not jump ahead of the 50-token one
    assert [[q.length for q in st.seqs] for st in steps] == [[60], [50, 10]]


def test_large_request_is_split_and_offsets_are_kept():
    s = TokenBudgetScheduler(max_batch_tokens=64, max_batch_seqs=4)
    s.add(0, [10] * 10)
    steps = list(s.steps())
    assert [len(st.seqs) for st in steps] == [4, 4, 2]  # the sequence cap binds first
    seqs = [q for st in steps for q in st.seqs]
    assert [q.start for q in seqs] == list(range(0, 100, 10))
    assert [q.index for q in seqs] == list(range(10))


def test_oversized_sequence_runs_alone():
    s = TokenBudgetScheduler(max_batch_tokens=16, max_batch_seqs=4)
    s.add(0, [5, 40, 5])
    assert [[q.length for q in st.seqs] for st in s.steps()] == [[5], [40], [5]]
    assert len(s) == 0 and s.next_step() is None
