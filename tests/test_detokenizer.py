"""IncrementalDetokenizer: streaming text that matches tokenizer.decode, and stop strings."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from mmengine.sample.detokenizer import IncrementalDetokenizer
from mmengine.testing import TinyLlavaSpec, tiny_llava_path

CORPUS = (
    "Hello world! The quick brown fox jumps over the lazy dog. "
    "你好，世界！今天天气很好。😀🎉👍 naïve café — stop here STOP. END of text.\n"
) * 3


def _build_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE: every byte is a token, so multi-byte characters can be split."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_end|>"],
        clean_up_tokenization_spaces=False,
    )


TOKENIZER = _build_tokenizer()
SPECIAL_IDS = TOKENIZER.all_special_ids
VOCAB = len(TOKENIZER)
token_ids = st.lists(st.integers(0, VOCAB - 1), max_size=40)


def _encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def _run(
    ids: list[int], prompt: list[int] = (), *, stop: list[str] = (), skip_special_tokens: bool = True
) -> tuple[IncrementalDetokenizer, str | None, int | None]:
    """Feeds `ids` (then flushes); returns the detokenizer, the stop matched and the index of the token that did."""
    detok = IncrementalDetokenizer(TOKENIZER, list(prompt), stop=stop, skip_special_tokens=skip_special_tokens)
    for i, token_id in enumerate(ids):
        matched = detok.append(token_id)
        if matched is not None:
            return detok, matched, i
    matched = detok.flush()
    return detok, matched, None if matched is None else len(ids)


def test_tokenizer_splits_multibyte_characters() -> None:
    assert SPECIAL_IDS and VOCAB > 300
    ids = _encode("😀")
    assert len(ids) > 1
    assert TOKENIZER.decode(ids[:1]) == "\ufffd"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=token_ids, prompt=token_ids, skip=st.booleans())
def test_streamed_text_equals_decode(ids: list[int], prompt: list[int], skip: bool) -> None:
    expected = TOKENIZER.decode(ids, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(TOKENIZER, prompt, skip_special_tokens=skip)
    previous = ""
    for token_id in ids:
        assert detok.append(token_id) is None
        # Emitted text never changes afterwards, so no premature U+FFFD can slip out.
        assert detok.text.startswith(previous) and expected.startswith(detok.text)
        previous = detok.text
    held_back = expected[len(detok.text) :]
    assert held_back == "" or held_back.endswith("\ufffd")
    assert detok.flush() is None
    assert detok.text == expected


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet="ab 好😀é\n", max_size=30), prompt=st.text(alphabet="xy 界🎉", max_size=8))
def test_valid_text_streams_without_replacement_chars(text: str, prompt: str) -> None:
    detok = IncrementalDetokenizer(TOKENIZER, _encode(prompt))
    for token_id in _encode(text):
        detok.append(token_id)
        assert "\ufffd" not in detok.text and text.startswith(detok.text)
    assert detok.text == text  # complete without flush


def test_split_emoji_appears_only_when_complete() -> None:
    ids = _encode("a😀")
    detok = IncrementalDetokenizer(TOKENIZER, _encode("hi "))
    texts = []
    for token_id in ids:
        detok.append(token_id)
        texts.append(detok.text)
    assert texts[0] == "a" and all(t == "a" for t in texts[:-1]) and texts[-1] == "a😀"


def test_prompt_ending_inside_a_character() -> None:
    ids = _encode("😀 ok")
    prompt, output = ids[:1], ids[1:]  # the prompt holds the emoji's first byte(s) only
    detok, _, _ = _run(output, prompt)
    assert detok.text == TOKENIZER.decode(output)


def test_special_tokens() -> None:
    ids = _encode("Hello") + [TOKENIZER.convert_tokens_to_ids("<|im_end|>")] + _encode(" world")
    assert _run(ids)[0].text == "Hello world"
    assert _run(ids, skip_special_tokens=False)[0].text == "Hello<|im_end|> world"


def test_work_per_token_is_bounded() -> None:
    """Each step decodes a handful of tokens, not the whole output (no quadratic re-decoding)."""

    class CountingTokenizer:
        def __init__(self, inner: Any) -> None:
            self.inner, self.decoded = inner, 0

        def decode(self, ids: list[int], **kwargs: Any) -> str:
            self.decoded += len(ids)
            return self.inner.decode(ids, **kwargs)

    ids = _encode(CORPUS * 4)
    counting = CountingTokenizer(TOKENIZER)
    detok = IncrementalDetokenizer(counting, _encode("prompt"))
    for token_id in ids:
        detok.append(token_id)
    assert detok.text == CORPUS * 4
    assert counting.decoded < 20 * len(ids)


# --- stop strings -----------------------------------------------------------------------------


def test_stop_string_spanning_tokens() -> None:
    text = "The quick brown fox jumps"
    ids = _encode(text)
    stop = "k bro"
    # The stop string must really span a token boundary for this test to mean anything.
    assert not any(stop in TOKENIZER.decode([i]) for i in ids)
    detok, matched, index = _run(ids, stop=[stop])
    assert matched == stop and detok.text == "The quic" and detok.stopped == stop
    # It is reported on the token that completes it.
    assert stop not in TOKENIZER.decode(ids[:index]) and stop in TOKENIZER.decode(ids[: index + 1])


def test_stop_string_at_the_first_token() -> None:
    ids = _encode("Hello world")
    detok = IncrementalDetokenizer(TOKENIZER, _encode("Say: "), stop=["He"])
    assert detok.append(ids[0]) == "He"
    assert detok.text == ""


def test_stop_string_in_prompt_does_not_count() -> None:
    detok, matched, _ = _run(_encode(" here"), _encode("STOP"), stop=["STOP", "STOP here"])
    assert matched is None and detok.text == " here"


def test_earliest_stop_string_wins() -> None:
    ids = _encode("The quick brown fox")
    detok, matched, _ = _run(ids, stop=["fox", "brown", "quick"])
    assert matched == "quick" and detok.text == "The "


def test_earliest_wins_within_one_token() -> None:
    ids = _encode(" world")
    assert len(ids) == 1
    detok, matched, _ = _run(ids, stop=["rld", "wor", "or"])
    assert matched == "wor" and detok.text == " "
    # Same start: the shorter one is complete first.
    detok, matched, _ = _run(ids, stop=["worl", "wo"])
    assert matched == "wo" and detok.text == " "


def test_stop_string_completed_first_wins_over_one_starting_earlier() -> None:
    ids = _encode("abcdef")
    assert len(ids) == 6  # one token per letter
    # Streaming cannot wait to see whether "abcdef" completes: "cd" ends first and wins.
    detok, matched, index = _run(ids, stop=["abcdef", "cd"])
    assert matched == "cd" and index == 3 and detok.text == "ab"


def test_appends_after_a_stop_are_ignored() -> None:
    ids = _encode("Hello world! The quick")
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=["world"])
    results = [detok.append(token_id) for token_id in ids]
    assert results.count("world") == 1 and detok.text == "Hello "
    assert detok.flush() is None and detok.text == "Hello "


def test_stop_string_with_multibyte_characters() -> None:
    text = "你好，世界！今天"
    detok, matched, _ = _run(_encode(text), stop=["世界"])
    assert matched == "世界" and detok.text == "你好，"


@settings(max_examples=100, deadline=None)
@given(ids=token_ids, data=st.data())
def test_single_stop_string_truncates_at_first_occurrence(ids: list[int], data: st.DataObject) -> None:
    full = TOKENIZER.decode(ids, skip_special_tokens=True)
    if full:
        start = data.draw(st.integers(0, len(full) - 1))
        stop = full[start : start + data.draw(st.integers(1, 4))]
    else:
        stop = "zz"
    detok, matched, _ = _run(ids, stop=[stop])
    if stop in full:
        assert matched == stop and detok.text == full[: full.index(stop)]
    else:
        assert matched is None and detok.text == full


@pytest.mark.parametrize("bad", [[""], [3]])
def test_invalid_stop_strings(bad: list[Any]) -> None:
    with pytest.raises(ValueError):
        IncrementalDetokenizer(TOKENIZER, [], stop=bad)


def test_queued_tokens_decode_to_the_text_of_token_by_token_decoding():
    """append(decode=False) queues tokens (generate() reads no text before the end); decoding them at
    once, or now and then, gives exactly the text of decoding each as it arrives, broken UTF-8 included."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llava_path(TinyLlavaSpec()))
    rng = random.Random(0)
    for _ in range(300):
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 6))]
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 24))]
        texts = []
        for every in (1, 0, 4):  # each token, only at the end, every fourth token
            detokenizer = IncrementalDetokenizer(tokenizer, prompt)
            for i, token in enumerate(ids):
                detokenizer.append(token, decode=every > 0 and i % every == every - 1)
            detokenizer.flush()
            texts.append(detokenizer.text)
        assert texts[0] == texts[1] == texts[2]
    with pytest.raises(ValueError, match="stop strings"):
        IncrementalDetokenizer(tokenizer, [], stop=["x"]).append(5, decode=False)
