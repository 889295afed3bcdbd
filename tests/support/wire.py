"""Helpers shared by the wire tests: act as a route's previous hop by hand (open a session on one hop,
send hand-made frames on a raw Frames stream and read the typed replies)."""

from __future__ import annotations

import queue
import threading

import grpc

from dgr.runtime.wire.gen import stage_pb2 as pb, stage_pb2_grpc as pb_grpc


def open_on(stub, addresses, hop_index, descs, sid, epoch):
    """OpenSession on hop `hop_index` alone, as the hop before it would (its description as upstream)."""
    route = [pb.Hop(address=a, bundle_id=d.identity.bundle_id, stage_index=d.identity.stage_index,
                    layer_begin=d.identity.layer_begin, layer_end=d.identity.layer_end)
             for a, d in zip(addresses, descs)]
    req = pb.OpenSessionRequest(session_id=sid, epoch=epoch, route=route, hop_index=hop_index)
    if hop_index:
        req.upstream.CopyFrom(descs[hop_index - 1])
    return stub.OpenSession(req, timeout=10)


class RawStream:
    """Act as the previous hop: send hand-made frames, read the typed replies."""

    def __init__(self, address, tls=None):
        """`tls`: a dgr.runtime.wire.tls.TlsConfig to present (a peer holding that certificate), or plaintext."""
        from dgr.runtime.wire.tls import channel

        self.channel = channel(address, tls)
        self.q, self.replies = queue.Queue(), queue.Queue()
        self.call = pb_grpc.StageStub(self.channel).Frames(iter(self.q.get, None))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for f in self.call:
                self.replies.put(f)
        except grpc.RpcError:
            pass                                            # closed by the test

    def ask(self, frame, expect_reply: bool = True) -> pb.Frame | None:
        """Send one frame; its reply (None when `expect_reply` is False and none came within 2 s)."""
        self.q.put(frame)
        try:
            return self.replies.get(timeout=10 if expect_reply else 2)
        except queue.Empty:
            if expect_reply:
                raise
            return None

    def close(self):
        self.q.put(None)
        self.channel.close()
