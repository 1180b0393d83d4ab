"""Out of the predictor: Alertmanager and webhook delivery, operator actions (drain, spare)."""
