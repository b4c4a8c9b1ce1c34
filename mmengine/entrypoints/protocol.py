"""The OpenAI request bodies this server reads (responses.py writes the answers).

mmengine extras ride along in the body (OpenAI's client sends them with `extra_body=`), as vLLM's do:
`cache_salt` (requests share cached KV blocks only under equal salts), `mm_uuids` (one id per image,
in order, replacing the content hash), `top_k` and `ignore_eos`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from mmengine.entrypoints.api_errors import APIError, from_engine_error
from mmengine.entrypoints.server_settings import MAX_N
from mmengine.entrypoints.response_format import ResponseFormat, structured_output_of
from mmengine.entrypoints.tools import Tool, call_grammar, forced_function, parameter_specs
from mmengine.errors import ConfigError
from mmengine.sample.params import SamplingParams
from mmengine.sample.structured_output import StructuredOutputParams


class LoadLoRARequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's name and fields)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    """POST /v1/unload_lora_adapter."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM clients may send it; names identify adapters here


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


MAX_TOP_LOGPROBS = 20  # OpenAI's limit


class _GenerationRequest(BaseModel):
    # A field this server does not know is a 400 naming it (api_errors.validation_error), never dropped.
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    use_beam_search: bool = False  # vLLM's extra: beam search of width n, n choices best first
    length_penalty: float = 1.0  # with use_beam_search
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    user: str | None = None  # an end-user id for the caller's own records; it changes no answer
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extra (transformers' rule: > 1 discourages repeats)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    prompt_logprobs: int | None = None  # vLLM's extra: each prompt token's log-probability and the best k
    # Accepted only at their neutral values: the engine does not implement them.
    store: bool | None = None
    service_tier: str | None = None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The output-length cap asked for, and the field that asked."""
        return self.max_tokens, "max_tokens"

    @property
    def num_choices(self) -> int:
        """Samples per prompt that are answered (n)."""
        return self.n

    def check_supported(self, max_n: int = MAX_N) -> None:
        if self.use_beam_search:
            if self.stream:
                raise APIError(400, "use_beam_search cannot stream (the best beams are known at the end)", param="stream",
                               code="invalid_value")
            if not 1 <= self.n <= 32:
                raise APIError(400, f"n is the beam width with use_beam_search: 1..32, got {self.n}", param="n", code="invalid_value")
        elif not 1 <= self.n <= max_n:
            raise APIError(400, f"n must be in 1..{max_n} (the server's --max-n), got {self.n}", param="n", code="invalid_value")
        if self.store:
            raise APIError(400, "store=true is not supported (answers are not stored)", param="store", code="unsupported_parameter")
        if self.service_tier not in (None, "auto", "default"):
            raise APIError(400, f"service_tier {self.service_tier!r} is not supported (only auto/default)", param="service_tier",
                           code="unsupported_parameter")
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
                raise APIError(400, f"prompt_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.prompt_logprobs}",
                               param="prompt_logprobs", code="invalid_value")
            if self.stream:
                raise APIError(400, "prompt_logprobs cannot stream (they come with the whole answer)", param="prompt_logprobs",
                               code="invalid_value")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options",
                           code="invalid_value")

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: how many alternatives per token (None: no logprobs)."""
        return None

    def sampling_params(self) -> tuple[SamplingParams, bool]:
        """The SamplingParams, and whether max_tokens was left out (then: all the room the prompt leaves)."""
        max_tokens, field = self.requested_max_tokens()
        values: dict[str, Any] = {"max_tokens": 1 if max_tokens is None else max_tokens, "ignore_eos": self.ignore_eos}
        for name in ("temperature", "top_p", "top_k", "seed", "stop", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        if self.logit_bias:
            try:
                values["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()}
            except ValueError:
                raise APIError(400, "logit_bias keys must be token ids", param="logit_bias", code="invalid_value") from None
        spec, spec_field = self.structured_output()
        values["structured_output"] = spec
        values["logprobs"] = self.num_logprobs()
        values["prompt_logprobs"] = self.num_prompt_logprobs()
        try:
            return SamplingParams(**values), max_tokens is None
        except ConfigError as err:
            fields = {"max_tokens": field, "structured_output": spec_field or "response_format", "logprobs": self.logprobs_field}
            raise from_engine_error(err, input_param="", sampling_fields=fields) from None

    def num_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: alternatives per prompt token (None: the prompt is not scored)."""
        return self.prompt_logprobs

    logprobs_field: ClassVar[str] = "logprobs"

    def structured_output(self) -> tuple[StructuredOutputParams | None, str | None]:
        """The grammar the answer must follow and the field that asked for it."""
        return structured_output_of(self)

    def grammar_checks(self) -> list[tuple[StructuredOutputParams, str, str]]:
        """Specs to compile before the request's own grammar (ChatCompletionRequest has some)."""
        return []

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[Any]
    max_completion_tokens: int | None = None
    mm_uuids: list[str | None] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # the chat template's controls (vLLM's extras)
    chat_template: str | None = None  # a request's own template: only with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    logprobs_field: ClassVar[str] = "top_logprobs"

    def tool_mode(self) -> tuple[str, str | None]:
        """("none" | "auto" | "required" | "named", the named function)."""
        return forced_function(self.tools, self.tool_choice)

    def structured_output(self) -> tuple[StructuredOutputParams | None, str | None]:
        """A forced call's grammar decides the turn, response_format or not: the format shapes answers
        in text, and this one writes none (OpenAI accepts both). vLLM's guided_* extras constrain this
        very answer, so a forced call contradicts them: a 400."""
        spec, field = structured_output_of(self)
        mode, name = self.tool_mode()
        if mode in ("required", "named"):
            if spec is not None and field != "response_format":
                raise APIError(400, f"tool_choice {self.tool_choice!r} forces a tool call, which {field} would contradict",
                               param=field, code="invalid_value")
            return call_grammar(self.tools, name, single=self.parallel_tool_calls is False), "tool_choice"
        return spec, field

    def grammar_checks(self) -> list[tuple[StructuredOutputParams, str, str]]:
        """(spec, param, what an error calls it) for each schema the request brings besides its own
        grammar, compiled first so that a bad one is named: a forced call's parameters schemas, one by
        one, and the response_format that the forced turn sets aside."""
        mode, name = self.tool_mode()
        if mode not in ("required", "named"):
            return []
        checks = [(spec, f"tools[{index}].function.parameters", f"tools[{index}].function.parameters ({function!r})")
                  for index, function, spec in parameter_specs(self.tools, name)]
        spec, field = structured_output_of(self)
        return checks + ([(spec, field, field)] if spec is not None else [])

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def check_supported(self, max_n: int = MAX_N) -> None:
        super().check_supported(max_n)
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise APIError(400, f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}",
                               param="top_logprobs", code="invalid_value")

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_GenerationRequest):
    # OpenAI's four forms: a string, a list of strings, a list of token ids, a list of lists of token ids
    prompt: str | list[int] | list[list[int]] | list[str]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | dict[str, list[int]]]:
        """One engine prompt per choice group: a str, or a {"prompt_token_ids": [...]} dict."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be an empty list", param="prompt", code="invalid_value")
        if all(isinstance(token, int) for token in prompt):
            return [{"prompt_token_ids": list(prompt)}]
        return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]

    @property
    def num_samples(self) -> int:
        """Samples drawn per prompt: best_of (the n best of them are answered), else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt alone (and its logprobs), nothing generated."""
        return self.echo and self.max_tokens == 0

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.echo_only:  # the engine computes one token, which the answer drops (as vLLM does)
            return 1, "max_tokens"
        return self.max_tokens, "max_tokens"

    def num_prompt_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:  # echo's logprobs start with the prompt's (completion_echo.py)
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def check_supported(self, max_n: int = MAX_N) -> None:
        super().check_supported(max_n)
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens 0 is served only with echo=true (the prompt alone, with its logprobs)",
                           param="max_tokens", code="invalid_value")
        if self.echo and self.use_beam_search:
            raise APIError(400, "echo is not supported with use_beam_search", param="echo", code="unsupported_parameter")
        if self.echo and self.stream and self.logprobs is not None:
            raise APIError(400, "echo with logprobs cannot stream (the prompt's logprobs come with the whole answer): "
                           "ask without stream, or without logprobs", param="echo", code="unsupported_parameter")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs}", param="logprobs",
                           code="invalid_value")
        if self.best_of is not None:
            if self.use_beam_search:
                raise APIError(400, "best_of does not apply to use_beam_search (n is the width)", param="best_of",
                               code="invalid_value")
            if not self.n <= self.best_of <= max_n:
                raise APIError(400, f"best_of must be in n..{max_n} (n={self.n}), got {self.best_of}", param="best_of",
                               code="invalid_value")
            if self.stream and self.best_of != self.n:
                raise APIError(400, "best_of > n cannot stream (the best are known at the end)", param="best_of",
                               code="invalid_value")

    def num_logprobs(self) -> int | None:
        if self.best_of is not None and self.best_of > self.n:
            return self.logprobs or 0  # ranking the samples needs their log-probabilities
        return self.logprobs


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages rendered as /v1/chat/completions renders
    them (pictures expand to their placeholder runs, as the engine counts them)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
