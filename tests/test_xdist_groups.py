"""The README's test command runs two workers that must keep each `xdist_group` on one worker
(tests/conftest.py): a real server's tests beside each other, a module's fixtures set up once."""

from __future__ import annotations

import os

import pytest


def test_the_scheduler_sees_this_tests_group(request: pytest.FixtureRequest) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("one process: no scheduler to hand groups out (the README's command runs -n 2)")
    # pytest-xdist hands a group to one worker by the `@group` its worker-side collection appends to the
    # node id; with pytest 9.2 and xdist 3.8 the suffix is lost and every test is scheduled on its own.
    assert request.node.nodeid.endswith("@test_xdist_groups"), (
        f"{request.node.nodeid}: xdist groups are ignored; see the pytest pin in pyproject.toml"
    )
