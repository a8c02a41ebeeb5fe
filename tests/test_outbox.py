"""The actors' outbox format (core/outbox.py), read the same way by the actor that restarts and by
``horizonrl accounting``: acknowledged entries left out, a torn last append ends the segment, an entry that
does not decode (or is another run's) is skipped and reported."""

from helpers import RUN_ID, make_trajectory

from horizonrl.buffer.accounting import outbox_trajectories
from horizonrl.core.outbox import acked_path, framed, read_outbox, segment_path
from horizonrl.core.run_dirs import RunDir
from horizonrl.protocol import encode


def write_segment(outbox, number, entries: list[bytes], acked: list[str] = (), torn: bytes = b"") -> None:
    outbox.mkdir(parents=True, exist_ok=True)
    segment_path(outbox, number).write_bytes(b"".join(framed(e) for e in entries) + torn)
    if acked:
        acked_path(outbox, number).write_text("".join(f"{i}\n" for i in acked))


def trajectory(trajectory_id: str, run_id: str = RUN_ID) -> bytes:
    group, index = trajectory_id.split("-")
    return encode(make_trajectory(group, int(index), run_id=run_id))


def test_unacknowledged_entries_are_read_in_order_and_a_torn_append_ends_the_segment(tmp_path):
    outbox = RunDir(tmp_path).outbox(0)
    torn = framed(trajectory("g9-0"))[:-5]
    write_segment(outbox, 1, [trajectory("g1-0"), trajectory("g1-1"), b"\x93garbage"], acked=["g1-0"])
    write_segment(outbox, 2, [trajectory("g2-0"), trajectory("g2-1", run_id="another-run")], torn=torn)
    first, second = read_outbox(outbox, RUN_ID)
    assert (first.number, [t.trajectory_id for _, t in first.unacked]) == (1, ["g1-1"])
    assert len(first.undecodable) == 1  # the garbage entry, skipped; the ones around it are read
    assert [t.trajectory_id for _, t in second.unacked] == ["g2-0"]  # another run's is not this run's to send
    assert len(second.undecodable) == 1
    # Without a run id (accounting reads whatever the directory holds) only the garbage is left out.
    assert [t.trajectory_id for _, t in read_outbox(outbox)[1].unacked] == ["g2-0", "g2-1"]


def test_accounting_sees_what_the_actor_would_send_again(tmp_path):
    write_segment(RunDir(tmp_path).outbox(0), 1, [trajectory("g1-0"), trajectory("g1-1")], acked=["g1-1"])
    write_segment(RunDir(tmp_path).outbox(1), 4, [trajectory("g2-0")], torn=b"\x05\x00")
    assert sorted(t.trajectory_id for t in outbox_trajectories(tmp_path)) == ["g1-0", "g2-0"]
