"""Telemetry in: the agents' wire format, tokens, batch ids, and the Prometheus reader."""
