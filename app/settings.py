"""Server settings: environment (``SALTSERVE_*``) and CLI flags -> ``Settings`` -> ``EngineConfig``."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.config import EngineConfig
from tenants.tokens import JWTConfig


class Settings(BaseSettings):
    """Everything the server reads at start-up. Env vars are ``SALTSERVE_<FIELD>`` (upper case).

    All state lives in ``data_dir``: the converted model, the SQLite database, the master key and
    the demo API key file.
    """

    model_config = SettingsConfigDict(env_prefix="SALTSERVE_", extra="ignore")

    data_dir: Path = Path(".saltserve")
    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = Field(None, description="HF folder; default: the bundled SmolLM2")
    served_model_name: str | None = None
    database_url: str | None = Field(None, description="default: sqlite in data_dir")
    master_key: str | None = Field(None, repr=False, description="salt encryption key")
    create_demo_tenant: bool = True
    max_request_body_bytes: int = 4 << 20
    metrics_token: str | None = Field(None, repr=False,
                                      description="bearer token for GET /metrics; unset = 403")

    # JWT bearer tokens (tenants.tokens): platform-issued (key in data_dir) + optional external IdP.
    jwt_algorithms: list[str] = ["EdDSA", "RS256"]
    jwt_issuer: str = "saltserve"
    jwt_audience: str = "saltserve"
    jwt_leeway_s: float = 0.0
    jwt_public_key_file: Path | None = None
    jwt_jwks_url: str | None = None
    jwt_tenant_claim: str = "tenant"
    jwt_role_claim: str = "role"

    block_size: int = 16
    max_model_len: int | None = 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    seed: int = 0

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'saltserve.db').resolve()}"

    def jwt_config(self) -> JWTConfig:
        """Raises ValueError (from JWTConfig) naming the bad ``SALTSERVE_JWT_*`` setting."""
        return JWTConfig(
            algorithms=tuple(self.jwt_algorithms), issuer=self.jwt_issuer,
            audience=self.jwt_audience, leeway_s=self.jwt_leeway_s,
            tenant_claim=self.jwt_tenant_claim, role_claim=self.jwt_role_claim,
            public_key_file=self.jwt_public_key_file, jwks_url=self.jwt_jwks_url)

    def engine_config(self, model_dir: Path) -> EngineConfig:
        """Raises ValueError (from EngineConfig) with a message naming the bad flag."""
        # Every EngineConfig field but ``model`` has a same-named setting (vLLM flag names).
        return EngineConfig(model=str(model_dir), **{
            f.name: getattr(self, f.name) for f in fields(EngineConfig) if f.name != "model"})
