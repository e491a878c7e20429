"""OpenAI / vLLM wire format: request validation, response bodies, SSE chunks, errors.

Pure functions over JSON-shaped dicts, so the HTTP handlers in ``app.py`` stay
short and this module can be tested without a server.

Errors use OpenAI's shape, as vLLM does::

    {"error": {"message": "...", "type": "BadRequestError", "param": null, "code": 400}}

Supported request fields: ``model``, ``messages`` (chat) or ``prompt``
(completions: a string, a list of token ids, or a one-element list of either),
``max_tokens`` / ``max_completion_tokens`` (the output length; chat prefers the
latter), ``stream``, ``stream_options.include_usage``, ``cache_salt``, ``tools``,
``add_generation_prompt``, ``n`` (1 only), ``ignore_eos`` and every sampling
field (accepted, ignored: output is filler of exactly ``max_tokens`` tokens, or
of the engine's ``answer_tokens`` when fewer: ``finish_reason`` ``stop``).

The sampling fields are still validated as vLLM validates them
(:func:`check_fields`), so a client's bad ``temperature`` gets the 400 it
would get from vLLM: the type of vLLM's request model (``null`` is the
default, as in OpenAI's API), then the range its ``SamplingParams`` checks,
in vLLM's words. Where vLLM's pydantic model would coerce a value of another
JSON type (``"0.5"`` for a number, ``1.0`` for an integer), this engine
refuses it, as it does for ``max_tokens`` and as the gateway does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

Kind = Literal["chat", "completion"]


class ApiError(Exception):
    """An error answered to the client in OpenAI's shape.

    Args:
        status: HTTP status.
        message: Human-readable message (names the field).
        type_: OpenAI error type (``BadRequestError``, ``NotFoundError``, ...).
        param: The request field at fault, if any.
    """

    def __init__(
        self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> bytes:
        """The JSON error body."""
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        return orjson.dumps({"error": err})


def bad_request(message: str, param: str | None = None) -> ApiError:
    """A 400 error."""
    return ApiError(400, message, "BadRequestError", param)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object.

    Raises:
        ApiError: 400 if it is not valid JSON or not an object.
    """
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


def check_model(body: Mapping[str, Any], served: str) -> str:
    """The served model name; 404 if the request names another one (vLLM's message)."""
    model = body.get("model")
    if model is None or model == served:
        return served
    if not isinstance(model, str):
        raise bad_request("'model' must be a string.", "model")
    raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def _positive_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(f"'{name}' must be a positive integer, got {value!r}.", name)
    return value


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

_NUMBERS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_INTEGERS = ("top_k", "seed", "n")
_OTHERS: dict[str, tuple[type, str]] = {"stream": (bool, "boolean"), "user": (str, "string")}
"""The fields :func:`check_fields` checks: each ``T | None`` in vLLM's
``ChatCompletionRequest`` and ``CompletionRequest`` (None: the default),
``float`` (numbers), ``int`` (integers) or another type."""


def _range_error(name: str, value: float) -> str | None:
    """vLLM's ``SamplingParams._verify_args`` message for an out-of-range value, or None."""
    if name == "temperature":
        if not math.isfinite(value):
            return f"temperature must be a finite number, got {value}."
        if value < 0.0:
            return f"temperature must be non-negative, got {value}."
        if value > 2.0:
            return f"temperature must be in [0, 2], got {value}."
    elif name == "top_p" and not 0.0 < value <= 1.0:
        return f"top_p must be in (0, 1], got {value}."
    elif name == "min_p" and not 0.0 <= value <= 1.0:
        return f"min_p must be in [0, 1], got {value}."
    elif name in ("presence_penalty", "frequency_penalty") and not -2.0 <= value <= 2.0:
        return f"{name} must be in [-2, 2], got {value}."
    elif name == "repetition_penalty":
        if not math.isfinite(value):
            return f"repetition_penalty must be a finite number, got {value}."
        if value <= 0.0:
            return f"repetition_penalty must be greater than zero, got {value}."
    elif name == "top_k" and value < -1:  # vLLM takes -1 for 0 (disabled)
        return f"top_k must be 0 (disable), or at least 1, got {value}."
    elif name == "seed" and not _INT64_MIN <= value <= _INT64_MAX:
        return f"seed must be a signed 64-bit integer, got {value}."
    elif name == "n" and value < 1:
        return f"n must be at least 1, got {value}."
    return None


def check_fields(body: Mapping[str, Any]) -> None:
    """Validate the sampling fields (and ``n``, ``stream``, ``user``) as vLLM does (module
    docstring), though the engine ignores most of them.

    Raises:
        ApiError: 400 naming the field (``param`` and the message).
    """
    for name in (*_NUMBERS, *_INTEGERS):
        value = body.get(name)
        if value is None:
            continue
        integer = name in _INTEGERS
        typed = isinstance(value, int) if integer else isinstance(value, (int, float))
        if not typed or isinstance(value, bool):  # a bool is an int to Python, not to JSON
            what = "integer" if integer else "number"
            raise bad_request(f"{name}: Input should be a valid {what}, got {value!r}.", name)
        # vLLM's model makes a float of a number field's integer (its messages say 2.0).
        message = _range_error(name, value if integer else float(value))
        if message is not None:
            raise bad_request(message, name)
    for name, (kind, what) in _OTHERS.items():
        value = body.get(name)
        if value is not None and not isinstance(value, kind):
            raise bad_request(f"{name}: Input should be a valid {what}, got {value!r}.", name)


@dataclass(frozen=True, slots=True)
class Options:
    """The generation options of a request that this engine honours.

    Attributes:
        max_tokens: Output length asked for; None = the server's default.
        stream: Answer with server-sent events.
        include_usage: Send a final usage chunk when streaming.
        cache_salt: vLLM's per-request cache isolation key.
    """

    max_tokens: int | None
    stream: bool
    include_usage: bool
    cache_salt: str | None


def parse_options(body: Mapping[str, Any], kind: Kind) -> Options:
    """Validate the options shared by chat and completions.

    Raises:
        ApiError: 400 naming the field.
    """
    check_fields(body)
    max_tokens = _positive_int(body, "max_tokens")
    if kind == "chat":
        max_tokens = _positive_int(body, "max_completion_tokens") or max_tokens
    if body.get("n") not in (None, 1):  # an integer of 2 or more (check_fields)
        raise bad_request("Only n=1 is supported by this engine.", "n")
    stream = body.get("stream") is True  # null is the default, false (check_fields)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad_request("'stream_options' must be an object.", "stream_options")
        if not stream:
            raise bad_request("Stream options can only be defined when `stream=True`.")
        include_usage = bool(opts.get("include_usage", False))
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.")
    return Options(max_tokens, stream, include_usage, salt)


def completion_prompt(body: Mapping[str, Any]) -> str | list[int]:
    """The one prompt of a completions request: text or token ids.

    Raises:
        ApiError: 400 if missing, malformed or a batch of several prompts.
    """
    if "prompt" not in body:
        raise bad_request("Field required: 'prompt'.", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("Batched prompts are not supported by this engine.", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        return list(prompt)
    raise bad_request(
        "'prompt' must be a string, a list of token ids or a one-element list of either.",
        "prompt",
    )


def chat_messages(body: Mapping[str, Any]) -> list[Any]:
    """The ``messages`` of a chat request (rendering checks each message).

    Raises:
        ApiError: 400 if missing or not a non-empty list.
    """
    if "messages" not in body:
        raise bad_request("Field required: 'messages'.", "messages")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list.", "messages")
    return messages


def length_error(
    prompt_tokens: int, max_tokens: int, max_model_len: int, hint: str = ""
) -> ApiError | None:
    """vLLM's 400 for a request that cannot fit in ``max_model_len``, or None.

    ``hint`` (a sentence naming the engine's options that would admit the
    request) follows vLLM's own message, after a space.
    """
    if prompt_tokens == 0:
        return bad_request("The prompt cannot be empty.", "prompt")
    tail = f" {hint}" if hint else ""
    if prompt_tokens >= max_model_len:
        return bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_tokens} input tokens. Please reduce the length of the input "
            "messages." + tail
        )
    if prompt_tokens + max_tokens > max_model_len:
        return bad_request(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
            f"maximum context length is {max_model_len} tokens and your request has "
            f"{prompt_tokens} input tokens ({max_tokens} > {max_model_len} - {prompt_tokens})."
            + tail,
            "max_tokens",
        )
    return None


# ----------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI usage with vLLM's ``prompt_tokens_details.cached_tokens``."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def full_response(
    kind: Kind,
    rid: str,
    created: int,
    model: str,
    text: str,
    use: dict[str, Any],
    finish_reason: str = "length",
) -> dict[str, Any]:
    """A non-streaming response body (``finish_reason``: ``stop`` for an answer that
    ended on its own, ``length`` for one cut at ``max_tokens``)."""
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
    }


class ChunkWriter:
    """Builds the SSE frames of one streaming response (``data: {json}\\n\\n``)."""

    __slots__ = ("_head", "_kind", "_reason")

    def __init__(
        self, kind: Kind, rid: str, created: int, model: str, finish_reason: str = "length"
    ) -> None:
        self._kind = kind
        self._reason = finish_reason
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._head = {"id": rid, "object": obj, "created": created, "model": model}

    @property
    def is_chat(self) -> bool:
        """Chat chunks (else completions)."""
        return self._kind == "chat"

    @staticmethod
    def frame(payload: Mapping[str, Any]) -> bytes:
        """One SSE event."""
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    def role(self) -> bytes:
        """Chat only: the first chunk, announcing the assistant role (as vLLM sends)."""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self.frame({**self._head, "choices": [choice]})

    def token(self, text: str, last: bool) -> bytes:
        """One output token; the last one carries ``finish_reason``."""
        reason = self._reason if last else None
        if self._kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if last:
            choice["stop_reason"] = None
        return self.frame({**self._head, "choices": [choice]})

    def usage(self, use: dict[str, Any]) -> bytes:
        """The usage chunk (``stream_options.include_usage``): no choices."""
        return self.frame({**self._head, "choices": [], "usage": use})

    DONE = b"data: [DONE]\n\n"


def render_result(
    rid: str, model: str, token_ids: Sequence[int], max_tokens: int, salt: str | None
) -> dict[str, Any]:
    """vLLM's ``/v1/*/render`` item: the request as the engine would run it."""
    return {
        "request_id": rid,
        "model": model,
        "token_ids": list(token_ids),
        "features": None,
        "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True},
        "cache_salt": salt,
        "stream": False,
    }
