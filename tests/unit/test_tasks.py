"""Built-in task plugins: prompt streams, tools, rewards (hand-written cases)."""

from __future__ import annotations

import json
import re

import pytest

from rollcall.tasks import registry
from rollcall.tasks.base import TaskPlugin, ToolError
from rollcall.tasks.calculator import TEMPLATES, CalculatorSpec, CalculatorTask, parse_number
from rollcall.tasks.guess import GuessSpec, GuessTask
from rollcall.tasks.retrieval import RetrievalSpec, RetrievalTask
from rollcall.tasks.safe_eval import CalcError, evaluate, format_number


@pytest.mark.parametrize(
    "name", sorted(n for n, i in registry.available().items() if i.source != "agent")
)
def test_every_builtin_plugin_honours_the_protocol(name: str) -> None:
    plugin = registry.get(name)
    assert isinstance(plugin, TaskPlugin)
    spec = plugin.Spec()
    train = [plugin.prompt(spec, i) for i in range(30)]
    assert train == [plugin.prompt(spec, i) for i in range(30)]  # deterministic
    json.dumps(train)  # JSON-serialisable: stored in episodes.prompt
    held = [plugin.eval_prompt(spec, i) for i in range(30)]
    json.dumps(held)
    assert plugin.instructions(spec, train[0])
    state = plugin.initial_state(spec, train[0])
    json.dumps(state)
    with pytest.raises(ToolError, match="unknown tool 'nope'"):
        plugin.call_tool(spec, train[0], state, "nope", {})
    for t in plugin.tools(spec):
        assert t.parameters["type"] == "object" and t.parameters["required"]


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("2 ** 10", 1024),
        ("1 / 4", 0.25),
        ("37 × 12 − 0".replace("−", "-"), 444),
        ("3 ^ 2", 9),
        ("+5 - -5", 10),
    ],
)
def test_safe_eval_arithmetic(expr: str, value: float) -> None:
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("__import__('os').system('true')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("lambda: 1", "Lambda is not allowed"),
        ("[1, 2]", "List is not allowed"),
        ("2 ** 1000", "exponents are limited"),
        ("9 ** 60", "exceeds"),
        ("1 / 0", "division by zero"),
        ("1 +", "cannot parse"),
        ("", "empty"),
        ("1+" * 150 + "1", "longer than"),
        ("-" * 40 + "1", "nested too deeply"),  # parentheses alone add no depth
        ("(-8) ** 0.5", "not a real number"),
    ],
)
def test_safe_eval_refuses(expr: str, message: str) -> None:
    with pytest.raises(CalcError, match=re.escape(message)):
        evaluate(expr)


def test_format_number() -> None:
    assert format_number(14) == "14"
    assert format_number(14.0) == "14"
    assert format_number(0.1 + 0.2) == "0.3"
    assert format_number(-2.5) == "-2.5"


def test_calculator_templates_hand_derived() -> None:
    # Warehouse: 12 boxes x 6 items - 10 shipped = 62.
    assert evaluate(TEMPLATES[0][1].format(a=12, b=6, c=10)) == 62
    # Pencils: 5 packs x 6 - 3 to each of 2 friends = 24.
    assert evaluate(TEMPLATES[1][1].format(a=5, b=6, c=3, d=2)) == 24
    # Train: 40 x 2 + 50 x 3 = 230.
    assert evaluate(TEMPLATES[2][1].format(a=40, b=2, c=50, d=3)) == 230
    # Tank: 120 / 4 + 5 = 35.
    assert evaluate(TEMPLATES[3][1].format(a=120, b=4, c=5)) == 35
    # Savings: (20 x 5 - 10) // 4 = 22.
    assert evaluate(TEMPLATES[4][1].format(a=20, b=5, c=10, d=4)) == 22


def test_calculator_streams_are_disjoint_and_answers_non_negative() -> None:
    task, spec = CalculatorTask(), CalculatorSpec()
    train = [task.prompt(spec, i) for i in range(400)]
    held = [task.eval_prompt(spec, i) for i in range(100)]
    assert not {p["key"] for p in train} & {p["key"] for p in held}
    assert all(float(p["answer"]) >= 0 for p in train + held)
    assert len({p["question"] for p in train}) > 390


def test_calculator_tool_and_reward() -> None:
    task, spec = CalculatorTask(), CalculatorSpec()
    prompt = {"question": "q", "answer": "1234"}
    obs = task.call_tool(spec, prompt, {}, "calc", {"expression": "1000 + 234"})
    assert obs.text == "1234" and obs.state == {"calc_calls": 1} and not obs.done
    with pytest.raises(ToolError, match="missing argument"):
        task.call_tool(spec, prompt, {}, "calc", {})
    with pytest.raises(ToolError, match="unknown argument"):
        task.call_tool(spec, prompt, {}, "calc", {"expression": "1", "x": 2})
    with pytest.raises(ToolError, match="must be a str"):
        task.call_tool(spec, prompt, {}, "calc", {"expression": 5})
    with pytest.raises(ToolError, match="division by zero"):
        task.call_tool(spec, prompt, {}, "calc", {"expression": "1/0"})
    assert task.reward(spec, prompt, "1234", {}, 2) == 1.0
    assert task.reward(spec, prompt, "1,234 items.", {}, 2) == 1.0
    assert task.reward(spec, prompt, "1233", {}, 2) == 0.1  # well-formed but wrong
    assert task.reward(spec, prompt, "about a thousand", {}, 2) == 0.0
    assert task.reward(spec, prompt, None, {}, 2) == 0.0


def test_parse_number() -> None:
    assert parse_number("42") == 42.0
    assert parse_number(" -3.5 ") == -3.5
    assert parse_number("12,000 km.") == 12000.0
    assert parse_number("x42") is None
    assert parse_number("") is None


def test_guess_game_binary_search_and_reward() -> None:
    task, spec = GuessTask(), GuessSpec()
    prompt = {"secret": 37}
    state = task.initial_state(spec, prompt)
    lo, hi, obs = spec.low, spec.high, None
    while True:
        mid = (lo + hi) // 2
        obs = task.call_tool(spec, prompt, state, "guess", {"number": mid})
        state = obs.state
        if obs.text == "correct":
            break
        lo, hi = (mid + 1, hi) if obs.text.startswith("higher") else (lo, mid - 1)
    assert obs.done and state["solved"] and state["guesses"] <= 7
    # Reward falls linearly from 1 (one guess) to 0.5 (the 8th): 1 - 0.5 * (g - 1) / 7.
    assert task.reward(spec, prompt, None, {"solved": True, "guesses": 1}, 1) == 1.0
    assert task.reward(spec, prompt, None, {"solved": True, "guesses": 8}, 8) == 0.5
    assert task.reward(spec, prompt, None, {"solved": True, "guesses": 4}, 4) == pytest.approx(
        1 - 0.5 * 3 / 7
    )
    assert task.reward(spec, prompt, None, {"solved": False, "guesses": 8}, 8) == 0.0


def test_guess_game_refuses_bad_calls_and_ends() -> None:
    task, spec = GuessTask(), GuessSpec(max_guesses=2)
    prompt = {"secret": 50}
    st = task.initial_state(spec, prompt)
    with pytest.raises(ToolError, match="between 1 and 100"):
        task.call_tool(spec, prompt, st, "guess", {"number": 101})
    with pytest.raises(ToolError, match="must be an integer"):
        task.call_tool(spec, prompt, st, "guess", {"number": True})
    with pytest.raises(ToolError, match="must be an integer"):
        task.call_tool(spec, prompt, st, "guess", {"number": "50"})
    o1 = task.call_tool(spec, prompt, st, "guess", {"number": 10})
    assert o1.text == "higher (1 guesses left)" and not o1.done
    o2 = task.call_tool(spec, prompt, o1.state, "guess", {"number": 90})
    assert o2.text.startswith("lower") and o2.done  # out of guesses
    with pytest.raises(ToolError, match="no guesses left"):
        task.call_tool(spec, prompt, o2.state, "guess", {"number": 50})


def test_retrieval_questions_are_answerable_with_the_tools() -> None:
    task, spec = RetrievalTask(), RetrievalSpec()
    for i in range(40):
        prompt = task.prompt(spec, i)
        state = task.initial_state(spec, prompt)
        subject = prompt["question"].split(":")[0]
        if prompt["hops"] == 2:
            obs = task.call_tool(spec, prompt, state, "search", {"query": subject})
            doc_id = obs.text.splitlines()[0].split(" (")[0]
            assert doc_id == subject and obs.text.splitlines()[0].endswith("(country)")
            obs = task.call_tool(spec, prompt, obs.state, "open", {"name": doc_id})
            subject = re.search(r"capital (\w+)", obs.text).group(1)  # type: ignore[union-attr]
            state = obs.state
        obs = task.call_tool(spec, prompt, state, "search", {"query": subject})
        doc_id = obs.text.splitlines()[0].split(" (")[0]
        assert doc_id == subject  # the best match is the subject's own document
        opened = task.call_tool(spec, prompt, obs.state, "open", {"name": doc_id})
        # the answer is the word right after the question's keyword in the document
        keyword = {"capital_export": "export"}.get(prompt["kind"], prompt["kind"])
        assert re.search(rf"\b{keyword} {prompt['answer']}\b", opened.text), (prompt, opened.text)
        assert task.reward(spec, prompt, prompt["answer"], opened.state, 3) == 1.0
        assert opened.state["opened"][-1] == doc_id.lower()


def test_retrieval_reward_and_errors() -> None:
    task, spec = RetrievalTask(), RetrievalSpec()
    prompt = {"question": "q", "answer": "Quopim"}
    assert task.reward(spec, prompt, "quopim", {}, 3) == 1.0
    assert task.reward(spec, prompt, " Quopim. ", {}, 3) == 1.0
    assert task.reward(spec, prompt, "Quopimx", {}, 3) == 0.0
    assert task.reward(spec, prompt, None, {}, 3) == 0.0
    with pytest.raises(ToolError, match="no document"):
        task.call_tool(spec, prompt, {}, "open", {"name": "Nowhere"})
    with pytest.raises(ToolError, match="no words"):
        task.call_tool(spec, prompt, {}, "search", {"query": "?!"})
    assert (
        task.call_tool(spec, prompt, {}, "search", {"query": "zzzz"}).text == "no documents found"
    )


def test_retrieval_corpus_names_and_kinds() -> None:
    from rollcall.tasks.retrieval import NAMES, build_corpus

    corpus = build_corpus(0, 12, 6)
    titles = [d.title for d in corpus.docs.values()]
    assert len(titles) == len(set(titles)) == 12 * 7 and set(titles) <= set(NAMES)
    assert {k for k, _, _ in corpus.facts} == {
        "capital", "currency", "country", "export", "capital_export"
    }  # fmt: skip
    # a corpus larger than the name list still gets distinct names
    big = build_corpus(1, 60, 6)
    assert len({d.title for d in big.docs.values()}) == 60 * 7
    assert build_corpus(2, 12, 6).docs != corpus.docs  # another seed, another encyclopedia


def test_retrieval_splits_are_disjoint() -> None:
    task, spec = RetrievalTask(), RetrievalSpec()
    train = {task.prompt(spec, i)["question"] for i in range(300)}
    held = {task.eval_prompt(spec, i)["question"] for i in range(100)}
    assert train and held and not train & held


@pytest.mark.parametrize(
    ("text", "read"),
    [
        ("42", "42"),
        ("42 km.", "42 km."),  # one number as written: the reward tolerates units
        ("-1,234", "-1,234"),
        ("The answer is 42.", "42"),
        ("**42**", "42"),
        # a free reply that shows its working: the last number is the answer (seen from
        # SmolLM2-135M; read as its first number before)
        ("19 - 5 = 9\n\nThe answer is 9.", "9"),
        ("17 * 11 - 74 = 113", "113"),
        ("no idea", "no idea"),
    ],
)
def test_the_calculator_reads_the_answer_of_a_free_reply(text: str, read: str) -> None:
    from rollcall.tasks.calculator import CalculatorSpec, CalculatorTask

    assert CalculatorTask().read_answer(CalculatorSpec(), text) == read
