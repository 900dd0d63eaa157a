"""Typed FastAPI dependencies: each part of the server named once, with its type.

Routes declare what they use (``admin: AdminServiceDep``) instead of reading
``request.app.state``; ``get_parts`` is the one place that reads the app's state, and code that
holds only the request (the auth dependencies in ``app.auth``, the console's helpers) calls it
too. Tests replace a part by setting a field of the app's ``ServerParts`` (every caller sees
the change); ``app.dependency_overrides[get_parts]`` would reach only the routes.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.metrics import ServerMetrics
from app.parts import ServerParts
from app.services.admin import AdminService
from app.services.completions import CompletionsService
from app.services.prompts import TokenizerService
from engine.protocol import EngineClient
from tenants.repository import TenantRepository


def get_parts(request: Request) -> ServerParts:
    """The parts the app was built from (``app.server.create_app``)."""
    return request.app.state.parts


Parts = Annotated[ServerParts, Depends(get_parts)]


def get_engine(parts: Parts) -> EngineClient:
    return parts.engine


def get_repo(parts: Parts) -> TenantRepository:
    return parts.repo


def get_completions(parts: Parts) -> CompletionsService:
    return parts.completions


def get_tokenizers(parts: Parts) -> TokenizerService:
    return parts.tokenizers


def get_admin_service(parts: Parts) -> AdminService:
    return parts.admin


def get_metrics(parts: Parts) -> ServerMetrics:
    return parts.metrics


EngineDep = Annotated[EngineClient, Depends(get_engine)]
RepoDep = Annotated[TenantRepository, Depends(get_repo)]
CompletionsDep = Annotated[CompletionsService, Depends(get_completions)]
TokenizersDep = Annotated[TokenizerService, Depends(get_tokenizers)]
AdminServiceDep = Annotated[AdminService, Depends(get_admin_service)]
MetricsDep = Annotated[ServerMetrics, Depends(get_metrics)]
