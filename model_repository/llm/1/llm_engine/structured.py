"""Structured output (``response_format``): JSON grammars that mask the logits token by token.

A request with ``{"type": "json_object"}`` or ``{"type": "json_schema", ...}`` gets an
llguidance matcher per sequence. Before each sampling step the matcher's set of allowed
next tokens masks its logits row (everything else becomes ``-inf``); after the step the
matcher consumes the chosen token. When the grammar is complete the only allowed token is
EOS, and the sequence ends with ``stop``. Requests without a format cost nothing.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from .errors import InvalidParameter

if TYPE_CHECKING:
    from .sequence import Sequence

log = logging.getLogger(__name__)

STRUCTURED_TYPES = ("json_object", "json_schema")
FORMAT_TYPES = ("text", *STRUCTURED_TYPES)
# Compact JSON, whatever the schema's own "x-guidance" says: a small model given free
# whitespace can emit newlines until max_tokens.
_JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_for(fmt: Any) -> str | None:
    """The llguidance grammar of a ``response_format`` value, or ``None`` for plain text.

    Raises :class:`InvalidParameter` naming the field for a malformed format or a schema
    that does not compile (an unknown type, a dangling ``$ref``, ...).
    """
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in FORMAT_TYPES:
        raise InvalidParameter("response_format must be an object whose type is 'text', 'json_object' "
                               f"or 'json_schema', got {fmt!r}")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    else:
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidParameter("response_format.json_schema.schema must be a JSON object")
    grammar, problem = compile_schema(schema)
    if problem:
        raise InvalidParameter(f"response_format.json_schema.schema is not a valid JSON schema: {problem}")
    return grammar


def compile_schema(schema: dict) -> tuple[str, str]:
    """A JSON schema's grammar, and what is wrong with it ("" if nothing)."""
    try:
        text = json.dumps(schema)  # in the schema's own order: properties come out in that order
    except (TypeError, ValueError) as exc:
        return "", str(exc)
    return _compile(text)


@functools.lru_cache(maxsize=128)
def _compile(schema: str) -> tuple[str, str]:
    """A schema's grammar and what is wrong with it ("" if nothing); clients often send the
    same schema again, and a request's is checked at parse and at admission (~2 ms each)."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    except (TypeError, ValueError) as exc:
        return "", str(exc)
    return grammar, llguidance.LLMatcher.validate_grammar(grammar)


class GrammarMatchers:
    """Builds matchers over the model's tokenizer; the token table is built at first use (~1 s)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self._hf = tokenizer
        self._vocab = vocab_size
        self._eos = eos_token_ids[0] if eos_token_ids else None  # what a whole JSON allows next
        self._tok: llguidance.LLTokenizer | None = None
        self._broken = ""  # why the token table cannot be built, once it failed
        self._lock = threading.Lock()

    def matcher(self, grammar: str | None, fork_of: llguidance.LLMatcher | None = None) -> llguidance.LLMatcher | None:
        """A matcher at the grammar's start, or a copy of ``fork_of`` in its state (``None``
        without a grammar); raises :class:`InvalidParameter` if it fails."""
        if not grammar:
            return None
        if fork_of is not None:
            return fork_of.deep_copy()
        m = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=1)
        if m.is_error():
            raise InvalidParameter(f"response_format cannot be used: {m.get_error()}")
        return m

    def warm_up(self) -> None:
        """Build the token table now (call from a background thread at start), so that the
        first request with a ``response_format`` does not wait for it."""
        try:
            self._tokenizer()
        except InvalidParameter:
            pass  # logged once where it failed

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tok is None and not self._broken:
                start = time.monotonic()
                try:
                    self._tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self._vocab, eos_token=self._eos)
                    log.info("structured output: token table of %d tokens built in %.2f s",
                             self._vocab, time.monotonic() - start)
                except Exception as exc:  # e.g. a slow (Python) tokenizer, which llguidance cannot read
                    self._broken = f"{type(exc).__name__}: {exc}"
                    log.exception("structured output: cannot build the token table; requests with a "
                                  "response_format will be refused")
            if self._tok is None:
                raise InvalidParameter(f"response_format is not available with this model's tokenizer ({self._broken})")
            return self._tok


def constrain(logits: torch.Tensor, owners: list[Sequence]) -> None:
    """Set to ``-inf`` each constrained row's tokens that its grammar does not allow next.

    A matcher in an error state, before or while computing its mask, leaves its row unmasked;
    :func:`accept` then fails the request instead of letting it end quietly.
    """
    rows = [i for i, s in enumerate(owners) if s.matcher is not None and not s.matcher.is_error()]
    if not rows:
        return
    vocab = logits.shape[1]
    size = (vocab + 31) // 32 * 4
    mask = np.stack([np.frombuffer(owners[i].matcher.compute_bitmask(), np.uint8)[:size] for i in rows])
    for j, i in enumerate(rows):
        if owners[i].matcher.is_error():  # it failed computing the mask (a limit hit): EOS only, which
            mask[j] = 0xFF                # would end the cut JSON as "stop"; accept() fails it instead
    allowed = unpack_bits(mask, vocab).to(logits.device)
    masked = logits.new_full((), float("-inf"))
    if len(rows) == logits.shape[0]:
        torch.where(allowed, logits, masked, out=logits)
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = torch.where(allowed, logits[index], masked)


def unpack_bits(mask: np.ndarray, vocab: int) -> torch.Tensor:
    """llguidance's bitmask rows, ``[R, bytes]`` uint8, to ``[R, V]`` bool.

    The mask is little-endian 32-bit words (bit ``b`` of word ``w`` is token ``32w + b``), so
    byte ``k`` holds tokens ``8k … 8k+7``, lowest bit first. numpy's ``unpackbits`` is about
    20x faster than shifting with torch."""
    return torch.from_numpy(np.unpackbits(mask, axis=1, bitorder="little")[:, :vocab]).bool()


def accept(seq: Sequence, token: int) -> bool:
    """Feed ``token`` to ``seq``'s matcher; return whether its grammar is now complete.

    Raises ``ValueError`` if the grammar does not allow the token (it was masked, so this
    means the matcher failed).
    """
    m = seq.matcher
    if not m.consume_token(token):
        raise ValueError(f"structured output: token {token} is not allowed here ({m.get_error()})")
    return m.is_stopped()
