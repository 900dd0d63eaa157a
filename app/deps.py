"""Typed FastAPI dependencies: each part of the server named once, with its type.

Routes declare what they use (``admin: AdminServiceDep``) instead of reading
``request.app.state``; ``get_parts`` is the one place that reads the app's state. Auth
dependencies (``CurrentTenant``, ``AdminPrincipal``, ``MetricsScraper``) live in ``app.auth``.
Tests replace a part with ``app.dependency_overrides`` or by setting a field of the app's
``ServerParts``.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.admin_refusals import AdminRefusals
from app.console.sessions import ConsoleSessions
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


def get_console_sessions(parts: Parts) -> ConsoleSessions:
    return parts.console_sessions


def get_admin_refusals(parts: Parts) -> AdminRefusals:
    return parts.admin_refusals


EngineDep = Annotated[EngineClient, Depends(get_engine)]
RepoDep = Annotated[TenantRepository, Depends(get_repo)]
CompletionsDep = Annotated[CompletionsService, Depends(get_completions)]
TokenizersDep = Annotated[TokenizerService, Depends(get_tokenizers)]
AdminServiceDep = Annotated[AdminService, Depends(get_admin_service)]
MetricsDep = Annotated[ServerMetrics, Depends(get_metrics)]
ConsoleSessionsDep = Annotated[ConsoleSessions, Depends(get_console_sessions)]
AdminRefusalsDep = Annotated[AdminRefusals, Depends(get_admin_refusals)]
