"""The fixtures of a test module that holds a real server's answers against an offline engine's: `server`, a
server over the session's tiny LLaVA checkpoint that asks for API_KEY, and `offline`, an engine on the same
checkpoint with the same options (CPU_FP32). Module-scoped; the module binds them to those names."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from serve_helpers import CPU_FP32, RunningServer, keyed_server

from mmengine import MMEngine


def server_fixtures() -> tuple[Any, Any]:
    """The fixtures `server` and `offline`, for `server, offline = server_fixtures()` in a test module."""

    @pytest.fixture(scope="module", name="server")
    def server_fixture(checkpoint_dir) -> Iterator[RunningServer]:
        with keyed_server(checkpoint_dir()) as running:
            yield running

    @pytest.fixture(scope="module", name="offline")
    def offline_fixture(checkpoint_dir) -> MMEngine:
        return MMEngine(str(checkpoint_dir()), **CPU_FP32)

    return server_fixture, offline_fixture
