"""A small deterministic byte-level BPE, trained locally, for the test checkpoints' tokenizers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

# Training text for the byte-level BPE: plain, varied English so the merges cover common words.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words, and this one shows
a small red house next to a tall green tree. What is in the image? There is a cat sitting on a wooden
table near the window. The sky is blue and the clouds are white. Two children are playing with a
yellow ball in the park while their parents watch from a bench.
Describe the image in detail. The photo was taken in the morning, when the light was soft and warm.
A man in a black coat is walking his dog along the river. Boats float on the water, and birds fly
above the bridge. On the left side there is a street with shops, cars, and people riding bicycles.
Question: how many apples are on the plate? Answer: there are three apples, two red and one green.
Question: what color is the car? Answer: the car is silver with a dark blue stripe.
The weather today is cold and rainy, so please bring an umbrella and wear a warm jacket.
She opened the old book and read the first page aloud. It was a story about a sailor who crossed
the ocean to find a hidden island full of strange animals and bright flowers.
Numbers and dates: 1, 2, 3, 10, 42, 100, 2024. The meeting starts at 9:30 and ends at 11:00.
Computers process images by splitting them into small patches. Each patch becomes a vector, and a
language model reads these vectors together with the words of the question.
The kitchen smells of fresh bread and coffee. A bowl of soup, a glass of water, and a slice of cheese
are waiting on the counter. Somebody left the door open, and the wind is moving the curtains.
Mountains rise behind the village, covered with snow at the top and forests below. A narrow road
climbs through the valley, past farms, fences, horses, and a small stone church.
Can you tell me what this sign says? It says: stop, look, and listen before you cross the road.
The team won the game after a long and difficult match. Everyone cheered, and the coach smiled.
Thank you for your help! You are welcome. Have a nice day, and see you tomorrow.
USER: What is shown in this picture? ASSISTANT: A dog running on the beach.
USER: Is there a person in the image? ASSISTANT: Yes, a woman is reading a newspaper.
"""


def train_byte_level_bpe(
    vocab_size: int, leading_special_tokens: Sequence[str] = (), added_special_tokens: Sequence[str] = ()
) -> Tokenizer:
    """A byte-level BPE trained on CORPUS up to `vocab_size` entries (deterministic).

    `leading_special_tokens` take ids 0, 1, ... (as <unk>, <s>, </s> in Llama); `added_special_tokens`
    are appended after the learned vocabulary, in order (as <image> in llava-hf or <|im_start|> in Qwen).
    Neither is ever split or normalized.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(leading_special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added_special_tokens])
    return tok


def tiny_tokenizer(
    vocab_size: int,
    *,
    leading_special_tokens: Sequence[str] = (),
    added_special_tokens: Sequence[str] = (),
    bos_first: bool = False,
    **options: object,
) -> PreTrainedTokenizerFast:
    """train_byte_level_bpe(...) as a transformers fast tokenizer that pads on the left (for batched
    generation). `options` go to PreTrainedTokenizerFast (bos_token, eos_token, pad_token, chat_template,
    extra_special_tokens, ...); `bos_first`: every encoded sequence starts with bos_token, as in Llama's."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = train_byte_level_bpe(vocab_size, leading_special_tokens, added_special_tokens)
    if bos_first:
        bos = options["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, padding_side="left", **options)


def model_vocab_size(tokenizer, requested: int | None) -> int:
    """The model's vocabulary: the tokenizer's size, or `requested` when given (never smaller)."""
    vocab_size = len(tokenizer) if requested is None else requested
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    return vocab_size
