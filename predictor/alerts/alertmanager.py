"""Paging on the strict threshold: Alertmanager API v2 and a generic webhook.

Alertmanager wants firing alerts re-sent (each with an `endsAt` a few resend
periods ahead, so alerts from a dead predictor expire) and an explicit resolve.
The webhook gets transitions only: {"status": "firing"|"resolved", "alerts": [...]}.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import aiohttp

log = logging.getLogger(__name__)
ALERT_NAME = "GPUFailurePredicted"


@dataclass
class Alert:
    node: str
    gpu: int
    uuid: str | None
    risk: float
    reason: str
    starts_at: datetime

    def labels(self) -> dict:
        labels = {"alertname": ALERT_NAME, "node": self.node, "gpu": str(self.gpu), "severity": "page",
                  "service": "ckpt-guard-predictor"}
        if self.uuid:
            labels["uuid"] = self.uuid
        return labels

    def payload(self, ends_at: datetime) -> dict:
        return {"labels": self.labels(),
                "annotations": {"summary": f"GPU {self.gpu} on {self.node} is predicted to fail",
                                "risk": f"{self.risk:.3f}", "reason": self.reason},
                "startsAt": _iso(self.starts_at), "endsAt": _iso(ends_at)}


def _iso(dt: datetime) -> str:
    return dt.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class StrictAlerts:
    """The set of GPUs over the strict threshold, kept in step with Alertmanager and a webhook."""

    def __init__(self, alertmanager_url: str | None, webhook_url: str | None, resend_s: float = 60.0,
                 on_delivery=None):
        self.alertmanager_url = alertmanager_url.rstrip("/") + "/api/v2/alerts" if alertmanager_url else None
        self.webhook_url = webhook_url
        self.resend_s = resend_s
        self.firing: dict[tuple[str, int], Alert] = {}
        self.on_delivery = on_delivery or (lambda target, ok: None)
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.alertmanager_url or self.webhook_url)

    async def start(self) -> None:
        if self.enabled:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
            self._task = asyncio.create_task(self._resend_loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        if self._session:
            await self._session.close()

    async def observe(self, gpus: list[tuple[str, int, str | None, float, str, bool]]) -> None:
        """(node, gpu, uuid, risk, reason, over_strict) for GPUs just scored; send transitions."""
        now = datetime.now(timezone.utc)
        fired, resolved = [], []
        for node, gpu, uuid, risk, reason, over in gpus:
            key = (node, gpu)
            current = self.firing.get(key)
            if current and (not over or (uuid and current.uuid and uuid != current.uuid)):
                resolved.append(self.firing.pop(key))     # risk fell, or the GPU was replaced
                current = None
            if over and current is None:
                self.firing[key] = a = Alert(node, gpu, uuid, risk, reason, now)
                fired.append(a)
            elif over:
                current.risk, current.reason = risk, reason or current.reason
        if self.enabled and (fired or resolved):
            await self._deliver(fired, resolved, now)

    async def _deliver(self, fired: list[Alert], resolved: list[Alert], now: datetime) -> None:
        ahead = now + timedelta(seconds=4 * self.resend_s)
        if self.alertmanager_url:
            body = [a.payload(ahead) for a in fired] + [a.payload(now) for a in resolved]
            await self._post("alertmanager", self.alertmanager_url, body)
        if self.webhook_url:
            for status, alerts, ends in (("firing", fired, ahead), ("resolved", resolved, now)):
                if alerts:
                    await self._post("webhook", self.webhook_url,
                                     {"version": "1", "status": status, "alerts": [a.payload(ends) for a in alerts]})

    async def _post(self, target: str, url: str, body) -> None:
        try:
            async with self._session.post(url, json=body) as resp:
                ok = resp.status < 300
                if not ok:
                    log.warning("%s answered %s: %s", target, resp.status, (await resp.text())[:200])
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            ok = False
            log.warning("%s unreachable: %s", target, e)
        self.on_delivery(target, ok)

    async def _resend_loop(self) -> None:
        while True:
            await asyncio.sleep(self.resend_s)
            if self.firing and self.alertmanager_url:
                now = datetime.now(timezone.utc)
                ahead = now + timedelta(seconds=4 * self.resend_s)
                await self._post("alertmanager", self.alertmanager_url,
                                 [a.payload(ahead) for a in self.firing.values()])
