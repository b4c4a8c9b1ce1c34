"""How each model family's chat template writes a user turn and marks a picture, for the tests that run
on every family (conftest.FamilyCase) and the fuzzer (tests/fuzz/fuzz_case.py)."""

from __future__ import annotations

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"

# The token the family's processor expands into a picture's placeholder run (what a token prompt holds,
# and what a prompt may write bare)
IMAGE_TOKEN = {"llava": "<image>", "gemma3": "<start_of_image>", "gemma4": "<|image|>", "internvl": "<IMG_CONTEXT>",
               "mistral3": "[IMG]", "smolvlm": "<image>", "llava_onevision": "<image>", "llama4": "<|image|>"}
# A picture's marker as the family's template writes it, when that is more than the bare token
_IMAGE_MARKER = {"gemma4": "\n\n<|image|>\n\n", "internvl": "<IMG_CONTEXT>\n"}
# What closes the model's answer before the next user turn
_TURN_END = {"llava": "</s>", "gemma3": "<end_of_turn>\n", "gemma4": "<turn|>\n", "mistral3": "</s>",
             "llava_onevision": "<|im_end|>", "smolvlm": "<end_of_utterance>\n", "llama4": "<|eot|>"}


def image_token(family: str) -> str:
    return IMAGE_TOKEN.get(family, "<|image_pad|>")


def image_marker(family: str) -> str:
    """One picture's marker in a prompt, as the family's template writes it."""
    if family in _IMAGE_MARKER:
        return _IMAGE_MARKER[family]
    return IMAGE_TOKEN.get(family, QWEN_IMAGE)


def user_turn(family: str, text: str, num_images: int = 0, system: str | None = None, first: bool = True) -> str:
    """One user turn, pictures first, then the generation prompt, with an optional system text. `first`: the
    conversation's first turn (the templates that write <bos> or <s> write it only there)."""
    images = image_marker(family) * num_images
    if family == "llava":
        return (f"{system} " if system else "") + "USER: " + "<image>\n" * num_images + text + " ASSISTANT:"
    if family == "gemma4":
        head = ("<bos>" if first else "") + (f"<|turn>system\n{system}<turn|>\n" if system else "")
        return f"{head}<|turn>user\n{images}{text}<turn|>\n<|turn>model\n"
    if family == "gemma3":  # the published template folds a system text into the user turn
        head = ("<bos>" if first else "") + "<start_of_turn>user\n" + (f"{system}\n\n" if system else "")
        return f"{head}{images}{text}<end_of_turn>\n<start_of_turn>model\n"
    if family == "mistral3":
        head = ("<s>" if first else "") + (f"[SYSTEM_PROMPT]{system}[/SYSTEM_PROMPT]" if system else "")
        return f"{head}[INST]{images}{text}[/INST]"
    if family == "llama4":
        head = ("<|begin_of_text|>" if first else "") + (f"<|header_start|>system<|header_end|>\n\n{system}<|eot|>" if system else "")
        return f"{head}<|header_start|>user<|header_end|>\n\n{images}{text}<|eot|><|header_start|>assistant<|header_end|>\n\n"
    if family == "llava_onevision":
        head = f"<|im_start|>system \n{system}<|im_end|>" if system else ""
        return f"{head}<|im_start|>user {images}\n{text}<|im_end|><|im_start|>assistant\n"
    if family == "smolvlm":
        head = ("<|im_start|>" if first else "") + (f"System: {system}<end_of_utterance>\n" if system else "")
        return f"{head}User" + (":" + images if num_images else ": ") + f"{text}<end_of_utterance>\nAssistant:"
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""  # the Qwen families and InternVL
    return f"{head}<|im_start|>user\n{images}{text}<|im_end|>\n<|im_start|>assistant\n"


def continue_chat(family: str, prompt: str, answer: str, text: str, num_images: int = 0) -> str:
    """The next turn's prompt: the previous prompt, the model's answer, and a new user message."""
    return prompt + answer + _TURN_END.get(family, "<|im_end|>\n") + user_turn(family, text, num_images, first=False)
