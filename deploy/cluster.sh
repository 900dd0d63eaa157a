#!/usr/bin/env bash
# Two saltserve replicas and HAProxy on loopback, against this machine's PostgreSQL and Redis:
# for trying the multi-replica deployment (docs/deployment.md) and for its tests. Ctrl-C stops
# all three. Everything can be overridden from the environment:
#
#   SALTSERVE_DATABASE_URL  postgresql://postgres@127.0.0.1:5432/saltserve (created if missing)
#   SALTSERVE_REDIS_URL     redis://127.0.0.1:6379/0
#   SALTSERVE_DATA_DIR      .saltserve-cluster (shared by the replicas on this machine: model,
#                           master key, JWT signing key; each keeps its own usage journal)
#   SALTSERVE_LB_BIND       127.0.0.1:8080 (clients connect here)
#   R1_PORT, R2_PORT        8001, 8002
#   SERVE_ARGS              extra `saltserve serve` flags for both replicas
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
export SALTSERVE_DATABASE_URL=${SALTSERVE_DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/saltserve}
export SALTSERVE_REDIS_URL=${SALTSERVE_REDIS_URL:-redis://127.0.0.1:6379/0}
export SALTSERVE_DATA_DIR=${SALTSERVE_DATA_DIR:-.saltserve-cluster}
export SALTSERVE_LB_BIND=${SALTSERVE_LB_BIND:-127.0.0.1:8080}
R1_PORT=${R1_PORT:-8001}
R2_PORT=${R2_PORT:-8002}
export SALTSERVE_REPLICA_1=127.0.0.1:$R1_PORT SALTSERVE_REPLICA_2=127.0.0.1:$R2_PORT

"$BIN/python" - <<'PY'
# Creates the cluster's database if it does not exist yet (one line on failure, no traceback).
import os, sys
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from tenants.db import normalize_database_url
url = normalize_database_url(os.environ["SALTSERVE_DATABASE_URL"])
if url.get_backend_name() == "postgresql":
    try:
        admin = create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            if conn.scalar(text("SELECT 1 FROM pg_database WHERE datname = :d"),
                           {"d": url.database}) is None:
                conn.execute(text(f'CREATE DATABASE "{url.database}"'))
    except Exception as e:
        sys.exit(f"cluster: cannot reach PostgreSQL at {url.render_as_string()}: "
                 f"{type(e).__name__}")
PY

pids=()
stop() { kill -TERM "${pids[@]}" 2>/dev/null || true; wait "${pids[@]}" 2>/dev/null || true; }
trap stop EXIT INT TERM

wait_healthy() {
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
    kill -0 "${pids[-1]}" 2>/dev/null || { echo "cluster: replica on :$1 exited" >&2; exit 1; }
    sleep 0.5
  done
  echo "cluster: replica on :$1 is not healthy" >&2; exit 1
}

# One after the other: the first start converts the model, migrates and creates the demo key.
for i in 1 2; do
  port_var=R${i}_PORT
  "$BIN/saltserve" serve --port "${!port_var}" --replica-id "r$i" --drain-seconds 5 \
      ${SERVE_ARGS:-} &
  pids+=($!)
  wait_healthy "${!port_var}"
done
haproxy -db -f deploy/haproxy/haproxy.cfg &
pids+=($!)
for _ in $(seq 1 50); do
  curl -sf "http://$SALTSERVE_LB_BIND/health" >/dev/null && break
  sleep 0.2
done
echo "cluster: HAProxy on http://$SALTSERVE_LB_BIND -> r1 :$R1_PORT, r2 :$R2_PORT" \
     "(demo key in $SALTSERVE_DATA_DIR/demo-api-key); Ctrl-C stops it"
wait -n "${pids[@]}"
