"""Fault handling around training: hang and failed-node detection (watchdog, heartbeats, the
hang policy), quarantine of repeat offenders, restart timing, a process group per round, and
leaving a rank without the interpreter's teardown."""
