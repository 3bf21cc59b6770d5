"""`benchmarks/budget.py`'s byte accounting: the tensors a step starts with, counted once per
storage, the baseline's left out."""

import torch

from benchmarks.budget import _tensors_alive


def test_tensors_alive_counts_each_storage_once_and_leaves_the_baseline_out():
    baseline = [torch.zeros(1000)]  # 4,000 bytes, alive before the run
    _, before = _tensors_alive(baseline)
    a = torch.zeros(25_000)  # 100,000 bytes
    views = [a[:10], a.view(250, 100), a]  # the same storage three more times
    b = torch.ones(5_000, dtype=torch.float64)  # 40,000 bytes
    held, after = _tensors_alive(baseline)
    assert after - before == 140_000
    ids = {t.untyped_storage().data_ptr() for t in held}
    assert a.untyped_storage().data_ptr() in ids and b.untyped_storage().data_ptr() in ids
    assert baseline[0].untyped_storage().data_ptr() not in ids
    del views, a, held
    _, freed = _tensors_alive(baseline)
    assert freed - before == 40_000
