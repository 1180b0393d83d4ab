"""The online service: HTTP server, scoring queue, job registry and job risk, /metrics."""
