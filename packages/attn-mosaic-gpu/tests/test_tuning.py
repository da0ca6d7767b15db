"""The tuned-config tables and the `attn tune` sweep, on the CPU (no GPU needed).

The sweep's timer is replaced by a cost model of the knobs, so the test checks the
coordinate descent, the table it writes and how ``ranker_attention(config=None)`` reads
tables back (user table first, exact key, then nearest sequence bucket, else defaults).
"""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_cli_usage_error

from attn_common import CapMethod, CapParams, KernelConfig, ranker_case
from attn_common.cli import main as attn_main
from attn_mosaic_gpu import tuner, tuning
from attn_mosaic_gpu.ranker import resolve_tuning
from attn_mosaic_gpu.ranker_fwd import default_config

SOFT_SIGN = CapParams(CapMethod.SOFT_SIGN, 80.0)
TANH = CapParams(CapMethod.TANH, 30.0)


@pytest.fixture
def user_table(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    monkeypatch.setenv("ATTN_TUNED_CONFIGS", str(path))
    return path


def _entry(device="cpu", dtype="bfloat16", head_dim=128, cap="soft_sign", bucket=2048, **fwd):
    forward = {"block_q": 64, "block_kv": 128, "num_stages": 2, **fwd}
    return {
        "device_kind": device,
        "dtype": dtype,
        "head_dim": head_dim,
        "cap": cap,
        "seq_bucket": bucket,
        "forward": forward,
        "backward": {"num_stages": 2, "exp2_fma_cols": 16},
    }


def _write(path, *entries):
    path.write_text(json.dumps({"format": 1, "entries": list(entries)}))


@pytest.mark.parametrize(
    "seq, bucket", [(1, 256), (256, 256), (257, 512), (1152, 2048), (5120, 8192)]
)
def test_seq_bucket(seq, bucket):
    assert tuning.seq_bucket(seq) == bucket


def test_user_table_exact_then_nearest_bucket_then_defaults(user_table):
    _write(
        user_table,
        _entry(exp2_fma_cols=48, rcp_fma_cols=64),
        _entry(bucket=8192, exp2_fma_cols=16),
        _entry(cap="tanh", bucket=8192, block_kv=64, num_stages=3),
    )
    look = jax.tree_util.Partial(tuning.lookup, head_dim=128, dtype=jnp.bfloat16, device_kind="cpu")
    exact = look(cap=SOFT_SIGN, seq_len=1152)
    assert exact.forward == KernelConfig(64, 128, 2, exp2_fma_cols=48, rcp_fma_cols=64)
    assert exact.backward == tuning.BackwardTuning(num_stages=2, exp2_fma_cols=16)
    assert exact.source.startswith("user table")
    # 4096 is one bucket from 2048 and 8192: the smaller bucket wins the tie.
    assert look(cap=SOFT_SIGN, seq_len=4000).forward.exp2_fma_cols == 48
    assert look(cap=SOFT_SIGN, seq_len=6000).forward.exp2_fma_cols == 16
    # The cap method is part of the key: tanh finds its own entry at any length.
    assert look(cap=TANH, seq_len=300).forward == KernelConfig(64, 64, 3)
    # fp16 shares the bf16 entries (both 2 bytes; the kernels are the same).
    fp16 = tuning.lookup(
        head_dim=128, dtype=jnp.float16, cap=SOFT_SIGN, seq_len=1152, device_kind="cpu"
    )
    assert fp16.forward.exp2_fma_cols == 48
    # Untuned: another device, another head dim, no cap entry -> the defaults, no error.
    for kw in (
        dict(head_dim=128, cap=SOFT_SIGN, device_kind="NVIDIA H100 80GB HBM3"),
        dict(head_dim=64, cap=SOFT_SIGN, device_kind="cpu"),
        dict(head_dim=128, cap=None, device_kind="cpu"),
    ):
        found = tuning.lookup(dtype=jnp.bfloat16, seq_len=1152, **kw)
        assert found.source == "defaults"
        assert found.forward == default_config(kw["head_dim"])
        assert found.backward == tuning.BackwardTuning()


def test_user_table_wins_over_package_table(user_table, tmp_path, monkeypatch):
    package = tmp_path / "package.json"
    _write(package, _entry(exp2_fma_cols=32))
    monkeypatch.setattr(tuning, "PACKAGE_TABLE", package)
    found = tuning.lookup(
        head_dim=128, dtype=jnp.bfloat16, cap=SOFT_SIGN, seq_len=1152, device_kind="cpu"
    )
    assert found.forward.exp2_fma_cols == 32 and found.source.startswith("package table")
    _write(user_table, _entry(exp2_fma_cols=96))
    found = tuning.lookup(
        head_dim=128, dtype=jnp.bfloat16, cap=SOFT_SIGN, seq_len=1152, device_kind="cpu"
    )
    assert found.forward.exp2_fma_cols == 96 and found.source.startswith("user table")


def test_broken_user_table_warns_and_falls_back(user_table):
    user_table.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the tuned-config table"):
        found = tuning.lookup(
            head_dim=128, dtype=jnp.bfloat16, cap=SOFT_SIGN, seq_len=1152, device_kind="cpu"
        )
    assert found.source != "" and found.forward is not None
    _write(user_table, {**_entry(), "forward": {"block_q": 64, "block_kv": 100}})
    with pytest.warns(UserWarning, match="KernelConfig.block_kv"):
        tuning.lookup(
            head_dim=128, dtype=jnp.bfloat16, cap=SOFT_SIGN, seq_len=1152, device_kind="cpu"
        )


def test_package_table_parses():
    data = json.loads(tuning.PACKAGE_TABLE.read_text())
    assert data["format"] == 1
    for entry in data["entries"]:
        tuning._parse_entry(entry)  # every shipped config is a valid KernelConfig
        assert entry["device_kind"].startswith("NVIDIA")


def test_ranker_attention_reads_the_table(user_table):
    """config=None takes the table's forward config and backward knobs on this device;
    one the problem cannot use (too much shared memory for D=256) gives way to the
    default; an explicit config wins."""
    device = jax.devices()[0].device_kind
    q = jnp.zeros((1, 1152, 2, 128), jnp.bfloat16)
    _write(user_table, _entry(device=device, exp2_fma_cols=48, rcp_fma_cols=64))
    config, bwd = resolve_tuning(q, SOFT_SIGN, None, None)
    assert config == KernelConfig(64, 128, 2, exp2_fma_cols=48, rcp_fma_cols=64)
    assert bwd == tuning.BackwardTuning(num_stages=2, exp2_fma_cols=16)
    mine = KernelConfig(64, 64, 3)
    assert resolve_tuning(q, SOFT_SIGN, mine, None)[0] == mine

    q256 = jnp.zeros((1, 1152, 2, 256), jnp.bfloat16)
    _write(user_table, _entry(device=device, head_dim=256, block_kv=256, num_stages=4))
    config, bwd = resolve_tuning(q256, SOFT_SIGN, None, None)
    assert config == default_config(256) and bwd is None


def _cost_model(fn, args, *, stage, knobs):
    """Synthetic ms: best forward at block_kv=128, exp2 64, rcp 64; best backward at
    exp2 32, 2 stages. Never runs ``fn``."""
    del fn, args
    if stage == "forward":
        return (
            2.0
            + abs(knobs["exp2_fma_cols"] - 64) / 100
            + abs(knobs["rcp_fma_cols"] - 64) / 200
            + (0.0 if knobs["block_kv"] == 128 else 0.3)
        )
    fwd = 2.0
    return fwd + 5.0 + abs(knobs["exp2_fma_cols"] - 32) / 50 + (knobs["num_stages"] - 2) * 0.2


def test_tune_descends_to_the_modelled_best():
    case = ranker_case("phoenix").scaled(1)
    timed = []  # every point the tuner timed, in order

    def timer(fn, args, *, stage, knobs):
        timed.append((stage, dict(knobs)))
        return _cost_model(fn, args, stage=stage, knobs=knobs)

    table = tuner.tune([case], timer=timer, progress=lambda _: None)
    (entry,) = table["entries"]
    assert entry["forward"] == {
        "block_q": 64, "block_kv": 128, "num_stages": 2, "exp2_fma_cols": 64, "rcp_fma_cols": 64
    }  # fmt: skip
    assert entry["backward"] == {"num_stages": 2, "exp2_fma_cols": 32, "rcp_fma_cols": 0}
    assert entry["seq_bucket"] == 2048 and entry["cap"] == "soft_sign"
    assert np.isclose(entry["forward_ms"], 2.0)
    assert np.isclose(entry["backward_ms"], 5.0)
    # Every timed point is recorded once, with its time, in the order it was timed.
    trials = table["trials"][0]
    recorded = [("forward", t) for t in trials["forward"]]
    recorded += [("fwd+bwd", t) for t in trials["backward"]]
    assert [(stage, {k: v for k, v in t.items() if k != "ms"}) for stage, t in recorded] == [
        (stage, knobs) for stage, knobs in timed
    ]
    assert len({tuple(sorted(k.items())) for s, k in timed if s == "forward"}) == len(
        trials["forward"]
    )
    tuning._parse_entry(entry)

    merged = tuning.merge_tables({"format": 1, "entries": [_entry(), _entry(bucket=512)]}, table)
    buckets = sorted(e["seq_bucket"] for e in merged["entries"])
    assert buckets == [512, 2048]  # the new 2048 entry replaced the old one


@pytest.mark.parametrize(
    "knob,value,case_name",
    [("programs", 132, "small-d64"), ("compute_registers", 240, "phoenix")],
)
def test_tune_keeps_a_faster_forward_knob(monkeypatch, knob, value, case_name):
    """On a device with an SM count the forward sweep tries programs = 0 or SMs after the
    tiling, and 240 registers per compute warpgroup last (the default 232 is written as
    0); it keeps a value that measures faster, and the table entry parses back to it."""
    monkeypatch.setattr(tuner, "_sm_count", lambda: 132)

    def cost(fn, args, *, stage, knobs):
        ms = _cost_model(fn, args, stage=stage, knobs=knobs)
        return ms - (0.2 if stage == "forward" and knobs.get(knob) == value else 0.0)

    case = ranker_case(case_name).scaled(1)
    (entry,) = tuner.tune([case], timer=cost, progress=lambda _: None)["entries"]
    assert entry["forward"][knob] == value
    assert getattr(tuning._parse_entry(entry)[1].forward, knob) == value


# packed (~7 s) in the slow tier: packed rows lower in the quick tier at the table's block
# sizes in test_ranker_fwd_cpu.py's test_smem_bytes_is_what_mosaic_allocates (users=2).
@pytest.mark.parametrize(
    "packed", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["one-user", "packed"]
)
def test_package_table_forward_configs_lower(packed):
    """Every H200 entry's forward config, as ``resolve_tuning`` hands it to its case
    (packed rows without persistent programs), passes the kernel's checks and lowers to
    one Mosaic GPU kernel whose memory warpgroup keeps what the compute warpgroups leave
    of the 504 registers."""
    from attn_mosaic_gpu.ranker_fwd import ranker_attention_fwd

    for entry in json.loads(tuning.PACKAGE_TABLE.read_text())["entries"]:
        case = ranker_case(entry["case"]).scaled(2)
        config = tuning._parse_entry(entry)[1].forward
        if packed:
            config = config.replace(programs=0)
        sds = jax.ShapeDtypeStruct
        b, s, hq, hkv, d = case.batch, case.seq_len, case.q_heads, case.kv_heads, case.head_dim
        bounds = sds((b, 3, 4) if packed else (b, 4), jnp.int32)

        def f(q, k, v, bounds, cap=case.cap, config=config):
            return ranker_attention_fwd(q, k, v, bounds, cap=cap, config=config, return_lse=True)

        text = jax.export.export(jax.jit(f), platforms=["cuda"])(
            sds((b, s, hq, d), jnp.bfloat16),
            sds((b, s, hkv, d), jnp.bfloat16),
            sds((b, s, hkv, d), jnp.bfloat16),
            bounds,
        ).mlir_module()
        memory = 504 - 2 * (config.compute_registers or 232)
        assert text.count(f"setmaxnreg.dec.sync.aligned.u32 {memory};") == 1, entry["case"]


def test_packed_bounds_drop_the_tables_persistent_programs(user_table):
    """A table config with persistent programs serves one-user rows as it is and packed
    rows ``[B, U, 4]`` (which the persistent kernel does not take) with programs=0."""
    device = jax.devices()[0].device_kind
    q = jnp.zeros((1, 1152, 2, 128), jnp.bfloat16)
    entry = _entry(device=device)
    entry["forward"]["programs"] = 132
    _write(user_table, entry)
    assert resolve_tuning(q, SOFT_SIGN, None, None)[0].programs == 132
    one_user, packed = jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 3, 4), jnp.int32)
    assert resolve_tuning(q, SOFT_SIGN, None, None, bounds=one_user)[0].programs == 132
    config = resolve_tuning(q, SOFT_SIGN, None, None, bounds=packed)[0]  # shape only
    assert config == tuning._parse_entry(entry)[1].forward.replace(programs=0)


def test_tune_sweeps_persistent_dq_before_the_ring_depth(monkeypatch):
    """On a device with an SM count the backward sweep tries dq_programs = 0 or SMs,
    before the ring depth: a persistent dq that a deeper ring would not fit (the timer
    refuses 3 stages with it, as pipelined_bwd does at D=128) is still found, although
    3 stages beat 2 for the per-tile dq (so the other order would end at 3, per-tile)."""
    monkeypatch.setattr(tuner, "_sm_count", lambda: 132)

    def cost(fn, args, *, stage, knobs):
        if stage == "forward":
            return _cost_model(fn, args, stage=stage, knobs=knobs)
        persistent = knobs.get("dq_programs", 0) == 132
        if knobs["num_stages"] == 3 and persistent:
            raise ValueError("shared memory")
        deeper = 0.1 if knobs["num_stages"] == 3 else 0.0
        return 7.0 + abs(knobs["exp2_fma_cols"] - 32) / 50 - deeper - 0.3 * persistent

    case = ranker_case("phoenix").scaled(1)
    (entry,) = tuner.tune([case], timer=cost, progress=lambda _: None)["entries"]
    assert entry["backward"] == {
        "num_stages": 2, "exp2_fma_cols": 32, "rcp_fma_cols": 0, "dq_programs": 132
    }  # fmt: skip
    assert tuning.BackwardTuning(**entry["backward"]).dq_programs == 132


def test_tune_keeps_the_incumbent_within_noise():
    """A variant only 0.5% faster does not replace the default (min_gain 1%)."""

    def flat(fn, args, *, stage, knobs):
        gain = 1.0 - 0.005 * (knobs.get("exp2_fma_cols", 0) > 0)
        return gain if stage == "forward" else 1.0 + 2.0 * gain  # fwd+bwd: fwd 1 ms

    case = ranker_case("small-d64").scaled(1)
    (entry,) = tuner.tune([case], timer=flat, progress=lambda _: None)["entries"]
    assert entry["forward"]["exp2_fma_cols"] == 0
    assert entry["backward"]["exp2_fma_cols"] == 0


def test_attn_tune_needs_a_hopper_gpu(capsys):
    assert attn_main(["tune"]) == 2
    assert "needs a Hopper GPU" in capsys.readouterr().err


@pytest.mark.parametrize(
    "value, needle",
    [
        ("0.7", "--min-gain: got 0.7, expected 0 <= value < 0.5"),
        ("0.5", "--min-gain: got 0.5, expected 0 <= value < 0.5"),
        ("-0.01", "--min-gain: got -0.01, expected 0 <= value < 0.5"),
        # float() reads these (0.001, nan): a typo must not become a threshold
        ("0.0_1", "--min-gain: got '0.0_1', expected a fraction (a decimal number)"),
        ("nan", "--min-gain: got 'nan', expected a fraction (a decimal number)"),
    ],
)
def test_attn_tune_refuses_a_bad_min_gain(value, needle, capsys):
    """Refused while the arguments are parsed, before the GPU check, in one line."""
    assert_cli_usage_error(["tune", "--min-gain", value], needle, capsys)


def test_backward_tuning_knobs_are_checked():
    from attn_mosaic_gpu.ranker_bwd_pipelined import check_backward_knobs

    with pytest.raises(ValueError, match="exp2_fma_cols"):
        check_backward_knobs({"exp2_fma_cols": 12}, SOFT_SIGN)
    with pytest.raises(ValueError, match="rcp_fma_cols"):
        check_backward_knobs({"rcp_fma_cols": 32}, TANH)
    with pytest.raises(ValueError, match="unknown"):
        check_backward_knobs({"stages": 2}, TANH)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="dq_programs"):
            check_backward_knobs({"dq_programs": bad}, TANH)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_backward_knobs(tuning.BackwardTuning(exp2_fma_cols=64).knobs(), TANH)
        check_backward_knobs(tuning.BackwardTuning(dq_programs=132).knobs(), TANH)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_backward_rings_fit(head_dim):
    """At every ring depth the sweep tries, both backward kernels fit the shared
    memory of a block, and a deeper ring needs more of it."""
    from attn_mosaic_gpu._smem import SMEM_LIMIT_BYTES
    from attn_mosaic_gpu.ranker_bwd_pipelined import pipelined_smem_bytes, pipelined_stages

    sizes = [pipelined_smem_bytes(head_dim, jnp.bfloat16, num_stages=n) for n in (2, 3, 4)]
    for kernel in ("dq", "dkv"):
        assert sizes[0][kernel] < sizes[1][kernel] < sizes[2][kernel]
    sweep = sizes[:2] if head_dim > 64 else sizes[::2]
    assert max(max(size.values()) for size in sweep) <= SMEM_LIMIT_BYTES
    # persistent dq programs double dq's fixed buffers: they fit at the default depth
    for n in (2, 3, 4):
        persistent = pipelined_smem_bytes(head_dim, jnp.bfloat16, num_stages=n, dq_programs=132)
        assert persistent["dq"] > sizes[n - 2]["dq"] and persistent["dkv"] == sizes[n - 2]["dkv"]
        if n == pipelined_stages(head_dim):
            assert persistent["dq"] <= SMEM_LIMIT_BYTES


def test_persistent_dq_too_deep_a_ring_is_refused():
    """D=128 persistent dq fits a 2- or 3-slot ring with one user per row (231,624 bytes
    at 3); 4 slots, or 3 with the packed rows' key table (234,728), are refused before
    any kernel is built, naming the kernel and the bytes."""
    from attn_mosaic_gpu.ranker_bwd_pipelined import pipelined_bwd

    x = jnp.zeros((1, 128, 1, 128), jnp.bfloat16)
    vec = jnp.zeros((1, 1, 128), jnp.float32)
    fields = dict(batch=1, seq_pad=128, q_heads=1, kv_heads=1, head_dim=128, sm_scale=1.0, cap=TANH)
    bounds = jnp.array([[0, 100, 100, 120]], jnp.int32)
    for stages, users in ((4, 0), (3, 2)):
        with pytest.raises(ValueError, match=r"the dq kernel needs \d+ bytes of shared memory"):
            pipelined_bwd(
                x, x, x, x, vec, vec, bounds, st_fields=fields, interpret=None,
                tuning={"num_stages": stages, "dq_programs": 132}, users=users,
            )  # fmt: skip


def test_attn_tune_writes_and_merges_the_user_table(user_table, monkeypatch, capsys):
    """`attn tune` (sweep replaced by the cost model) writes the user table after each
    case, keeps entries of other keys, and lookup then reads it."""
    _write(user_table, _entry(device="other GPU", bucket=512))

    real_tune = tuner.tune

    def fake_tune(cases, **kw):
        return real_tune(cases, timer=_cost_model, progress=lambda _: None)

    monkeypatch.setattr(tuner, "tune", fake_tune)
    assert attn_main(["tune", "--allow-any-device", "--cases", "phoenix", "--batch", "1"]) == 0
    data = json.loads(user_table.read_text())
    assert [e["device_kind"] for e in data["entries"]] == [
        "other GPU",
        jax.devices()[0].device_kind,
    ]
    assert data["provenance"]["command"].startswith("attn tune")
    assert "phoenix" in capsys.readouterr().out
    found = resolve_tuning(jnp.zeros((1, 1152, 2, 128), jnp.bfloat16), SOFT_SIGN, None, None)
    assert found[0].exp2_fma_cols == 64 and found[1].exp2_fma_cols == 32
