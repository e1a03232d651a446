#!/usr/bin/env python
"""The MLflow server's identities, brought in line with docker/.env at every start of the `mlflow` service.

The admin is MLflow's own (made on the first start from MLFLOW_AUTH_ADMIN_PASSWORD); this adds the workers'
service account and a read-only viewer, each holding a role over every experiment and registered model,
and resets their passwords to the configured ones (so rotating one is: edit docker/.env, restart).
Only the auth REST API, as the admin; stdlib only (the server image has no project code); scripts/ui_check/
runs it too. Prints names only.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

SERVER = f"http://127.0.0.1:{os.environ.get('MLFLOW_PORT', '5000')}"  # This container's server.
WORKSPACE = "default"  # MLflow's workspace when workspaces are off: where roles live.
# Role -> permission on every ("*") experiment and registered model. EDIT is what the workers need: log runs
# and artifacts, create model versions and move the `champion` alias (MLflow checks "can update" on the
# registered model for SetRegisteredModelAlias); what they create themselves they also MANAGE. No deletes.
ROLES = {
    "cifar-worker": {"experiment": "EDIT", "registered_model": "EDIT"},
    "cifar-viewer": {"experiment": "READ", "registered_model": "READ"},
}
# (user name variable, its default, password variable, role)
ACCOUNTS = (
    ("MLFLOW_WORKER_USERNAME", "cifar-worker", "MLFLOW_WORKER_PASSWORD", "cifar-worker"),
    ("MLFLOW_VIEWER_USERNAME", "viewer", "MLFLOW_VIEWER_PASSWORD", "cifar-viewer"),
)


class Admin:
    def __init__(self, username: str, password: str):
        token = base64.b64encode(f"{username}:{password}".encode()).decode()
        self.headers = {"Authorization": f"Basic {token}", "Content-Type": "application/json"}

    def call(self, method: str, path: str, body: dict | None = None, **query: str) -> dict | None:
        """The JSON answer of one auth API call; None for RESOURCE_DOES_NOT_EXIST."""
        url = f"{SERVER}/api/{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise RuntimeError(f"{method} {path}: HTTP {error.code} {error.read()[:200]!r}") from None


def wait_for_server(timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{SERVER}/health", timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"MLflow did not answer at {SERVER} in {timeout:.0f} s") from None
            time.sleep(2)


def ensure_role(admin: Admin, name: str, permissions: dict[str, str]) -> int:
    roles = admin.call("GET", "3.0/mlflow/roles/list", workspace=WORKSPACE)["roles"]
    role = next((role for role in roles if role["name"] == name), None)
    if role is None:
        body = {"name": name, "workspace": WORKSPACE, "description": f"{name}: docker/mlflow/identities.py"}
        role = admin.call("POST", "3.0/mlflow/roles/create", body)["role"]
    held = admin.call("GET", "3.0/mlflow/roles/permissions/list", role_id=str(role["id"]))["role_permissions"]
    by_type = {grant["resource_type"]: grant for grant in held if grant["resource_pattern"] == "*"}
    for resource_type, permission in permissions.items():
        grant = by_type.get(resource_type)
        if grant is None:
            body = {"role_id": role["id"], "resource_type": resource_type, "resource_pattern": "*",
                    "permission": permission}  # fmt: skip
            admin.call("POST", "3.0/mlflow/roles/permissions/add", body)
        elif grant["permission"] != permission:
            body = {"role_permission_id": grant["id"], "permission": permission}
            admin.call("PATCH", "3.0/mlflow/roles/permissions/update", body)
    return role["id"]


def ensure_account(admin: Admin, username: str, password: str, role_id: int) -> str:
    if admin.call("GET", "2.0/mlflow/users/get", username=username) is None:
        admin.call("POST", "2.0/mlflow/users/create", {"username": username, "password": password})
        done = "created"
    else:
        admin.call("PATCH", "2.0/mlflow/users/update-password", {"username": username, "password": password})
        done = "password set"
    roles = admin.call("GET", "3.0/mlflow/users/roles/list", username=username)["roles"]
    if not any(role["id"] == role_id for role in roles):
        admin.call("POST", "3.0/mlflow/roles/assign", {"username": username, "role_id": role_id})
    return done


def main() -> int:
    wait_for_server()
    admin = Admin(os.environ.get("MLFLOW_AUTH_ADMIN_USERNAME", "admin"), os.environ["MLFLOW_AUTH_ADMIN_PASSWORD"])
    role_ids = {name: ensure_role(admin, name, permissions) for name, permissions in ROLES.items()}
    for username_variable, default, password_variable, role in ACCOUNTS:
        username = os.environ.get(username_variable) or default
        done = ensure_account(admin, username, os.environ[password_variable], role_ids[role])
        print(f"mlflow identities: {username} ({role}): {done}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
