"""What the target is asked to write its own EAGLE-3 training questions about (Magpie-style self-prompting).

Left to itself, SmolLM2 asks narrow questions ("Can you provide ..."). A topic system prompt steers the subject and a
few opening words steer the form, so the questions span the kinds a chat user asks (the kinds the bench's held-out
questions cover) without ever seeing those questions. An empty opening lets the model pick its own first word.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topic:
    name: str
    system: str  # the system prompt shown while the target writes a user's question
    openings: tuple[str, ...]  # first words of the question; "" leaves them to the model


_COMMON = ("", "", "What", "How", "Why", "Can you", "Explain", "I")

TOPICS: tuple[Topic, ...] = (
    Topic(
        "code",
        "You are a helpful assistant. Users ask you programming questions about Python, JavaScript, SQL and other "
        "languages: how to write a function, fix an error, or understand a concept.",
        (*_COMMON, "Write a", "Write a Python function that", "How do I", "What is the difference between", "My code"),
    ),
    Topic(
        "writing",
        "You are a helpful assistant. Users ask you to write things for them: emails, poems, stories, slogans, "
        "letters and short texts of every kind.",
        (*_COMMON, "Write a", "Write a short", "Can you write", "Help me write", "Give me", "Compose"),
    ),
    Topic(
        "facts",
        "You are a helpful assistant. Users ask you short factual questions about the world: places, people, "
        "animals, countries, records and everyday knowledge.",
        (*_COMMON, "Who", "Which", "Where", "When", "How many", "Tell me", "Is it true that"),
    ),
    Topic(
        "math",
        "You are a helpful assistant. Users ask you math questions and word problems: percentages, arithmetic, "
        "geometry, prices, speeds and simple algebra.",
        (
            *_COMMON,
            "If",
            "A",
            "What is",
            "Calculate",
            "Solve",
            "How much",
            "Is",
            "Solve step by step:",
            "A store",
            "Tom has",
        ),
    ),
    Topic(
        "how-to",
        "You are a helpful assistant. Users ask you how to do practical things: cooking, cleaning, repairs, "
        "gardening, travel and hobbies.",
        (*_COMMON, "How do I", "How can I", "What is the best way to", "Give me step-by-step", "Suggest", "Plan"),
    ),
    Topic(
        "science",
        "You are a helpful assistant. Users ask you science questions about physics, chemistry, biology, the human "
        "body, space and nature, and want clear explanations.",
        (*_COMMON, "Why do", "What causes", "How does", "Describe", "What is", "Is"),
    ),
    Topic(
        "history",
        "You are a helpful assistant. Users ask you about history: ancient civilizations, wars, inventions, famous "
        "people and how events shaped the world.",
        (*_COMMON, "Who was", "What was", "When did", "Why did", "Describe", "Tell me about"),
    ),
    Topic(
        "advice",
        "You are a helpful assistant. Users ask you for advice about their lives: work, friends, family, health, "
        "sleep, money and feelings.",
        (*_COMMON, "I'm", "My", "Should I", "How can I", "Any tips", "What should I do"),
    ),
    Topic(
        "language",
        "You are a helpful assistant. Users ask you about words and language: meanings, idioms, grammar, spelling, "
        "translations and learning languages.",
        (*_COMMON, "What does", "What is the difference between", "Is it correct to say", "Translate", "Give me"),
    ),
    Topic(
        "reasoning",
        "You are a helpful assistant. Users ask you to compare, decide, summarize or reason through questions, and "
        "to explain the pros and cons of choices.",
        (*_COMMON, "Compare", "What are the pros and cons of", "Which is better", "Summarize", "Is it"),
    ),
)


@dataclass(frozen=True)
class PassageTask:
    """A request over a text the target wrote itself (one of its answers): the long-input work Spec-Bench measures
    (summarization, QA and RAG over a given passage, translation) without any of Spec-Bench's texts."""

    name: str
    template: str  # fields: {passage}, {excerpt} (its first sentences), {question} (what it answered), {language}


PASSAGE_TASKS: tuple[PassageTask, ...] = (
    PassageTask("summary", "Summarize the following text in a few sentences.\n\n{passage}"),
    PassageTask("tldr", "{passage}\n\nWrite a short summary of the text above."),
    PassageTask("key-points", "List the main points of the text below.\n\n{passage}"),
    PassageTask("qa", "Answer the question using the passage below.\n\nPassage: {passage}\n\nQuestion: {question}"),
    PassageTask("rag", "Context:\n{passage}\n\nUsing only the context above, answer: {question}"),
    PassageTask("translate", "Translate the following text into {language}:\n\n{excerpt}"),
    PassageTask("rewrite", "Rewrite this text in simpler words:\n\n{excerpt}"),
)
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese")
_MIN_PASSAGE_WORDS = 40
_MAX_PASSAGE_WORDS = 300
_EXCERPT_SENTENCES = 3


def passage_prompt(task: PassageTask, question: str, answer: str, language: str) -> str | None:
    """`task`'s request over `answer` (the target's answer to `question`), or None when the answer is too short to
    work on; passages are cut to whole words."""
    words = answer.split()
    if len(words) < _MIN_PASSAGE_WORDS:
        return None
    passage = " ".join(words[:_MAX_PASSAGE_WORDS]) if len(words) > _MAX_PASSAGE_WORDS else answer.strip()
    sentences = [s for s in passage.replace("\n", " ").split(". ") if s.strip()]
    excerpt = ". ".join(sentences[:_EXCERPT_SENTENCES]).strip()
    if excerpt and not excerpt.endswith((".", "!", "?")):
        excerpt += "."
    return task.template.format(passage=passage, excerpt=excerpt, question=question.strip(), language=language)


_SENTINEL = "\x00question\x00"
_MAX_QUESTION_LINES = 6  # past this a "question" is a document the model went on writing
_MIN_QUESTION_CHARS = 8


def question_prefix(tokenizer, system: str, opening: str) -> str:
    """The chat rendering of a conversation with `system`, cut where the user's words begin, plus `opening`: the
    target's continuation of it is a question a user of that topic might ask."""
    from specserve.workers.models import chat

    text = chat.chat_text(tokenizer, chat.conversation(_SENTINEL, system))
    return text[: text.index(_SENTINEL)] + opening


def _normal(text: str) -> str:
    return " ".join("".join(c if c.isalnum() else " " for c in text.casefold()).split())


class QuestionFilter:
    """Keeps the questions worth answering: drops empty or degenerate ones (broken bytes, chat markup, loops, a
    document instead of a question) and any that is or contains a held-out question, which only the bench may ask."""

    def __init__(self, held_out: tuple[str, ...], special_tokens: list[str]):
        self.held_out = [n for n in (_normal(q) for q in held_out) if n]
        self.special_tokens = [t for t in special_tokens if t]

    def is_held_out(self, question: str) -> bool:
        normal = _normal(question)
        return bool(normal) and any(h in normal for h in self.held_out)

    def keep(self, question: str) -> bool:
        text = question.strip()
        if len(text) < _MIN_QUESTION_CHARS or "\ufffd" in text or "\x00" in text:
            return False
        if any(t in text for t in self.special_tokens) or "<|" in text:
            return False
        if sum(1 for line in text.splitlines() if line.strip()) > _MAX_QUESTION_LINES:
            return False
        if sum(c.isalpha() for c in text) < 0.5 * len(text.replace(" ", "")):
            return False
        return not _loops(text) and not self.is_held_out(text)


def _loops(text: str, n: int = 4, repeats: int = 3) -> bool:
    """Whether some run of `n` words occurs `repeats` times: the model got stuck."""
    words = text.split()
    counts: dict[tuple[str, ...], int] = {}
    for i in range(len(words) - n + 1):
        gram = tuple(words[i : i + n])
        counts[gram] = counts.get(gram, 0) + 1
        if counts[gram] >= repeats:
            return True
    return False
