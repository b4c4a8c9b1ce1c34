"""A preprocessing worker's output segment (multimodal/output_arena.py): pictures after the first that fit are laid
out in one shared segment the worker keeps, sent to the engine once; the engine's copies stay its own when the next
picture writes over the segment; a picture larger than any before goes in a segment of its own and grows the arena."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmengine.errors import PreprocessingWorkerError
from mmengine.models.family import EncoderInputs
from mmengine.multimodal.output_arena import ALIGN, OutputArena, Placed, copy_out

F32 = np.dtype(np.float32)


def picture(arena: OutputArena, rows: int, value: float) -> EncoderInputs:
    """A picture's outputs as the fast path makes them: a pixel tensor through `allocate`, filled, and a small grid."""
    arena.start()
    pixels = arena.allocate((rows, 8), F32)
    pixels.fill_(value)
    return EncoderInputs(pixel_values=pixels, image_grid_thw=torch.tensor([[1, rows, 1]]))  # made outside the arena


def test_pictures_after_the_first_reuse_one_segment_sent_once():
    arena = OutputArena()
    first = picture(arena, 16, 1.0)  # no segment yet: a tensor of its own
    layout = arena.layout(first)
    assert isinstance(layout["pixel_values"], torch.Tensor) and layout["pixel_values"].is_shared()
    assert arena.take_new_segment() is None
    segments = []
    for value in (2.0, 3.0, 4.0):
        inputs = picture(arena, 16, value)
        layout = arena.layout(inputs)
        assert layout["pixel_values"] == Placed(0, (16, 8), torch.float32)
        # the grid, made in this process's memory, is copied in after the pixels, on the next cache line
        assert layout["image_grid_thw"] == Placed(-(-16 * 8 * 4 // ALIGN) * ALIGN, (1, 3), torch.int64)
        segments.append(arena.take_new_segment())
    segment = segments[0]
    assert segment is not None and segment.is_shared() and segments[1:] == [None, None]  # sent once, then reused
    assert arena.segment.data_ptr() == segment.data_ptr()


def test_the_engines_copy_stays_its_own_when_the_next_picture_writes_over_the_segment():
    arena = OutputArena()
    arena.layout(picture(arena, 16, 1.0))
    layout = arena.layout(picture(arena, 16, 2.0))
    segment = arena.take_new_segment()
    got = copy_out(layout, segment)
    assert not got["pixel_values"].is_shared()
    arena.layout(picture(arena, 16, 5.0))  # the worker's next picture, in the same place
    assert torch.equal(got["pixel_values"], torch.full((16, 8), 2.0))
    assert torch.equal(got["image_grid_thw"], torch.tensor([[1, 16, 1]]))


def test_a_larger_picture_goes_in_a_segment_of_its_own_and_the_next_grows_it():
    arena = OutputArena()
    arena.layout(picture(arena, 16, 1.0))
    arena.layout(picture(arena, 16, 1.0))
    small = arena.take_new_segment()
    layout = arena.layout(picture(arena, 64, 7.0))  # more than the segment holds
    assert isinstance(layout["pixel_values"], torch.Tensor) and arena.take_new_segment() is None
    assert torch.equal(copy_out(layout, small)["pixel_values"], torch.full((64, 8), 7.0))
    layout = arena.layout(picture(arena, 64, 8.0))
    grown = arena.take_new_segment()
    assert grown is not None and grown.numel() > small.numel() and isinstance(layout["pixel_values"], Placed)
    assert torch.equal(copy_out(layout, grown)["pixel_values"], torch.full((64, 8), 8.0))


def test_a_placed_tensor_without_its_segment_is_a_typed_error():
    with pytest.raises(PreprocessingWorkerError, match="'pixel_values'"):
        copy_out({"pixel_values": Placed(0, (2, 2), torch.float32)}, None)
