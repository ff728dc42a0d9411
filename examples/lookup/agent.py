"""Example (a): a lookup-tool agent, written as plain async Python.

It answers questions about a generated encyclopedia (the corpus of rollcall's built-in
retrieval task) with two tools, ``search`` and ``open``. Everything it does goes through
``ctx``: the model's turns (``ctx.chat``), the tools (``ctx.tool``), so a crashed rollout
resumes at the exact call. Run it: ``rollcall run examples/lookup/config.yaml``.
"""

from __future__ import annotations

from typing import Any

from rollcall import AgentContext, Outcome
from rollcall.tasks.retrieval import build_corpus, normalise

CORPUS = build_corpus(0, 12, 6)  # the retrieval task's default corpus

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Find documents whose name or text matches the query; returns their "
            "names.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "open",
            "description": "Read the document with this name.",
            "parameters": {
                "type": "object",
                "properties": {"name": {"type": "string"}},
                "required": ["name"],
            },
        },
    },
]


def search(query: str) -> str:
    words = set(normalise(query).split())
    scored = []
    for doc in CORPUS.docs.values():
        score = 3 * len(words & set(normalise(doc.title).split()))
        score += len(words & set(normalise(doc.text).split()))
        if score:
            scored.append((-score, doc.id, f"{doc.title} ({doc.kind})"))
    return "\n".join(line for *_, line in sorted(scored)[:5]) or "no documents found"


def open_doc(name: str) -> str:
    doc = CORPUS.docs.get(name.strip().lower())
    if doc is None:  # becomes the observation "error: ..." for the model
        raise LookupError(f"no document {name!r}; search for its name first")
    return doc.text


async def rollout(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    task = "Look it up: search finds documents, open reads one. Answer with the fact only."
    msgs: list[dict[str, Any]] = [{"role": "user", "content": f"{prompt['question']}\n{task}"}]
    answer = None
    for _ in range(8):
        reply = await ctx.chat(msgs, tools=TOOLS)
        msgs.append(reply.message)
        if reply.answer is not None:
            answer = reply.answer
            break
        if reply.error is not None:  # a turn the tool-call format could not read
            msgs.append({"role": "tool", "content": f"error: {reply.error}"})
            continue
        for call in reply.tool_calls:
            msgs.append(await ctx.tool({"search": search, "open": open_doc}, call))
    right = answer is not None and normalise(answer) == normalise(prompt["answer"])
    return Outcome(reward=1.0 if right else 0.0, info={"answer": answer})
