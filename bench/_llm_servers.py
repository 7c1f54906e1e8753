"""bench/llm_serving.py's two servers of tiny-chat: `transformers serve --continuous-batching`
(`reference_server`) and the suite (`loadmaster_server`), each a context manager yielding the
`Target` the client drives."""

from __future__ import annotations

import argparse
import shlex
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from _harness import EXAMPLE_CONFIG, ROOT, running_suite_handle
from _llm_client import Target, say

MODEL_FOLDER = ROOT / "examples" / "models" / "tiny-chat" / "artifacts"


def reference_server(
    args: argparse.Namespace, log_dir: Path, *, name: str = "reference", threads: int | None = None
) -> Callable[[], AbstractContextManager[Target]]:
    """`transformers serve`; `threads`: OMP_NUM_THREADS (None: --reference-threads; 0: torch's default)."""
    threads = args.reference_threads if threads is None else threads

    @contextmanager
    def start() -> Iterator[Target]:
        from _hf_serve import hf_serve

        say(f"[{name}] starting `transformers serve --continuous-batching`…")
        with hf_serve(
            MODEL_FOLDER,
            device=args.device,
            extra=tuple(shlex.split(args.reference_args)),
            threads=threads or None,
            log_path=log_dir / f"{name}.log",
        ) as served:
            notes = [
                "command: " + " ".join(served.command[1:]),
                (
                    f"extra flags: {args.reference_args}"
                    if args.reference_args
                    else "KV cache: its own sizing (no --cb-num-blocks/--cb-block-size/--cb-max-batch-tokens; "
                    "its docs give no CPU values)"
                )
                + "; Loadmaster's: see its notes",
                "torch threads: "
                + (f"OMP_NUM_THREADS={threads}" if threads else "torch's default (one per core)")
                + " (Loadmaster: model_pool.inference_threads 1)",
                "no priorities: requests carry no x_priority (it answers 422 to unknown fields)",
                "temperature 0 comes from the first request: it builds its manager from that one",
            ]
            yield Target(
                name,
                served.base_url,
                served.model,
                priority_field=False,
                notes=notes,
                diagnose=served.diagnose,
            )

    return start


def _model_config() -> tuple[dict[str, Any], dict[str, Any]]:
    """tiny-chat's config.yaml and its entry under `models.known` in the example config."""
    import yaml

    model = yaml.safe_load((MODEL_FOLDER.parent / "config.yaml").read_text()) or {}
    example = yaml.safe_load(EXAMPLE_CONFIG.read_text()) or {}
    known = ((example.get("models") or {}).get("known") or {}).get("tiny-chat") or {}
    return model, known


@contextmanager
def _suite(max_inflight: int) -> Iterator[Any]:
    """The suite as the other benches start it; with `max_inflight`, from a copy of the example
    config whose tiny-chat admits that many streams (the scheduler's grants)."""
    if not max_inflight:
        with running_suite_handle(preload=["tiny-chat"]) as suite:
            yield suite
        return
    import yaml

    from loadmaster.cli.launcher import Suite, free_port_overrides

    config = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    config["models"]["repository"] = str((EXAMPLE_CONFIG.parent / config["models"]["repository"]).resolve())
    config["models"]["known"].setdefault("tiny-chat", {})["max_inflight"] = max_inflight
    overrides = free_port_overrides()
    overrides["model_pool"]["preload"] = ["tiny-chat"]
    with tempfile.TemporaryDirectory(prefix="loadmaster-llm-serving-suite-") as folder:
        path = Path(folder) / "loadmaster.yaml"
        path.write_text(yaml.safe_dump(config))
        suite = Suite(path, overrides=overrides, log_dir=Path(folder))
        suite.start(timeout_s=120)
        try:
            suite.wait_for_models(["tiny-chat"], timeout_s=120)
            yield suite
        finally:
            suite.stop()


def loadmaster_server(args: argparse.Namespace) -> Callable[[], AbstractContextManager[Target]]:
    @contextmanager
    def start() -> Iterator[Target]:
        say("[loadmaster] starting the suite with tiny-chat preloaded…")
        model, known = _model_config()
        with _suite(args.loadmaster_max_inflight) as suite:
            gateway = suite.settings.gateway

            def diagnose() -> str:
                tails = [(name, suite.log_tail(name, 8)) for name in ("gateway", "scheduler", "model-pool")]
                return "\n".join(f"{name}: {tail}" for name, tail in tails if tail)

            admitted = args.loadmaster_max_inflight or known.get("max_inflight")
            yield Target(
                "loadmaster",
                f"http://{gateway.http_host}:{gateway.http_port}/v1",
                "tiny-chat",
                priority_field=True,
                notes=[
                    "the suite from examples/loadmaster.yaml on free ports, tiny-chat preloaded",
                    f"tiny-chat: max_sequences {model.get('max_sequences')}, block_size "
                    f"{model.get('block_size')}, num_blocks {model.get('num_blocks')} (its config.yaml); "
                    f"the scheduler admits {admitted} streams (max_inflight"
                    + (
                        ", --loadmaster-max-inflight)"
                        if args.loadmaster_max_inflight
                        else ", the example config)"
                    ),
                    "priorities as x_priority (0 highest)",
                ],
                diagnose=diagnose,
            )

    return start
