"""OpenAI request fields -> SamplingParams, with the model's generation_config as defaults (vLLM's behaviour)."""

from __future__ import annotations

import logging
from typing import Any

from kvserve.engine.sampling_params import SamplingParams
from kvserve.server.errors import bad_request
from kvserve.server.protocol import SamplingFields

logger = logging.getLogger("kvserve.server")

# generation_config.json keys that vLLM takes as request defaults (when the request leaves them out).
GENERATION_CONFIG_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FALLBACKS: dict[str, float | int] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0,
}


def model_sampling_defaults(generation_config: dict[str, Any]) -> dict[str, float | int]:
    defaults = {
        key: generation_config[key] for key in GENERATION_CONFIG_DEFAULTS
        if isinstance(generation_config.get(key), (int, float)) and not isinstance(generation_config.get(key), bool)
    }
    if defaults:
        logger.info("Sampling defaults from the model's generation config: %s (requests may override them)", defaults)
    return defaults


def build_sampling_params(request: SamplingFields, max_tokens: int, logprobs: int | None,
                          defaults: dict[str, float | int], prompt_logprobs: int | None = None) -> SamplingParams:
    """prompt_logprobs: what the route needs scored (completions' echo with logprobs), else the request's own."""
    def pick(name: str) -> Any:
        value = getattr(request, name)
        return value if value is not None else defaults.get(name, FALLBACKS[name])

    try:
        return SamplingParams(
            n=request.n,
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            presence_penalty=pick("presence_penalty"),
            frequency_penalty=pick("frequency_penalty"),
            repetition_penalty=pick("repetition_penalty"),
            seed=request.seed,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids or [],
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else request.prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            logit_bias=_token_biases(request.logit_bias),
        )
    except ValueError as exc:
        message = str(exc)
        # SamplingParams messages start with the field name ("top_p must be in (0, 1], got 2.0").
        field_name = message.split(" ", 1)[0]
        param = field_name if field_name in SamplingParams.__dataclass_fields__ else None
        raise bad_request(message, param=param) from None


def _token_biases(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys, so as strings."""
    if not logit_bias:
        return None
    try:
        return {int(token): bias for token, bias in logit_bias.items()}
    except ValueError:
        keys = [token for token in logit_bias if not token.strip().lstrip("-").isdigit()]
        raise bad_request(f"logit_bias keys must be token ids, got {keys[0]!r}", param="logit_bias") from None


def check_common_unsupported(request: SamplingFields) -> None:
    """OpenAI / vLLM fields kvserve declares but cannot honour: refused by name, never silently ignored."""
    if request.priority != 0:
        raise bad_request("priority scheduling is not built (--scheduling-policy is fcfs or lpm); send priority 0",
                          param="priority")
    if request.prompt_logprobs is not None and request.stream:
        raise bad_request("prompt_logprobs is served without streaming only", param="prompt_logprobs")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options can only be set when stream is true", param="stream_options")
