"""Built-in chat questions, the kind a user asks a small instruct model, and how they become prompt token ids.

Two fixed, disjoint halves:

- `TRAIN_QUESTIONS` may be used to train draft heads or drafters.
- `HELD_OUT_QUESTIONS` are `specserve bench`'s prompts for real targets. They are never used for training, so the
  bench's acceptance rates are not measured on text a drafter was fitted to.

Both halves mix facts, how-to, code, writing, reasoning and math, advice, science and history, interleaved so that the
first few questions of either half already span several kinds (the quick bench takes the first 4 held-out ones).
"""

from __future__ import annotations

from specserve.workers.errors import InvalidRequestError
from specserve.workers.models import chat

TRAIN_QUESTIONS: tuple[str, ...] = (
    "What is the tallest mountain in Africa?",
    "How do I remove a red wine stain from a white carpet?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Can you write a short poem about autumn leaves?",
    "If a train travels 180 km in 2.5 hours, what is its average speed?",
    "I have a job interview tomorrow and I'm really nervous. Any tips?",
    "Why is the sky blue?",
    "Who was Cleopatra and why is she famous?",
    "What are some healthy breakfast ideas that take less than ten minutes to make?",
    "Explain the difference between 'affect' and 'effect'.",
    "What should I pack for a week-long hiking trip in the mountains?",
    "How many continents are there, and what are they called?",
    "What's the easiest way to start learning the guitar?",
    "Explain what a linked list is and when you would use one instead of an array.",
    "Write a friendly email to my neighbor asking them to water my plants while I'm away.",
    "A shirt costs $24 after a 20% discount. What was the original price?",
    "How can I stop procrastinating when I work from home?",
    "How do vaccines train the immune system?",
    "What caused the fall of the Western Roman Empire?",
    "Is it bad to drink coffee on an empty stomach?",
    "What does the idiom 'break the ice' mean?",
    "Which is the largest ocean on Earth?",
    "Give me step-by-step instructions for folding a paper airplane.",
    "How do I reverse an array in JavaScript?",
    "Write a two-sentence horror story.",
    "What is the sum of all whole numbers from 1 to 100?",
    "My friend forgot my birthday. Should I tell her it hurt my feelings?",
    "What is photosynthesis, in simple terms?",
    "When did humans first land on the Moon, and who were the astronauts?",
    "Suggest a simple vegetarian dinner I can cook for four people.",
    "Tell me three interesting facts about octopuses.",
    "What is the best way to learn a new language as an adult?",
)

HELD_OUT_QUESTIONS: tuple[str, ...] = (
    "What is the capital of Australia?",
    "How do I boil an egg so that the yolk stays a little soft?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Can you write a haiku about the ocean?",
    "What is 15% of 240? Show your working.",
    "I keep waking up tired even after eight hours of sleep. What could help?",
    "How does a rainbow form?",
    "Who built the pyramids of Giza, and how long did it take?",
    "Explain what a recursive function is, with a small example.",
    "Write a short thank-you note to a teacher who helped me a lot this year.",
    "If I save $50 every week, how much will I have after two years?",
    "What are some good ways to make new friends after moving to a new city?",
    "Why do we have seasons on Earth?",
    "What was the Industrial Revolution?",
    "How many bones are in the adult human body?",
    "What's a good way to keep my houseplants alive while I travel?",
    "What is the difference between a list and a tuple in Python?",
    "Give me a catchy slogan for a small bakery that sells sourdough bread.",
    "A rectangle has a perimeter of 30 cm and a length of 9 cm. What is its width?",
    "How do I say no to my boss without sounding rude?",
    "What is the difference between weather and climate?",
    "Why did World War I start?",
    "What are the health benefits of walking every day?",
    "What does 'the early bird catches the worm' mean?",
    "Plan a relaxing one-day itinerary for a first visit to Paris.",
    "What is the largest planet in our solar system?",
    "How can I write a SQL query that counts the orders of each customer?",
    "Describe a sunset to someone who has never seen one.",
    "Is 91 a prime number? Explain why or why not.",
    "What are a few simple ways to reduce plastic waste at home?",
    "How do bees make honey?",
    "Who was Marie Curie?",
)


def question_prompt_ids(tokenizer, question: str, system: str | None = None) -> list[int]:
    """Token ids of `question` as a user turn (after an optional system turn), ready for the assistant's reply: the
    same rendering as every serving path (workers/models/chat.py)."""
    if not question.strip():
        raise InvalidRequestError("question", "must not be empty")
    return chat.chat_prompt_ids(tokenizer, chat.conversation(question, system))


def read_questions(path: str) -> list[str]:
    """One question per line of a UTF-8 file; blank lines and lines starting with '#' are skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequestError("chat_prompts", f"cannot read {path!r}: {e}") from None
    questions = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not questions:
        raise InvalidRequestError("chat_prompts", f"{path!r} holds no questions (one a line; '#' starts a comment)")
    return questions
