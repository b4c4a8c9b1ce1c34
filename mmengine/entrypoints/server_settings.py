"""The HTTP front end's settings (plain data), apart from the app (api_server.py): a launcher that only hands them
to its front-end processes (`mmengine serve --api-server-count N`) imports neither fastapi nor the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmengine.multimodal.media_urls import MediaPolicy

MAX_N = 16  # samples per prompt (n, best_of) unless the server sets another limit


@dataclass
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    chat_template: str | None = None  # the template's text (`--chat-template FILE`); None: the model's own
    media: MediaPolicy = field(default_factory=MediaPolicy)
    lora_modules: dict[str, str] = field(default_factory=dict)  # adapter name -> directory, registered at start
    lora_runtime_updates: bool = False  # the load/unload endpoints
    enable_mm_embeds: bool = False  # image_embeds content parts (untrusted tensors: see embeds_payload.py)
    max_n: int = MAX_N  # the most samples per prompt a request may ask for (n, best_of)
    trust_request_chat_template: bool = False  # a request's own chat_template is rendered (else a 400)
