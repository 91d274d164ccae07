"""`CascadePlanCache`: a decode batch reuses its cascade plan between block boundaries, and
every change a plan reads (rows added, cleared, moved, swapped; a row's computed tokens crossing
a block boundary) plans again: the cached plan always equals a fresh `plan_cascade`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.attention import cascade
from pagoda.attention.cascade import CascadePlan, CascadePlanCache, plan_cascade
from pagoda.worker.block_table import BlockTable

BLOCK_SIZE = 4


def same_plan(a: CascadePlan | None, b: CascadePlan | None) -> bool:
    if a is None or b is None:
        return a is b
    fields = ("req_groups", "prefix_lens", "leaders")
    return all(np.array_equal(getattr(a, name), getattr(b, name)) for name in fields)


def test_cached_plan_matches_a_fresh_plan_through_decode_and_layout_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cascade, "CASCADE_MIN_SHARED_TOKENS", 1)
    table = BlockTable(4, 8, torch.device("cpu"), pin_memory=False)
    for row, own in enumerate((10, 11, 12)):
        table.add_row([1, 2, own], row)  # rows share blocks 1, 2 (8 tokens), then one own block
    num_computed = np.array([9, 9, 9])
    cache = CascadePlanCache()
    plans = []

    def step() -> CascadePlan | None:
        n = len(num_computed)
        args = (table.block_table_np[:n], num_computed, num_computed + 1, BLOCK_SIZE)
        plan = cache.plan(table.layout_version, *args)
        assert same_plan(plan, plan_cascade(*args))
        plans.append(plan)
        return plan

    first = step()
    assert first is not None and first.prefix_lens.tolist() == [8]
    num_computed += 1
    assert step() is first  # tokens 9 -> 10: no block boundary crossed, the plan is reused
    num_computed += 2  # 12 computed tokens: a third whole block before the query
    for row, new in enumerate((20, 21, 22)):
        table.append_row([new], row)
    assert step() is not first
    table.swap_row(0, 2)
    step()
    table.add_row([3, 4, 5, 6], 1)  # a resumed request's fresh blocks: it leaves the group
    assert step().req_groups.tolist() == [0, -1, 0]
    table.move_row(2, 1)  # condense after row 1 leaves
    num_computed = num_computed[:2]
    table.clear_row(2)
    assert step().req_groups.tolist() == [0, 0]
