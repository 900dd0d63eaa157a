"""Server settings: environment (``SALTSERVE_*``) and CLI flags -> ``Settings`` -> ``EngineConfig``."""

from __future__ import annotations

import re
import shutil
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Literal, get_type_hints

from pydantic import ByteSize, Field, create_model
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.config import EngineConfig
from tenants.tokens import JWTConfig


def engine_setting_fields() -> dict[str, Any]:
    """``{name: (type, Field)}`` for every ``EngineConfig`` field but ``model``.

    Type, default and description (the field's ``metadata["help"]``) come from ``EngineConfig``;
    ``Settings.model`` is declared separately because its default (the bundled model) is
    resolved by ``app.bootstrap``.
    """
    hints = get_type_hints(EngineConfig)  # resolves the string annotations of ``__future__``
    out: dict[str, Any] = {}
    for f in fields(EngineConfig):
        if f.name == "model" or f.metadata.get("flag") is False:
            continue
        if f.default is MISSING:
            raise TypeError(f"EngineConfig.{f.name} needs a default to be a setting")
        typ = hints[f.name]
        if f.metadata.get("bytes"):  # 8GiB, 500MB or a plain number of bytes
            typ = ByteSize | None if f.default is None else ByteSize
        out[f.name] = (typ, Field(f.default, description=f.metadata["help"]))
    return out


DEFAULT_DISK_TIER_BYTES = 8 << 30


def default_disk_tier_bytes(directory: str | Path) -> int:
    """The served default of ``--kv-offload-size``: 8 GiB (llama.cpp's server keeps 8 GiB of
    prompt cache in RAM by default; disk is cheaper), or half the disk space free where the
    tier lives, whichever is less (docs/prefix-caching.md)."""
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return 0
    return min(DEFAULT_DISK_TIER_BYTES, free // 2)


# Engine settings (vLLM flag names), generated so that EngineConfig stays their one source.
_EngineSettings = create_model("_EngineSettings", __base__=BaseSettings,
                               **engine_setting_fields())


# BaseSettings is listed again (no MRO change) so linters see a pydantic model.
class Settings(_EngineSettings, BaseSettings):  # type: ignore[misc,valid-type]
    """Everything the server reads at start-up. Env vars are ``SALTSERVE_<FIELD>`` (upper case).

    All state lives in ``data_dir``: the converted model, the SQLite database, the master key and
    the demo API key file. The engine settings (``block_size``, ``max_model_len``, ...) are every
    ``EngineConfig`` field but ``model``, with ``EngineConfig``'s types, defaults and help.
    """

    model_config = SettingsConfigDict(env_prefix="SALTSERVE_", extra="ignore")

    data_dir: Path = Path(".saltserve")
    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = Field(None, description="HF folder; default: the bundled SmolLM2")
    database_url: str | None = Field(None, description="default: sqlite in data_dir")
    redis_url: str | None = Field(None, description="replicas share cache evictions and rate "
                                  "limits through this Redis (redis://host:6379/0); unset: one "
                                  "replica, in-memory limits")
    redis_namespace: str = Field("saltserve", description="prefix of this deployment's Redis "
                                 "keys and channels")
    master_key: str | None = Field(None, repr=False, description="salt encryption key")
    create_demo_tenant: bool = True
    # Logging (app.logs): text or JSON lines on stderr; the level governs uvicorn too.
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    drain_seconds: float = Field(0.0, ge=0, description="on SIGTERM, answer /health 503 this "
                                 "long before closing the listener (a load balancer's health "
                                 "checks move new requests away first)")
    replica_id: str | None = Field(None, description="this replica's name in every log line "
                                   "[<hostname>:<port>]")
    max_request_body_bytes: int = 4 << 20
    metrics_token: str | None = Field(None, repr=False,
                                      description="bearer token for GET /metrics; unset = 403")

    # The operator console (/console): server-side sessions opened with an admin JWT.
    console_session_idle_s: float = Field(900.0, gt=0, description="console logout after this "
                                          "many idle seconds")
    console_session_max_s: float = Field(3600.0, gt=0, description="console sessions end this "
                                         "many seconds after login (or at the JWT's exp)")
    console_secure_cookie: bool = Field(False, description="always mark the console cookie "
                                        "Secure (behind a TLS-terminating proxy)")

    # JWT bearer tokens (tenants.tokens): platform-issued (key in data_dir) + optional external IdP.
    jwt_algorithms: list[str] = ["EdDSA", "RS256"]
    jwt_issuer: str = "saltserve"
    jwt_audience: str = "saltserve"
    jwt_leeway_s: float = 0.0
    jwt_public_key_file: Path | None = None
    jwt_jwks_url: str | None = None
    jwt_tenant_claim: str = "tenant"
    jwt_role_claim: str = "role"
    jwt_jwks_refetch_cooldown_s: float = 30.0
    jwt_max_token_ttl_s: int = 30 * 86400

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'saltserve.db').resolve()}"

    def jwt_config(self) -> JWTConfig:
        """Raises ValueError (from JWTConfig) naming the bad ``SALTSERVE_JWT_*`` setting."""
        return JWTConfig(
            algorithms=tuple(self.jwt_algorithms), issuer=self.jwt_issuer,
            audience=self.jwt_audience, leeway_s=self.jwt_leeway_s,
            tenant_claim=self.jwt_tenant_claim, role_claim=self.jwt_role_claim,
            public_key_file=self.jwt_public_key_file, jwks_url=self.jwt_jwks_url,
            jwks_refetch_cooldown_s=self.jwt_jwks_refetch_cooldown_s,
            max_token_ttl_s=self.jwt_max_token_ttl_s)

    def replica_folder(self, name: str) -> Path:
        """``<data dir>/<name>``, or ``<name>-<replica id>`` with ``--replica-id``: replicas
        sharing a data dir each keep their own (usage journal, disk tier)."""
        if self.replica_id is None:
            return Path(self.data_dir) / name
        return Path(self.data_dir) / (name + "-" + re.sub(r"[^A-Za-z0-9_.-]", "_",
                                                          self.replica_id)[:64])

    def engine_config(self, model_dir: Path, kv_owner_key: bytes | None = None) -> EngineConfig:
        """The engine's settings; ``kv_owner_key`` keys the offload tiers' owner tags
        (``SaltCipher.kv_owner_key``: every replica of a deployment derives the same).

        Raises:
            ValueError: from EngineConfig, naming the bad flag.
        """
        # Every EngineConfig field but ``model`` and those filled here ("flag": False) is a
        # same-named setting (engine_setting_fields).
        values = {f.name: getattr(self, f.name) for f in fields(EngineConfig)
                  if f.name != "model" and f.metadata.get("flag") is not False}
        values = {k: int(v) if isinstance(v, ByteSize) else v for k, v in values.items()}
        values["kv_offload_dir"] = values["kv_offload_dir"] or str(self.replica_folder(
            "kv-offload"))
        if values["kv_offload_size"] is None:
            values["kv_offload_size"] = default_disk_tier_bytes(values["kv_offload_dir"])
        values["kv_offload_redis_url"] = values["kv_offload_redis_url"] or self.redis_url
        values["kv_offload_redis_namespace"] = self.redis_namespace
        values["kv_offload_owner_key"] = kv_owner_key
        return EngineConfig(model=str(model_dir), **values)
