"""When a request stops: the stop strings its detokenizer found, EOS and stop_token_ids past min_tokens, and
its length limits (max_tokens, or the model's context)."""

from __future__ import annotations

from kvserve.engine.request import Request, RequestStatus


def stop_status(request: Request, token_id: int, stop_string: str | None, max_model_len: int) -> RequestStatus | None:
    """The status `request` finishes with after appending `token_id` (its stop_reason set), or None."""
    params = request.sampling_params
    if stop_string is not None:
        request.stop_reason = stop_string
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_output_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
