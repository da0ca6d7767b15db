"""The two test tiers: the quick one (``-m "not slow"``) runs each property test with a
quarter of its hypothesis examples, at least 10; the full one runs them all."""

from helpers import tier_examples


def test_tier_is_set_by_the_root_conftest():
    import os

    assert os.environ["ATTN_TEST_TIER"] in ("quick", "full")


def test_examples_per_tier(monkeypatch):
    monkeypatch.setenv("ATTN_TEST_TIER", "quick")
    assert [tier_examples(n) for n in (6, 25, 60, 150, 400)] == [6, 10, 15, 37, 100]
    monkeypatch.setenv("ATTN_TEST_TIER", "full")
    assert [tier_examples(n) for n in (6, 25, 60, 150, 400)] == [6, 25, 60, 150, 400]
