"""The TPU ranker's tuned-tiling table (``ranker_tuning``) and ``attn tune`` on a TPU
(``tune_ranker``): which tiling ``config=None`` runs, and the table the sweep writes."""

from __future__ import annotations

import json
import math
import warnings

import jax
import jax.numpy as jnp
import pytest

from attn_common import CapMethod, CapParams, KernelConfig
from attn_common.suite import RANKER_SUITE
from attn_pallas_tpu import ranker_tuning, tune_ranker
from attn_pallas_tpu.ranker_config import default_config
from attn_pallas_tpu.ranker_fwd import prepare

DEVICE = "TPU v5 lite"
SOFT = CapParams(CapMethod.SOFT_SIGN, 80.0)


def _entry(block_q=256, block_kv=512, *, bucket=2048, device=DEVICE, cap="soft_sign", dim=128):
    return {
        "device_kind": device, "dtype": "bfloat16", "head_dim": dim, "cap": cap,
        "seq_bucket": bucket, "case": "phoenix", "block_q": block_q, "block_kv": block_kv,
    }  # fmt: skip


@pytest.fixture
def user_table(tmp_path, monkeypatch):
    path = tmp_path / "tpu_ranker_tuned.json"
    monkeypatch.setenv("ATTN_TPU_TUNED_CONFIGS", str(path))
    # Only this table: the package's own (a v5e's entries) is tested below.
    monkeypatch.setattr(ranker_tuning, "PACKAGE_TABLE", tmp_path / "no_package_table.json")

    def write(*entries, fmt=1):
        path.write_text(json.dumps({"format": fmt, "entries": list(entries)}))

    return write


def _config(seq_len=1152, dtype=jnp.bfloat16, cap=SOFT, device=DEVICE, dim=128):
    return ranker_tuning.config_for(
        seq_len=seq_len, head_dim=dim, dtype=dtype, cap=cap, device_kind=device
    )


def test_no_table_gives_the_default(user_table):
    assert _config() == default_config(1152, 128)
    assert ranker_tuning.lookup(
        head_dim=128, dtype=jnp.bfloat16, cap=SOFT, seq_len=1152, device_kind=DEVICE
    ) == (None, "defaults")


def test_user_entry_exact_and_nearest_bucket(user_table):
    user_table(_entry(128, 384, bucket=2048), _entry(128, 128, bucket=8192))
    assert _config(1152) == KernelConfig(block_q=128, block_kv=384)  # bucket 2048
    assert _config(5000) == KernelConfig(block_q=128, block_kv=128)  # bucket 8192
    assert _config(3000) == KernelConfig(block_q=128, block_kv=384)  # 4096: nearer 2048
    assert _config(1152, dtype=jnp.float32) == KernelConfig(block_q=128, block_kv=384)
    # another chip, head dim or cap: not this entry
    assert _config(device="TPU v6 lite") == default_config(1152, 128)
    assert _config(dim=64) == default_config(1152, 64)
    assert _config(cap=None) == default_config(1152, 128)


def test_an_entry_that_pads_far_more_than_the_default_is_not_taken(user_table):
    """The nearest bucket may be a longer problem's: its blocks are taken only while they
    pad ``S`` at most ``PAD_SLACK`` times the default's padding."""
    user_table(_entry(640, 640, bucket=2048))
    assert _config(1152) == KernelConfig(block_q=640, block_kv=640)  # 1280 vs 1152 rows
    assert _config(300) == default_config(300, 128)  # bucket 512 -> 2048: 640 vs 384 rows
    assert _config(700) == default_config(700, 128)  # 1280 vs 768 rows
    assert _config(1900) == KernelConfig(block_q=640, block_kv=640)  # 1920 either way


def test_entries_that_do_not_fit_or_are_invalid_fall_back(user_table):
    user_table(_entry(144, 128, dim=256))  # a KernelConfig, but not a multiple of 128
    assert _config(dim=256) == default_config(1152, 256)
    user_table(_entry(1024, 1024, dim=256))  # fits the VMEM model in bf16, not in f32
    assert _config(2048, dim=256) == KernelConfig(block_q=1024, block_kv=1024)
    assert _config(2048, dim=256, dtype=jnp.float32) == default_config(2048, 256)


def test_broken_table_warns_and_falls_back(user_table):
    user_table(_entry(), fmt=7)
    with pytest.warns(UserWarning, match="ignoring the tuned-config table"):
        assert _config() == default_config(1152, 128)


def test_the_op_runs_the_tabled_tiling(user_table):
    """``config=None`` takes the table's entry for this device (the CPU here); an explicit
    config wins."""
    here = jax.devices()[0].device_kind
    user_table(_entry(128, 256, bucket=256, device=here, cap="none", dim=64))
    q = jnp.zeros((1, 200, 2, 64), jnp.bfloat16)
    bounds = jnp.asarray([[0, 150, 150, 200]], jnp.int32)
    _, st, _ = prepare(q, q, q, bounds, sm_scale=0.1, cap=None, config=None)
    assert (st.block_q, st.block_kv) == (128, 256)
    explicit = KernelConfig(block_q=256, block_kv=128)
    _, st, _ = prepare(q, q, q, bounds, sm_scale=0.1, cap=None, config=explicit)
    assert (st.block_q, st.block_kv) == (256, 128)


def test_the_shipped_table_covers_the_suite_on_a_v5e(tmp_path, monkeypatch):
    """The package's table (measured on a v5e): each suite case's key has an entry that
    validates and fits, and with no user table ``config_for`` returns it."""
    monkeypatch.setenv("ATTN_TPU_TUNED_CONFIGS", str(tmp_path / "none.json"))
    table = json.loads(ranker_tuning.PACKAGE_TABLE.read_text())
    assert table["provenance"]["device"] == DEVICE and table["entries"]
    for case in RANKER_SUITE:
        got, source = ranker_tuning.lookup(
            head_dim=case.head_dim, dtype=jnp.bfloat16, cap=case.cap, seq_len=case.seq_len,
            device_kind=DEVICE,
        )  # fmt: skip
        assert source.startswith("package table"), case.name
        assert ranker_tuning.fits(got, head_dim=case.head_dim, dtype=jnp.bfloat16), case.name
    for entry in table["entries"]:  # the timed tiling it names, never faster than claimed
        assert entry["ms"] <= entry["default_ms"]
        timed = [t for t in table["trials"] if t["case"] == entry["case"]]
        assert min(t["ms"] for t in timed) == entry["ms"] or entry["ms"] == entry["default_ms"]


def _row(case, ms, bq=384, bkv=384, *, sweep=False, mode="fwd+bwd", **extra):
    return dict(case=case, layout="padded", mode=mode, head_dim=128, cap="soft_sign",
                seq_len=1152, block_q=bq, block_kv=bkv, device_ms=ms, ms=ms + 1.0,
                **({"sweep": True} if sweep else {}), **extra)  # fmt: skip


def test_table_takes_the_fastest_tiling_only_past_min_gain():
    result = {
        "device": DEVICE,
        "rows": [
            _row("phoenix", 10.0),
            _row("phoenix", 9.95, 256, 512, sweep=True),  # 0.5 % faster: not enough
            _row("phoenix", 5.0, 128, 128, sweep=True, mode="fwd"),  # another mode
            _row("phoenix", 1.0, 640, 640, sweep=True, error="OOM"),  # failed
            _row("long", 20.0, 640, 640),
            _row("long", 18.0, 512, 640, sweep=True),
            _row("long", 19.0, 640, 512, sweep=True),
        ],
    }
    table = tune_ranker.table_from_result(result, objective="fwd+bwd", min_gain=0.01)
    by_case = {e["case"]: e for e in table["entries"]}
    assert (by_case["phoenix"]["block_q"], by_case["phoenix"]["block_kv"]) == (384, 384)
    assert by_case["phoenix"]["ms"] == 10.0 and by_case["phoenix"]["default_ms"] == 10.0
    assert (by_case["long"]["block_q"], by_case["long"]["block_kv"]) == (512, 640)
    assert by_case["long"]["ms"] == 18.0 and by_case["long"]["default_ms"] == 20.0
    assert by_case["long"]["seq_bucket"] == 2048 and by_case["long"]["device_kind"] == DEVICE
    assert len(table["trials"]) == 3  # the timed sweep rows of the objective
    zero = tune_ranker.table_from_result(result, objective="fwd+bwd", min_gain=0.0)
    assert {e["case"]: e["block_q"] for e in zero["entries"]}["phoenix"] == 256


def test_tune_refuses_off_a_tpu_in_one_line(capsys):
    if jax.default_backend() == "tpu":
        pytest.skip("runs on a TPU here")
    assert tune_ranker.main(["--cases", "phoenix"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--smoke" in err


@pytest.mark.slow
def test_tune_smoke_writes_a_table_the_op_reads(tmp_path, monkeypatch):
    """The whole tool in interpret mode: the sweep, the table (merged with an entry of
    another key), and ``config_for`` reading it back."""
    out = tmp_path / "t.json"
    other = _entry(device="TPU v6 lite")
    out.write_text(json.dumps({"format": 1, "entries": [other], "trials": []}))
    argv = ["--smoke", "--cases", "small-d64", "--objective", "fwd", "--iterations", "1",
            "--out", str(out), "--results", str(tmp_path / "res")]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert tune_ranker.main(argv) == 0
    table = json.loads(out.read_text())
    assert table["entries"][0] == other
    (entry,) = table["entries"][1:]
    assert entry["case"] == "small-d64-smoke" and entry["objective"] == "fwd"
    assert any(t["case"] == "small-d64-smoke" for t in table["trials"])
    monkeypatch.setenv("ATTN_TPU_TUNED_CONFIGS", str(out))
    # The sweep's winner is timed in interpret mode, so any of its tilings may win: ask at
    # a length the winner's blocks divide, where it pads no more than the default does.
    seq_len = math.lcm(entry["block_q"], entry["block_kv"])
    got = ranker_tuning.config_for(
        seq_len=seq_len, head_dim=64, dtype=jnp.bfloat16, cap=None, device_kind=entry["device_kind"]
    )
    assert (got.block_q, got.block_kv) == (entry["block_q"], entry["block_kv"])


def test_attn_tune_parser_on_a_tpu_is_the_tool():
    """``attn tune`` as the TPU backend adds it: the tool's flags and defaults, its run,
    and its one-line refusal off a TPU."""
    from attn_common.cli_args import OneLineParser
    from attn_pallas_tpu import cli

    parser = OneLineParser(prog="attn")
    cli.COMMANDS["tune"](parser.add_subparsers(dest="command"))
    args = parser.parse_args(["tune", "--objective", "fwd", "--cases", "long"])
    assert args.func is cli.cmd_tune and args.error_prog == "attn tune"
    assert (args.objective, args.cases, args.min_gain, args.iterations) == (
        "fwd",
        ["long"],
        0.01,
        5,
    )
    if jax.default_backend() != "tpu":
        assert "--smoke" in args.check(args)
    smoke = parser.parse_args(["tune", "--smoke"])
    assert smoke.check(smoke) is None  # interpret mode runs anywhere
