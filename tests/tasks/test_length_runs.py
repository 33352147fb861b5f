"""Which rows share a forward (tuneforge.tasks.length_runs): runs of similar length that pad the fewest tokens,
and the batches predictors run, cut into such runs on a CPU only. Each predictor's answers staying those of a
text alone is its own tests' (tests/tasks/test_sentence_encoder.py, test_predict.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st


def set_partitions(items: list[int]):
    """Every partition of `items` into non-empty groups."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [[first], *partition]
        for i in range(len(partition)):
            yield [*partition[:i], [first, *partition[i]], *partition[i + 1 :]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 80), min_size=1, max_size=7), st.sampled_from([0, 3, 48, 1000]))
def test_length_groups_are_the_cheapest_partition_of_the_rows(lengths, per_forward):
    """Every row in exactly one run, and no partition of the rows (any grouping, not only runs of the sorted lengths)
    pads fewer tokens plus per_forward per run."""
    from tuneforge.tasks.length_runs import length_groups

    def cost(groups):
        return sum(len(g) * max(lengths[i] for i in g) + per_forward for g in groups)

    groups = length_groups(lengths, per_forward)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths))) and all(groups)
    assert cost(groups) == min(cost(p) for p in set_partitions(list(range(len(lengths)))))


@given(st.lists(st.integers(1, 512), max_size=80), st.integers(1, 40), st.booleans())
def test_length_batches_hold_every_row_once_at_most_batch_size_a_batch(lengths, batch_size, on_cpu):
    """Every row in exactly one batch of at most batch_size rows; off a CPU the batches are the longest-first order
    cut every batch_size rows; on a CPU they pad no more tokens than those batches do."""
    from tuneforge.tasks.length_runs import length_batches

    batches = length_batches(lengths, batch_size, on_cpu)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths))) and all(batches)
    assert all(len(b) <= batch_size for b in batches)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    whole = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    if not on_cpu:
        assert batches == whole

    def padded(groups):
        return sum(len(g) * max(lengths[i] for i in g) for g in groups)

    assert padded(batches) <= padded(whole)


def test_a_question_and_paragraphs_are_not_padded_together_on_a_cpu():
    from tuneforge.tasks.length_runs import length_batches

    lengths = [12, 256, 14, 250, 11, 240]
    assert sorted(map(sorted, length_batches(lengths, 32, on_cpu=True))) == [[0, 2, 4], [1, 3, 5]]
    assert length_batches(lengths, 32, on_cpu=False) == [[1, 3, 5, 2, 0, 4]]
