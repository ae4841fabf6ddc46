"""Wordle rules and the scripted solver (examples/wordle)."""

from __future__ import annotations

import pytest

from examples.wordle.game import Game, answer_words, feedback, parse_guess, reward
from examples.wordle.solver import TreeSolver


@pytest.mark.parametrize(
    ("guess", "answer", "expected"),
    [
        ("crane", "crane", "GGGGG"),
        ("kebab", "abbey", "XYGYY"),  # one b green, the other yellow: the answer has two
        ("papal", "apple", "YYGXY"),  # the second a is grey: the answer has one a, already used
        ("geese", "eerie", "XGYXG"),  # greens first, then one yellow for the one e left
        ("sassy", "brass", "YYXGX"),  # three s guessed, two in the answer: green + one yellow
        ("llama", "hello", "YYXXX"),
    ],
)
def test_feedback_with_repeated_letters(guess: str, answer: str, expected: str) -> None:
    assert feedback(guess, answer) == expected


def test_the_tree_solver_wins_every_answer_within_six() -> None:
    solver = TreeSolver()
    worst = 0
    for answer in answer_words():
        history: list[tuple[str, str]] = []
        while not history or history[-1][1] != "GGGGG":
            history.append((g := solver.guess(history), feedback(g, answer)))
            assert len(history) <= 6, (answer, history)
        worst = max(worst, len(history))
    assert worst <= 6 and len(answer_words()) == 3568


def test_invalid_moves_warn_once_then_end_the_episode() -> None:
    game = Game(answer="crane")
    first = game.play("abc")
    assert (first["valid"], first["reward"], game.done, len(game.history)) == (False, 0.0, False, 0)
    assert game.play("slate")["feedback"] == "XXGXG"
    assert game.play("zzzzz")["reason"] == "'zzzzz' is not in the word list"
    assert game.done and not game.won


def test_rewards_and_parsing() -> None:
    assert reward("GGGGG") == 1.0 and reward("GGXYX") == pytest.approx(0.25) and reward("XXXXX") == 0.0
    assert parse_guess("I think <guess> Crane </guess>") == "crane"
    assert parse_guess("crane") is None
