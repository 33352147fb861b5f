"""The tensor work of `--task embedding` as pure functions (tuneforge.tasks.embedding_ops): runs of similar length
that pad the fewest tokens, runs cut until every rank has as many, and texts packed into rows that fit. The
embeddings these give, and the losses, are test_task_embedding.py's."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st


@given(st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=6), min_size=1, max_size=4), st.integers(1, 12))
def test_split_to_cuts_runs_until_every_rank_has_as_many(groups, count):
    from tuneforge.tasks.embedding_ops import split_to

    rows = sorted(i for g in groups for i in g)
    out = split_to(groups, max(count, len(groups)))
    assert len(out) == max(count, len(groups))
    assert sorted(i for g in out for i in g) == rows  # the same rows, none lost or repeated
    assert sum(1 for g in out if not g) == max(0, max(count, len(groups)) - len(rows))  # empty only past the rows


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=40), st.sampled_from([1, 16, 128]))
def test_pack_rows_puts_every_row_once_in_bins_that_fit(lengths, width):
    """Every row in exactly one bin; a bin holds at most `width` tokens unless it is one longer row alone; no two
    bins could be merged (first-fit leaves no bin that the next could have taken whole)."""
    from tuneforge.tasks.embedding_ops import pack_rows

    bins = pack_rows(lengths, width)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths))) and all(bins)
    used = [sum(lengths[i] for i in b) for b in bins]
    assert all(u <= width or len(b) == 1 for u, b in zip(used, bins))
    assert all(used[a] + used[b] > width for a in range(len(bins)) for b in range(a + 1, len(bins)))
