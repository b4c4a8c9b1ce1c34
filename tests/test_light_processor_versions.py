"""The light processor's chat normalization on every supported transformers: 5.24 moved ProcessorMixin's
normalization of one conversation into chat_template_utils._normalize_chat_messages; before it, 5.23 dropped the
None values inline, which light_processor.messages_without_none does. (test_light_processor.py checks the rendered
text against transformers' processor on whichever transformers is installed.)"""

from __future__ import annotations

import pytest

from mmengine.multimodal import light_processor
from mmengine.multimodal.light_processor import messages_without_none

CHAT = [
    {"role": "system", "content": "Be brief.", "tool_calls": None},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                                 {"type": "text", "text": "What is it?"}], "name": None},
    {"role": "assistant", "content": None, "reasoning": "none"},
]
NORMALIZED = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "image", "url": "https://example.com/a.png"}, {"type": "text", "text": "What is it?"}]},
    {"role": "assistant", "reasoning": "none"},
]


def test_the_fallback_drops_what_transformers_own_normalization_drops():
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    if not hasattr(chat_template_utils, "_normalize_chat_messages"):
        pytest.skip("transformers < 5.24: the fallback is the normalization in use")
    assert messages_without_none(CHAT) == chat_template_utils._normalize_chat_messages(CHAT)


@pytest.mark.parametrize("batched", [False, True])
def test_a_transformers_without_normalize_chat_messages_gets_the_same_conversations(monkeypatch, batched):
    from transformers.utils import chat_template_utils

    monkeypatch.delattr(chat_template_utils, "_normalize_chat_messages", raising=False)
    conversations, was_batched = light_processor._normalized([CHAT, CHAT] if batched else CHAT)
    assert was_batched is batched
    assert conversations == [NORMALIZED] * (2 if batched else 1)
