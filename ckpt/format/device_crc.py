"""CRC32C computed with torch ops, so a GPU can verify the bytes that landed on it.

A restore from pinned memory runs at the host→device floor only if the host does not
checksum every byte first (CRC32C on 16 host threads took 2-4.5x the DMA of the same bytes
on an H100 VM). The CRC is linear over GF(2), so it can be computed with table lookups and
XORs, in parallel, by any torch device:

* ``crc0`` (the CRC with a zero initial value and no final XOR) of a message is the XOR over
  its bytes of ``M^d(byte)``, where ``M`` is the CRC's step over one zero byte and ``d`` the
  byte's distance from the end. Leading zero bytes add nothing, so messages of different
  lengths are verified together as equal-length rows, each right-aligned after zeros.
* A row is cut into ``L``-byte chunks; one lookup per two bytes in a table of ``M^d`` by
  position gives each chunk's ``crc0``; then chunks are folded ``B`` at a time, each
  shifted by its distance (a lookup on each of the four bytes of each value).
* ``crc32c(m) = crc0(m) ^ M^n(0xFFFFFFFF) ^ 0xFFFFFFFF`` for ``n = len(m)``.

Shift tables (``M^z`` as four 256-entry tables, one per byte of the state) are built on
the CPU by composing powers of two; tests check every path against the ``crc32c`` package.
"""
from __future__ import annotations

import functools

import torch

POLY = 0x82F63B78  # CRC32C (Castagnoli), reflected
CHUNK = 128  # bytes per chunk of the first fold (64 two-byte lookups: a 16 MiB table)
FAN_IN = 256  # chunk values per later fold
ONES = 0xFFFFFFFF


@functools.cache
def _byte_table() -> torch.Tensor:
    t = torch.arange(256, dtype=torch.int64)
    for _ in range(8):
        t = torch.where(t & 1 == 1, (t >> 1) ^ POLY, t >> 1)
    return t


def _apply(shift: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``M^z(v)`` for 32-bit values ``v`` (int64), ``shift`` the [4, 256] tables of ``M^z``."""
    return shift[0][v & 255] ^ shift[1][(v >> 8) & 255] ^ shift[2][(v >> 16) & 255] ^ shift[3][(v >> 24) & 255]


@functools.cache
def _power_of_two_shift(i: int) -> torch.Tensor:
    """``M^(2^i)`` as [4, 256] int64 tables."""
    if i == 0:
        b = torch.arange(256, dtype=torch.int64)
        return torch.stack([_byte_table(), b, b << 8, b << 16])  # M(b << 8k) = b << 8(k-1) for k > 0
    half = _power_of_two_shift(i - 1)
    return _apply(half, half)


def shifted(values: torch.Tensor, nbytes: torch.Tensor) -> torch.Tensor:
    """``M^nbytes(values)``, elementwise (broadcast): CRC states after ``nbytes`` more zero
    bytes, composed from powers of two, all values at once."""
    for i in range(int(nbytes.max()).bit_length() if nbytes.numel() else 0):
        values = torch.where((nbytes >> i) & 1 == 1, _apply(_power_of_two_shift(i), values), values)
    return values


def shift_tables(nbytes: list[int]) -> torch.Tensor:
    """``M^n`` for each ``n`` of ``nbytes`` as [len, 4, 256] tables (entry k, b: ``M^n(b << 8k)``)."""
    identity = torch.arange(256, dtype=torch.int64) << torch.tensor([[0], [8], [16], [24]])
    return shifted(identity.expand(len(nbytes), 4, 256), torch.tensor(nbytes).view(-1, 1, 1))


def crc0_from_crc32c(crcs: list[int], lengths: list[int]) -> torch.Tensor:
    """Each message's ``crc0`` from its CRC32C and length, as int32 (the device's values)."""
    ones = shifted(torch.full((len(crcs),), ONES, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64))
    return _int32(ones ^ ONES ^ torch.tensor(crcs, dtype=torch.int64))


def _int32(t: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values (int64) as the int32 of the same bits."""
    return torch.where(t >= 1 << 31, t - (1 << 32), t).to(torch.int32)


def row_bytes(nbytes: int) -> int:
    """The row length that holds a message of ``nbytes``: ``CHUNK`` times a power of two."""
    return max(CHUNK, 1 << max(0, nbytes - 1).bit_length())


class RowCRC:
    """``crc0`` of right-aligned rows of ``row`` bytes on one device; tables made once."""

    def __init__(self, row: int, device: torch.device) -> None:
        if row < CHUNK or row & (row - 1):
            raise ValueError(f"row must be a power of two >= {CHUNK}, got {row}")
        self.row = row
        self.folds = [_fold(1, CHUNK, device)]
        unit, left = CHUNK, row // CHUNK
        while left > 1:
            b = min(FAN_IN, left)
            self.folds.append(_fold(unit, b, device))
            unit, left = unit * b, left // b

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """``crc0`` of each row of ``rows`` (uint8, [P, row], on the tables' device): int32 [P]."""
        v = rows.reshape(-1)
        for fold in self.folds:
            v = fold(v.view(torch.uint8))
        return v.view(rows.shape[0])


@functools.cache
def _fold(unit: int, count: int, device: torch.device) -> _Fold:
    """The fold of ``count`` values of ``unit`` bytes each (made once per process: rows of
    every size share them)."""
    if unit == 1:  # bytes, read two at a time: byte j of a chunk is count - j steps (M) from its end
        byte = shift_tables([count - j for j in range(count)])[:, 0]
        pairs = (byte[0::2, None, :] ^ byte[1::2, :, None]).reshape(count // 2, 1 << 16)  # [unit, b1 * 256 + b0]
        # indexed by the signed int16 of the pair plus 32768: swap the table's halves
        return _Fold(pairs.roll(1 << 15, dims=1), torch.int16, 1 << 15, device)
    # 32-bit chunk values, by byte: value j is (count - 1 - j) units from the group's end
    return _Fold(shift_tables([(count - 1 - j) * unit for j in range(count)]).reshape(4 * count, 256),
                 torch.uint8, 0, device)


class _Fold:
    """One fold: each group of ``table``'s row count of ``units`` (uint8 or int16) becomes the
    XOR of ``table[position][unit + bias]`` over its units: one gather, one XOR tree."""

    def __init__(self, table: torch.Tensor, units: torch.dtype, bias: int, device: torch.device) -> None:
        positions, entries = table.shape
        self.table = _int32(table.reshape(-1)).to(device)
        self.units, self.width = units, positions
        self.offsets = torch.arange(bias, positions * entries, entries, dtype=torch.int32, device=device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        idx = x.view(self.units).view(-1, self.width) + self.offsets  # int32, one kernel
        v = self.table.index_select(0, idx.view(-1)).view(-1, self.width)
        del idx
        w = self.width
        while w > 1:
            w //= 2
            v = v[:, :w] ^ v[:, w:]
        return v.reshape(-1)
