"""An Inferential-protocol camera client for bench/robot_clients.py, run inside a network
namespace whose link to the gateway is shaped (tc): one 640x480 frame per observation to the
`classifier`, RAW or as a JPEG tensor (UINT8 [480, 640, 3], compressed bytes in the payload).

    _camera_client.py EDGE raw|jpeg CALLS FRAME.npy     prints one JSON line
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import simplejpeg
import zmq

from loadmaster.v1 import edge_pb2, tensor_pb2

WARMUP = 5


def main() -> None:
    edge, mode, calls, frame_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    pixels = np.load(frame_path)
    data = simplejpeg.encode_jpeg(pixels, quality=90) if mode == "jpeg" else pixels.tobytes()
    observation = edge_pb2.Observation(model_id="classifier")
    observation.client.id = f"camera-{mode}"
    observation.tensors.add(
        key="image",
        dtype=tensor_pb2.DTYPE_UINT8,
        shape=pixels.shape,
        byte_offset=0,
        byte_length=len(data),
        encoding=tensor_pb2.ENCODING_JPEG if mode == "jpeg" else tensor_pb2.ENCODING_RAW,
    )
    envelope = observation.SerializeToString()
    socket = zmq.Context().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(edge)
    samples = []
    for index in range(WARMUP + calls):
        started = time.perf_counter()
        # a robot encodes each new frame before it sends it: that time counts
        payload = simplejpeg.encode_jpeg(pixels, quality=90) if mode == "jpeg" else pixels.tobytes()
        socket.send_multipart([b"", envelope, payload])
        if not socket.poll(30_000):
            raise SystemExit("no reply within 30 s")
        frames = socket.recv_multipart()
        reply = edge_pb2.ModelResponse.FromString(frames[1])
        if "error" in reply.metadata:
            raise SystemExit(f"error: {reply.metadata['error']}")
        if index >= WARMUP:
            samples.append(time.perf_counter() - started)
    print(json.dumps({"samples_s": samples, "request_bytes": len(envelope) + len(data)}))


if __name__ == "__main__":
    main()
