"""Errors as OpenAI's API writes them: `{"error": {"message", "type", "param", "code"}}` with the
matching HTTP status, for mmengine's typed errors, bad JSON, bad fields, unknown routes and keys."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmengine.engine.async_errors import EngineOverloadedError, RequestFailedError
from mmengine.errors import (
    AudioCountMismatchError,
    AudioTooLongError,
    ConfigError,
    CorruptAudioError,
    CorruptImageError,
    EmptyPromptError,
    EngineDeadError,
    ImageCountMismatchError,
    ImageTooLargeError,
    InvalidInputError,
    ItemTooLargeError,
    MediaDecodeTimeoutError,
    PreprocessingWorkerError,
    PromptTooLongError,
    TooManyAudiosError,
    TooManyImagesError,
    UnknownAdapterError,
    UnsupportedContainerError,
    UnsupportedImageTypeError,
)

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}

# mmengine's input errors, most specific first: (error class, code)
_INPUT_ERROR_CODES: tuple[tuple[type[InvalidInputError], str], ...] = (
    (PromptTooLongError, "context_length_exceeded"),
    (TooManyImagesError, "too_many_images"),
    (ImageCountMismatchError, "image_count_mismatch"),
    (ImageTooLargeError, "image_too_large"),
    (ItemTooLargeError, "image_too_large"),
    (CorruptImageError, "invalid_image"),
    (UnsupportedImageTypeError, "invalid_image"),
    (TooManyAudiosError, "too_many_audios"),
    (AudioCountMismatchError, "audio_count_mismatch"),
    (AudioTooLongError, "audio_too_long"),
    (CorruptAudioError, "invalid_audio"),
    (UnsupportedContainerError, "unsupported_media_container"),
    (MediaDecodeTimeoutError, "media_decode_timeout"),
    (PreprocessingWorkerError, "preprocessing_worker_failed"),
    (EmptyPromptError, "empty_prompt"),
)
_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+) ")


class APIError(Exception):
    """An answer in OpenAI's error format."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or ERROR_TYPES.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_engine_error(err: Exception, *, input_param: str, sampling_fields: dict[str, str] | None = None) -> APIError:
    """The API error for an exception the engine raised on a request. `input_param` names the request
    field holding the prompt and images ("messages" or "prompt"); `sampling_fields` maps a
    SamplingParams field to the request field it came from (e.g. max_tokens -> max_completion_tokens)."""
    if isinstance(err, EngineOverloadedError):
        return APIError(503, str(err), code="overloaded", headers={"Retry-After": str(err.retry_after)})
    if isinstance(err, EngineDeadError):
        return APIError(503, str(err), code="engine_dead")
    if isinstance(err, RequestFailedError):
        return APIError(500, str(err), code="request_failed")
    if isinstance(err, UnknownAdapterError):
        return APIError(404, err.reason, param="model", code="model_not_found")
    if isinstance(err, InvalidInputError):
        code = next((code for cls, code in _INPUT_ERROR_CODES if isinstance(err, cls)), "invalid_value")
        return APIError(400, err.reason, param=input_param, code=code)
    if isinstance(err, ConfigError):  # a SamplingParams value
        match = _SAMPLING_FIELD.search(str(err))
        field = match.group(1) if match else None
        param = (sampling_fields or {}).get(field, field) if field else None
        message = str(err).replace(f"SamplingParams.{field}", param) if field else str(err)
        return APIError(400, message, param=param, code="invalid_value")
    logger.error("request failed", exc_info=err)
    return APIError(500, f"internal error: {type(err).__name__}: {err}", code="internal_error")


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] | None = None) -> None:
    """Every error answer in OpenAI's format; `on_error(status)` is told of each one."""

    def answer(err: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(err.status)
        return err.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return answer(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        return answer(validation_error(err.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        if err.status_code == 404:
            message, code = f"no such route: {request.method} {request.url.path}", "not_found"
        elif err.status_code == 405:
            message, code = f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
        else:
            message, code = str(err.detail), None
        return answer(APIError(err.status_code, message, code=code, headers=getattr(err, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:  # Starlette then re-raises it to be logged
        return answer(APIError(500, f"internal error: {type(err).__name__}: {err}", code="internal_error"))


def validation_error(errors: list[dict[str, Any]] | tuple[dict[str, Any], ...]) -> APIError:
    """A 400 for the first problem FastAPI found in the request body (bad JSON, a missing field, a
    value of the wrong type), naming the field."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": (), "type": ""}
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        return APIError(400, f"the request body is not valid JSON: {detail}", code="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":  # never dropped: a field the server does not know is refused
        return APIError(400, f"{param} is not supported by this server", param=param, code="unsupported_parameter")
    where = f"{param}: " if param else "request body: "
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_type"
    return APIError(400, where + str(first.get("msg", "invalid value")), param=param, code=code)
