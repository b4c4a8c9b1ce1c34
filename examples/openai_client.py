"""Chat about a picture with a running `mmengine serve`, through the official `openai` client.

    mmengine serve --model /models/llava-1.5-7b-hf --served-model-name llava      # in one shell
    python examples/openai_client.py --image cat.jpg                              # in another

The image travels as a base64 data: URL. The second turn asks about the same picture again: its
`cached_tokens` shows the prefix (the image's placeholders included) served from the KV cache, and
the vision encoder does not run again (`mmengine_encoder_runs_total` on the server's /metrics).
"""

from __future__ import annotations

import argparse
import base64
import io
import mimetypes
import os

import openai


def image_data_url(path: str | None) -> str:
    if path is None:  # a generated picture, so the example runs without any file
        from mmengine.testing import make_test_image

        buffer = io.BytesIO()
        make_test_image(0, size=(64, 48)).save(buffer, "PNG")
        data, media_type = buffer.getvalue(), "image/png"
    else:
        with open(path, "rb") as file:
            data = file.read()
        media_type = mimetypes.guess_type(path)[0] or "image/jpeg"
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default=os.environ.get("MMENGINE_API_KEY", "none"))
    parser.add_argument("--model", default=None, help="the served model name (default: the server's only model)")
    parser.add_argument("--image", default=None, help="an image file (default: a generated picture)")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_data_url(args.image)}},
        {"type": "text", "text": "What is shown in this picture?"},
    ]}]

    first = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens, temperature=0)
    answer = first.choices[0].message.content
    print(f"assistant: {answer}\n  [{first.usage.prompt_tokens} prompt tokens, {first.usage.completion_tokens} generated]")

    # The second turn streams; the last chunk carries the usage.
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Describe its colours."}]
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    print("assistant: ", end="", flush=True)
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
            print(f"\n  [{chunk.usage.prompt_tokens} prompt tokens, {cached} of them from the prefix cache]")


if __name__ == "__main__":
    main()
