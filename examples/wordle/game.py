"""Wordle rules, word lists, a scripted solver, prompts and rewards (no I/O beyond reading the word lists)."""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

__all__ = [
    "MAX_GUESSES",
    "SYSTEM",
    "Game",
    "allowed_words",
    "answer_words",
    "feedback",
    "parse_guess",
    "render_messages",
    "reward",
    "solver_guess",
]

DATA = Path(__file__).parent / "data"
MAX_GUESSES = 6
WORD = re.compile(r"^[a-z]{5}$")
_GUESS_TAG = re.compile(r"<guess>\s*([^<]*?)\s*</guess>", re.IGNORECASE)


@cache
def allowed_words() -> frozenset[str]:
    """Every guess the environment accepts."""
    return frozenset((DATA / "allowed.txt").read_text().split())


@cache
def answer_words() -> tuple[str, ...]:
    """The secret words (common ones), sorted."""
    return tuple((DATA / "answers.txt").read_text().split())


def feedback(guess: str, answer: str) -> str:
    """Wordle feedback, one letter per position: G (right place), Y (elsewhere), X (absent).

    Repeated letters are handled as the game does: greens first, then yellows from left to right, each
    only while the answer still has an unmatched copy of that letter.
    """
    result = ["X"] * 5
    remaining: Counter[str] = Counter()
    for i, (g, a) in enumerate(zip(guess, answer, strict=True)):
        if g == a:
            result[i] = "G"
        else:
            remaining[a] += 1
    for i, g in enumerate(guess):
        if result[i] != "G" and remaining[g] > 0:
            result[i] = "Y"
            remaining[g] -= 1
    return "".join(result)


@dataclass
class Game:
    """One episode. Invalid moves get one warning; a second invalid move ends the episode (lost)."""

    answer: str
    history: list[tuple[str, str]] = field(default_factory=list)
    warnings: int = 0
    done: bool = False
    won: bool = False

    def play(self, raw: str) -> dict[str, object]:
        """Apply a move (the raw text the player sent); returns the step result."""
        if self.done:
            raise ValueError("the episode is over")
        guess = raw.strip().lower()
        reason = None
        if not WORD.match(guess):
            reason = "a guess is exactly 5 letters a-z"
        elif guess not in allowed_words():
            reason = f"{guess!r} is not in the word list"
        if reason is not None:
            self.warnings += 1
            if self.warnings >= 2:
                self.done = True
            return {"valid": False, "reason": reason, "feedback": None, "reward": 0.0}
        fb = feedback(guess, self.answer)
        self.history.append((guess, fb))
        self.won = fb == "GGGGG"
        self.done = self.won or len(self.history) >= MAX_GUESSES
        return {"valid": True, "reason": None, "feedback": fb, "reward": reward(fb)}

    def observation(self) -> dict[str, object]:
        return {
            "history": [{"guess": g, "feedback": f} for g, f in self.history],
            "done": self.done,
            "won": self.won,
            "warnings": self.warnings,
            "guesses_left": MAX_GUESSES - len(self.history),
        }


def reward(fb: str) -> float:
    """1.0 for a win; else partial credit from this guess: 0.1 per green and 0.05 per yellow (at most 0.4)."""
    if fb == "GGGGG":
        return 1.0
    return 0.1 * fb.count("G") + 0.05 * fb.count("Y")


def solver_guess(history: list[tuple[str, str]], rng: random.Random | None = None) -> str:
    """A scripted player: a random answer word consistent with every feedback so far (always wins in <= 6 on the
    answer list in practice; the test checks it)."""
    candidates = [w for w in answer_words() if all(feedback(g, w) == f for g, f in history)]
    if not history:
        return "crane" if rng is None else rng.choice(("crane", "slate", "trace", "crate", "stare"))
    return candidates[0] if rng is None else rng.choice(candidates)


def parse_guess(text: str) -> str | None:
    """The word inside ``<guess>...</guess>`` (lowercased), or ``None`` if the reply is not well formed."""
    match = _GUESS_TAG.search(text)
    return match.group(1).strip().lower() if match else None


SYSTEM = (
    "You are playing Wordle. Guess the secret 5-letter word in 6 tries. After each guess you get feedback per "
    "letter: G = right letter, right place; Y = in the word, elsewhere; X = not in the word. Reply with your "
    "guess as <guess>xxxxx</guess>."
)


def render_messages(history: list[tuple[str, str]]) -> list[dict[str, str]]:
    """The chat prompt for the next guess."""
    lines = [f"{g} {f}" for g, f in history] or ["(no guesses yet)"]
    return [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": "Previous guesses:\n" + "\n".join(lines) + f"\nGuesses left: {MAX_GUESSES - len(history)}",
        },
    ]
