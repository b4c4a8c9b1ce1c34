"""The OpenAI-compatible HTTP server over AsyncMMEngine (`mmengine serve`). Needs the `serve` extra:
`pip install "mmengine-vlm[serve]"` (FastAPI, uvicorn, prometheus_client)."""
