"""Structured outputs: a grammar per request, applied to the logits as a token mask.

Grammars are compiled by llguidance (a well-kept Rust grammar engine, vLLM's ``guidance``
backend) against the model's tokenizer. ``GrammarCompiler`` caches one compiled matcher per
(tenant, kind, spec) and hands each request a cheap deep copy, so a schema is compiled once
however many of a tenant's requests use it. The cache is per tenant, like the prefix cache: a
tenant cannot time whether another tenant used a schema (a hit would answer faster), and one
tenant's flood of schemas only evicts its own entries. The API layer compiles in its
preprocessing workers (a hostile schema costs its own tenant's worker time, never the engine
loop); the engine compiles only for offline requests that arrive without a matcher.

Per step the sampler asks each constrained row's matcher for its allowed tokens (a bitmask,
microseconds to a millisecond per row) and masks the rest to -inf; after sampling, the model
runner feeds the chosen token back (``consume``). When the grammar is complete only eos is
allowed, so a constrained completion ends by itself (or at ``max_tokens``).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from engine.errors import InvalidRequestError

GrammarKind = Literal["json_schema", "json_object", "regex", "lark"]
# Compact JSON: no free whitespace between tokens (a small model would otherwise pad forever).
_JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match (vLLM ``StructuredOutputsParams``).

    Attributes:
        kind: ``json_schema`` (``spec`` is the schema as JSON text), ``json_object`` (any JSON
            object; ``spec`` unused), ``regex`` or ``lark`` (``spec`` is the pattern / grammar).
        spec: see ``kind``.
    """

    kind: GrammarKind
    spec: str = ""

    def grammar(self) -> str:
        """The llguidance grammar text. Raises InvalidRequestError for a bad schema."""
        from llguidance import LLMatcher

        try:
            if self.kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"},
                                                          defaults=_JSON_OPTIONS)
            if self.kind == "json_schema":
                return LLMatcher.grammar_from_json_schema(json.loads(self.spec),
                                                          defaults=_JSON_OPTIONS)
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(self.spec)
            return LLMatcher.grammar_from_lark(self.spec)
        except ValueError as e:
            raise InvalidRequestError(f"invalid {self.kind}: {str(e)[:200]}",
                                      "response_format") from None


class GrammarCompiler:
    """Compiles ``StructuredOutput`` specs into llguidance matchers, cached per tenant
    (thread-safe).

    Args:
        tokenizer: the model's Hugging Face (fast) tokenizer.
        vocab_size: the model's vocabulary (its logits' width), which may be padded beyond the
            tokenizer's; the masks are this wide.
        max_per_tenant: compiled grammars kept per tenant (least recently used dropped).
        max_tenants: tenants with a cache (the least recently active one's dropped).

    The llguidance tokenizer is built on first use (about 0.4 s for SmolLM2's 49,152 tokens).
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, max_per_tenant: int = 16,
                 max_tenants: int = 256) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll_tokenizer: Any = None
        self._caches: OrderedDict[str | None, OrderedDict[StructuredOutput, Any]] = \
            OrderedDict()
        self._max_per_tenant = max_per_tenant
        self._max_tenants = max_tenants
        self._lock = threading.Lock()
        self.num_compiled = 0  # grammars compiled (cache misses), for tests and metrics

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer,
                                                                  n_vocab=self._vocab_size)
            return self._ll_tokenizer

    def matcher(self, spec: StructuredOutput, tenant_id: str | None = None) -> Any:
        """A fresh ``llguidance.LLMatcher`` for one request of ``tenant_id``.

        Raises:
            InvalidRequestError: the schema, regex or grammar is invalid (``param``
                ``response_format``), with llguidance's reason, cut to 200 characters.
        """
        from llguidance import LLMatcher

        with self._lock:
            cache = self._caches.get(tenant_id)
            proto = cache.get(spec) if cache is not None else None
            if proto is not None:
                cache.move_to_end(spec)  # type: ignore[union-attr]
                self._caches.move_to_end(tenant_id)
                return proto.deep_copy()
        tokenizer = self._tokenizer()
        proto = LLMatcher(tokenizer, spec.grammar(), log_level=0)
        if proto.is_error():
            raise InvalidRequestError(f"invalid {spec.kind}: {proto.get_error()[:200]}",
                                      "response_format")
        with self._lock:
            self.num_compiled += 1
            cache = self._caches.setdefault(tenant_id, OrderedDict())
            self._caches.move_to_end(tenant_id)
            cache[spec] = proto
            while len(cache) > self._max_per_tenant:
                cache.popitem(last=False)
            while len(self._caches) > self._max_tenants:
                self._caches.popitem(last=False)
        return proto.deep_copy()


def fill_allowed(matcher: Any, out_words: Any) -> None:
    """Writes ``matcher``'s allowed-token bitmask into ``out_words`` (a contiguous int32 CPU
    tensor of ceil(vocab / 32) words: bit i of word w allows token 32 * w + i)."""
    matcher.unsafe_compute_mask_ptr(out_words.data_ptr(),
                                    out_words.numel() * out_words.element_size())
