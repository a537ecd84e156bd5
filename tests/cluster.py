"""The pytest fixture over ``benchmarks.netns``: a Ray cluster whose nodes are hosts in network namespaces."""

import pytest

from benchmarks.netns import NetnsCluster, NetnsUnavailable


@pytest.fixture
def netns_cluster(monkeypatch):
    """A running head (1 CPU) to add nodes to; the driver env (RAY_AUTH_MODE, RAY_ADDRESS) set in os.environ."""
    cluster = NetnsCluster()
    try:
        cluster.start()
    except NetnsUnavailable as e:
        pytest.skip(str(e))
    try:
        for key, value in cluster.env.items():
            monkeypatch.setenv(key, value)
        yield cluster
    finally:
        cluster.close()
