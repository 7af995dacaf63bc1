"""The virtual GPU's card table and the ``--virtual-gpu`` spec parser."""

from __future__ import annotations

import re

import pytest

from memprof.collect.virtual.cards import CARDS, DEFAULT_CARD, parse_spec

# the issue's table: card -> (marketing GB, compute capability)
ISSUE_TABLE = {
    "H100 80GB": (80, (9, 0)),
    "H200": (141, (9, 0)),
    "H100 NVL 94GB": (94, (9, 0)),
    "A100 80GB": (80, (8, 0)),
    "A100 40GB": (40, (8, 0)),
    "L40S": (48, (8, 9)),
    "A10 24GB": (24, (8, 6)),
    "L4": (24, (8, 9)),
    "RTX 4090": (24, (8, 9)),
    "RTX 3090": (24, (8, 6)),
    "V100 16GB": (16, (7, 0)),
    "T4": (16, (7, 5)),
}


def test_the_table_is_the_issues():
    assert {card.name: card.capability for card in CARDS} == {
        name: capability for name, (_, capability) in ISSUE_TABLE.items()}
    assert DEFAULT_CARD.name == "H100 80GB"


@pytest.mark.parametrize("card", CARDS, ids=lambda c: c.name)
def test_driver_totals_are_below_the_marketing_size(card):
    # the driver keeps a few hundred MiB to about 1.5 GiB of the card for itself
    marketing = ISSUE_TABLE[card.name][0] << 30  # an "80GB" card has 80 GiB on board
    assert 0.90 * marketing < card.total_bytes < marketing
    assert card.total_bytes - card.context_bytes == card.usable_bytes > 0


@pytest.mark.parametrize(("spec", "name"), [
    ("h100", "H100 80GB"), ("H100 80GB", "H100 80GB"), ("NVIDIA H100 80GB HBM3", "H100 80GB"),
    ("h200", "H200"), ("H200 SXM 141GB", "H200"), ("NVIDIA H200", "H200"),
    ("h100-nvl", "H100 NVL 94GB"), ("A100", "A100 80GB"), ("A100-40GB", "A100 40GB"),
    ("a100_40gib", "A100 40GB"), ("a10", "A10 24GB"), ("A10 24GB", "A10 24GB"),
    ("l4", "L4"), ("L40S", "L40S"), ("rtx4090", "RTX 4090"),
    ("NVIDIA GeForce RTX 3090", "RTX 3090"), ("v100", "V100 16GB"),
    ("Tesla V100-SXM2-16GB", "V100 16GB"), ("t4", "T4"), ("Tesla T4", "T4"),
])
def test_card_names_are_forgiving(spec, name):
    assert parse_spec(spec).name == name


def test_device_names_round_trip():
    for card in CARDS:
        assert parse_spec(card.device_name) is card
        assert parse_spec(card.name) is card


@pytest.mark.parametrize(("spec", "total"), [
    ("24GiB", 24 << 30), ("24G", 24 << 30), ("1.5 TiB", 3 << 39),
    ("24GB", 24 * 10**9), ("24000MB", 24 * 10**9),  # decimal, as every size memprof reads
])
def test_sizes_make_a_card_of_that_memory(spec, total):
    card = parse_spec(spec)
    assert card.total_bytes == total
    assert card.capability == DEFAULT_CARD.capability
    assert card.context_bytes == DEFAULT_CARD.context_bytes


@pytest.mark.parametrize("spec", ["b200", "", "24 apples", "100MB", "0GB", "-3GB"])
def test_bad_specs_say_which_cards_exist(spec):
    with pytest.raises(ValueError) as error:
        parse_spec(spec)
    message = str(error.value)
    assert "\n" not in message and repr(spec) in message
    for card in CARDS:
        assert card.name in message
    assert re.search(r"such as 24GiB", message)
