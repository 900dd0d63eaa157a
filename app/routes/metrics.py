"""``GET /metrics``: Prometheus exposition, behind the scrape token (``app.auth.MetricsScraper``)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from app.auth import MetricsScraper
from app.deps import EngineDep, MetricsDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics")
async def metrics(request: Request, _: MetricsScraper, engine: EngineDep,
                  server_metrics: MetricsDep) -> Response:
    """Engine counters read on the engine thread now, plus request-level metrics.

    Text format 0.0.4, or OpenMetrics when the scraper's Accept header asks for it. A dead engine
    gives 503 (``EngineDeadError``), so the scrape fails visibly.
    """
    snapshot = await engine.stats()
    body, content_type = server_metrics.render(snapshot, request.headers.get("accept", ""))
    return Response(body, media_type=content_type)
