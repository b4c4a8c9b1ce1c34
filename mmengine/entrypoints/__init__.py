"""The OpenAI-compatible HTTP server over AsyncMMEngine (`mmengine serve`). Needs the `serve` extra:
`pip install "mmengine-vlm[serve]"` (FastAPI, uvicorn, prometheus_client).

  serve_cli.py        `mmengine serve`: its arguments, one or N replicas
  engine_flags.py     one flag per EngineConfig field, shared by every command
  api_server.py       the FastAPI app over one AsyncMMEngine;  server_settings.py  its settings (plain data)
  protocol.py         the request bodies read;  responses.py  the JSON answered
  responses_api.py    POST /v1/responses: the Responses API translated to and from the chat path
  tokenize.py         /tokenize, /detokenize, /version
  chat.py             OpenAI messages -> the conversation MMEngine.chat takes
  media.py            image and video URLs -> bytes or files;  embeds_payload.py  image embeddings over HTTP
  response_format.py  structured-output fields;  tools.py  tool calls;  logprobs_format.py  logprobs
  api_errors.py       errors as OpenAI writes them;  metrics.py  /metrics
"""
