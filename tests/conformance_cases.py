# The cases marked with an ``upstream`` test are ported from PyTorch's distributed
# checkpoint tests (test/distributed/checkpoint/). PyTorch is BSD-3-Clause licensed:
#   Copyright (c) 2016-     Facebook, Inc            (Adam Paszke)
#   Copyright (c) Meta Platforms, Inc. and affiliates. All rights reserved.
#   Redistribution and use in source and binary forms, with or without modification, are
#   permitted provided that the conditions of the BSD 3-Clause licence are met
#   (https://github.com/pytorch/pytorch/blob/main/LICENSE).
"""The conformance suite's cases, made in the parent process: ported ones (each naming the
upstream file and test it comes from) and generated ones (hypothesis, derandomized, so
every run makes the same cases). A case is one tensor (and, for ``with_conj``, its conj()
view beside it), saved laid out as ``save`` says and restored as ``load`` says:

    {"id", "upstream", "shape", "dtype", "seed", "view", "with_conj",
     "save": {"mesh": None | "1d" | "2d" | "sub", "placements": ["S0", "R"], "local": "noncontiguous"?},
     "load": {...}}

``view`` is how the saved plain tensor is made (transposed, narrowed, strided, expanded,
conj, neg, channels_last); targets are always plain zeros or DTensors of zeros.
"""
from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

RESHARDING = "test_dtensor_resharding.py"
PLAIN = {"mesh": None}


def _spec(mesh: str | None, *placements: str, **extra: str) -> dict:
    return {"mesh": mesh, "placements": list(placements), **extra} if mesh else dict(PLAIN)


def _case(cid: str, upstream: str, shape: tuple, save: dict, load: dict, *, dtype: str = "float32",
          view: str = "none", with_conj: bool = False, seed: int | None = None) -> dict:
    return {"id": cid, "upstream": upstream, "shape": list(shape), "dtype": dtype, "view": view,
            "with_conj": with_conj, "seed": seed if seed is not None else sum(map(ord, cid)) % 10007,
            "save": save, "load": load}


def ported() -> list[dict]:
    """Cases from PyTorch's own tests (the upstream test named in each)."""
    cases = []
    one_d = ["S0", "S1", "R"]
    for a, b in itertools.product(one_d, one_d):  # TestDTensorReshardPlacementChange
        cases.append(_case(f"1d-{a}-{b}", f"{RESHARDING}::TestDTensorReshardPlacementChange::"
                           "test_1d_to_1d_reshard_placement_change", (8, 8), _spec("1d", a), _spec("1d", b)))
    two_d = list(itertools.product(one_d, one_d))
    for a, b in itertools.product(two_d, two_d):
        cases.append(_case(f"2d-{''.join(a)}-{''.join(b)}", f"{RESHARDING}::TestDTensorReshardPlacementChange::"
                           "test_2d_to_2d_reshard_placement_change", (8, 8), _spec("2d", *a), _spec("2d", *b)))
    for a, b in itertools.product(one_d, two_d):  # TestDTensorReshardMeshChange
        cases.append(_case(f"mesh-1d-{a}-2d-{''.join(b)}", f"{RESHARDING}::TestDTensorReshardMeshChange::"
                           "test_1d_to_2d_reshard_mesh_change", (8, 8), _spec("1d", a), _spec("2d", *b)))
        cases.append(_case(f"mesh-2d-{''.join(b)}-1d-{a}", f"{RESHARDING}::TestDTensorReshardMeshChange::"
                           "test_2d_to_1d_reshard_mesh_change", (8, 8), _spec("2d", *b), _spec("1d", a)))
    cases += [
        _case("uneven-S0-S1", f"{RESHARDING}::TestDTensorReshardMeshChange::test_dtensor_checkpoint_with_uneven_shards",
              (7, 3), _spec("1d", "S0"), _spec("1d", "S1")),
        _case("empty-shard-S0-R", f"{RESHARDING}::TestDTensorReshardMeshChange::"
              "test_dtensor_checkpoint_resharding_with_empty_shard", (1, 4), _spec("1d", "S0"), _spec("1d", "R")),
        _case("fsdp-to-tp", "test_fsdp_tp_checkpoint_conversion.py::TestFsdpTpCheckpointConversion::"
              "test_fsdp_to_tp", (8, 4), _spec("1d", "S0"), _spec("1d", "S1")),
        _case("fsdp-tp-to-fsdp", "test_fsdp_tp_checkpoint_conversion.py (FSDP+TP, 2-D mesh, to FSDP2)",
              (8, 4), _spec("2d", "S0", "S1"), _spec("1d", "S0")),
        _case("plain-tensor", "test_file_system_checkpoint_cpu.py::TestDistributedStateDictSaveLoad::"
              "test_read_write_only_tensor", (10, 10), PLAIN, PLAIN),
        _case("dtensor-to-plain", "test_dtensor_checkpoint.py::DTensorPlanner (a DTensor loaded as a tensor)",
              (8, 4), _spec("1d", "S0"), PLAIN),
        _case("plain-to-dtensor", "test_dtensor_checkpoint.py::DTensorPlanner (a tensor loaded as a DTensor)",
              (8, 4), PLAIN, _spec("1d", "S0")),
        _case("noncontiguous-local", "test_dtensor_checkpoint.py (a DTensor's local shard, not contiguous)",
              (8, 4), _spec("1d", "S0", local="noncontiguous"), _spec("1d", "S0")),
        _case("noncontiguous-target", "test_dtensor_checkpoint.py (restored into a DTensor whose local shard "
              "is not contiguous)", (8, 4), _spec("1d", "S0"), _spec("1d", "S1", local="noncontiguous")),
        _case("noncontiguous-target-same", "test_dtensor_checkpoint.py (the same layout, into a DTensor whose "
              "local shard is not contiguous)", (8, 4), _spec("1d", "S0"), _spec("1d", "S0", local="noncontiguous")),
        _case("submesh", "test_dtensor_checkpoint.py::DTensorPlanner::test_distributed_tensor_planner (a DTensor on "
              "a sub-mesh: ranks outside hold nothing)", (8, 4), _spec("sub", "S0"), _spec("sub", "S0")),
        _case("submesh-to-1d", "test_dtensor_checkpoint.py (sub-mesh to the whole mesh)", (8, 4), _spec("sub", "S0"),
              _spec("1d", "S1")),
        _case("1d-to-submesh", "test_dtensor_checkpoint.py (whole mesh to a sub-mesh)", (8, 4), _spec("1d", "R"),
              _spec("sub", "S1")),
        _case("conj-beside", "views: a complex tensor and its conj() view in one state", (4, 3), PLAIN, PLAIN,
              dtype="complex64", with_conj=True),
    ]
    return cases


DTYPES = ["float32", "float64", "float16", "bfloat16", "bool", "int8", "uint8", "int32", "int64",
          "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"]
VIEWS = ["none", "transposed", "narrowed", "strided", "expanded", "conj", "neg", "channels_last"]


@st.composite
def _generated(draw: st.DrawFn) -> dict:
    dtype = draw(st.sampled_from(DTYPES))
    sharded = draw(st.booleans())
    if sharded:
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=2)))
        dims = [f"S{d}" for d in range(len(shape))] + ["R"]
        specs = st.one_of(st.builds(lambda p: _spec("1d", p), st.sampled_from(dims)),
                          st.builds(lambda a, b: _spec("2d", a, b), st.sampled_from(dims), st.sampled_from(dims)),
                          st.just(dict(PLAIN)))
        save, load, view = draw(specs), draw(specs), "none"
    else:
        view = draw(st.sampled_from(VIEWS))
        rank = 4 if view == "channels_last" else draw(st.integers(0 if view in ("none", "conj", "neg") else 1, 3))
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=rank, max_size=rank)))
        if view == "conj" and not dtype.startswith("complex"):
            view = "none"
        save, load = dict(PLAIN), dict(PLAIN)
    return _case("", "hypothesis", shape, save, load, dtype=dtype, view=view, seed=draw(st.integers(0, 2**31 - 1)))


def generated(n: int) -> list[dict]:
    """``n`` cases drawn derandomized: the same ones in every run and on every machine."""
    out: list[dict] = []

    @settings(derandomize=True, database=None, max_examples=n, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(_generated())
    def collect(case: dict) -> None:
        out.append(case)

    collect()
    seen, unique = set(), []
    for case in out:
        key = repr({k: v for k, v in case.items() if k != "seed"})
        if key not in seen:
            seen.add(key)
            unique.append({**case, "id": f"gen{len(unique):03d}-{case['dtype']}-{case['view']}"})
    return unique[:n]


def fast_subset(cases: list[dict]) -> list[dict]:
    """What ``make test`` runs: the cases that found bugs plus one of each kind of layout change."""
    wanted = {"1d-S0-S1", "1d-S0-R", "1d-R-S1", "2d-S0R-RS0", "2d-RS0-S0R", "2d-S0S1-S1S0", "2d-S0R-S0S1",
              "mesh-1d-S0-2d-RS0", "mesh-2d-S0S1-1d-S1", "uneven-S0-S1", "empty-shard-S0-R", "fsdp-to-tp",
              "fsdp-tp-to-fsdp", "plain-tensor", "dtensor-to-plain", "plain-to-dtensor", "noncontiguous-local",
              "noncontiguous-target", "noncontiguous-target-same", "submesh", "submesh-to-1d", "1d-to-submesh",
              "conj-beside"}
    return [c for c in cases if c["id"] in wanted or c["id"].startswith("gen00")]


# Model-and-optimizer cases (issue 47; ``conformance_models_child.py``): a model held as users hold
# it (KIND: a bare module, DDP, FSDP2, HSDP, FSDP2+TP, FSDP2 over a mesh of permuted ranks), its
# optimizer, trained one step, saved and restored as another KIND or the same.
KINDS = ["plain", "ddp", "fsdp", "hsdp", "tp_fsdp", "permuted"]


def _model(cid: str, save: str, load: str, *, groups: bool = False, reorder: bool = False, extras: bool = False,
           stateful: bool = False, dcp_saver: str = "save") -> dict:
    return {"id": cid, "save": save, "load": load, "groups": groups, "reorder": reorder, "extras": extras,
            "stateful": stateful, "dcp_saver": dcp_saver}


def model_cases(generated_n: int = 12) -> list[dict]:
    """Named cases (each layout change and option at least once) plus ``generated_n`` drawn by
    hypothesis (derandomized) over layout pairs and options."""
    named = [
        _model("m-fsdp-groups-reorder", "fsdp", "fsdp", groups=True, reorder=True, extras=True),
        _model("m-fsdp-stateful", "fsdp", "fsdp", stateful=True, reorder=True),
        _model("m-tp-fsdp-to-fsdp", "tp_fsdp", "fsdp", reorder=True),
        _model("m-fsdp-to-tp-fsdp", "fsdp", "tp_fsdp", groups=True),
        _model("m-hsdp-to-fsdp", "hsdp", "fsdp", groups=True, dcp_saver="async"),
        _model("m-fsdp-to-hsdp", "fsdp", "hsdp", extras=True, dcp_saver="planner"),
        _model("m-ddp-to-plain", "ddp", "plain", reorder=True),
        _model("m-plain-to-ddp", "plain", "ddp", reorder=True, extras=True),
        _model("m-permuted-to-fsdp", "permuted", "fsdp", reorder=True, dcp_saver="async"),
        _model("m-ddp-stateful", "ddp", "ddp", stateful=True, groups=True, dcp_saver="planner"),
    ]
    out: list[dict] = []

    @settings(derandomize=True, database=None, max_examples=generated_n, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(KINDS), st.sampled_from(KINDS), st.booleans(), st.booleans(), st.booleans(),
           st.booleans(), st.sampled_from(["save", "async", "planner"]))
    def collect(save: str, load: str, groups: bool, reorder: bool, extras: bool, stateful: bool, saver: str) -> None:
        out.append(_model("", save, load, groups=groups, reorder=reorder, extras=extras, stateful=stateful,
                          dcp_saver=saver))

    collect()
    seen, unique = set(), []
    for case in out:
        key = repr({k: v for k, v in case.items() if k != "id"})
        if key not in seen:
            seen.add(key)
            unique.append({**case, "id": f"m-gen{len(unique):02d}-{case['save']}-{case['load']}"})
    return named + unique[:generated_n]


def model_fast_subset(cases: list[dict]) -> list[dict]:
    """What ``make test`` runs of them: the four wrongs of issue 47 and a TP and an HSDP change."""
    wanted = {"m-fsdp-groups-reorder", "m-fsdp-stateful", "m-plain-to-ddp", "m-tp-fsdp-to-fsdp"}
    return [c for c in cases if c["id"] in wanted]
