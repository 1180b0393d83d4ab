"""A GPU fleet simulator: labelled telemetry traces and a live per-node source.

Why it exists: real fleets fail rarely and their logs are not public, so the
predictor is developed and evaluated on simulated fleets. The model below is our
own; its proportions follow published field data where such data exists, and
everything else is a stated, configurable assumption.

Published statistics the model follows
--------------------------------------
* Meta, "The Llama 3 Herd of Models" (2024), §3.3.4 and Table 5: 16,384 H100
  80GB GPUs (2,048 nodes of 8), 54 days, 466 interruptions of which 419
  unexpected; GPU issues were 58.7% of the unexpected ones: faulty GPU 148
  (30.1%, NVLink included), HBM3 memory 72 (17.2%), GPU SRAM 19 (4.5%), GPU
  system processor (GSP) 17 (4.1%), GPU thermal interface and sensor 6 (1.4%).
  We use it for (a) the default GPU (H100 SXM, 8 per node), (b) the mode mix:
  HBM is the largest single mode with a precursor, thermal the smallest, and
  (c) the failures with no precursor: SRAM (XID 48 out of the blue), GSP
  (XID 119/120) and "fallen off the bus" (XID 79), together about one third.
  The real rate (419 / 2048 / 54 = 0.0038 per node-day) is far too low for a
  trace of a few days, so labelled traces are *enriched* (default one failure
  per 20 GPU-days, as EVAL.md states); EVAL's scorer re-weights to the real rate.
* NVIDIA, "XID Errors" (r555 driver docs) and the A100/H100 row-remapping
  documentation: which XIDs a mode ends in (48 DBE, 94/95 contained/uncontained
  ECC, 64 row-remap failure, 79 fallen off the bus, 74 NVLink, 62 internal
  micro-controller halt, 119/120 GSP), that 63 records a row remap and 92
  reports a high single-bit rate (warnings), that 13/31/43/45 are raised by
  applications, that a row remap is permanent (survives a reset; the volatile
  ECC, PCIe replay and NVLink counters do not), and the clocks-event bits.
* Cui et al., "Characterizing GPU Resilience and Impact on AI/HPC Systems"
  (arXiv 2503.11901, 2025; NCSA Delta, A100 and H100, 11.7 M GPU-hours): the
  GSP is the most error-prone GPU hardware component (hence GSP XIDs among the
  sudden failures), H100 memory errors are more frequent than A100's (HBM is
  our largest precursor mode), and NVLink errors often do not fail the job
  because links retry (hence GPUs with steady NVLink CRC errors that never
  fail). Application XIDs (13, 31, 43, 45) are common and come in bursts on a
  job's GPUs; we model that qualitatively and claim no number from it.

The model (all rates and durations configurable in ``FleetConfig``)
--------------------------------------------------------------------
Time: each node samples its 8 GPUs together every ``interval_s`` with its own
phase offset and tens of milliseconds of jitter; single samples go missing, the
agent sometimes stops for minutes, nodes reboot (volatile counters restart).
A ``time_scale`` > 1 runs the processes that many times faster than the clock
(a one-hour precursor lasts a minute at 60), so a live demo fits in minutes.

Healthy variation:
* workload: per node, jobs (busy for hours) alternate with idle gaps (minutes
  to hours); busy GPUs draw 75-95% of TDP with checkpoint stalls every 15-60 min;
  idle GPUs show idle clocks, ~70 W and the idle clocks-event bit;
* temperature: inlet air (+ fleet offset, + diurnal swing, + a few *hot nodes*
  running 4-11 °C warmer) plus thermal resistance x power, lagged ~100 s; HBM a
  few degrees above the core; software power capping and rare node-wide power
  brake events (0x80) lower clocks without any failure;
* look-alikes that never fail: GPUs with a steady correctable-ECC rate (with an
  occasional row remap / XID 63, XID 92), GPUs with steady PCIe replays or
  NVLink CRC errors, and application XID storms (13/31/43 then 45 on a job's
  GPUs, after which the job restarts and the node idles);
* blank fields (singly, and a field a node's driver never reports) and GPUs
  replaced in maintenance (new UUID, counters from zero).

Failure modes with precursors (the GPU stops reporting at the terminal XID):
* hbm: single-bit ECC rate rising exponentially, correctable row remaps (XID
  63), XID 92 once the rate is high, sometimes a DBE and an uncorrectable remap
  at the end; terminal XID 48, 94, 95 or 64 (then the remap-failure flag is set);
* thermal: cooling loss; temperature climbs 8-30 °C, thermal throttle bits,
  falling clocks; terminal XID 79;
* pcie: PCIe replay rate accelerating; terminal XID 79;
* nvlink: NVLink CRC flit error rate accelerating; terminal XID 74.
Each has a precursor duration (log-normal per mode, minutes to hours) and a
strength (log-normal: some precursors are faint). ``precursor_s`` in
failures.parquet is the precursor's duration, as in the shared fleet sample:
its first visible event comes later (a faint one may emit almost nothing).
Precursor rates, durations, look-alike rates and the temperature spread are
matched to the shared sample (its last ten minutes before an HBM failure show
0.01-0.07 SBE/s, PCIe 0.06-0.35 replays/s, NVLink 0.07-0.9 CRC errors/s, thermal
+7-40 °C; look-alikes run steady at 100-290 SBE, 25-130 PCIe replays or 20-60
NVLink errors a day), so that a predictor validated here is not fooled by
precursors louder than the sample's.
Sudden failures (default one third): XID 79, 48, 119, 120 or 62 with no sign.

After a failure the node's job dies (the other GPUs idle for a while); the GPU
is absent 0.5-24 h, then comes back reset (same UUID, volatile counters at
zero, remapped rows kept) or replaced (new UUID, all counters at zero).
"""
import importlib

from agents.fleetsim.config import PROFILES, FleetConfig, GpuProfile, ScheduledFailure

__all__ = ["FleetConfig", "GpuProfile", "ScheduledFailure", "PROFILES", "NodeSim", "write_trace"]
#: imported on first use: they need pyarrow, which `agents --help` (the base install) does without
_NEEDS_PYARROW = {"NodeSim": "agents.fleetsim.node", "write_trace": "agents.fleetsim.trace"}


def __getattr__(name: str):
    if name in _NEEDS_PYARROW:
        return getattr(importlib.import_module(_NEEDS_PYARROW[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
