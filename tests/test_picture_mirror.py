"""The front end's and the core's books of the pictures that crossed (engine/picture_mirror.py): the same
evictions on both sides, so an item crosses bare exactly when the core holds its tensors."""

from __future__ import annotations

import torch

from mmengine.core.request import MMItem
from mmengine.engine.picture_mirror import ReceivedPictures, SentPictures

PICTURE_BYTES = 3 * 4 * 4 * 4  # a [3, 4, 4] float32 picture


def item(name: str, seed: int, side: int = 4) -> MMItem:
    pixels = torch.arange(3 * side * side, dtype=torch.float32).reshape(3, side, side) + seed
    return MMItem("image", name, 0, 1, {"pixel_values": pixels})


def cross(sent: SentPictures, received: ReceivedPictures, items: list[MMItem]) -> tuple[int, list[MMItem]]:
    stripped, bare = sent.strip(items)
    assert sum(not i.encoder_inputs for i in stripped) == bare
    return bare, received.fill(stripped)


def test_both_sides_evict_the_same_pictures_and_the_core_puts_back_every_tensor():
    sent, received = SentPictures(2 * PICTURE_BYTES), ReceivedPictures(2 * PICTURE_BYTES)
    pictures = {name: item(name, seed) for seed, name in enumerate("abc")}
    bare_counts = []
    for names in ["a", "b", "a", "c", "b", "a", "aa"]:  # c evicts b (a was used since), b evicts a, ...
        bare, filled = cross(sent, received, [pictures[n] for n in names])
        bare_counts.append(bare)
        for name, got in zip(names, filled):
            assert torch.equal(got.encoder_inputs["pixel_values"], pictures[name].encoder_inputs["pixel_values"])
    assert bare_counts == [0, 0, 1, 0, 0, 0, 2]
    assert len(sent.books) == len(received.books) == 2 and sent.books.num_bytes == received.books.num_bytes


def test_the_core_keeps_private_copies_and_books_nothing_too_large():
    sent, received = SentPictures(PICTURE_BYTES), ReceivedPictures(PICTURE_BYTES)
    shared = item("a", 0)
    shared.encoder_inputs["pixel_values"].share_memory_()
    _, (kept,) = cross(sent, received, [shared])
    assert not kept.encoder_inputs["pixel_values"].is_shared()  # no segment stays open per picture in the core
    large = item("big", 1, side=8)
    assert [cross(sent, received, [large])[0] for _ in range(2)] == [0, 0]  # larger than the books: always sent
    assert cross(sent, received, [shared])[0] == 1
