"""`gact_graph.switches`: the switch around once-per-graph work."""

import threading

from gact_graph.switches import is_once_per_graph, once_per_graph


def test_the_switch_nests_and_is_per_thread():
    seen = []
    assert not is_once_per_graph()
    with once_per_graph():
        with once_per_graph():
            assert is_once_per_graph()
        assert is_once_per_graph()
        t = threading.Thread(target=lambda: seen.append(is_once_per_graph()))
        t.start()
        t.join()
    assert not is_once_per_graph() and seen == [False]
