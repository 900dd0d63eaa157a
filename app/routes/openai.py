"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Thin: parse, authenticate (``CurrentTenant``), delegate to ``app.services.completions``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.auth import CurrentTenant
from app.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from app.services.completions import CompletionsService

router = APIRouter(prefix="/v1", tags=["openai"])


def _service(request: Request) -> CompletionsService:
    return request.app.state.completions


@router.post("/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           auth: CurrentTenant) -> JSONResponse | StreamingResponse:
    """OpenAI chat completions (``stream`` for SSE)."""
    return await _service(request).create_chat_completion(body, auth, request.is_disconnected)


@router.post("/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request,
                      auth: CurrentTenant) -> JSONResponse | StreamingResponse:
    """OpenAI (legacy) completions; ``prompt`` is text or a list of token ids."""
    return await _service(request).create_completion(body, auth, request.is_disconnected)


@router.get("/models")
async def list_models(request: Request, auth: CurrentTenant) -> ModelList:
    info = _service(request).info
    return ModelList(data=[ModelCard(id=info.served_model_name, created=request.app.state.started_at,
                                     max_model_len=info.max_model_len)])
