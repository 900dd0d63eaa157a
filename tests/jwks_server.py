"""A local JWKS endpoint for JWT tests (an identity provider's key set over HTTP)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jwt
import pytest


def jwks_body(keys: dict) -> bytes:
    """The JSON key set publishing the public half of each RSA private key, under its kid."""
    jwks = [{**jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key(), as_dict=True),
             "kid": kid, "use": "sig", "alg": "RS256"} for kid, key in keys.items()]
    return json.dumps({"keys": jwks}).encode()


def serve_jwks(request: pytest.FixtureRequest, respond: Callable[[], tuple[int, bytes]]
               ) -> tuple[str, list[str]]:
    """Serves ``respond() -> (status, body)`` on every GET until the test ends.

    Returns:
        (the endpoint's URL, the list of paths fetched so far, appended to live).
    """
    fetches: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            fetches.append(self.path)
            status, body = respond()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    request.addfinalizer(server.shutdown)
    return f"http://127.0.0.1:{server.server_address[1]}/jwks.json", fetches
