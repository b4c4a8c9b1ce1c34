"""Where a prompt's videos go: the text a video marker becomes (Qwen3-VL writes one marker per temporal
patch, after its timestamp), the runs each marker expands into, and one item per temporal patch."""

from __future__ import annotations

from mmengine.errors import VideoCountMismatchError
from mmengine.models.family import ModelFamily
from mmengine.multimodal.video_loader import LoadedVideo
from mmengine.core.request import MMItem, VideoPatch


def write_video_markers(prompt: str, marker: str, texts: list[str | None], start: str = "", end: str = "") -> str:
    """The prompt with its k-th video `marker` replaced by texts[k] (which holds one marker per item),
    together with the `start` / `end` tokens around it where the chat template wrote them."""
    parts, rest = [], prompt
    for text in texts:
        at = rest.index(marker)
        before, after = rest[:at], rest[at + len(marker):]
        if start and end and before.endswith(start) and after.startswith(end):
            before, after = before[: -len(start)], after[len(end):]
        parts += [before, marker if text is None else text]
        rest = after
    return "".join(parts) + rest


def video_runs(family: ModelFamily, videos: list[LoadedVideo]) -> list[list[int]]:
    """Per video marker of the tokenized prompt, the run lengths of its items: all of a video's items
    behind one marker, or one item per marker where the family writes a marker per item."""
    runs: list[list[int]] = []
    for video in videos:
        plan = video.plan
        if family.video_prompt_text(plan) is None:
            runs.append([plan.item_tokens(k) for k in range(plan.num_patches)])
        else:
            runs += [[plan.item_tokens(k)] for k in range(plan.num_patches)]
    return runs


def video_items(token_ids: list[int], starts: list[int], videos: list[LoadedVideo], video_token_id: int) -> list[MMItem]:
    """One item per temporal patch, at the run starts the expansion recorded; the prompt must hold no
    video tokens besides them."""
    expected = sum(video.plan.num_tokens for video in videos)
    found = token_ids.count(video_token_id)
    if found != expected or len(starts) != sum(len(video.inputs) for video in videos):
        raise VideoCountMismatchError(f"the prompt holds {found} video tokens but its {len(videos)} video(s) need {expected}")
    items, position = [], iter(starts)
    for video in videos:
        count = len(video.inputs)
        for index, (mm_hash, inputs) in enumerate(zip(video.hashes, video.inputs)):
            patch = VideoPatch(index, count, video.plan.time_step)
            items.append(MMItem("video", mm_hash, next(position), video.plan.item_tokens(index), inputs, patch))
    return items
