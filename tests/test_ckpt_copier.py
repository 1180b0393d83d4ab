"""The snapshot copy behind the trainer (``tiers/memory/copier.py``): whoever takes a pair
cuts it, so the trainer hands the pairs over as they are; the slot is unsealed (``first``)
before any byte of it changes, on the copy thread when that thread copies every byte."""
from __future__ import annotations

import threading

import pytest
import torch

from ckpt.tiers.memory import copier as copier_mod
from ckpt.tiers.memory.copier import TensorCopier


def pairs_of() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Sources of every kind a pair may hold (contiguous, strided, bfloat16 which numpy lacks, empty
    shapes aside) and zeroed destinations of their shapes."""
    torch.manual_seed(0)
    src = [torch.randn(300), torch.randn(7, 5).t(), torch.randn(9, 11).to(torch.bfloat16), torch.arange(40)]
    return [torch.zeros_like(s, memory_format=torch.contiguous_format) for s in src], src


@pytest.fixture
def copier() -> TensorCopier:
    c = TensorCopier()
    yield c
    c.close()


def test_the_unseal_runs_once_before_any_byte_is_copied_and_every_byte_arrives(copier: TensorCopier,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copier_mod, "PIECE_BYTES", 64)  # every contiguous source cut in several pieces
    dst, src = pairs_of()
    seen: list[bool] = []
    copy = copier.start(list(zip(dst, src)), first=lambda: seen.append(all(not d.any() for d in dst)))
    copy.wait()
    assert seen == [True]
    for d, s in zip(dst, src):
        assert torch.equal(d, s)


def test_with_bytes_copied_before_returning_the_caller_unseals_first(copier: TensorCopier) -> None:
    dst, src = pairs_of()
    order: list[str] = []
    copy = copier.start(list(zip(dst[1:], src[1:])), [(dst[0], src[0])],
                        first=lambda: order.append(f"unsealed {threading.current_thread().name}, "
                                                   f"copied now: {bool(dst[0].any())}"))
    assert order == [f"unsealed {threading.current_thread().name}, copied now: False"]
    copy.wait()
    for d, s in zip(dst, src):
        assert torch.equal(d, s)


def test_a_failed_unseal_copies_nothing_and_is_raised_by_the_wait(copier: TensorCopier) -> None:
    dst, src = pairs_of()

    def first() -> None:
        raise OSError("the seal could not be removed")

    copy = copier.start(list(zip(dst, src)), first=first)
    with pytest.raises(OSError, match="could not be removed"):
        copy.wait()
    assert all(not d.any() for d in dst)


def test_the_seal_bytes_are_made_on_the_copy_thread_or_else_by_the_sealer(copier: TensorCopier) -> None:
    """``StagedSnapshot.sealed_bytes``: the manifest's bytes made behind the copy, or made by
    the thread that seals when the copy thread has not started them; the same bytes either way."""
    from ckpt.format.manifest import ShardManifest
    from ckpt.format.state import flatten
    from ckpt.save.overlap import StagedSnapshot
    from ckpt.tiers.base import CheckpointId
    from ckpt.tiers.memory.copier import plan_layout

    flat = flatten({"w": torch.randn(4, 3), "opt": {"lr": 0.1, "betas": (0.9, 0.99)}})
    entries, nbytes = plan_layout(flat.tensors)
    manifest = ShardManifest(0, 7, 0, nbytes, entries, flat.tree, 1 << 20)
    dst, src = pairs_of()
    go = threading.Event()
    copy = copier.start(list(zip(dst, src)), first=lambda: go.wait(10))  # the copy thread held at the unseal
    staged = StagedSnapshot(CheckpointId(0, 7), None, manifest, copy, [], [], encoded=copier.then(manifest.to_bytes))
    assert staged.sealed_bytes() == manifest.to_bytes() and staged.encoded.cancelled()  # made here
    go.set()
    copy.wait()
    made = copier.then(manifest.to_bytes)
    made.result(10)
    staged.encoded = made
    assert staged.sealed_bytes() == manifest.to_bytes()  # made there


def test_what_follows_a_copy_runs_in_its_job_after_its_bytes_even_when_the_copy_fails(copier: TensorCopier) -> None:
    """``then`` while a copy runs: in the copy's own job (one thread submission), after every byte, on the copy
    thread; a copy that raised still runs it; once the job ended, a job of its own."""
    dst, src = pairs_of()
    go = threading.Event()
    copy = copier.start(list(zip(dst, src)), first=lambda: go.wait(10))
    seen = copier.then(lambda: (threading.current_thread().name, all(torch.equal(d, s) for d, s in zip(dst, src))))
    assert not seen.done()
    go.set()
    copy.wait()
    name, copied = seen.result(10)
    assert name.startswith("ckpt-stage") and copied

    def refuse() -> None:
        raise OSError("could not be removed")

    failed = copier.start(list(zip(*pairs_of())), first=refuse)
    after = copier.then(lambda: 7)
    with pytest.raises(OSError):
        failed.wait()
    assert after.result(10) == 7 and copier.then(lambda: 8).result(10) == 8
