"""bench.peers: the peers are timed in the environment Harmony's workers get."""

import os

import pytest

from bench.peers import MMAP_THRESHOLD, spawn_environment


@pytest.mark.parametrize("parent", [None, "1048576"])
def test_throughput_jobs_start_without_the_mmap_threshold_and_limit_jobs_with_it(monkeypatch, parent):
    """The threshold makes every activation a fresh mapping and slows the peers; only the
    memory-limit jobs, which read each job's RSS growth on shared processes, need it."""
    if parent is None:
        monkeypatch.delenv(MMAP_THRESHOLD, raising=False)
    else:
        monkeypatch.setenv(MMAP_THRESHOLD, parent)
    with spawn_environment(rss_between_jobs=False):
        assert MMAP_THRESHOLD not in os.environ
    with spawn_environment(rss_between_jobs=True):
        assert os.environ[MMAP_THRESHOLD] == "65536"
    assert os.environ.get(MMAP_THRESHOLD) == parent
