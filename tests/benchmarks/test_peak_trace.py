"""`benchmarks/memory.py trace`'s replay of an allocator trace: the blocks alive at the moment
the most bytes were, grouped by the lines that allocated them."""

from benchmarks.memory import live_at_peak


def _alloc(addr, size, line):
    frames = [{"filename": "/x/gact_graph/ops/dropout.py", "line": line, "name": "backward"}]
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def _free(addr):
    return {"action": "free_completed", "addr": addr}


def test_live_at_peak_replays_to_the_worst_moment():
    mib = 2**20
    trace = [
        _alloc(1, 4 * mib, 10), _alloc(2, 4 * mib, 10), _free(1),  # 8 MiB, then 4
        _alloc(3, 3 * mib, 20), _alloc(4, 2 * mib, 30),            # 9 MiB: the peak
        _free(3), _free(4), _alloc(5, 1 * mib, 40),               # after it: not listed
    ]  # fmt: skip
    lines = live_at_peak({"device_traces": [trace]}, top=5)
    assert lines[0] == "trace peak 9 MiB above the step's start"
    assert [ln.split("MiB")[0].strip() for ln in lines[1:]] == ["4.0", "3.0", "2.0"]
    assert "dropout.py:10 backward" in lines[1] and "dropout.py:40" not in "".join(lines)
