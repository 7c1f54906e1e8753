"""Steady request load on a gateway's edge, run on host A by test_three_hosts.py
(`ip netns exec <A> python robots.py ...`): `--robots` Inferential clients, each sending one
`double` request after another until `--stop-file` appears, each request recorded as a JSON
line (sent and answered UNIX times, result code) in `--out`. A request with no reply within
`--reply-timeout-s` is recorded as `no_reply`."""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import numpy as np
from inferential import Connection


def robot(
    index: int, edge: str, stop_file: Path, reply_timeout_s: float, out: list[dict[str, object]]
) -> None:
    connection = Connection(server=edge, client_id=f"robot-{index}")
    try:
        model = connection.model("double")
        n = 0
        while not stop_file.exists():
            x = np.full(4, float(n % 1000), dtype=np.float32)
            sent = time.time()
            model.observe(x=x)
            result = model.get_result(timeout_ms=int(reply_timeout_s * 1000))
            answered = time.time()
            if result is None:
                code = "no_reply"
            elif "error" in result:
                code = str(result.get("error_code") or "error")
            else:
                code = "ok" if np.array_equal(result["x"], x * 2) else "wrong_result"
            out.append({"robot": index, "n": n, "sent": sent, "answered": answered, "code": code})
            n += 1
            time.sleep(0.02)
    finally:
        connection.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--edge", required=True)
    parser.add_argument("--robots", type=int, default=4)
    parser.add_argument("--stop-file", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reply-timeout-s", type=float, default=30.0)
    args = parser.parse_args()
    records: list[dict[str, object]] = []
    threads = [
        threading.Thread(target=robot, args=(i, args.edge, args.stop_file, args.reply_timeout_s, records))
        for i in range(args.robots)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    args.out.write_text("".join(json.dumps(record) + "\n" for record in records))


if __name__ == "__main__":
    main()
