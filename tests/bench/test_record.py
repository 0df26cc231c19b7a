"""Record / new_record: the typed common fields, written as the same JSON keys as before."""

from __future__ import annotations

import dataclasses
import json

from leangrad_bench import RECORD_FIELDS, Record, new_record


def test_record_fields_are_the_dataclass_fields_in_order() -> None:
    assert tuple(f.name for f in dataclasses.fields(Record)) == RECORD_FIELDS
    assert RECORD_FIELDS[:3] == ("engine", "config", "peak_bytes")
    assert Record().as_dict() == dict.fromkeys(RECORD_FIELDS)


def test_new_record_is_fromkeys_then_update_key_for_key() -> None:
    common = {"suite": "s", "engine": "e", "series": "a"}
    old = dict.fromkeys(RECORD_FIELDS)
    old.update(common, kind="k", peak_bytes=3, x=1, series="b")
    new = new_record(common, kind="k", peak_bytes=3, x=1, series="b")
    assert new == old and list(new) == list(old)
    assert json.dumps(new) == json.dumps(old)
    assert list(new_record()) == list(RECORD_FIELDS)
