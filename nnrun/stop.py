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
        """Why `req` stops after its newest token, or None; read once per request per step, so kept lean."""
        params = req.sampling_params
        output = req.output_token_ids
        num_output = len(output)
        if num_output >= params.min_tokens:  # before min_tokens only the length limits stop a request
            token_id = output[-1]
            if token_id in self.eos_token_ids and not params.ignore_eos:
                req.stop_reason = None
                return FinishReason.STOP
            if params.stop_token_ids and token_id in params.stop_token_ids:
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
        max_tokens = params.max_tokens
        if max_tokens is not None and num_output >= max_tokens:
            return FinishReason.LENGTH
        if len(req.prompt_token_ids) + num_output >= self.max_model_len:
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
