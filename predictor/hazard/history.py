"""A fleet's service history (one row per stay of a GPU in a slot) read and cleaned.

The format is Titan's (shared/data/titan/README.md): ``SN, location, insert, remove,
duration, out, event``. Times are local wall-clock time without a zone; they are converted
once to epoch seconds in ``tz`` so that a DST change does not make a stay an hour off.
Rows with no insert are event records (a DBE or OTB at ``remove``), not stays.
"""
from __future__ import annotations

import csv
import logging
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar
from zoneinfo import ZoneInfo

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_TZ = "America/New_York"
COLUMNS = ("SN", "location", "insert", "remove", "duration", "out", "event")
EVENTS = ("DBE", "OTB")
LOCATION = re.compile(r"^c(\d+)-(\d+)c(\d+)s(\d+)n(\d+)$")
T = TypeVar("T")
LOT_LEN = 5  # the serial's prefix that names its production lot


class HistoryError(ValueError):
    """A malformed row: the message names the file and the row."""


def parse_time(text: str, tz: str = DEFAULT_TZ) -> float:
    """Epoch seconds of ``YYYY-MM-DD[ HH:MM[:SS]]``; local time in ``tz`` unless it has an offset."""
    t = datetime.fromisoformat(text.strip())
    if t.tzinfo is None:
        t = t.replace(tzinfo=ZoneInfo(tz))
    return t.timestamp()


def parse_location(text: str) -> tuple[int, int, int, int, int]:
    """(cabinet column, row, cage, slot, node) of ``c{col}-{row}c{cage}s{slot}n{node}``."""
    m = LOCATION.match(text)
    if not m:
        raise ValueError(f"location {text!r} is not c<col>-<row>c<cage>s<slot>n<node>")
    return tuple(int(g) for g in m.groups())  # type: ignore[return-value]


@dataclass
class History:
    """Stays and event records as parallel arrays (epoch seconds), GPUs indexed by ``gpu``."""

    serials: np.ndarray      # str, one per GPU
    stay_gpu: np.ndarray     # int, per stay
    stay_loc: np.ndarray     # int (n, 5): col, row, cage, slot, node
    stay_location: np.ndarray  # str, per stay
    stay_in: np.ndarray
    stay_out_t: np.ndarray
    stay_out: np.ndarray     # bool: taken out of service at the end
    stay_event: np.ndarray   # bool: a DBE or OTB ended the stay
    event_gpu: np.ndarray    # every DBE/OTB (stay ends and event records), per event
    event_t: np.ndarray
    event_kind: np.ndarray   # str
    event_location: np.ndarray  # str: the slot it happened in
    end_t: float             # where the record is cut

    @property
    def lots(self) -> np.ndarray:
        return np.array([s[:LOT_LEN] for s in self.serials])

    def first_insert(self) -> np.ndarray:
        """Each GPU's first insert (inf for a GPU only seen in event records)."""
        first = np.full(len(self.serials), np.inf)
        np.minimum.at(first, self.stay_gpu, self.stay_in)
        return first


def _resolve_overlaps(gpu: np.ndarray, t_in: np.ndarray, t_out: np.ndarray, rows: np.ndarray, path: str) -> np.ndarray:
    """Cut an earlier stay of a GPU at the start of a later one that overlaps it (a GPU is in one slot)."""
    t_out = t_out.copy()
    order = np.lexsort((t_in, gpu))
    for a, b in zip(order[:-1], order[1:]):
        if gpu[a] == gpu[b] and t_out[a] > t_in[b]:
            log.warning("%s: two stays of one GPU overlap (rows %d and %d): the earlier ends when the later begins",
                        path, rows[a], rows[b])
            t_out[a] = t_in[b]
    return t_out


def _checked(read: Callable[[], T], reader: Any, path: str) -> T:
    """``read()``, with what the csv module or the decoder refuses (a field over
    csv.field_size_limit(), a NUL byte, bytes that are not UTF-8) as one HistoryError."""
    try:
        return read()
    except csv.Error as e:
        raise HistoryError(f"{path}: line {reader.line_num}: {e} (not a service history CSV?)") from None
    except UnicodeDecodeError as e:
        raise HistoryError(f"{path}: not UTF-8 text: {e}") from None


def _rows(reader: csv.DictReader, path: str) -> Iterator[dict]:
    while (row := _checked(lambda: next(reader, None), reader, path)) is not None:
        yield row


def read_history(path: str | Path, tz: str = DEFAULT_TZ, end: str | None = None) -> History:
    """Read a history CSV; one ``HistoryError`` naming the row for the first malformed value."""
    path = str(path)
    serial_idx: dict[str, int] = {}
    stays: list[tuple] = []
    events: list[tuple[int, float, str, str]] = []
    # utf-8-sig: a spreadsheet's byte order mark is not part of the first column's name
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (_checked(lambda: reader.fieldnames, reader, path) or [])]
        if missing:
            raise HistoryError(f"{path}: missing columns {missing} (need {', '.join(COLUMNS)})")
        for rowno, row in enumerate(_rows(reader, path), start=2):
            try:
                sn = row["SN"].strip()
                if not sn:
                    raise ValueError("SN is empty")
                loc = parse_location(row["location"].strip())
                removed = parse_time(row["remove"], tz)
                event = row["event"].strip()
                if event and event not in EVENTS:
                    raise ValueError(f"event {event!r} is not one of {EVENTS} or empty")
                g = serial_idx.setdefault(sn, len(serial_idx))
                if not row["insert"].strip():
                    if not event:
                        raise ValueError("a row without insert must be an event record (DBE or OTB)")
                    events.append((g, removed, event, row["location"].strip()))
                    continue
                inserted = parse_time(row["insert"], tz)
                if removed < inserted:
                    raise ValueError("remove is before insert")
                out = row["out"].strip()
                if out.lower() not in ("true", "false"):   # the Titan files write TRUE and FALSE
                    raise ValueError(f"out {out!r} is not True or False")
                taken_out = out.lower() == "true"
            except (ValueError, TypeError, AttributeError) as e:
                raise HistoryError(f"{path}: row {rowno}: {e}") from None
            stays.append((g, loc, row["location"].strip(), inserted, removed, taken_out, bool(event), rowno))
            if event:
                events.append((g, removed, event, row["location"].strip()))
    if not stays:
        raise HistoryError(f"{path}: no stays (rows with an insert time)")
    gpu = np.array([s[0] for s in stays])
    t_in = np.array([s[3] for s in stays])
    t_out = _resolve_overlaps(gpu, t_in, np.array([s[4] for s in stays]), np.array([s[7] for s in stays]), path)
    end_t = parse_time(end, tz) if end else float(max(t_out.max(), max((e[1] for e in events), default=0)))
    return History(
        serials=np.array(list(serial_idx)), stay_gpu=gpu, stay_loc=np.array([s[1] for s in stays]),
        stay_location=np.array([s[2] for s in stays]), stay_in=t_in, stay_out_t=t_out,
        stay_out=np.array([s[5] for s in stays]), stay_event=np.array([s[6] for s in stays]),
        event_gpu=np.array([e[0] for e in events], dtype=int), event_t=np.array([e[1] for e in events], dtype=float),
        event_kind=np.array([e[2] for e in events], dtype=str),
        event_location=np.array([e[3] for e in events], dtype=str), end_t=end_t)
