"""The engine: the public MMEngine and AsyncMMEngine and what sits directly behind them.

  mm_engine.py      MMEngine: a thin facade (add_request / step / generate / chat / LoRA / caches / stats)
  startup.py        EngineParts: the model, caches, runner, scheduler and grammars built once at start-up
  input_parts.py    InputParts: start-up's first part, the intake's (config, family, processor), no model code
  prompt_inputs.py  the prompt forms callers hand in (str, prompt dicts, images, videos, chat-template options), checked
  intake.py         RequestIntake: the one pass from a caller's arguments to validated, preprocessed prompts
  chat_media.py     OpenAI image_url / video_url parts in MMEngine.chat, loaded under a MediaPolicy
  step_loop.py      StepLoop: one scheduler step (sync or async), its tokens, outputs and their owners
  stats.py          the counters stats() reports
  async_engine.py   AsyncMMEngine: the engine loop on a thread, streams for asyncio callers
  async_errors.py   its refusals of a request (overloaded, failed), importable without the engine
  beam_search.py    beam search, a layer above the engine that drives it through its public methods
  weight_update.py  what update_weights takes (state dict, pairs, checkpoint dir) and which caches an update makes stale

Names are imported on first use, so `import mmengine.engine` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmengine.utils.lazy_exports import lazy_exports

__all__ = ["AsyncMMEngine", "BeamSearchParams", "MMEngine"]

_EXPORTS = {
    "AsyncMMEngine": "mmengine.engine.async_engine",
    "BeamSearchParams": "mmengine.engine.beam_search",
    "MMEngine": "mmengine.engine.mm_engine",
}

if TYPE_CHECKING:
    from mmengine.engine.async_engine import AsyncMMEngine
    from mmengine.engine.beam_search import BeamSearchParams
    from mmengine.engine.mm_engine import MMEngine

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
