"""Pre-encoded List responses decode to the same messages."""

from cri_api import api_pb2 as pb
from shim.cri.list_cache import field1_entry, labels_match
from shim.cri.servicer import _split_entries


def test_concatenated_entries_are_a_valid_response() -> None:
    items = [pb.Container(id=str(i) * 64, labels={"a": "b" * i}) for i in range(1, 300, 37)]
    data = b"".join(field1_entry(c.SerializeToString()) for c in items)
    assert list(pb.ListContainersResponse.FromString(data).containers) == items
    assert len(_split_entries(data)) == len(items)


def test_labels_match() -> None:
    assert labels_match({"a": "1", "b": "2"}, {"a": "1"})
    assert not labels_match({"a": "1"}, {"a": "2"})
    assert not labels_match({}, {"a": "1"})
