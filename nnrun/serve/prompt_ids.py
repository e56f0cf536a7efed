"""A trace's text prompts tokenized by the client, used by the server only when both hold the same tokenizer.

The server runs every client's traces on one Python interpreter, so all its CPU per trace comes
out of one GIL; the client (a notebook, on its own core) has CPU to spare. nnrun's client
tokenizes the prompts its trace passes to `model.trace(...)`/`model.generate(...)` and sends
their ids beside the text, with a fingerprint of its tokenizer: the classes and versions that
run it and every setting that decides `tokenizer(text)["input_ids"]`. The server takes the ids
only if the fingerprint equals its own tokenizer's, so they are exactly the ids it would have
computed; otherwise (another tokenizer, nnsight's own client, a slow tokenizer) it tokenizes the
text itself, as before. Ids it takes are still checked against the model's vocabulary.

A tokenizer can change after it is loaded (`add_tokens`, a setting, a new post-processor), so
each side keeps its fingerprint with a cheap key of that state (`TokenizerIdentity`) and
computes it again when the key changes: a stale fingerprint would make the server run ids its
own tokenizer would no longer produce.
"""

from __future__ import annotations

import hashlib
from typing import Any

from nnrun.prompts import text_token_ids

PROMPT_IDS_ATTRIBUTE = "nnrun_prompt_ids"  # on the client's tracer, pickled with it: (fingerprint, {text: ids})
# Per-process or per-load state that does not change what `tokenizer(text)` returns.
_UNRELATED = {"name_or_path", "verbose", "_in_target_context_manager", "padding_side", "truncation_side"}


def tokenizer_fingerprint(tokenizer: Any) -> str | None:
    """A digest of what decides `tokenizer(text)["input_ids"]`, or None if it cannot be pinned down.

    Only HF fast tokenizers qualify: their Rust backend serializes its whole state (normalizer,
    pre-tokenizer, model, post-processor, added tokens, truncation and padding); the Python
    side adds its class (and the library versions that define it) and its scalar settings.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        return None
    import tokenizers
    import transformers

    try:
        state = backend.to_str()
    except Exception:
        return None
    settings = _scalar_settings(tokenizer)
    special = sorted((name, repr(value)) for name, value in tokenizer.special_tokens_map.items())
    digest = hashlib.sha256()
    for part in (
        transformers.__version__,
        tokenizers.__version__,
        type(tokenizer).__module__,
        type(tokenizer).__qualname__,
        repr(settings),
        repr(special),
        state,
    ):
        digest.update(part.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
    return digest.hexdigest()


class TokenizerIdentity:
    """A tokenizer's fingerprint, computed again whenever the tokenizer (or its state) changes."""

    def __init__(self) -> None:
        self._tokenizer: Any = None
        self._key: Any = None
        self._fingerprint: str | None = None

    def fingerprint(self, tokenizer: Any) -> str | None:
        key = _state_key(tokenizer)
        if tokenizer is not self._tokenizer or key != self._key:
            fingerprint = tokenizer_fingerprint(tokenizer)
            self._tokenizer, self._key, self._fingerprint = tokenizer, key, fingerprint
        return self._fingerprint


def _state_key(tokenizer: Any) -> Any:
    """What a tokenizer's users change in place, read in a few microseconds (the vocabulary's size, not its contents)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    parts = [
        len(tokenizer),
        backend.get_vocab_size(with_added_tokens=False),
        repr(backend.truncation),
        repr(backend.padding),
        _scalar_settings(tokenizer),
    ]
    for name in ("normalizer", "pre_tokenizer", "post_processor"):
        component = getattr(backend, name)
        parts.append(component.__getstate__() if component is not None else None)
    return tuple(parts)


def _scalar_settings(tokenizer: Any) -> list[tuple[str, str]]:
    return sorted(
        (name, repr(value))
        for name, value in vars(tokenizer).items()
        if name not in _UNRELATED and (value is None or isinstance(value, (bool, int, float, str)))
    )


def encode_trace_prompts(tokenizer: Any, fingerprint: str | None, inputs: tuple) -> tuple[str, dict] | None:
    """(fingerprint, {text: ids}) for the text prompts in a trace's own inputs; None if there are none."""
    if fingerprint is None or len(inputs) != 1:
        return None
    prompt = inputs[0]
    texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, (list, tuple)) else ()
    encoded = {}
    for text in texts:
        if not isinstance(text, str) or not text or text in encoded:
            continue
        try:
            encoded[text] = text_token_ids(text, tokenizer)  # HF's ids, as the server would make them
        except Exception:  # the server tokenizes it, and says what is wrong with it
            continue
    return (fingerprint, encoded) if encoded else None


def accepted_prompt_ids(shipped: Any, fingerprint: str | None) -> dict[str, list[int]] | None:
    """The client's {text: ids} if it was made by a tokenizer with this `fingerprint`, else None."""
    if fingerprint is None or not isinstance(shipped, tuple) or len(shipped) != 2 or shipped[0] != fingerprint:
        return None
    encoded = shipped[1]
    return encoded if isinstance(encoded, dict) else None


def checked_ids(ids: Any, vocab_size: int) -> list[int] | None:
    """`ids` if they are a non-empty list of Python ints inside the vocabulary, else None."""
    if (
        type(ids) is not list
        or not ids
        or not all(type(token) is int for token in ids)
        or min(ids) < 0
        or max(ids) >= vocab_size
    ):
        return None
    return ids
