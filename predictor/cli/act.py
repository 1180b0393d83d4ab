"""`predictor act drain / serve`: take a node predicted to fail out of the scheduler's pool
and ask for a spare (predictor/alerts/actions/). Dry run unless --apply."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import click

from predictor.ingest.auth import ENV_FILE, ENV_TOKENS

DEFAULT_ALERTS = ("GPUFailurePredicted",)


def _backend_options(f):
    options = [
        click.option("--backend", type=click.Choice(["slurm", "kubernetes"]), required=True),
        click.option("--apply", is_flag=True, help="change the cluster (default: a dry run that logs the plan)"),
        click.option("--max-per-hour", default=2, show_default=True, type=click.IntRange(min=0),
                     help="nodes taken out of service per hour at most; past it, refuse and page"),
        click.option("--log", "log_path", default="ckpt-guard-actions.jsonl", show_default=True,
                     type=click.Path(dir_okay=False, path_type=Path),
                     help="the action log (JSON lines; also the cap's count across restarts)"),
        click.option("--page-alertmanager", help="Alertmanager base URL to page when the cap is reached"),
        click.option("--spare-job", help="slurm: release the oldest held job of this name as the spare"),
        click.option("--kube-api", help="kubernetes: API URL (default: in-cluster service account)"),
        click.option("--kube-token-file", type=click.Path(exists=True, dir_okay=False),
                     help="kubernetes: bearer token file (with --kube-api)"),
        click.option("--kube-ca", type=click.Path(exists=True, dir_okay=False), help="kubernetes: CA bundle"),
        click.option("--namespace", default="default", show_default=True, help="kubernetes: standby pods' namespace"),
        click.option("--standby-pod", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="kubernetes: Pod manifest (JSON) to create as the spare"),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _responder(backend: str, apply: bool, max_per_hour: int, log_path: Path, page_alertmanager: str | None,
               spare_job: str | None, kube_api: str | None, kube_token_file: str | None, kube_ca: str | None,
               namespace: str, standby_pod: Path | None):
    from predictor.alerts.actions.errors import ActionError
    from predictor.alerts.actions.record import ActionLog
    from predictor.alerts.actions.responder import Responder, alertmanager_pager
    if backend == "slurm":
        from predictor.alerts.actions.slurm import SlurmNodes
        nodes = SlurmNodes(spare_job)
    else:
        from predictor.alerts.actions.kubernetes import KubernetesNodes
        try:
            template = json.loads(standby_pod.read_text()) if standby_pod else None
        except ValueError as e:
            raise click.BadParameter(f"not JSON: {e}", param_hint="--standby-pod") from None
        if kube_api:
            if not kube_token_file:
                raise click.UsageError("--kube-api needs --kube-token-file")
            nodes = KubernetesNodes(kube_api, Path(kube_token_file).read_text().strip(), kube_ca, namespace, template)
        else:
            try:
                nodes = KubernetesNodes.in_cluster(template)
            except ActionError as e:
                raise click.ClickException(str(e)) from None
    try:
        actions = ActionLog(log_path)
    except ActionError as e:
        raise click.ClickException(str(e)) from None
    return Responder(nodes, actions, max_per_hour, dry_run=not apply,
                     page=alertmanager_pager(page_alertmanager) if page_alertmanager else None)


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@click.group()
def act() -> None:
    """Drain a node predicted to fail and ask for a spare (Slurm or Kubernetes)."""


@act.command()
@click.argument("node")
@click.option("--reason", default="operator request", show_default=True, help="why (kept in the log and the scheduler)")
@click.option("--json", "as_json", is_flag=True, help="print the log entry as JSON")
@_backend_options
def drain(node: str, reason: str, as_json: bool, **backend) -> None:
    """Drain NODE now (with the same cap, log and idempotence as the webhook). Exit 1 when
    refused, capped, failed, or when the action log cannot be written (then nothing is applied)."""
    from predictor.alerts.actions.errors import ActionError
    from predictor.alerts.actions.record import Prediction
    _logging()
    try:
        entry = _responder(**backend).handle(Prediction(node, "operator", {"reason": reason}))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="NODE") from None
    except ActionError as e:   # RecordError: the log could not be written
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(entry, sort_keys=True))
    else:
        click.echo(f"{entry['action']} {node}{' (dry run)' if entry['dry_run'] else ''}: "
                   f"{'; '.join(entry['steps']) or 'nothing done'}")
    if entry["error"]:
        raise click.ClickException(entry["error"])


@act.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=9411, show_default=True)
@click.option("--tokens", "tokens_path", type=click.Path(exists=True, dir_okay=False),
              help=f"token file, 'ROLE TOKEN' lines; the webhook needs an operator token (default: ${ENV_FILE}, "
                   f"or ${ENV_TOKENS['operator']})")
@click.option("--alert", "alerts", multiple=True, default=DEFAULT_ALERTS, show_default=True,
              help="alert names that drain their node (repeatable)")
@_backend_options
def serve(host: str, port: int, tokens_path: str | None, alerts: tuple[str, ...], **backend) -> None:
    """Alertmanager's webhook receiver: POST /v1/alertmanager."""
    from predictor.alerts.actions import receiver
    from predictor.ingest import auth
    _logging()
    try:
        tokens = auth.load_tokens(tokens_path)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    try:
        receiver.run(_responder(**backend), tokens, frozenset(alerts), host, port)
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None
