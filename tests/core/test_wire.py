"""Wire format: spec round trips, buffer packing, and rejection of malformed specs (no process group)."""

import json

import pytest
import torch

from meshkd.core import wire
from meshkd.core.wire import tree_from_spec, tree_spec
from tests.trees import assert_same_tree, sample_batch


def round_trip(value):
    tensors = []
    spec = wire.decode_spec(wire.encode_spec(tree_spec(value, tensors)))
    leaves = wire.leaf_specs(spec)
    buffer = wire.pack_leaves(tensors, torch.device("cpu")).clone()  # clone: receivers own their buffer
    return tree_from_spec(spec, wire.unpack_leaves(buffer, leaves))


@pytest.mark.parametrize(
    "value",
    [sample_batch(0), sample_batch(3), torch.randn(2, 3, 4), torch.tensor(True), [], (), {}, None, 5, "s",
     (torch.zeros(0),), [torch.ones(3, dtype=torch.bool), torch.ones(2, dtype=torch.bfloat16)]],
)
def test_round_trip_preserves_structure_dtypes_and_values(value):
    assert_same_tree(round_trip(value), value)


def test_tree_spec_extracts_leaves_without_copies_and_rebuild_aliases_them():
    value = {"a": torch.arange(3), "b": [torch.ones(2)]}
    tensors = []
    spec = tree_spec(value, tensors)
    assert tensors[0] is value["a"] and tensors[1] is value["b"][0]
    rebuilt = tree_from_spec(spec, tensors)
    assert rebuilt["a"] is tensors[0] and rebuilt["b"][0] is tensors[1]
    json.dumps(spec)  # the spec is plain JSON: no pickle involved


def test_single_leaf_is_sent_from_its_own_memory():
    logits = torch.randn(2, 3, 5)
    assert wire.pack_leaves([logits], torch.device("cpu")).data_ptr() == logits.data_ptr()


def test_unsendable_values_are_rejected_on_the_sender():
    with pytest.raises(TypeError, match="cannot send a value of type object"):
        tree_spec({"x": object()}, [])
    with pytest.raises(TypeError, match="dict key of type tuple"):
        tree_spec({(1, 2): 3}, [])


def encoded(document) -> torch.Tensor:
    return torch.tensor(list(json.dumps(document).encode()), dtype=torch.uint8)


def tensor_node(index=0, dtype="float32", shape=(2,)):
    return {"tensor": index, "dtype": dtype, "shape": list(shape)}


@pytest.mark.parametrize(
    "document, message",
    [
        ({"version": 99, "tree": {"value": 1}}, "unknown wire format version 99"),
        ({"tree": {"value": 1}}, "unknown wire format version None"),
        ({"version": 1, "tree": tensor_node(dtype="float128")}, "unknown dtype 'float128'"),
        ({"version": 1, "tree": tensor_node(shape=(2, -1))}, "invalid shape"),
        ({"version": 1, "tree": tensor_node(shape=(1 << 40, 1 << 10))}, "larger than the limit"),
        ({"version": 1, "tree": {"list": [tensor_node(shape=(1 << 30,))] * 5000}}, "not 0..4999 in order"),
        ({"version": 1, "tree": {"list": [tensor_node(0), tensor_node(2)]}}, r"indices \[0, 2\]"),
        ({"version": 1, "tree": {"set": []}}, "unknown spec node kind 'set'"),
        ({"version": 1, "tree": {"dict": [["k"]]}}, r"\[key, value\] pairs"),
        ({"version": 1, "tree": {"value": [1, 2]}}, "invalid scalar leaf"),
        ({"version": 1, "tree": {"list": [], "a": 1, "b": 2}}, "malformed spec node"),
        ({"version": 1, "tree": {"value": 1}, "pickle": "x"}, "unexpected fields"),
    ],
)
def test_malformed_specs_are_rejected_before_allocation(document, message):
    with pytest.raises(wire.WireFormatError, match=message):
        wire.decode_spec(encoded(document))


def test_garbage_and_absurd_lengths_are_rejected():
    with pytest.raises(wire.WireFormatError, match="not valid JSON"):
        wire.decode_spec(torch.tensor([0x80, 0x04, 0x95], dtype=torch.uint8))  # a pickle header
    with pytest.raises(wire.WireFormatError, match="outside"):
        wire.checked_spec_length(1 << 40)


def test_a_spec_nested_past_the_json_parsers_recursion_is_a_wire_format_error():
    """A peer's (or an HTTP body's) spec nested 50,000 deep is refused as malformed, not a RecursionError."""
    deep = b'{"version":1,"tree":' + b'{"list":[' * 50_000 + b']}' * 50_000 + b"}"
    with pytest.raises(wire.WireFormatError, match="nested more than 64 levels"):
        wire.decode_spec(wire.bytes_tensor(deep))
    with pytest.raises(wire.WireFormatError, match="nested more than 64 levels"):
        wire.from_bytes(len(deep).to_bytes(8, "little") + deep)


def test_a_sender_error_reaches_the_receiver_as_its_message():
    with pytest.raises(wire.SenderError, match="rank 3 had nothing to send"):
        wire.decode_spec(wire.encode_error("rank 3 had nothing to send"))


def test_spec_bytes_is_what_encode_spec_carries():
    spec = tree_spec(sample_batch(2), [])
    document = wire.spec_bytes(spec)
    assert bytes(wire.encode_spec(spec).numpy()) == document == bytes(wire.bytes_tensor(document).numpy())
    assert wire.decode_spec(wire.bytes_tensor(document)) == json.loads(document)["tree"]
    # Equal structures give equal documents: the sender's "same spec as last time" test is a bytes comparison.
    assert wire.spec_bytes(tree_spec(sample_batch(2), [])) == document
    assert wire.spec_bytes(tree_spec(sample_batch(3), [])) != document


def test_payload_nbytes_and_receive_nbytes_match_the_packed_buffer():
    for value in (sample_batch(0), {"logits": torch.randn(2, 3, 5)}, {"x": 1}):
        tensors = []
        tree_spec(value, tensors)
        packed = wire.pack_leaves(tensors, torch.device("cpu")) if tensors else torch.empty(0, dtype=torch.uint8)
        assert wire.payload_nbytes(value) == wire.receive_nbytes(wire.leaves_of(tensors)) == packed.numel()
    assert wire.payload_nbytes({"logits": torch.randn(2, 3, 5)}) == 2 * 3 * 5 * 4  # one leaf: no padding


def test_pack_leaves_into_a_given_buffer():
    tensors = []
    value = sample_batch(1)
    tree_spec(value, tensors)
    size = wire.receive_nbytes(wire.leaves_of(tensors))
    out = torch.full((size,), 7, dtype=torch.uint8)
    packed = wire.pack_leaves(tensors, torch.device("cpu"), out=out)
    assert packed.data_ptr() == out.data_ptr()
    leaves = wire.leaves_of(tensors)
    assert_same_tree(tree_from_spec(tree_spec(value, []), wire.unpack_leaves(out, leaves)), value)
    with pytest.raises(ValueError, match="out must be a uint8 buffer"):
        wire.pack_leaves(tensors, torch.device("cpu"), out=torch.empty(size + 1, dtype=torch.uint8))
    assert wire.packs_in_place([torch.ones(3)], torch.device("cpu"))
    assert not wire.packs_in_place([torch.ones(3, 2).t()], torch.device("cpu"))


def test_a_value_survives_its_byte_string_and_a_damaged_one_is_refused():
    value = {"batch": {"input_ids": torch.arange(6).view(2, 3), "mask": torch.ones(2, 3, dtype=torch.bool)},
             "mode": "topk", "values": [torch.randn(2, 3, 4, dtype=torch.bfloat16), 1.5, None]}
    back = wire.from_bytes(wire.to_bytes(value))
    assert back["mode"] == "topk" and back["values"][1:] == [1.5, None]
    torch.testing.assert_close(back["batch"]["input_ids"], value["batch"]["input_ids"])
    assert torch.equal(back["values"][0], value["values"][0]) and back["batch"]["mask"].dtype == torch.bool
    assert wire.from_bytes(wire.to_bytes({"none": []})) == {"none": []}
    data = wire.to_bytes(value)
    for damaged, message in ((data[:5], "too few"), (data[:-1], "bytes of tensors"), (data + b"x", "bytes of tensors"),
                             ((1 << 30).to_bytes(8, "little") + data[8:], "outside"),
                             (data[:8] + b"}" + data[9:], "not valid JSON")):
        with pytest.raises(wire.WireFormatError, match=message):
            wire.from_bytes(damaged)


def test_a_value_reaches_a_device_in_one_copy_equal_to_its_host_form():
    """`from_bytes(..., device=)` and `to_device` give the value `from_bytes` gives, its leaves on the device (the
    meta device here: its leaves are views of the one moved buffer, shapes and dtypes kept)."""
    value = {"mode": "topk", "log_probs": torch.randn(2, 3, 4), "indices": torch.randint(0, 9, (2, 3, 4)).int(),
             "flags": torch.ones(5, dtype=torch.bool), "rest": [torch.randn(3, dtype=torch.bfloat16), 2.5]}
    data = wire.to_bytes(value)
    for moved in (wire.from_bytes(data, device=torch.device("cpu")), wire.to_device(value, torch.device("cpu"))):
        assert moved["mode"] == "topk" and moved["rest"][1] == 2.5
        for key in ("log_probs", "indices", "flags"):
            assert torch.equal(moved[key], value[key])
        assert torch.equal(moved["rest"][0], value["rest"][0])
    for moved in (wire.from_bytes(data, device=torch.device("meta")), wire.to_device(value, torch.device("meta"))):
        leaves = [moved["log_probs"], moved["indices"], moved["flags"], moved["rest"][0]]
        assert all(leaf.is_meta for leaf in leaves)
        assert [(leaf.dtype, leaf.shape) for leaf in leaves] == [(torch.float32, (2, 3, 4)), (torch.int32, (2, 3, 4)),
                                                                 (torch.bool, (5,)), (torch.bfloat16, (3,))]
    assert wire.to_device({"none": []}, torch.device("meta")) == {"none": []}
