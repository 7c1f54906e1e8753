"""Image generation through the real suite: `client.images.generate` with `tiny-diffusion`
(or `--model tiny-sd`, the text-conditioned Stable Diffusion pipeline).

    .venv/bin/python bench/images.py [--model tiny-sd] [--sizes 64x64 256x256 512x512] [--n 1 4] [--repeat 5]

Starts the suite on free ports with the model preloaded, then for each size and n
times `--repeat` synchronous requests from the `openai` client (wall time, request to the
decoded reply), and the time from an async job's submit to the first poll that finds it
succeeded (polling every 20 ms). CPU only: 4 DDIM steps of a tiny random UNet.
Writes bench/results/images.json (tiny-diffusion) or images_<model>.json.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import httpx
import openai
from _harness import percentiles_ms, running_suite_handle, write_result

DEFAULT_MODEL = "tiny-diffusion"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=["64x64", "256x256", "512x512"])
    parser.add_argument("--n", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    args = parser.parse_args()
    model = args.model
    results: dict[str, Any] = {"model": model, "sync": {}, "async": {}}
    with running_suite_handle(preload=[model]) as suite:
        gateway = suite.settings.gateway
        url = f"http://{gateway.http_host}:{gateway.http_port}/v1"
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
        client.images.generate(model=model, prompt="warm", size="64x64")
        for size in args.sizes:
            for n in args.n:
                samples = []
                for _ in range(args.repeat):
                    started = time.perf_counter()
                    reply = client.images.generate(model=model, prompt="bench", size=size, n=n)  # type: ignore[arg-type]
                    samples.append(time.perf_counter() - started)
                    assert reply.data is not None and len(reply.data) == n
                results["sync"][f"{size} n={n}"] = percentiles_ms(samples)
                print(f"sync  {size} n={n}: {results['sync'][f'{size} n={n}']}", flush=True)
        samples = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            job = httpx.post(
                f"{url}/images/generations",
                json={"model": model, "prompt": "bench", "size": "64x64", "x_async": True},
                timeout=30,
            ).json()
            while httpx.get(f"{url}/jobs/{job['id']}", timeout=30).json()["status"] != "succeeded":
                time.sleep(0.02)
            samples.append(time.perf_counter() - started)
        results["async"]["64x64 n=1 submit->succeeded"] = percentiles_ms(samples)
        print(f"async 64x64 n=1: {results['async']['64x64 n=1 submit->succeeded']}", flush=True)
    name = "images" if model == DEFAULT_MODEL else f"images_{model}"
    print(f"wrote {write_result(name, results)}")


if __name__ == "__main__":
    main()
