"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, and
vLLM's ``/tokenize`` and ``/detokenize``.

Thin: authenticate (``CurrentTenant``), delegate to ``app.services.completions``. The body is not
parsed here: the service reads and parses it off the event loop once the tenant's limits admit
the call (DESIGN "Multi-tenant capacity"); the OpenAPI schema still documents it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from app.auth import CurrentTenant
from app.deps import CompletionsDep, Parts, TokenizersDep
from app.errors import APIError
from app.parts import ServerParts
from app.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

router = APIRouter(prefix="/v1", tags=["openai"])
tokenizer_router = APIRouter(tags=["vllm"])


def _body_schema(model: type[BaseModel]) -> dict:
    """The OpenAPI request body of ``model`` with its ``$defs`` inlined (self-contained)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: object) -> object:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": inline(schema)}}}}


@router.post("/chat/completions", response_model=None,
             openapi_extra=_body_schema(ChatCompletionRequest))
async def chat_completions(request: Request, auth: CurrentTenant,
                           service: CompletionsDep) -> JSONResponse | StreamingResponse:
    """OpenAI chat completions (``stream`` for SSE); body: ``ChatCompletionRequest``."""
    return await service.create_chat_completion(request.body, auth, request.is_disconnected)


@router.post("/completions", response_model=None, openapi_extra=_body_schema(CompletionRequest))
async def completions(request: Request, auth: CurrentTenant,
                      service: CompletionsDep) -> JSONResponse | StreamingResponse:
    """OpenAI (legacy) completions; ``prompt`` is text or a list of token ids; body:
    ``CompletionRequest``."""
    return await service.create_completion(request.body, auth, request.is_disconnected)


def _model_card(parts: ServerParts) -> ModelCard:
    info = parts.engine.model_info()
    return ModelCard(id=info.served_model_name, created=parts.started_at,
                     max_model_len=info.max_model_len)


@router.get("/models")
async def list_models(auth: CurrentTenant, parts: Parts) -> ModelList:
    return ModelList(data=[_model_card(parts)])


@router.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, auth: CurrentTenant, parts: Parts) -> ModelCard:
    """OpenAI "retrieve model"; an unknown id is 404 ``model_not_found``, as in OpenAI."""
    card = _model_card(parts)
    if model_id != card.id:
        raise APIError(404, f"the model {model_id!r} does not exist", "model",
                       "model_not_found")
    return card


@tokenizer_router.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest))
async def tokenize(request: Request, auth: CurrentTenant,
                   tokenizers: TokenizersDep) -> TokenizeResponse:
    """vLLM ``/tokenize``: a ``prompt``, or chat ``messages`` through the chat template."""
    return await tokenizers.tokenize(await request.body(), auth.tenant_id)


@tokenizer_router.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
async def detokenize(request: Request, auth: CurrentTenant,
                     tokenizers: TokenizersDep) -> DetokenizeResponse:
    """vLLM ``/detokenize``: token ids to text."""
    return await tokenizers.detokenize(await request.body(), auth.tenant_id)
