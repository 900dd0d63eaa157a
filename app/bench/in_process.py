"""``saltserve bench ... --in-process``: our engine in the bench's own process, no server.

The same ``LLMEngine`` that ``saltserve serve`` runs, behind the same ``AsyncLLM`` engine thread,
driven through the ``EngineClient`` interface (``engine/protocol.py``) with no HTTP, database or
API keys in between. Its endpoints stand in for ``validate.Endpoint`` (``complete``, ``tokenize``,
``cache_config``), and its probe for ``profiles.MetricsProbe`` (the engine's own counters,
``EngineClient.stats``), so every runner works unchanged. Use it to measure the engine alone; the
server adds HTTP, auth and streaming on top, which is what ``--url`` measures.

Tenants are engine-level: each endpoint has a tenant id and a random ``cache_salt`` of its own
(what the server derives from a tenant's secret salt), so two endpoints never share a block; the
"caching off" endpoint sends ``enable_prefix_caching=False`` as a tenant with caching off does.
A prompt is tokenised as ``/v1/completions`` does (``add_special_tokens=True``).
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
import uuid
from collections.abc import Coroutine
from typing import Any, Self

from app.bench import IN_PROCESS_URL
from app.bench.profiles import MetricsProbe
from app.bench.validate import Sample
from engine.errors import EngineDeadError


class InProcessEngine:
    """An ``AsyncLLM`` over an ``LLMEngine`` built from ``config`` (an ``EngineConfig``), with an
    asyncio loop on a thread of its own for the request streams. ``close()`` stops both.

    Raises:
        ValueError: a bad engine setting (from ``EngineConfig`` / ``LLMEngine``).
    """

    url = IN_PROCESS_URL

    def __init__(self, config: Any) -> None:
        from engine.async_engine import AsyncLLM  # torch: only when the bench asks for it

        self.client = AsyncLLM.from_config(config)  # built and stepped on the engine thread
        self.info = self.client.model_info()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="bench-streams",
                                        daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Runs ``coro`` on the streams' loop; its result (blocks the calling thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def endpoint(self, tenant: str, prefix_caching: bool = True) -> InProcessEndpoint:
        """A client of tenant ``tenant`` (a fresh random cache_salt) with caching on or off."""
        return InProcessEndpoint(self, tenant, prefix_caching)

    def probe(self) -> EngineProbe:
        """The engine's prefix-cache counters and KV usage, read as ``MetricsProbe`` reads
        ``/metrics``."""
        return EngineProbe(self)

    def cache_config(self) -> dict[str, str]:
        """The labels of ``saltserve:cache_config_info`` (what ``Endpoint.cache_config`` reads
        from a server)."""
        i = self.info
        return {"model_name": i.served_model_name, "block_size": str(i.block_size),
                "num_gpu_blocks": str(i.num_blocks), "device": i.device,
                "enable_prefix_caching": str(i.enable_prefix_caching),
                "cache_dtype": i.cache_dtype}

    def close(self) -> None:
        """Stops the engine and the streams' loop (idempotent)."""
        self.client.shutdown()
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self.loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InProcessEndpoint:
    """``validate.Endpoint``'s interface over an ``InProcessEngine``: one engine-level tenant."""

    def __init__(self, engine: InProcessEngine, tenant: str, prefix_caching: bool) -> None:
        self.engine = engine
        self.url = engine.url
        self.model = engine.info.served_model_name
        self.metrics_token = None
        self.tenant = tenant
        self.prefix_caching = prefix_caching
        self._salt = secrets.token_bytes(32)

    def tokenize(self, text: str) -> list[int]:
        return list(self.engine.info.tokenizer.encode(text, add_special_tokens=True))

    def complete(self, prompt: str, max_tokens: int, ignore_eos: bool = False) -> Sample:
        """One greedy completion: TTFT (to the first output with a token) and total time in
        seconds, measured from submission, and its token counts.

        Raises:
            RuntimeError: the engine refused the request (invalid, or not running) or it
                finished with an error.
        """
        from engine.request import EngineRequest
        from engine.sampling_params import SamplingParams

        request = EngineRequest(
            request_id=f"bench-{uuid.uuid4().hex}", prompt_token_ids=tuple(self.tokenize(prompt)),
            sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                           ignore_eos=ignore_eos),
            tenant_id=self.tenant, cache_salt=self._salt,
            enable_prefix_caching=self.prefix_caching)
        return self.engine.run(self._consume(request))

    async def _consume(self, request: Any) -> Sample:
        start = time.perf_counter()
        first = None
        last = None
        try:
            async for out in self.engine.client.generate(request):
                if first is None and out.new_token_ids:
                    first = time.perf_counter() - start
                last = out
        except Exception as e:  # EngineDeadError, InvalidRequestError: the runners' error type
            raise RuntimeError(f"the engine refused a request: {e}") from e
        total = time.perf_counter() - start
        if last is None or last.finish_reason == "error":
            raise RuntimeError("a request failed in the engine: "
                               f"{last.error if last else 'no output'}")
        return Sample(first if first is not None else total, total, last.num_prompt_tokens,
                      last.num_cached_tokens, last.num_output_tokens)

    def cache_config(self) -> dict[str, str]:
        return self.engine.cache_config()


class EngineProbe(MetricsProbe):
    """``MetricsProbe`` over the engine's ``stats()`` instead of a server's ``/metrics``."""

    def __init__(self, engine: InProcessEngine) -> None:
        super().__init__(engine.url, None)
        self.engine = engine

    def read(self) -> dict[str, float] | None:
        """The counters, or None once the engine has stopped (as an unreachable server)."""
        try:
            s = self.engine.run(self.engine.client.stats())
        except EngineDeadError:
            return None
        return {"queries": float(s.prefix_cache_queries), "hits": float(s.prefix_cache_hits),
                "evictions": float(sum(s.evictions.values())), "kv_usage": s.kv_cache_usage}
