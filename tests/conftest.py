"""Shared pytest fixtures. World section: multi-process ranks for distributed tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.world import World, close_worlds, get_world


@pytest.fixture(scope="session", autouse=True)
def _close_worlds_at_session_end() -> Iterator[None]:
    # Rank processes are forked lazily (on first use, after collection has imported every
    # test module) and shared by all tests; reap them when the session ends.
    yield
    close_worlds()


@pytest.fixture
def world() -> Callable[[int], World]:
    """Factory: ``world(n)`` returns the session's cached ``n``-rank world."""
    return get_world
