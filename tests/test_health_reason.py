"""/health names why the engine died when the death is the engine's own (an engine-core process or a
tensor-parallel rank), not only when the step loop failed: it answered "shut down" for a killed rank."""

from __future__ import annotations

import httpx

from mmengine import MMEngine
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints.api_server import ServerSettings
from mmengine.errors import EngineDeadError
from serve_helpers import MODEL_NAME, running_server


def test_health_names_a_dead_rank(checkpoint_dir, monkeypatch):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL_NAME)) as server:
        assert httpx.get(server.base_url + "/health").status_code == 200
        death = EngineDeadError("tensor-parallel worker rank 1 (pid 4242) died (killed by SIGKILL)")
        monkeypatch.setattr(MMEngine, "dead_error", property(lambda self: death))  # as a TP engine's runner reports it
        health = httpx.get(server.base_url + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        message = health.json()["error"]["message"]
        assert "rank 1 (pid 4242)" in message and "shut down" not in message
        monkeypatch.undo()
