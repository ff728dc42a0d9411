"""``retrieval``: questions about a generated encyclopedia, answered with ``search`` and ``open``.

The corpus (fictional countries and their cities) is generated deterministically from the
spec's ``corpus_seed``; nothing is downloaded. Questions need one lookup ("Varnholt: what is its
export?") or two ("Zephyria: what is the export of its capital?"), so trajectories are longer
and use two different tools. ``search`` lists matching documents by name and kind ("Varnholt
(city)"); ``open`` takes a document's name and returns its text ("Varnholt is a city, country
Zephyria, founded 1384, population 23900, export tea."). Reward: 1 for the right answer (case
and punctuation ignored), else 0.

Shaped so that a small model can learn it: the subject comes first in every question, a
document is opened by the name the question and the search results already use, each fact's
value follows its keyword directly in the text, and answers are single words or names. Place
names come from a fixed list (``NAMES``) while it lasts, so a tokenizer can hold each name as
one token (the project's tiny model does). Every step is then a copy of one token the context
holds, chosen by a keyword of the question.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field

from rollcall.tasks.base import Observation, SplitTask, TaskSpec, Tool, ToolError, require_args

SEARCH_RESULTS = 5
_SYLLABLES = (
    *("var", "nol", "zeph", "ri", "ka", "tor", "mel", "un", "dra", "sil", "quo", "bex"),
    *("lan", "ther", "os", "pim", "ga", "rue", "fen", "hal", "ix", "mor", "tes", "ul"),
)
_EXPORTS = ("copper", "salt", "timber", "wool", "glass", "silk", "tea", "iron", "amber", "wine")
_CURRENCIES = ("lira", "crown", "mark", "dinar", "florin", "real", "shell", "thaler")
_WORD = re.compile(r"[a-z0-9]+")
WORDS = _EXPORTS + _CURRENCIES  # the values of the facts that are not place names


@dataclass(frozen=True)
class Doc:
    id: str  # the title, lower-cased
    title: str
    kind: str  # "country" or "city"
    text: str


@dataclass(frozen=True)
class Corpus:
    docs: dict[str, Doc]
    facts: tuple[tuple[str, str, str], ...]  # (kind, subject, answer) the questions are built on


def random_name(r: random.Random) -> str:
    """A fictional name of two or three syllables, as the corpus's places are named."""
    while True:
        n = "".join(r.choice(_SYLLABLES) for _ in range(r.randint(2, 3))).capitalize()
        if len(n) >= 5:
            return n


def _fixed_names(count: int) -> tuple[str, ...]:
    r = random.Random("retrieval-names")
    names: dict[str, None] = {}
    while len(names) < count:
        names[random_name(r)] = None
    return tuple(names)


# The place names corpora draw from (then random ones, for corpora larger than the list).
NAMES = _fixed_names(320)


def _names(r: random.Random, count: int) -> list[str]:
    picked = r.sample(NAMES, min(count, len(NAMES)))
    used = set(picked)
    while len(picked) < count:
        n = random_name(r)
        if n not in used:
            used.add(n)
            picked.append(n)
    return picked


@functools.lru_cache(maxsize=8)
def build_corpus(seed: int, countries: int, cities_per_country: int) -> Corpus:
    r = random.Random(f"retrieval-corpus:{seed}")
    names = iter(_names(r, countries * (1 + cities_per_country)))
    docs: dict[str, Doc] = {}
    facts: list[tuple[str, str, str]] = []
    for _ in range(countries):
        country = next(names)
        cities = [next(names) for _ in range(cities_per_country)]
        capital = cities[0]
        currency = r.choice(_CURRENCIES)
        cdoc = country.lower()
        docs[cdoc] = Doc(
            cdoc,
            country,
            "country",
            f"{country} is a country, capital {capital}, currency {currency}, cities "
            f"{', '.join(cities)}.",
        )
        facts += [("capital", country, capital), ("currency", country, currency)]
        for city in cities:
            founded = r.randint(800, 1900)
            population = r.randint(2, 900) * 100
            export = r.choice(_EXPORTS)
            did = city.lower()
            docs[did] = Doc(
                did,
                city,
                "city",
                f"{city} is a city, country {country}, founded {founded}, population "
                f"{population}, export {export}.",
            )
            facts += [("country", city, country), ("export", city, export)]
            if city == capital:
                facts.append(("capital_export", country, export))
    return Corpus(docs, tuple(facts))


_QUESTIONS = {
    "capital": "{s}: what is its capital?",
    "currency": "{s}: what is its currency?",
    "country": "{s}: which country is it in?",
    "export": "{s}: what is its export?",
    "capital_export": "{s}: what is the export of its capital?",
}


def normalise(text: str) -> str:
    return " ".join(_WORD.findall(text.lower().replace(",", "")))


class RetrievalSpec(TaskSpec):
    corpus_seed: int = 0
    countries: int = Field(default=12, ge=1, le=200)
    cities_per_country: int = Field(default=6, ge=1, le=50)
    max_turns: int = Field(default=10, ge=1, le=128)


class RetrievalTask(SplitTask):
    held_out_per_mille: ClassVar[int] = 150

    name: ClassVar[str] = "retrieval"
    description: ClassVar[str] = (
        "Questions about a generated encyclopedia, with search and open tools."
    )
    Spec: ClassVar[type[TaskSpec]] = RetrievalSpec

    def corpus(self, spec: TaskSpec) -> Corpus:
        assert isinstance(spec, RetrievalSpec)
        return build_corpus(spec.corpus_seed, spec.countries, spec.cities_per_country)

    def draw(self, spec: TaskSpec, rng: random.Random) -> tuple[str, dict[str, Any]]:
        kind, subject, answer = rng.choice(self.corpus(spec).facts)
        return f"{kind}:{subject}", {
            "question": _QUESTIONS[kind].format(s=subject),
            "answer": answer,
            "kind": kind,
            "subject": subject,
            "hops": 2 if kind == "capital_export" else 1,
        }

    def instructions(self, spec: TaskSpec, prompt: dict[str, Any]) -> str:
        return (
            f"{prompt['question']}\nLook it up: search finds documents, open reads one. "
            "Answer with the fact only."
        )

    def tools(self, spec: TaskSpec) -> list[Tool]:
        return [
            Tool(
                "search",
                "Find documents whose name or text matches the query; returns their names.",
                {
                    "type": "object",
                    "properties": {"query": {"type": "string"}},
                    "required": ["query"],
                },
            ),
            Tool(
                "open",
                "Read the document with this name.",
                {
                    "type": "object",
                    "properties": {"name": {"type": "string"}},
                    "required": ["name"],
                },
            ),
        ]

    def initial_state(self, spec: TaskSpec, prompt: dict[str, Any]) -> dict[str, Any]:
        return {"searches": 0, "opened": []}

    def call_tool(
        self,
        spec: TaskSpec,
        prompt: dict[str, Any],
        state: dict[str, Any],
        name: str,
        arguments: dict[str, Any],
    ) -> Observation:
        corpus = self.corpus(spec)
        if name == "search":
            require_args(arguments, query=str)
            words = set(_WORD.findall(arguments["query"].lower()))
            if not words:
                raise ToolError("the query has no words")
            scored = []
            for doc in corpus.docs.values():
                title = set(_WORD.findall(doc.title.lower()))
                body = set(_WORD.findall(doc.text.lower()))
                score = 3 * len(words & title) + len(words & body)
                if score:
                    scored.append((-score, doc.id, doc.title, doc.kind))
            scored.sort()
            lines = [f"{t} ({k})" for _, _, t, k in scored[:SEARCH_RESULTS]]
            state = {**state, "searches": int(state.get("searches", 0)) + 1}
            return Observation("\n".join(lines) if lines else "no documents found", state)
        if name == "open":
            require_args(arguments, name=str)
            found = corpus.docs.get(arguments["name"].strip().lower())
            if found is None:
                raise ToolError(f"no document {arguments['name']!r}; search for its name first")
            opened = [*state.get("opened", []), found.id]
            return Observation(found.text, {**state, "opened": opened})
        return super().call_tool(spec, prompt, state, name, arguments)

    def reward(
        self,
        spec: TaskSpec,
        prompt: dict[str, Any],
        answer: str | None,
        state: dict[str, Any],
        turns: int,
    ) -> float:
        if answer is None:
            return 0.0
        return 1.0 if normalise(answer) == normalise(str(prompt["answer"])) else 0.0
