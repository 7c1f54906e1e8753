"""Grammar libraries for structured output, compared on tiny-chat's vocabulary.

For xgrammar, outlines-core and llguidance (whichever are installed): the time to build the
tokenizer-side state once (the library's import not included), to compile a JSON schema (a small one and a nested one, plus
`json_object`), and the per-token cost of filling the next-token mask while a sequence of
tokens the grammar allows is consumed (the work our logits processor adds per decode step).
Prints a table and writes bench/results/structured_output_libs.json.

    .venv/bin/python bench/structured_output_libs.py [--tokens 200] [--repeats 5]

Needs `make models` (tiny-chat's tokenizer). One CPU thread. Only llguidance is a project
dependency; to compare, install the others by hand (xgrammar without its dependencies, which
would pull triton and another torch):
    .venv/bin/pip install outlines-core && .venv/bin/pip install --no-deps xgrammar apache-tvm-ffi
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "examples" / "models" / "tiny-chat" / "artifacts"
RESULTS = ROOT / "bench" / "results" / "structured_output_libs.json"

SMALL = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "title": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "status": {"enum": ["open", "closed", "blocked"]},
        "owner": {
            "type": "object",
            "properties": {
                "login": {"type": "string", "pattern": "^[a-z]{2,10}$"},
                "admin": {"type": "boolean"},
                "score": {"type": "number"},
            },
            "required": ["login", "admin"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "title", "status", "owner"],
    "additionalProperties": False,
}
SCHEMAS: dict[str, dict[str, Any] | None] = {"json_object": None, "small": SMALL, "nested": NESTED}


def _byte_vocab(tokenizer: Any) -> dict[bytes, list[int]]:
    """Token id -> its bytes, for a byte-level BPE (GPT-2 style) tokenizer."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    decode = {chr(char): byte for byte, char in zip(printable, chars, strict=True)}
    out: dict[bytes, list[int]] = {}
    for token, index in tokenizer.get_vocab().items():
        if token in tokenizer.all_special_tokens:
            continue
        out.setdefault(bytes(decode[c] for c in token), []).append(index)
    return out


def _unpack(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """An int32 bitmask row (bit t%32 of word t//32 = token t allowed) -> bool [vocab]."""
    return ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab].bool()


class Walker:
    """One library: compile(schema) -> matcher; mask(matcher) -> allowed ids; advance(matcher, id)."""

    name = ""

    def setup(self, tokenizer: Any) -> None: ...
    def compile(self, schema: dict[str, Any] | None) -> Any: ...
    def start(self, compiled: Any) -> Any: ...
    def mask(self, matcher: Any) -> torch.Tensor: ...  # bool [V]
    def advance(self, matcher: Any, token: int) -> None: ...
    def done(self, matcher: Any) -> bool: ...


class XGrammar(Walker):
    name = "xgrammar"

    def setup(self, tokenizer: Any) -> None:
        import xgrammar as xgr  # installed --no-deps here: its requirements pull triton

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id]
        )
        self.vocab = len(tokenizer)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bitmask = xgr.allocate_token_bitmask(1, self.vocab)

    def compile(self, schema: dict[str, Any] | None) -> Any:
        if schema is None:
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def start(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, matcher: Any) -> torch.Tensor:
        matcher.fill_next_token_bitmask(self.bitmask)
        return _unpack(self.bitmask[0], self.vocab)

    def advance(self, matcher: Any, token: int) -> None:
        assert matcher.accept_token(token)

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())


class LLGuidance(Walker):
    name = "llguidance"

    def setup(self, tokenizer: Any) -> None:
        import llguidance  # not llguidance.torch: it imports torch._dynamo (seconds)
        import llguidance.hf

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
        self.vocab = len(tokenizer)
        self.bitmask = torch.full((1, (self.vocab + 31) // 32), -1, dtype=torch.int32)

    def compile(self, schema: dict[str, Any] | None) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"},
            defaults={"whitespace_flexible": False},
        )
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)  # compiling happens here
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def start(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def mask(self, matcher: Any) -> torch.Tensor:
        row = self.bitmask[0]
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        return _unpack(row, self.vocab)

    def advance(self, matcher: Any, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())


class OutlinesCore(Walker):
    name = "outlines-core"

    def setup(self, tokenizer: Any) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc = outlines_core
        self.regex = build_regex_from_schema
        self.vocab = len(tokenizer)
        self.eos = tokenizer.eos_token_id
        self.vocabulary = outlines_core.Vocabulary(self.eos, _byte_vocab(tokenizer))

    def compile(self, schema: dict[str, Any] | None) -> Any:
        # outlines-core has no generic-JSON grammar: json_object is the schema {"type": "object"}
        # (free-form values inside an object are not expressible as a regular language, so its
        # regex builder allows only a bounded nesting depth).
        regex = self.regex(json.dumps(schema if schema is not None else {"type": "object"}))
        return self.oc.Index(regex, self.vocabulary)

    def start(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def mask(self, matcher: Any) -> torch.Tensor:
        allowed = torch.zeros(self.vocab, dtype=torch.bool)
        allowed[torch.tensor(matcher.get_tokens(), dtype=torch.int64)] = True
        return allowed

    def advance(self, matcher: Any, token: int) -> None:
        matcher.advance(token)

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_finished())


def _walk(walker: Walker, compiled: Any, *, tokens: int, rng: random.Random, eos: int) -> tuple[float, int]:
    """Random allowed tokens until done or `tokens`: mean seconds per mask, tokens walked."""
    matcher = walker.start(compiled)
    spent = 0.0
    walked = 0
    for _ in range(tokens):
        if walker.done(matcher):
            break
        began = time.perf_counter()
        allowed = walker.mask(matcher)
        spent += time.perf_counter() - began
        choices = [int(i) for i in torch.nonzero(allowed).flatten() if int(i) != eos] or [eos]
        token = rng.choice(choices)
        walker.advance(matcher, token)
        walked += 1
        if token == eos:
            break
    return spent / max(1, walked), walked


def measure(walker: Walker, tokenizer: Any, *, tokens: int, repeats: int) -> dict[str, Any]:
    for module in {
        "xgrammar": ["xgrammar"],
        "outlines-core": ["outlines_core", "outlines_core.json_schema"],
        "llguidance": ["llguidance", "llguidance.hf"],
    }[walker.name]:
        importlib.import_module(module)  # imported before the clock starts
    began = time.perf_counter()
    walker.setup(tokenizer)
    row: dict[str, Any] = {"setup_ms": (time.perf_counter() - began) * 1e3}
    for label, schema in SCHEMAS.items():
        compile_ms = []
        compiled = None
        for _ in range(repeats):
            began = time.perf_counter()
            compiled = walker.compile(schema)
            compile_ms.append((time.perf_counter() - began) * 1e3)
        rng = random.Random(0)
        per_token = []
        walked = 0
        for _ in range(repeats):
            seconds, count = _walk(walker, compiled, tokens=tokens, rng=rng, eos=tokenizer.eos_token_id)
            per_token.append(seconds * 1e6)
            walked += count
        row[label] = {
            "compile_ms_median": statistics.median(compile_ms),
            "mask_us_per_token_median": statistics.median(per_token),
            "tokens_walked": walked,
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER, local_files_only=True)
    walkers: list[Callable[[], Walker]] = [XGrammar, OutlinesCore, LLGuidance]
    results: dict[str, Any] = {"vocab": len(tokenizer), "tokens": args.tokens, "repeats": args.repeats}
    for make in walkers:
        walker = make()
        try:
            results[walker.name] = measure(walker, tokenizer, tokens=args.tokens, repeats=args.repeats)
        except ImportError as error:
            results[walker.name] = {"error": f"not installed: {error}"}
        except Exception as error:  # a library that cannot do a case says so in the table
            results[walker.name] = {"error": f"{type(error).__name__}: {error}"}
    print(f"tiny-chat vocab {results['vocab']}, up to {args.tokens} tokens a walk, {args.repeats} repeats")
    print(
        f"{'library':<14} {'setup ms':>9} "
        + " ".join(f"{s + ' compile ms':>20} {'mask us/tok':>11}" for s in SCHEMAS)
    )
    for make in walkers:
        row = results[make.name]
        if "error" in row:
            print(f"{make.name:<14} {row['error']}")
            continue
        cells = " ".join(
            f"{row[s]['compile_ms_median']:>20.2f} {row[s]['mask_us_per_token_median']:>11.1f}"
            for s in SCHEMAS
        )
        print(f"{make.name:<14} {row['setup_ms']:>9.1f} {cells}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    results = {
        "benchmark": "structured_output_libs",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **results,
    }
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
