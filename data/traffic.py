"""The kind of traffic a request is: chat, code, summarization, creative or reasoning.

Acceptance differs a lot between kinds of traffic (code and summaries copy text; open chat does not),
so eyas labels conversations by what their first request asks for and reports acceptance per kind.
The labels come from plain keyword rules over the request text, checked in this order (the first that
matches wins): a request that shows or asks for code is code; one that asks to shorten a given text is
summarization; one that asks for a story, poem, song or the like is creative; arithmetic, puzzles and
step-by-step proofs are reasoning; everything else is chat. Rules, not a model: cheap, deterministic,
and wrong now and then, which only moves a prompt between report rows.
"""

from __future__ import annotations

import re

KINDS = ("code", "summarization", "creative", "reasoning", "chat")

_CODE = re.compile(
    r"```|\b(def|class|import|return|public|private|static|void|const|var|let|function|lambda|select|from|where)"
    r"\b.*[(){};=]|[{};]\s*$|#include|\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|php|ruby|swift|"
    r"kotlin|sql|html|css|react(\.js)?|node\.js|django|flask|regex|bash|shell script|powershell|api|json|yaml|"
    r"docker|kubernetes|git|code|coding|script|function|method|compile|compiler|debug|bug|stack ?trace|"
    r"exception|traceback|syntax|algorithm|implement|program(ming)?)\b|\b[A-Z]\w*(Error|Exception|Warning)\b|"
    r"\b\w+\.(py|js|jsx|ts|tsx|java|go|rs|cpp|cc|h|rb|php|swift|kt|cs|sh)\b",
    re.IGNORECASE | re.MULTILINE)
_SUMMARY = re.compile(r"\b(summar(y|ise|ize|ies|izing|ising)|tl;?dr|key (points|takeaways)|condense|shorten|"
                      r"in (\d+|a few|one|two|three) (sentences|bullet points|words)|rephrase|paraphrase|"
                      r"rewrite (this|the following))\b", re.IGNORECASE)
_CREATIVE = re.compile(r"\b(story|stories|poem|poetry|haiku|limerick|song|lyrics|rap|fiction|novel|screenplay|"
                       r"script for a (video|film|movie|play)|character|fairy ?tale|fable|sonnet|slogan|"
                       r"joke|imagine|role ?play|creative|blog|essay|letter|speech|valentine)\b",
                       re.IGNORECASE)
_REASONING = re.compile(r"\d\s*[-+*/x×^=]\s*\d|\b(solve|calculate|compute|how many|how much|prove|proof|"
                        r"equation|math(s|ematics|ematical)?|probability|percent(age)?|riddle|puzzle|logic(al)?|"
                        r"step[- ]by[- ]step|derive|integral|derivative)\b", re.IGNORECASE)


def traffic_kind(request: str) -> str:
    """The kind of traffic of one request text (see the module docstring for the rules and their order)."""
    for kind, rule in (("code", _CODE), ("summarization", _SUMMARY), ("creative", _CREATIVE),
                       ("reasoning", _REASONING)):
        if rule.search(request):
            return kind
    return "chat"


def first_request(messages: list[dict]) -> str:
    """The text of the first user turn of a conversation ("" when there is none)."""
    return next((m["content"] for m in messages if m["role"] == "user"), "")
