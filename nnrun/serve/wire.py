"""What travels between a serve client and the server, both directions, in one place.

Requests carry nnsight's serialized trace (`RequestModel.serialize`) with nnsight's headers;
the key goes in `ndif-api-key` (nnsight's client) or `Authorization: Bearer` (OpenAI clients).
A trace's answer is `torch.save({"saves": {name: value}, "error": <deferred error or None>,
"registered": [per prompt: {edit: {name: value}}]})`; nnrun's own client asks (header
`nnrun-result: raw-tensors`) for the same dict as a plain pickle with tensors as raw bytes
(`tensor_pickle`), which costs both ends a tenth as much, and reads either.

The error is nnsight's deferred-error dict (`capture_exception`), which nnsight's
`LocalServeBackend` re-raises as a RuntimeError naming the type; nnrun adds the exception
itself, pickled, under "exception" when it survives a pickle, so nnrun's client re-raises the
real type.
"""

from __future__ import annotations

import builtins
import io
import pickle
import traceback as _traceback
from typing import Any

import torch

from nnsight.intervention.errors import capture_exception, raise_deferred

from nnrun.serve import tensor_pickle

API_KEY_HEADER = "ndif-api-key"
RESULT_FORMAT_HEADER = "nnrun-result"  # value RAW_TENSORS: answer with `tensor_pickle` where it can
RAW_TENSORS = "raw-tensors"
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 3600.0  # a trace may queue behind others; the server's own limit ends it first


class ServerShuttingDown(ConnectionError):
    """The server stopped (SIGTERM) before this request finished; it was aborted. Send it again once it is back.

    Defined here, where clients import it without the server's packages, so it reaches them as its own type.
    """


def accepted_kwargs(kind: str) -> tuple[str, ...]:
    """The keywords a remote `trace`/`generate` may carry: a local one's, but no streamer (it would run here)."""
    from interleaver.attentions import ATTENTION_KWARGS
    from interleaver.keywords import GENERATE_KWARGS

    return GENERATE_KWARGS + ATTENTION_KWARGS  # a trace takes generation settings and ignores them, as on HF


def headers(api_key: str | None) -> dict[str, str]:
    """The headers a trace or a registration carries (nnsight's, and the answer format nnrun's client reads)."""
    sending = {
        "Content-Type": "application/octet-stream",
        "nnsight-compress": "False",
        RESULT_FORMAT_HEADER: RAW_TENSORS,
    }
    if api_key:
        sending[API_KEY_HEADER] = api_key
    return sending


def capture_error(error: BaseException, filename: str | None = None, client_filename: str | None = None) -> dict:
    """nnsight's deferred error for `error`, plus the exception itself when it survives a pickle.

    The traceback keeps the block's own frames (`filename`, shown as the client's file name).
    """
    captured: dict[str, Any] = dict(capture_exception(error))
    if filename is not None:
        traceback = getattr(error, "__intervention_tb__", None) or error.__traceback__
        frames = [entry for entry in _traceback.extract_tb(traceback) if entry.filename == filename]
        text = "".join(_traceback.format_list(frames))  # none: the server's own frames are not the user's
        captured["traceback"] = text.replace(filename, client_filename or filename)
    copy = _portable(error)
    if copy is not None:
        captured["exception"] = pickle.dumps(copy)  # pickled apart: torch.save turns OSError subclasses into OSError
    return captured


def _portable(error: BaseException) -> BaseException | None:
    """A copy of `error` that unpickles as its own type (without its traceback), or None."""
    for candidate in (error, _bare(error)):
        if candidate is None:
            continue
        try:
            copy = pickle.loads(pickle.dumps(candidate))
        except Exception:
            continue
        if type(copy) is type(error):
            copy.__traceback__ = None
            copy.__context__ = copy.__cause__ = None
            return copy
    return None


def _bare(error: BaseException) -> BaseException | None:
    try:
        return type(error)(*error.args)
    except Exception:
        return None


def encode_result(
    saves: dict[str, Any],
    error: dict[str, Any] | None,
    registered: list[dict[str, Any]] | None = None,
    raw_tensors: bool = False,
) -> bytes:
    """The body of a trace's answer (`error` from `capture_error`); unpicklable saves become its error.

    `raw_tensors`: the client reads `tensor_pickle`'s form; used where it carries every value exactly.
    """
    payload = {"saves": saves, "error": error, "registered": registered or []}
    if raw_tensors:
        try:
            body = tensor_pickle.dumps(payload)
        except Exception:
            body = None  # unpicklable: torch.save below says so as the trace's error
        if body is not None:
            return body
    buffer = io.BytesIO()
    try:
        torch.save(payload, buffer)
    except Exception as failure:
        unsendable = TypeError(f"the trace's saved values cannot be sent back: {type(failure).__name__}: {failure}")
        buffer = io.BytesIO()
        torch.save({"saves": {}, "error": error or capture_error(unsendable), "registered": []}, buffer)
    return buffer.getvalue()


def decode_result(content: bytes) -> dict[str, Any]:
    if content.startswith(tensor_pickle.MAGIC):
        return tensor_pickle.loads(content)
    return torch.load(io.BytesIO(content), map_location="cpu", weights_only=False)


def raise_remote_error(error: dict[str, Any] | None) -> None:
    """Re-raise a trace's deferred error at the client: its own type where possible, with the server's traceback."""
    if not error or error.get("is_control_flow"):
        return
    try:
        exception = pickle.loads(error["exception"]) if "exception" in error else None
    except Exception:
        exception = None
    if not isinstance(exception, BaseException):
        exception_type = getattr(builtins, str(error.get("type_name")), None)
        if isinstance(exception_type, type) and issubclass(exception_type, Exception):
            try:
                exception = exception_type(error.get("message", ""))
            except Exception:
                exception = None
    if not isinstance(exception, BaseException):
        raise_deferred(error)
        return
    traceback = (error.get("traceback") or "").rstrip()
    if traceback:
        exception.add_note(f"Traceback on the server (the block's own lines):\n{traceback}")
    raise exception


def http_error_message(url: str, status_code: int, detail: str) -> str:
    return f"nnrun serve at {url} answered {status_code}: {detail}"
