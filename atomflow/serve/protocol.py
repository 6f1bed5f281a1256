"""The OpenAI request bodies the server accepts (pydantic), and its error object.

Unknown fields are refused with 400, as the OpenAI API does ("Unrecognized request argument
supplied: x"): a misspelt parameter is an error, not a silent default. Parameters the engine
does not support yet (n > 1, tools, logprobs, penalties) are known fields refused with a 400
that names them. Extensions, as in vLLM: top_k, ignore_eos.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

MAX_STOP = 4  # the OpenAI API's limit on stop strings


class ApiError(Exception):
    """An error the client caused or must handle, answered as {"error": {...}} with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type or {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            413: "invalid_request_error",
            503: "service_unavailable",
            504: "timeout",
        }.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)

    model: str | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1)  # -1 or 0: off
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    n: StrictInt = Field(1, ge=1)
    logprobs: Any | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    user: str | None = None
    ignore_eos: StrictBool = False

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def _number(cls, v):
        if isinstance(v, bool) or (v is not None and not isinstance(v, (int, float))):
            raise ValueError("must be a number")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    def unsupported(self) -> ApiError | None:
        """The first supported-later parameter this request sets, as the 400 to answer."""
        if self.n != 1:
            return ApiError(400, "n > 1 is not supported: the engine decodes one stream", "n", "unsupported_parameter")
        if self.logprobs not in (None, False, 0):
            return ApiError(400, "logprobs are not supported yet", "logprobs", "unsupported_parameter")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                return ApiError(400, f"{name} is not supported yet (only 0)", name, "unsupported_parameter")
        if self.logit_bias:
            return ApiError(400, "logit_bias is not supported yet", "logit_bias", "unsupported_parameter")
        return None

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list | None = None
    tool_call_id: str | None = None

    def as_template_message(self) -> dict:
        """{"role", "content"} for the chat template (developer is the system role; text parts joined)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(_Request):
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    tools: list | None = None
    tool_choice: Any | None = None
    parallel_tool_calls: bool | None = None
    top_logprobs: StrictInt | None = None
    response_format: dict | None = None

    def unsupported(self) -> ApiError | None:
        if self.tools:
            return ApiError(400, "tools are not supported yet", "tools", "unsupported_parameter")
        if self.tool_choice not in (None, "none"):
            return ApiError(400, "tool_choice is not supported yet", "tool_choice", "unsupported_parameter")
        if self.top_logprobs:
            return ApiError(400, "logprobs are not supported yet", "top_logprobs", "unsupported_parameter")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return ApiError(400, 'only response_format {"type": "text"} is supported', "response_format", "unsupported_parameter")
        for i, m in enumerate(self.messages):
            if m.role == "tool" or m.tool_calls:
                return ApiError(400, "tool messages are not supported yet", f"messages[{i}]", "unsupported_parameter")
            if m.content is None:
                return ApiError(400, f"messages[{i}].content is required", f"messages[{i}].content")
        return super().unsupported()

    @property
    def token_limit(self) -> tuple[int | None, str]:
        """(the requested completion limit, the field that set it)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(_Request):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    def unsupported(self) -> ApiError | None:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                return ApiError(
                    400, "one prompt per request (a batch of prompts is not supported)", "prompt", "unsupported_parameter"
                )
        if self.echo:
            return ApiError(400, "echo is not supported yet", "echo", "unsupported_parameter")
        if self.suffix:
            return ApiError(400, "suffix is not supported", "suffix", "unsupported_parameter")
        if self.best_of not in (None, 1):
            return ApiError(400, "best_of > 1 is not supported", "best_of", "unsupported_parameter")
        return super().unsupported()

    @property
    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            p = p[0]
        if (isinstance(p, str) and not p) or (isinstance(p, list) and not p):
            raise ApiError(400, "prompt is empty", "prompt")
        return p

    @property
    def token_limit(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()


def validation_error(exc) -> ApiError:
    """A pydantic ValidationError -> 400 naming the first bad field, as OpenAI does."""
    e = exc.errors()[0]
    loc = [str(x) for x in e.get("loc", ()) if not str(x).startswith(("function-", "list[", "union["))]
    # union branches add their type names to the location: keep the field path only
    loc = [x for x in loc if x not in ("str", "int", "float", "bool", "list", "dict", "TextPart")]
    param = ".".join(loc) if loc else None
    if e.get("type") == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if e.get("type") == "missing":
        return ApiError(400, f"Missing required parameter: '{param}'", param, "missing_required_parameter")
    msg = e.get("msg", "invalid value").removeprefix("Value error, ")
    return ApiError(400, f"Invalid value for '{param}': {msg}", param, "invalid_value")
