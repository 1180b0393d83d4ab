"""``predictor act serve``: Alertmanager's webhook receiver. Each firing alert named in
``alerts`` with a node label becomes a Prediction for the Responder; resolved alerts do
nothing (a drained node returns to service when a person resumes it, after a look).

POST /v1/alertmanager  (Bearer token of the operator role; Alertmanager's
http_config.authorization.credentials_file), GET /healthz."""
from __future__ import annotations

import asyncio
import json
import logging
import socket

from aiohttp import web

from predictor.ingest.auth import Tokens

from .record import Prediction, RecordError
from .responder import NODE_NAME, Responder

log = logging.getLogger("predictor.actions")
MAX_BODY = 1 << 20
NODE_LABELS = ("node", "Hostname")   # the predictor's alerts; dcgm-exporter's rules


def _error(cls: type[web.HTTPException], reason: str) -> web.HTTPException:
    return cls(text=json.dumps({"error": reason}), content_type="application/json")


def predictions(payload: object, alerts: frozenset[str]) -> list[Prediction]:
    """The firing alerts of a webhook payload (version 4) that ask for a drain; ValueError
    naming the problem when the payload is not one."""
    if not isinstance(payload, dict) or not isinstance(payload.get("alerts"), list):
        raise ValueError("not an Alertmanager webhook payload: no 'alerts' list")
    out = []
    for n, alert in enumerate(payload["alerts"]):
        labels = alert.get("labels") if isinstance(alert, dict) else None
        if not isinstance(labels, dict):
            raise ValueError(f"alerts[{n}] has no labels object")
        if alert.get("status") != "firing" or labels.get("alertname") not in alerts:
            continue
        node = next((labels[k] for k in NODE_LABELS if isinstance(labels.get(k), str) and labels[k]), None)
        if node is None:
            raise ValueError(f"alerts[{n}] ({labels.get('alertname')}) has no {' or '.join(NODE_LABELS)} label")
        if not NODE_NAME.fullmatch(node):
            raise ValueError(f"alerts[{n}]: node {node!r} is not one node's name (letters, digits, . _ -)")
        annotations = alert.get("annotations") if isinstance(alert.get("annotations"), dict) else {}
        out.append(Prediction(node, f"alertmanager:{labels['alertname']}",
                              {**{k: v for k, v in labels.items() if isinstance(v, str)},
                               **{k: v for k, v in annotations.items() if k in ("risk", "reason", "summary")},
                               "startsAt": alert.get("startsAt"), "fingerprint": alert.get("fingerprint")}))
    return out


def make_app(responder: Responder, tokens: Tokens | None, alerts: frozenset[str]) -> web.Application:
    async def webhook(request: web.Request) -> web.Response:
        if tokens is not None and tokens.role_of(request.headers.get("Authorization")) != "operator":
            raise _error(web.HTTPUnauthorized, "an operator token is required")
        body = await request.content.read(MAX_BODY + 1)
        if len(body) > MAX_BODY:
            raise _error(web.HTTPRequestEntityTooLarge, f"body over {MAX_BODY} bytes")
        try:
            wanted = predictions(json.loads(body), alerts)
            entries = [await asyncio.to_thread(responder.handle, p) for p in wanted]
        except ValueError as e:   # bad JSON, a payload of another shape, a node that is not one name
            log.warning("webhook refused: %s", e)
            raise _error(web.HTTPBadRequest, str(e)) from None
        except RecordError as e:  # the action log cannot be written: nothing applied (Alertmanager retries)
            raise _error(web.HTTPInternalServerError, str(e)) from None
        return web.json_response({"actions": entries})

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "dry_run": responder.dry_run})

    app = web.Application(client_max_size=MAX_BODY + 1)
    app.router.add_post("/v1/alertmanager", webhook)
    app.router.add_get("/healthz", health)
    return app


def run(responder: Responder, tokens: Tokens | None, alerts: frozenset[str], host: str, port: int) -> None:
    """Serve until interrupted."""
    try:
        sock = socket.create_server((host, port))
    except OSError as e:
        raise RuntimeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    web.run_app(make_app(responder, tokens, alerts), sock=sock, access_log=None,
                print=lambda _msg: log.warning("listening on http://%s:%d (%s, auth %s)", host, port,
                                               "DRY RUN" if responder.dry_run else "APPLYING",
                                               "on" if tokens else "OFF"))
