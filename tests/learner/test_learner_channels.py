"""The learner's batch client against a real ZMQ ROUTER played by the test: a bad batch is reported and
asked for again, an unanswered request is sent again, and neither is ever trained on."""

import threading

import msgspec
import zmq
from helpers import RUN_ID, make_trajectory

from horizonrl.learner.channels import BatchClient
from horizonrl.protocol import Batch, BatchRequest, decode_as, encode
from horizonrl.protocol.transport import make_socket


class Buffer(threading.Thread):
    """Answers the n-th request with ``replies[n]`` (None: no answer)."""

    def __init__(self, ctx, replies):
        super().__init__(daemon=True)
        self.socket = make_socket(ctx, zmq.ROUTER)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.replies = list(replies)
        self.requests: list[BatchRequest] = []
        self.done = threading.Event()

    def run(self):
        try:
            while not self.done.is_set():
                if not self.socket.poll(50):
                    continue
                identity, data = self.socket.recv_multipart()
                request = decode_as(data, BatchRequest)
                self.requests.append(request)
                reply = self.replies.pop(0) if self.replies else None
                if reply is not None:
                    self.socket.send_multipart([identity, reply(request)])
        finally:
            self.socket.close(linger=0)


GOOD = [make_trajectory("g", i, reward=float(i)) for i in range(2)]


def good(request):
    return encode(Batch(run_id=RUN_ID, request_id=request.request_id, groups=[GOOD]))


def inconsistent(request):
    broken = msgspec.structs.replace(GOOD[0], logprobs=b"\x00\x00\x80")
    return encode(Batch(run_id=RUN_ID, request_id=request.request_id, groups=[[broken, GOOD[1]]]))


def garbage(request):
    return b"\x00not a batch"


def _client(ctx, buffer):
    return BatchClient(ctx, f"tcp://127.0.0.1:{buffer.port}", RUN_ID, vocab_size=100)


def test_bad_batches_are_asked_for_again_and_only_a_good_one_is_returned():
    ctx = zmq.Context()
    buffer = Buffer(ctx, [garbage, inconsistent, good])
    buffer.start()
    client = _client(ctx, buffer)
    try:
        payload = client.request(3, 1, 30, lambda: False, lineage=[(0, 0)], committed_step=2, resend_s=30)
        assert decode_as(payload, Batch).groups == [GOOD]
        assert client.counters["bad_batches"] == 2
        # each time the same step (learner version 3): the buffer takes an unused batch back
        assert [(r.request_id, r.learner_version, r.committed_step) for r in buffer.requests] == [
            (1, 3, 2), (2, 3, 2), (3, 3, 2)]
    finally:
        buffer.done.set()
        buffer.join(5)
        client.close()
        ctx.term()


def test_an_unanswered_request_is_sent_again():
    ctx = zmq.Context()
    buffer = Buffer(ctx, [None, good])  # the first request is lost (a restarted buffer)
    buffer.start()
    client = _client(ctx, buffer)
    try:
        payload = client.request(0, 1, 30, lambda: False, lineage=[(0, 0)], committed_step=0, resend_s=0.5)
        assert decode_as(payload, Batch).request_id == 2
        assert client.counters["requests_resent"] == 1 and len(buffer.requests) == 2
    finally:
        buffer.done.set()
        buffer.join(5)
        client.close()
        ctx.term()


def test_a_stop_while_waiting_returns_none():
    ctx = zmq.Context()
    buffer = Buffer(ctx, [None])
    buffer.start()
    client = _client(ctx, buffer)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    try:
        assert client.request(0, 1, 30, stop.is_set, lineage=[(0, 0)], committed_step=0, resend_s=30) is None
    finally:
        buffer.done.set()
        buffer.join(5)
        client.close()
        ctx.term()


def test_a_batch_beyond_the_steps_token_budget_or_with_a_trajectory_past_the_context_is_a_bad_batch():
    """Lengths are bounded at the buffer's door; the learner checks again, so that no step can be handed more
    than it was sized for (a 10^6-token group once held a learner in one step for 7 minutes)."""
    from horizonrl.learner.channels import BatchLimits

    ctx = zmq.Context()
    try:
        client = BatchClient(ctx, None, RUN_ID, vocab_size=100,
                             limits=BatchLimits(max_groups=1, max_group_size=4, max_trajectory_tokens=12, max_tokens=24))

        def problem(groups):
            return client._check(encode(Batch(run_id=RUN_ID, request_id=1, groups=groups)))[0]

        assert problem([GOOD]) is None  # 2 x 12 tokens: at the budget
        assert "too_long" in problem([[make_trajectory("g", 0, tokens=13), make_trajectory("g", 1)]])
        assert "groups of" in problem([GOOD, GOOD])  # two groups for a step of one
        assert "fields" in problem([[make_trajectory("g", 0, group_size=5), make_trajectory("g", 1, group_size=5)]])
        client.close()
    finally:
        ctx.term()
