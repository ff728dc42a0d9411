"""``retrieval``: questions about a generated encyclopedia, answered with ``search`` and ``open``.

The corpus (fictional countries and their cities) is generated deterministically from the
spec's ``corpus_seed``; nothing is downloaded. Questions need one lookup ("When was Varnholt
founded?") or two ("What does the capital of Zephyria export?"), so trajectories are longer and
use two different tools. Reward: 1 for the right answer (case, punctuation and thousands
separators ignored), else 0.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field

from tasks.base import Observation, SplitTask, TaskSpec, Tool, ToolError, require_args

SEARCH_RESULTS = 5
_SYLLABLES = (
    *("var", "nol", "zeph", "ri", "ka", "tor", "mel", "un", "dra", "sil", "quo", "bex"),
    *("lan", "ther", "os", "pim", "ga", "rue", "fen", "hal", "ix", "mor", "tes", "ul"),
)
_EXPORTS = ("copper", "salt", "timber", "wool", "glass", "silk", "tea", "iron", "amber", "wine")
_CURRENCIES = ("lira", "crown", "mark", "dinar", "florin", "real", "shell", "thaler")
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class Doc:
    id: str
    title: str
    text: str


@dataclass(frozen=True)
class Corpus:
    docs: dict[str, Doc]
    facts: tuple[tuple[str, str, str], ...]  # (kind, subject, answer) the questions are built on


def _name(r: random.Random, used: set[str]) -> str:
    while True:
        n = "".join(r.choice(_SYLLABLES) for _ in range(r.randint(2, 3))).capitalize()
        if n not in used and len(n) >= 5:
            used.add(n)
            return n


@functools.lru_cache(maxsize=8)
def build_corpus(seed: int, countries: int, cities_per_country: int) -> Corpus:
    r = random.Random(f"retrieval-corpus:{seed}")
    used: set[str] = set()
    docs: dict[str, Doc] = {}
    facts: list[tuple[str, str, str]] = []
    for _ in range(countries):
        country = _name(r, used)
        cities = [_name(r, used) for _ in range(cities_per_country)]
        capital = cities[0]
        currency = r.choice(_CURRENCIES)
        cdoc = f"country-{country.lower()}"
        docs[cdoc] = Doc(
            cdoc,
            country,
            f"{country} is a country. Its capital is {capital}. Its currency is the {currency}. "
            f"Its cities include {', '.join(cities)}.",
        )
        facts.append(("capital", country, capital))
        for city in cities:
            founded = r.randint(800, 1900)
            population = r.randint(2, 900) * 100
            export = r.choice(_EXPORTS)
            did = f"city-{city.lower()}"
            docs[did] = Doc(
                did,
                city,
                f"{city} is a city in {country}. It was founded in {founded}. Its population is "
                f"{population:,}. Its main export is {export}.",
            )
            facts += [
                ("founded", city, str(founded)),
                ("population", city, str(population)),
                ("export", city, export),
            ]
            if city == capital:
                facts.append(("capital_export", country, export))
    return Corpus(docs, tuple(facts))


_QUESTIONS = {
    "capital": "What is the capital of {s}?",
    "founded": "In which year was {s} founded?",
    "population": "What is the population of {s}?",
    "export": "What is the main export of {s}?",
    "capital_export": "What is the main export of the capital of {s}?",
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
                "Find documents whose title or text matches the query; returns ids and titles.",
                {
                    "type": "object",
                    "properties": {"query": {"type": "string"}},
                    "required": ["query"],
                },
            ),
            Tool(
                "open",
                "Read the document with this id.",
                {
                    "type": "object",
                    "properties": {"doc_id": {"type": "string"}},
                    "required": ["doc_id"],
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
                    scored.append((-score, doc.id, doc.title))
            scored.sort()
            lines = [f"{i}: {t}" for _, i, t in scored[:SEARCH_RESULTS]]
            state = {**state, "searches": int(state.get("searches", 0)) + 1}
            return Observation("\n".join(lines) if lines else "no documents found", state)
        if name == "open":
            require_args(arguments, doc_id=str)
            found = corpus.docs.get(arguments["doc_id"].strip())
            if found is None:
                raise ToolError(f"no document {arguments['doc_id']!r}; search for an id first")
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
