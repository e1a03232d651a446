#!/usr/bin/env bash
# The MLflow tracking server of docker/compose.yaml with MLflow's basic-auth app.
#
# Writes the auth app's configuration (users in the MLflow database, no permission by default) to a file
# only this user can read, starts `mlflow server --app-name basic-auth ARGS...`, then brings the service
# accounts in line with the environment (identities.py) and marks the server ready for its health check.
# Needs MLFLOW_BACKEND_STORE_URI, MLFLOW_AUTH_ADMIN_PASSWORD, MLFLOW_WORKER_PASSWORD, MLFLOW_VIEWER_PASSWORD.
set -euo pipefail

ready=$HOME/.mlflow-identities-ready  # The health check's sign that the accounts are in place.
rm -f "$ready"
umask 077
config=$HOME/.mlflow-basic-auth.ini
# configparser reads `%` as interpolation: a literal one is written `%%`.
cat > "$config" <<INI
[mlflow]
default_permission = NO_PERMISSIONS
database_uri = ${MLFLOW_BACKEND_STORE_URI//%/%%}
admin_username = ${MLFLOW_AUTH_ADMIN_USERNAME:-admin}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
# A password check (scrypt) costs ~0.1 s of CPU: each server process remembers a good one for 60 s, so a
# changed or deleted password may still pass for that long on the processes that did not make the change.
auth_cache_ttl_seconds = 60
INI
export MLFLOW_AUTH_CONFIG_PATH=$config
# The front door's names are hosts this server answers (DNS-rebinding protection) and origins its UI is
# used from (MLflow refuses other origins' state-changing requests).
names=${CIFAR_PUBLIC_HOST:-127.0.0.1}${CIFAR_PROXY_NAMES:+,$CIFAR_PROXY_NAMES}
export MLFLOW_SERVER_ALLOWED_HOSTS=${MLFLOW_SERVER_ALLOWED_HOSTS:-mlflow,mlflow:*,localhost,localhost:*,127.0.0.1,127.0.0.1:*}
origins=()
for name in ${names//,/ }; do
    MLFLOW_SERVER_ALLOWED_HOSTS+=",$name,$name:*"
    origins+=("https://$name:${MLFLOW_HOST_PORT:-5000}")
done
MLFLOW_SERVER_CORS_ALLOWED_ORIGINS=$(IFS=,; echo "${origins[*]}")
export MLFLOW_SERVER_CORS_ALLOWED_ORIGINS

mlflow server --app-name basic-auth "$@" &
server=$!
trap 'kill -TERM "$server" 2>/dev/null || true' TERM INT
if cifar-mlflow-identities; then
    touch "$ready"
else
    echo "mlflow: the service accounts could not be set up; stopping" >&2
    kill -TERM "$server" 2>/dev/null || true
fi
status=0
wait "$server" || status=$?
# A signal interrupts `wait`: wait again until the server has exited.
while kill -0 "$server" 2>/dev/null; do
    wait "$server" || status=$?
done
exit "$status"
