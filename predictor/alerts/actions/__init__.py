"""Acting on a predicted failure: take the node out of the scheduler's pool and ask for a
spare (Slurm: drain + release a held spare job; Kubernetes: cordon + taint + a standby
pod), behind a dry-run default, an hourly cap and a log line per action.

Kept apart from the predictor's service: it runs where the scheduler's operator rights
are (the Slurm controller's host, a Kubernetes service account), fed by Alertmanager's
webhook (``predictor act serve``) or by hand (``predictor act drain``)."""
