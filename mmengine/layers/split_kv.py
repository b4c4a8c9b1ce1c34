"""How many slices a split-KV attention pass cuts each context into (paged decode, and the
cascade prefix pass): enough programs to fill the GPU, none shorter than it is worth."""

from __future__ import annotations

MIN_SPLIT_KEYS = 256


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int, most: int = 64) -> int:
    """Enough programs for about two waves, no split shorter than 256 keys, at most `most`; a power of two.
    (`num_reqs` counts the units that run in parallel before splitting: requests, or prefix tiles.)"""
    wanted = -(-2 * num_sms // max(1, num_reqs * num_kv_heads))
    longest = max(1, max_seq_len // MIN_SPLIT_KEYS)
    splits = int(max(1, min(wanted, longest, most)))
    return 1 << (splits.bit_length() - 1)
