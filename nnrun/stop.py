"""When a request stops: EOS, stop tokens, stop strings, max_tokens, the context length."""

from __future__ import annotations

from typing import Any

from nnrun.request import FinishReason, Request


class StopChecker:
    """Decides, after each new token, whether a request is done (and trims stop strings)."""

    def __init__(self, eos_token_ids: set[int], max_model_len: int, tokenizer: Any) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def check(self, req: Request) -> FinishReason | None:
        params = req.sampling_params
        token_id = req.output_token_ids[-1]
        if len(req.output_token_ids) < params.min_tokens:
            return self._length_limit(req)
        if not params.ignore_eos and token_id in self.eos_token_ids:
            req.stop_reason = None
            return FinishReason.STOP
        if token_id in params.stop_token_ids:
            req.stop_reason = token_id
            return FinishReason.STOP
        if params.stop_strings and self.tokenizer is not None:
            text = self.detokenize(req)
            for stop in params.stop_strings:
                index = text.find(stop)
                if index >= 0:
                    req.text = text[:index]
                    req.stop_reason = stop
                    return FinishReason.STOP
        return self._length_limit(req)

    def _length_limit(self, req: Request) -> FinishReason | None:
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None and len(req.output_token_ids) >= max_tokens:
            return FinishReason.LENGTH
        if req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def final_text(self, req: Request) -> str:
        """A finished request's text: cut at its stop string if one ended it, else all its tokens decoded."""
        if req.text is None:
            req.text = self.detokenize(req)
        return req.text

    def detokenize(self, req: Request) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(req.output_token_ids, skip_special_tokens=req.sampling_params.skip_special_tokens)
