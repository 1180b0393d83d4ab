"""predictor: GPU failure prediction from fleet telemetry.

Grouped by the data's path, imports running one way (cli -> serve/alerts/hazard -> model -> ingest):
ingest/ (wire format, tokens, Prometheus reader), model/ (features, labels, ramps, rules, the
one scorer, training, the safe model file, evaluation, replay), serve/ (the HTTP service, its
scoring queue, jobs and job risk, /metrics), alerts/ (Alertmanager delivery, operator actions),
hazard/ (fleet hazard from service history), cli/ (the `predictor` commands).
"""
