"""CRC32C with torch ops (``device_crc``) and the staged, device-verified restore of pinned
pieces (``device_reads``), run here on the CPU: the same ops and steps a GPU runs, in order.
The CUDA path itself is covered by the tests marked gpu in test_ckpt_roundtrip.py."""
from __future__ import annotations

import crc32c
import pytest
import torch

from ckpt.format.device_crc import RowCRC, crc0_from_crc32c, row_bytes
from ckpt.format.device_reads import DevicePiece, StagedDeviceReads

CPU = torch.device("cpu")


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def crc(t: torch.Tensor) -> int:
    return crc32c.crc32c(t.numpy().tobytes())


@pytest.mark.parametrize("row", [128, 256, 4096, 1 << 17, 1 << 20], ids=lambda r: f"row{r}")
def test_row_crc_equals_crc32c_for_every_length_right_aligned(row: int) -> None:
    lengths = sorted({0, 1, 3, 255, 256, 257, row // 2 + 1, row - 1, row} & set(range(row + 1)))
    msgs = [random_bytes(n, n) for n in lengths]
    rows = torch.zeros(len(msgs), row, dtype=torch.uint8)
    for r, m in enumerate(msgs):
        rows[r, row - len(m):] = m
    got = RowCRC(row, CPU)(rows)
    assert got.tolist() == crc0_from_crc32c([crc(m) for m in msgs], lengths).tolist()


def test_row_bytes_is_the_smallest_power_of_two_row() -> None:
    assert [row_bytes(n) for n in (0, 1, 128, 129, 4096, 4097)] == [128, 128, 128, 256, 4096, 8192]
    with pytest.raises(ValueError, match="power of two"):
        RowCRC(3 << 10, CPU)


SIZES = [0, 1, 255, 256, 257, 4096, 70_000, 1 << 16, (1 << 18) + 5, 3]


def pieces(sizes: list[int], *, verified: bool = True) -> list[DevicePiece]:
    out = []
    for i, n in enumerate(sizes):
        host = random_bytes(n, 100 + i)
        out.append(DevicePiece(host, torch.zeros(n, dtype=torch.uint8), crc(host) if verified else None, i))
    return out


@pytest.mark.parametrize("below", [0, 4096], ids=["all-on-device", "small-on-host"])
def test_every_piece_lands_checked_across_blocks_and_reused_buffers(below: int) -> None:
    """``below``: pieces under it are checked by the host's threads while the others are staged
    (here 4 KiB: the sizes 1, 255, 256, 257 and 3), and copied once all of them passed."""
    ps = pieces(SIZES)
    done: list[int] = []
    StagedDeviceReads(CPU, block_bytes=64 << 10, depth=2, host_check_below=below, threads=3).run(
        ps, lambda p: AssertionError(p.tag), done.append)
    assert all(torch.equal(p.dst, p.host) for p in ps)
    assert sum(done) == sum(SIZES)


def test_unverified_pieces_are_copied_as_they_are() -> None:
    ps = pieces(SIZES, verified=False)
    done: list[int] = []
    StagedDeviceReads(CPU).run(ps, lambda p: AssertionError(p.tag), done.append)
    assert all(torch.equal(p.dst, p.host) for p in ps)
    assert sum(done) == sum(SIZES)


@pytest.mark.parametrize("bad", [1, 5, 8], ids=["first-block", "middle", "row-above-block"])
def test_a_damaged_piece_is_named_and_reaches_no_target(bad: int) -> None:
    ps = pieces(SIZES)
    ps[bad].host[len(ps[bad].host) // 2] ^= 0x10  # damaged after its CRC was taken
    with pytest.raises(LookupError) as err:
        StagedDeviceReads(CPU, block_bytes=64 << 10, depth=2, host_check_below=0).run(ps, lambda p: LookupError(p.tag))
    assert err.value.args == (bad,)
    assert not ps[bad].dst.any()


SMALL = [i for i, n in enumerate(SIZES) if 0 < n < 4096]


@pytest.mark.parametrize("bad", [SMALL[0], SMALL[-1], 6], ids=["small-first", "small-last", "staged"])
def test_a_damaged_piece_keeps_every_host_checked_piece_from_its_target(bad: int) -> None:
    """Damage in a small piece or in a staged one: no piece checked on the host is copied."""
    ps = pieces(SIZES)
    ps[bad].host[len(ps[bad].host) // 2] ^= 0x10
    with pytest.raises(LookupError) as err:
        StagedDeviceReads(CPU, block_bytes=64 << 10, host_check_below=4096, threads=3).run(
            ps, lambda p: LookupError(p.tag))
    assert err.value.args == (bad,)
    assert not any(ps[i].dst.any() for i in SMALL)
