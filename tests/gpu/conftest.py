"""torch's CUDA graph calls faked, for the tests of the graphs' bookkeeping on a machine with no GPU."""

import pytest
import torch


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on a CPU: counts replays, hands out a pool id."""

    made = []

    def __init__(self):
        self.replays, self.captured_in = 0, "not captured"
        FakeGraph.made.append(self)

    def pool(self):
        return ("pool of", FakeGraph.made[0])

    def replay(self):
        self.replays += 1


class fake_capture:
    """Stands in for torch.cuda.graph: the code inside runs eagerly, and the graph notes the pool."""

    def __init__(self, graph, pool=None):
        graph.captured_in = pool

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def fake_graphs(monkeypatch):
    """torch's graph calls faked (this machine has no GPU): a capture runs its code eagerly, a
    replay only counts. Yields the list of the graphs made, in order."""
    FakeGraph.made = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    yield FakeGraph.made
