"""`gact_graph.once`: listeners hear where once-per-graph work starts and ends."""

from gact_graph import once


class _Ear:
    def __init__(self):
        self.heard = []

    def once_per_graph_started(self):
        self.heard.append(("start", once.is_once_per_graph()))

    def once_per_graph_ended(self):
        self.heard.append(("end", once.is_once_per_graph()))


def test_listeners_hear_the_outermost_work_only_while_listening():
    ear, other = _Ear(), _Ear()
    with once.once_per_graph():  # nobody listens yet
        pass
    once.add_listener(ear)
    once.add_listener(other)
    try:
        assert not once.is_once_per_graph()
        with once.once_per_graph():
            assert once.is_once_per_graph()
            with once.once_per_graph():  # nested: one start and one end in all
                pass
            assert once.is_once_per_graph()
        assert not once.is_once_per_graph()
    finally:
        once.remove_listener(ear)
    with once.once_per_graph():
        pass
    once.remove_listener(other)
    once.remove_listener(other)  # a no-op
    # told outside the switch: the meter reads what came before, and after, it
    assert ear.heard == [("start", False), ("end", False)]
    assert other.heard == ear.heard * 2
