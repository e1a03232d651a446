#!/usr/bin/env bash
# Creates the Prefect and MLflow databases on one PostgreSQL server (idempotent).
#
# The postgres image runs this once, on an empty volume, from /docker-entrypoint-initdb.d (where it
# connects over the local socket as POSTGRES_USER). It also runs against any server given
# PGHOST/PGPORT/PGPASSWORD.
set -euo pipefail

: "${POSTGRES_USER:?}" "${CIFAR_PREFECT_DB:?}" "${CIFAR_MLFLOW_DB:?}"

for database in "$CIFAR_PREFECT_DB" "$CIFAR_MLFLOW_DB"; do
    psql -v ON_ERROR_STOP=1 --no-psqlrc --quiet --username "$POSTGRES_USER" --dbname postgres \
        --set name="$database" <<'SQL'
SELECT format('CREATE DATABASE %I', :'name')
WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = :'name')\gexec
SQL
done
