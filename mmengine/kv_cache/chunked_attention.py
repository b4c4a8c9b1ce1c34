"""Chunked local attention (Llama 4's): the attention chunk as a pool's span, and the books of its pool.

A chunked layer's query at position p sees keys from floor(p / C) * C to p: a window whose start is aligned to
the chunk C instead of trailing the query. Its layers keep their blocks in a pool of their own, as sliding-window
layers do (kv_cache/sliding_window.py), and the same books serve it with one rule changed: once a request has
computed c tokens, its later queries (at c and beyond) never read a key before floor(c / C) * C, so its blocks
wholly before that go back to the pool; a prefix hit ending at n tokens needs only the cached blocks from the
start of the chunk holding n onwards. At most C - 1 keys before a step's tokens are read, so a pool sized as for
a window of C tokens holds every request's share.

`AttentionChunk` marks a span as a chunk where a family lists its layers' spans (ModelFamily.kv_cache_windows):
it is the int C (what sizes a pool is the same for both kinds), and says which rule its pool keeps.
"""

from __future__ import annotations

from mmengine.kv_cache.sliding_window import SlidingWindowManager


class AttentionChunk(int):
    """An attention chunk of C tokens (an int: it sizes the pool as a window of C tokens would)."""

    def __repr__(self) -> str:
        return f"AttentionChunk({int(self)})"

    __str__ = int.__repr__  # printed as the number

    def __hash__(self) -> int:
        # apart from a window of as many tokens in a set of spans, so that a decoder with both kinds of layers
        # counts two spans (and keeps every token in every layer: one pool holds one kind)
        return hash((AttentionChunk, int(self)))


def is_chunk(span: int | None) -> bool:
    return isinstance(span, AttentionChunk)


def chunk_start(position: int, chunk: int) -> int:
    """The first key the query at `position` sees on a layer with attention chunks of `chunk` tokens."""
    return position // chunk * chunk


class ChunkedAttentionManager(SlidingWindowManager):
    """The chunked layers' pool: SlidingWindowManager's books with the chunk's rule for what is still read."""

    def first_needed_block(self, num_computed: int) -> int:
        return chunk_start(num_computed, self.window) // self.block_size
