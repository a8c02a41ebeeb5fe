import msgspec
import numpy as np
import pytest
from helpers import make_trajectory

from horizonrl.protocol import (
    SCHEMA_VERSION,
    Batch,
    Control,
    ForeignRunError,
    ProtocolError,
    Trajectory,
    decode,
    decode_as,
    encode,
)
from horizonrl.protocol.arrays import TOKEN_DTYPE, unpack


def test_trajectory_round_trip_keeps_arrays_exact():
    traj = make_trajectory("g", 0, reward=1.0, tokens=100)
    back = decode_as(encode(traj), Trajectory)
    assert back == traj
    assert np.array_equal(unpack(back.token_ids, TOKEN_DTYPE), np.arange(100))
    assert back.num_tokens == 100


def test_nested_batch_round_trip():
    batch = Batch(run_id="test-run", request_id=3, groups=[[make_trajectory("g", i) for i in range(2)]], buffer_stats={"x": 1.0})
    assert decode(encode(batch)) == batch


@pytest.mark.parametrize("data", [b"", b"\x00", b"\x93\x01\x02\x03", b"not msgpack at all", b"\xc1"])
def test_malformed_bytes_raise_protocol_error(data):
    with pytest.raises(ProtocolError):
        decode(data)


def test_oversized_message_is_rejected_before_decoding():
    data = encode(make_trajectory("g", 0, tokens=1000))
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode(data, max_bytes=len(data) - 1)


def test_wrong_schema_version_is_named():
    class FutureControl(msgspec.Struct, tag="control"):
        v: int
        something_new: str

    with pytest.raises(ProtocolError, match="schema version 99"):
        decode(msgspec.msgpack.encode(FutureControl(v=99, something_new="x")))


def test_unexpected_type_and_missing_fields():
    control = encode(Control(run_id="r", learner_step=0, max_turns=5, weight_version=0))
    with pytest.raises(ProtocolError, match="expected Trajectory"):
        decode_as(control, Trajectory)
    with pytest.raises(ProtocolError, match="invalid 'trajectory'"):
        decode(msgspec.msgpack.encode({"type": "trajectory", "v": SCHEMA_VERSION}))


def test_protocol_layer_imports_neither_torch_nor_vllm():
    import subprocess
    import sys

    code = ("import sys, horizonrl.protocol, horizonrl.core.config, horizonrl.core.schedule, horizonrl.core.runtime; "
            "bad = [m for m in ('torch', 'vllm') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_message_of_another_run_is_told_apart():
    data = encode(make_trajectory("g", 0))
    assert decode(data, run_id="test-run").trajectory_id == "g-0"
    with pytest.raises(ForeignRunError, match="of run 'test-run'; this process is in run 'other'"):
        decode(data, run_id="other")
