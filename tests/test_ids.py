"""random_hex: the request, response and tool-call ids, drawn without a system call (utils/ids.py)."""

from __future__ import annotations

import os
import re

import pytest

from mmengine.entrypoints.responses import new_id
from mmengine.entrypoints.tools import parse_tool_calls
from mmengine.utils.ids import random_hex


def test_ids_keep_their_shape_and_never_repeat():
    ids = {random_hex() for _ in range(10_000)}
    assert len(ids) == 10_000 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert re.fullmatch(r"[0-9a-f]{24}", random_hex(24))
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", new_id("chatcmpl"))
    (call,) = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>').tool_calls
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_draws_other_ids_than_its_parent():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.write(write, " ".join(random_hex() for _ in range(4)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = set(os.read(read, 4096).decode().split())
    os.close(read)
    parent = {random_hex() for _ in range(4)}
    assert len(child) == 4 and not child & parent
