"""What the launchers and their workers agree on, importable by either without the other's
modules (a launcher needs no checkpoint engine): the environment a worker is handed, the beat
period, and the exit codes that mean "relaunch the job", "go on without me" and "stop the job"."""

WORKER_ENV = "CKPT_INPROCESS_WORKER"
LAUNCHER_ENV = "CKPT_INPROCESS_LAUNCHER_PID"
BEAT_S = 0.2
EXIT_FALLBACK = 75  # "relaunch the job": no round came, or this worker is in none
EXIT_LEAVE = 76  # "go on without me": a sticky device error (XID 79 leaves one); never resumed in place
EXIT_STOP = 77  # "stop the job, relaunch nothing": going back again would loop (a second failed canary)
