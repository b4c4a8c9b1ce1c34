"""Cache-affine placement and sharing keys: pure functions, no Ray cluster needed."""

from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmengine.errors import ConfigError
from mmengine.ray.keys import SharingKeys, image_key
from mmengine.ray.placement import place_rows
from mmengine.testing import make_test_image

ONE_TOKEN_WORDS = "the and are at be car dog image in is of on read small there this to was with you".split()


def test_round_robin_deals_rows_in_turn():
    placement = place_rows(["a"] * 7, 3, affinity=False)
    assert placement.rows == ((0, 3, 6), (1, 4), (2, 5))


def test_equal_keys_meet_on_one_replica_in_input_order():
    keys = ["a", "b", "a", None, "c", "b", "a", "c"]
    placement = place_rows(keys, 2)
    where = placement.replica_of()
    for key in "abc":
        rows = [i for i, k in enumerate(keys) if k == key]
        assert len({where[i] for i in rows}) == 1
        replica_rows = placement.rows[where[rows[0]]]
        start = replica_rows.index(rows[0])
        assert list(replica_rows[start : start + len(rows)]) == rows  # together, in input order


def test_a_key_larger_than_a_fair_share_is_split():
    keys = ["hot"] * 12 + ["x", "y", "z", "w"]
    placement = place_rows(keys, 4)
    assert max(placement.loads) <= math.floor(4 * 1.25)
    hot_replicas = {placement.replica_of()[i] for i in range(12)}
    assert len(hot_replicas) == 3  # 12 rows in chunks of a fair share (4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(0, 6)), max_size=60), st.integers(1, 6), st.sampled_from([1.0, 1.25, 2.0]))
def test_every_row_placed_once_within_the_skew_cap(keys, num_replicas, max_skew):
    placement = place_rows(keys, num_replicas, max_skew=max_skew)
    placed = [row for rows in placement.rows for row in rows]
    assert sorted(placed) == list(range(len(keys)))
    fair = max(1, math.ceil(len(keys) / num_replicas))
    assert max(placement.loads) <= max(fair, math.floor(fair * max_skew))


def test_bad_replica_count_is_a_config_error():
    with pytest.raises(ConfigError, match="num_replicas"):
        place_rows(["a"], 0)


def test_image_key_is_the_content_of_path_bytes_or_pixels(tmp_path):
    picture = make_test_image(1)
    buffer = io.BytesIO()
    picture.save(buffer, "PNG")
    path = tmp_path / "one.png"
    path.write_bytes(buffer.getvalue())
    assert image_key(str(path)) == image_key(buffer.getvalue()) == image_key(path)
    assert image_key(picture) == image_key(np.asarray(picture))
    assert image_key(make_test_image(2)) != image_key(picture)


def test_text_rows_in_one_prefix_group_share_a_key(checkpoint_dir):
    rng = random.Random(0)

    def words(n: int) -> str:
        return "".join(" " + rng.choice(ONE_TOKEN_WORDS) for _ in range(n))

    shared_a, shared_b = words(40), words(40)
    prompts = [shared_a + words(10), shared_b + words(10), shared_a + words(10), words(50), shared_b + words(10)]
    images = [None, None, [], None, None]
    prompts.append("USER: <image>\nWhat is this? ASSISTANT:")
    images.append([make_test_image(3)])
    keys = SharingKeys(checkpoint_dir(), block_size=16).keys(prompts, images)
    assert keys[0] == keys[2] and keys[1] == keys[4] and keys[0] != keys[1]
    assert keys[0].startswith("prefix:") and keys[3] is None
    assert keys[5] == image_key(make_test_image(3))


def test_importing_mmengine_ray_does_not_import_ray():
    import subprocess
    import sys

    code = "import sys, mmengine, mmengine.ray; assert 'ray' not in sys.modules, 'ray was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_preferred_replicas_make_placement_sticky_within_the_cap():
    keys = ["a", "b", "c", "d"] * 2
    placement = place_rows(keys, 2, preferred={"a": 1, "b": 1, "c": 0})
    where = placement.replica_of()
    assert where[0] == where[4] == 1 and where[1] == where[5] == 1 and where[2] == 0
    assert placement.loads == [4, 4]
    crowded = place_rows(["a"] * 3 + ["b"] * 3, 2, preferred={"a": 0, "b": 0})
    assert crowded.loads == [3, 3]  # b's favourite is full: it goes elsewhere
