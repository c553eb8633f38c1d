"""Rewrite a Mooncake trace (512-token blocks) with finer blocks, as an engine with a smaller
block size would hash the same prompts (the Qwen-Bailian traces use 16-token blocks).

Block `b` of a request becomes `512 // tokens` sub-blocks with ids `b * factor + j`: equal
prefixes still give equal ids, and a request's last block keeps only the sub-blocks its
`input_length` covers, so the trace stays one a reader accepts. A row whose `input_length`
does not fit its ids as 512-token blocks (another block size, or a trace split already) is
refused, naming its line. Then compare policies at the finer size:

    python benchmarks/split_blocks.py data/traces/mooncake_conversation/conversation_trace.jsonl \
        /tmp/conv16.jsonl --tokens 16
    kvtier simulate /tmp/conv16.jsonl --policies lru,kvaware --capacities 1%,10%
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

from _cli import require_file, require_writable, run_main
from kvtier.outputs import atomic_write
from kvtier.sim.readers import MOONCAKE_BLOCK_TOKENS


def split_request(row: dict[str, object], tokens: int) -> dict[str, object]:
    """`row` with its `hash_ids` split into `tokens`-token blocks (other fields kept)."""
    if tokens < 1 or MOONCAKE_BLOCK_TOKENS % tokens:
        raise ValueError(f"tokens={tokens} is invalid; expected a divisor of 512")
    factor = MOONCAKE_BLOCK_TOKENS // tokens
    ids = row["hash_ids"]
    length = row["input_length"]
    if not isinstance(ids, list) or not isinstance(length, int):
        raise ValueError(f"not a Mooncake row: {row!r}")
    n = len(ids)
    # As the reader checks 512-token rows: a row that does not fit them (another block size,
    # or a trace split already) would give sub-block ids of other blocks, or drop its last.
    if not (n - 1) * MOONCAKE_BLOCK_TOKENS < length <= n * MOONCAKE_BLOCK_TOKENS and (n or length):
        low, high = max(0, (n - 1) * MOONCAKE_BLOCK_TOKENS + 1), n * MOONCAKE_BLOCK_TOKENS
        raise ValueError(
            f"input_length={length} does not fit {n} blocks of {MOONCAKE_BLOCK_TOKENS} tokens; "
            f"expected {low}..{high}"
        )
    out: list[int] = []
    last = n - 1
    for i, block in enumerate(ids):
        # The last block is partial: keep the sub-blocks that hold some of its tokens.
        subs = factor if i < last else -(-(length - last * MOONCAKE_BLOCK_TOKENS) // tokens)
        out.extend(block * factor + j for j in range(subs))
    return {**row, "hash_ids": out}


def split_trace(src: Path, tokens: int) -> Iterator[str]:
    """The lines of `src` rewritten with `tokens`-token blocks; ValueError, naming the file and
    line, at a line that is not a Mooncake request."""
    with src.open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = split_request(json.loads(line), tokens)
                except (ValueError, KeyError, TypeError) as e:
                    what = f"no {e} field" if isinstance(e, KeyError) else str(e)
                    raise ValueError(f"{src}:{n}: not a Mooncake trace line ({what})") from None
                yield json.dumps(row) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="Mooncake trace (512-token blocks)")
    parser.add_argument("dst", type=Path, help="where to write the finer trace")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per block (default 16)")
    args = parser.parse_args()
    # Checked before any line is read.
    if args.tokens < 1 or MOONCAKE_BLOCK_TOKENS % args.tokens:
        parser.error(f"--tokens {args.tokens} is invalid; expected a divisor of 512")
    require_file(parser, "src", args.src)
    # Also a hard link to src, which resolve() does not see: the split would replace it.
    require_writable(parser, args.dst, "dst", inputs=[args.src])
    # Whole or not at all: a bad line, Ctrl-C or a full disk midway leaves no partial trace,
    # and an earlier file named `dst` as it was (it was emptied, then deleted).
    try:
        with atomic_write(args.dst) as out:
            out.writelines(split_trace(args.src, args.tokens))
    except ValueError as e:
        parser.error(f"src: {e}")
    except OSError as e:
        if e.filename is not None and str(e.filename) == str(args.src):
            parser.error(f"src {str(args.src)!r}: cannot read it ({e.strerror or e})")
        parser.error(f"dst {str(args.dst)!r}: cannot write there ({e.strerror or e})")


if __name__ == "__main__":
    run_main(main)
