"""A scripted Wordle player that always wins within 6 guesses on the answer list: a decision tree built once.

Each node holds the guess that splits the remaining candidate answers into the most feedback groups (ties go to
words that could be the answer, then to the smaller largest group). It is committed as ``data/solver_tree.json``;
the builder writes only where ``--out`` says, and replaces an existing file only with ``--force``:

    python -m examples.wordle.solver --out /tmp/tree.json --answers 100    # the first 100 answers (~3 s)
    python -m examples.wordle.solver --out examples/wordle/data/solver_tree.json --force  # the committed one (~8 min)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import numpy as np

from .game import DATA, allowed_words, answer_words, feedback

__all__ = ["TreeSolver", "build_tree", "feedback_codes"]

TREE = DATA / "solver_tree.json"
_POW3 = np.array([1, 3, 9, 27, 81])


def _encode(words: list[str]) -> np.ndarray:
    return np.array([[ord(c) - 97 for c in w] for w in words], dtype=np.int8)


def feedback_codes(guess: np.ndarray, answers: np.ndarray) -> np.ndarray:
    """Feedback of one guess (5,) against many answers (n, 5), as base-3 codes (X=0, Y=1, G=2), vectorized.

    Same rule as :func:`examples.wordle.game.feedback`: greens first, then yellows left to right while the
    answer still has an unmatched copy of the letter.
    """
    green = answers == guess
    out = np.where(green, 2, 0)
    for i in range(5):
        letter = guess[i]
        unmatched = ((answers == letter) & ~green).sum(axis=1)
        used = np.zeros(len(answers), dtype=np.int64)
        for k in range(i):
            if guess[k] == letter:
                used += out[:, k] == 1
        out[:, i] = np.where(~green[:, i] & (unmatched - used > 0), 1, out[:, i])
    return out @ _POW3


def _ranked_guesses(cands: list[str], pool: list[str], pool_codes: np.ndarray, top: int) -> list[str]:
    """The ``top`` guesses by (feedback groups, could-win, -largest group), best first."""
    if len(cands) <= 2:
        return list(cands)
    enc = _encode(cands)
    cand_set = set(cands)
    keyed = []
    for word, code in zip(pool, pool_codes, strict=True):
        counts = np.bincount(feedback_codes(code, enc), minlength=243)
        keyed.append(((int((counts > 0).sum()), word in cand_set, -int(counts.max())), word))
    keyed.sort(key=lambda kw: kw[0], reverse=True)
    return [w for _, w in keyed[:top]]


def build_tree(max_guesses: int = 6, top: int = 40, answers: Sequence[str] | None = None) -> dict:
    """The whole decision tree, {"guess": w, "next": {feedback: subtree}}, winning within ``max_guesses``.

    Greedy (most feedback groups), with a bounded lookahead: where a subtree would need too many guesses,
    the next-ranked guesses (up to ``top``) are tried until one fits. ``answers``: the words it must win
    (default: the whole answer list).
    """
    pool = sorted(allowed_words())
    pool_codes = _encode(pool)
    start = time.time()
    nodes = 0

    def node(cands: list[str], depth: int) -> dict | None:
        nonlocal nodes
        nodes += 1
        if nodes % 500 == 0:
            print(f"{nodes} nodes, {time.time() - start:.0f} s", file=sys.stderr, flush=True)
        if depth > max_guesses:
            return None
        for guess in _ranked_guesses(cands, pool, pool_codes, top):
            groups: dict[str, list[str]] = {}
            for answer in cands:
                groups.setdefault(feedback(guess, answer), []).append(answer)
            children = {}
            for fb, group in sorted(groups.items()):
                if fb == "GGGGG":
                    continue
                child = node(group, depth + 1)
                if child is None:
                    break
                children[fb] = child
            else:
                return {"guess": guess, "next": children}
        return None

    tree = node(list(answer_words() if answers is None else answers), 1)
    if tree is None:
        raise RuntimeError(f"no tree wins every answer within {max_guesses} guesses at top={top}")
    return tree


@cache
def _tree() -> dict:
    return json.loads(TREE.read_text())


class TreeSolver:
    """Plays by the committed decision tree (optionally from a random opening of ``k`` tree moves)."""

    def guess(self, history: list[tuple[str, str]]) -> str:
        node = _tree()
        for g, fb in history:
            if g != node["guess"] or fb not in node["next"]:
                return _fallback(history)  # off the tree (an opening it did not choose): play consistently
            node = node["next"][fb]
        return str(node["guess"])


def _fallback(history: list[tuple[str, str]]) -> str:
    cands = [w for w in answer_words() if all(feedback(g, w) == f for g, f in history)]
    return cands[0] if cands else random.choice(sorted(allowed_words()))


def depth(tree: dict) -> int:
    return 1 + max((depth(c) for c in tree["next"].values()), default=0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where to write the tree (JSON)")
    parser.add_argument("--answers", type=int, help="win only the first N words of data/answers.txt (default: all)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    every = answer_words()
    if args.answers is not None and not 0 < args.answers <= len(every):
        parser.error(f"--answers must be in 1..{len(every)}, got {args.answers}")
    partial = args.answers is not None and args.answers < len(every)
    if partial and args.out.resolve() == TREE.resolve():
        parser.error(f"{args.out}: the demo's tree must win every answer; write a partial tree elsewhere")
    if args.out.exists() and not args.force:
        parser.error(f"{args.out} exists: pass --force to replace it")
    start = time.monotonic()
    tree = build_tree(answers=every[: args.answers] if partial else None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(tree, separators=(",", ":"), sort_keys=True))
    n = args.answers if partial else len(every)
    print(f"wrote {args.out}: {n} answers, depth {depth(tree)}, {time.monotonic() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
