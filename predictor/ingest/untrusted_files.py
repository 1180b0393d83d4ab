"""Reading files an outsider may have written (model files) in bounded memory, with one
clear ValueError for anything out of bounds instead of MemoryError or RecursionError.

A skops file is a zip of ``.npy`` arrays and a ``schema.json``: every member's declared
size is checked against the bytes it comes from, and every array's declared shape against
its member's size, before skops allocates anything; JSON text is measured for depth
before ``json.loads`` recurses into it."""
from __future__ import annotations

import io
import json
import math
import re
import zipfile
from pathlib import Path

import numpy as np
import skops.io as sio

#: DEFLATE expands at most ~1032x; a member that claims more is lying about its size.
MAX_EXPANSION = 1100
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """The deepest nesting of brackets outside strings (no parsing, no recursion)."""
    depth = deepest = 0
    for b in _BRACKETS.findall(_STRING.sub("", text)):
        depth += 1 if b in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def loads_json(text: str, what: str, max_depth: int = 32, max_chars: int = 1 << 20) -> object:
    """``json.loads`` of untrusted text, refused (ValueError) past ``max_chars`` or ``max_depth``."""
    if len(text) > max_chars:
        raise ValueError(f"{what} is {len(text)} characters, over the limit of {max_chars}")
    if json_depth(text) > max_depth:
        raise ValueError(f"{what} is nested deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None


def check_skops(data: bytes, what: str, max_unpacked: int, max_schema_depth: int = 200) -> None:
    """Refuse (ValueError) a skops file whose members or arrays declare more bytes than it
    holds, more than ``max_unpacked`` in all, object arrays, or a schema nested too deep."""
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
        members = z.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError) as e:
        raise ValueError(f"{what}: not a skops model file (a zip): {e}") from None
    total = 0
    for m in members:
        total += m.file_size
        if m.compress_size > len(data) or m.file_size > MAX_EXPANSION * m.compress_size + 4096:
            raise ValueError(f"{what}: member {m.filename!r} declares {m.file_size} bytes from {m.compress_size} "
                             "stored: not a model file")
        if total > max_unpacked:
            raise ValueError(f"{what}: members declare over {max_unpacked} bytes in all: not a model file")
    try:
        for m in members:
            if m.filename.endswith(".npy"):
                _check_array(z, m, what)
            elif m.filename == "schema.json" and json_depth(z.read(m).decode("utf-8")) > max_schema_depth:
                raise ValueError(f"{what}: schema.json is nested deeper than {max_schema_depth} levels")
    except (zipfile.BadZipFile, EOFError, UnicodeDecodeError, OSError) as e:
        raise ValueError(f"{what}: damaged model file: {e}") from None


def load_skops(path: str | Path, what: str, trusted: list[str], max_file: int, max_unpacked: int) -> object:
    """What a skops model file holds, after ``check_skops``; a type outside ``trusted`` is
    refused (its code never runs), and whatever skops raises on a damaged file is one
    ValueError naming ``what`` ("model", "hazard model")."""
    size = Path(path).stat().st_size
    if size > max_file:
        raise ValueError(f"{path}: {size} bytes, over the {max_file}-byte limit of a {what} file")
    data = Path(path).read_bytes()
    check_skops(data, str(path), max_unpacked)
    try:
        untrusted = [t for t in sio.get_untrusted_types(data=data) if t not in trusted]
        if not untrusted:
            return sio.loads(data, trusted=trusted)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError, IndexError) as e:
        raise ValueError(f"{path}: not a readable {what}: {str(e)[:200]}") from None
    raise ValueError(f"{path}: refusing to load {what} with unexpected types {untrusted[:5]}"
                     + (f" and {len(untrusted) - 5} more" if len(untrusted) > 5 else ""))


def _check_array(z: zipfile.ZipFile, m: zipfile.ZipInfo, what: str) -> None:
    with z.open(m) as f:
        try:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(f)
        except (ValueError, SyntaxError, TypeError) as e:
            raise ValueError(f"{what}: array {m.filename!r} has a bad header: {e}") from None
        header = f.tell()
    if dtype.hasobject:
        raise ValueError(f"{what}: array {m.filename!r} holds Python objects: refused")
    declared = math.prod(shape) * dtype.itemsize
    if declared != m.file_size - header:
        raise ValueError(f"{what}: array {m.filename!r} declares shape {shape} of {dtype} ({declared} bytes) but "
                         f"holds {m.file_size - header} bytes")
