"""Property-based fuzzing of the control plane against a live sender and a live receiver.

Both ends run with a transfer secret; the sender in its own process, the receiver in this one.
``hypothesis`` generates batches of frames from a ``Forger``: raw garbage, envelopes with wild
field values (every field of every body, by its protobuf type), mutations of real inits (a
receiver's own template with a few fields changed), truncated, bit-flipped or padded frames,
wrong versions, unknown rooms, huge block ids; each signed with the secret (so it reaches the
protocol logic), unsigned, or signed and then damaged. Some target live rooms: the receiver has
rooms waiting for the sender, the sender holds data for some rooms, and frames may pose as the
real peer.

After every batch: each frame that reached an endpoint was counted exactly once as handled or
dropped (``received == handled + dropped_*``), no handler raised, the sender process is alive.
At the end no block, room, quarantine or control socket leaks, and a normal room still moves
every byte. ``make test`` runs 200 examples; the ``slow`` suite 2000.
"""

from __future__ import annotations

import os
import string
import time

import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.peer import Peer
from common.transfer import messages
from common.transfer.control import MAX_INIT_BLOCKS
from common.transfer.types import ReceivedEmbeddings
from protos.epd.v1 import transfer_pb2

from .conftest import assert_no_leaks, layout_of, make_config, new_room, wait_for
from .forge import Forger
from .helpers import run_rooms, spec

SECRET = b"fuzzing-the-transfer-control-plane"
U64 = st.one_of(
    st.integers(0, 8),
    st.sampled_from([2**31, 2**32 - 1, 2**63, 2**64 - 1]),
    st.integers(0, 2**64 - 1),
)
U32 = st.one_of(st.integers(0, 300), st.sampled_from([2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
ENUM = st.one_of(st.integers(-2, 20), st.integers(-(2**31), 2**31 - 1))
FLOAT = st.one_of(
    st.sampled_from([0.0, -1.0, 1e-9, 5.0, 1e308, float("inf"), float("-inf"), float("nan")]),
    st.floats(allow_nan=True, allow_infinity=True),
)
TEXT = st.text(max_size=80)
NAME = st.text(alphabet=string.ascii_letters + string.digits + "._-", max_size=40)  # no ':' '/'


def _dump(stats: dict) -> dict:
    return stats["messages"]


def _accounted(messages: dict) -> bool:
    dropped = sum(v for k, v in messages.items() if k.startswith("dropped_"))
    return messages.get("received", 0) == messages.get("handled", 0) + dropped


class Arena:
    """The live endpoints, the rooms the fuzz may aim at, and the strategies that aim."""

    def __init__(self, sender: Peer, receiver, forger: Forger) -> None:
        self.sender, self.receiver, self.forger = sender, receiver, forger
        self.template = receiver._make_init_template()
        self.sender_rooms: list[int] = []  # data held by the sender (expected, no init yet)
        self.receiver_rooms: list[int] = []  # waiting on the receiver for the real sender
        self.endpoints = [
            forger.endpoint,
            sender.endpoint,
            receiver.endpoint,
            "tcp://127.0.0.1:1",  # nothing listens on port 1
            "",
            "ipc:///tmp/epd-fuzz",
            "tcp://:0",
            "tcp://" + "a" * 300 + ":1",
        ]
        self.sessions = ["", receiver.mooncake.session_id, "127.0.0.1:1"]  # loopback only

    def rooms(self) -> st.SearchStrategy[int]:
        """A live room by its role (the 3 held by the sender, the 3 first and the latest room
        waiting on the receiver: the same draws whatever the ids), or any number at all."""
        live = st.sampled_from(["s0", "s1", "s2", "r0", "r1", "r2", "latest"]).map(self._room)
        return st.one_of(live, U64)

    def _room(self, role: str) -> int:
        if role == "latest":
            return self.receiver_rooms[-1]
        rooms = self.sender_rooms if role[0] == "s" else self.receiver_rooms
        return rooms[int(role[1])]

    def endpoint(self) -> st.SearchStrategy[str]:
        return st.one_of(st.sampled_from(self.endpoints), NAME)

    def value(self, field: FieldDescriptor) -> st.SearchStrategy:
        """A wild value of ``field``'s protobuf type (strings that name a host are kept to
        loopback addresses, so nothing on the fuzz path reaches past this machine)."""
        if field.name in ("room",):
            return self.rooms()
        if field.name.endswith("endpoint"):
            return self.endpoint()
        if field.name == "mooncake_session":
            return st.sampled_from(self.sessions)
        if field.name == "shm_name":
            return st.one_of(st.just(""), NAME, st.just("../../etc/passwd"))
        kind = field.type
        if kind == FieldDescriptor.TYPE_UINT64:
            return U64
        if kind == FieldDescriptor.TYPE_UINT32:
            return U32
        if kind == FieldDescriptor.TYPE_ENUM:
            return ENUM
        if kind == FieldDescriptor.TYPE_DOUBLE:
            return FLOAT
        if kind == FieldDescriptor.TYPE_BOOL:
            return st.booleans()
        if kind == FieldDescriptor.TYPE_BYTES:
            return st.binary(max_size=64)
        return TEXT

    def mutate(self, draw, message) -> None:
        """Set a few fields of ``message`` (recursing into sub-messages) to wild values."""
        fields = list(message.DESCRIPTOR.fields)
        for field in draw(st.lists(st.sampled_from(fields), max_size=4)):
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                self.mutate(draw, getattr(message, field.name))
            elif field.name == "block_ids":
                ids = draw(
                    st.one_of(
                        st.lists(U32, max_size=64),
                        st.just(list(range(MAX_INIT_BLOCKS + 1))),
                        st.just([2**32 - 1] * 3),
                    )
                )
                del message.block_ids[:]
                message.block_ids.extend(ids)
            else:
                setattr(message, field.name, draw(self.value(field)))

    def envelope(self, draw, to: str) -> transfer_pb2.TransferEnvelope:
        env = _fresh(self.forger, to) if draw(st.booleans()) else self.forger.envelope(to)
        body = draw(st.sampled_from(["init", "init", "status", "status", "abort", "beat", "none"]))
        if body == "init":
            if draw(st.booleans()):  # a real receiver's init, a few fields off
                env.init.CopyFrom(self.template)
                env.init.receiver_endpoint = self.forger.endpoint
                env.init.block_ids.extend(range(24, 32))
                env.init.num_tokens_allocated = 1024
            env.init.room = draw(self.rooms())
            self.mutate(draw, env.init)
        elif body == "status":
            env.status.room = draw(self.rooms())
            env.status.state = draw(st.integers(0, 4))
            self.mutate(draw, env.status)
        elif body == "abort":
            env.abort.room = draw(self.rooms())
            self.mutate(draw, env.abort)
        elif body == "beat":
            env.heartbeat.sent_at = draw(FLOAT)
        if draw(st.integers(0, 3)) == 0:  # the envelope itself: version, stamps, addresses
            self.mutate(draw, env)
        return env

    def frame(self, draw, to: str) -> bytes:
        shape = draw(st.sampled_from(["signed"] * 4 + ["unsigned", "garbage", "damaged"]))
        if shape == "garbage":
            return draw(st.binary(max_size=512))
        payload = self.envelope(draw, to).SerializeToString()
        if shape == "unsigned":
            return payload
        frame = self.forger.sign(payload)
        if shape == "signed":
            return frame
        how = draw(st.sampled_from(["truncate", "flip", "pad"]))
        # where, as a share of the frame: its length varies with the stamps, the draw must not
        at = draw(st.integers(0, 999)) * len(frame) // 1000
        if how == "truncate":
            return frame[:at]
        if how == "flip":
            return frame[:at] + bytes([frame[at] ^ draw(st.integers(1, 255))]) + frame[at + 1 :]
        return frame + draw(st.binary(min_size=1, max_size=64))


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("fuzz") / "secret"
    path.write_bytes(SECRET)
    return str(path)


def _fresh(forger: Forger, to: str) -> transfer_pb2.TransferEnvelope:
    """A frame of a new forger incarnation: fuzzed sequence numbers cannot make it a replay."""
    return forger.envelope(to, incarnation=int.from_bytes(os.urandom(8), "little") | 1)


def _fuzz(secret_file: str, make_receiver, max_examples: int) -> None:
    config = make_config(num_blocks=128, secret_file=secret_file)
    sender = Peer("sender", config, layout_of(config))
    receiver = make_receiver(secret_file=secret_file, num_blocks=64)
    forger = Forger(secret=SECRET)
    try:
        arena = Arena(sender, receiver, forger)
        deadline = time.monotonic() + 600.0
        for _ in range(3):  # targets: data held by the sender, rooms waiting on the receiver
            held = spec(new_room(), 700)
            sender.ask("call", "expect", held.seed, deadline)
            assert sender.ask("submit", held)
            arena.sender_rooms.append(held.seed)
            waiting = new_room()  # its sender is the forger: statuses from it are believed
            receiver.add_room(waiting, forger.endpoint, deadline)
            arena.receiver_rooms.append(waiting)

        def settle(endpoint: str) -> None:
            """Wait until ``endpoint`` went through every frame pushed at it so far: the forger's
            socket to it is ordered, so a sentinel behind them proves it."""
            if endpoint == sender.endpoint:  # an abort of an unknown room is answered
                probe = _fresh(forger, endpoint)
                probe.abort.room = new_room()
                forger.push(endpoint, forger.seal(probe))
                answered = False
                while not answered and forger.sink.poll(10_000):
                    reply = messages.decode(forger.sink.recv()).envelope
                    answered = reply.status.room == probe.abort.room
                assert answered, "the sender did not get through its frames"
                return
            room = arena.receiver_rooms[-1]  # added before the batch: the fuzz may hit it too
            forger.push(endpoint, forger.seal(sentinel_for(room)))
            assert wait_for(lambda: receiver.poll(room).is_final), "the receiver is stuck"
            for done, result in receiver.pop_done():
                if isinstance(result, ReceivedEmbeddings):
                    receiver.release(done)

        def sentinel_for(room: int) -> transfer_pb2.TransferEnvelope:
            probe = _fresh(forger, receiver.endpoint)
            probe.status.room, probe.status.state = room, transfer_pb2.TRANSFER_STATE_FAILED
            return probe

        def check(endpoint: str) -> None:
            stats = sender.ask("call", "stats") if endpoint == sender.endpoint else receiver.stats()
            messages_ = stats["messages"]
            assert _accounted(messages_), messages_
            assert messages_.get("dropped_handler_error", 0) == 0, messages_

        ends = [sender.endpoint, receiver.endpoint]

        @settings(
            max_examples=max_examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(st.data())
        def frames_are_handled_or_dropped(data: st.DataObject) -> None:
            room = new_room()  # a fresh target, which the receiver's sentinel then ends
            receiver.add_room(room, forger.endpoint, deadline)
            arena.receiver_rooms.append(room)
            for _ in range(data.draw(st.integers(1, 4), label="frames")):
                to = data.draw(st.sampled_from(ends), label="to")
                forger.push(to, arena.frame(data.draw, to))
            for endpoint in ends:
                settle(endpoint)
                check(endpoint)
            assert sender.process.is_alive()

        frames_are_handled_or_dropped()

        for room in arena.sender_rooms:  # cancel what the fuzz spared
            sender.ask("call", "fail", room, "fuzz over")
        for room in arena.receiver_rooms:  # the targets, and the rooms of examples cut short
            if not receiver.poll(room).is_final:  # (claimed, queued for blocks in quarantine)
                receiver.abort(room)
        assert wait_for(lambda: not receiver.stats()["rooms_active"])
        for room, result in receiver.pop_done():  # every room has reported: none comes later
            if isinstance(result, ReceivedEmbeddings):
                receiver.release(room)
        assert_no_leaks(sender, receiver, timeout_s=20.0)  # fuzzed rooms time out on their own
        assert wait_for(lambda: receiver.stats()["num_quarantined_blocks"] == 0)
        stats = sender.ask("call", "stats")
        assert stats["num_control_sockets"] <= config.max_peers
        assert wait_for(lambda: sender.ask("call", "stats")["num_peers"] == 0)
        run_rooms(sender, receiver, [spec(new_room(), 1500), spec(new_room(), 100)])
        assert_no_leaks(sender, receiver)
        for endpoint in ends:
            check(endpoint)
    finally:
        forger.close()
        sender.close()


def test_fuzz_control_frames(secret_file, make_receiver) -> None:
    _fuzz(secret_file, make_receiver, max_examples=200)


@pytest.mark.slow
def test_fuzz_control_frames_long(secret_file, make_receiver) -> None:
    _fuzz(secret_file, make_receiver, max_examples=2000)
