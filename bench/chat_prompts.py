"""Chat prompt kinds for bench/make_prompts.py's chat-topics.jsonl, beyond "an ask about a topic".

Each kind is a function `(rng) -> str` that builds one request from lists and random fills, in
the shapes chat users ask in: role-play, short reasoning puzzles, school mathematics, pulling
facts out of a given text, STEM and humanities questions, and rewriting or correcting a given
passage. Only variety matters (the target answers them itself); none copies an eval prompt.
"""

from __future__ import annotations

import random

NAMES = [
    "Alice",
    "Ben",
    "Chloe",
    "David",
    "Emma",
    "Farid",
    "Grace",
    "Hiro",
    "Isabel",
    "Jonas",
    "Kira",
    "Liam",
    "Maya",
    "Noah",
    "Olga",
    "Pedro",
    "Quinn",
    "Rosa",
    "Sam",
    "Tara",
    "Umar",
    "Vera",
    "Wei",
    "Yusuf",
    "Zoe",
]
CITIES = [
    "Lisbon",
    "Osaka",
    "Nairobi",
    "Toronto",
    "Krakow",
    "Lima",
    "Hanoi",
    "Oslo",
    "Austin",
    "Melbourne",
    "Cairo",
    "Seville",
    "Denver",
    "Bergen",
    "Jaipur",
    "Porto",
    "Quito",
    "Tallinn",
    "Glasgow",
    "Perth",
]
COMPANIES = [
    "Northwind Labs",
    "Bluefin Robotics",
    "Greenleaf Foods",
    "Orbit Logistics",
    "Silverline Media",
    "Cobalt Energy",
    "Maple Health",
    "Harbor Analytics",
    "Quartz Motors",
    "Nimbus Software",
    "Redwood Textiles",
    "Summit Pharma",
    "Atlas Shipping",
    "Lumen Optics",
    "Pioneer Farms",
]
PRODUCTS = [
    "wireless earbuds",
    "a robot vacuum",
    "a standing desk",
    "an electric kettle",
    "a mechanical keyboard",
    "a hiking backpack",
    "a smartwatch",
    "a coffee grinder",
    "a pair of running shoes",
    "an e-reader",
    "an air purifier",
    "a camping tent",
    "a blender",
    "a portable speaker",
    "a gaming monitor",
]

PERSONAS = [
    "a pirate captain who has sailed every ocean",
    "a medieval knight",
    "a detective in 1920s London",
    "a nutritionist",
    "a travel agent",
    "a stand-up comedian",
    "a kindergarten teacher",
    "a startup founder",
    "a wise old wizard",
    "a sports commentator",
    "a museum curator",
    "a head chef in a busy restaurant",
    "a defense lawyer",
    "a marriage counselor",
    "a personal fitness trainer",
    "an astronaut on the space station",
    "a 19th-century naturalist",
    "a grumpy librarian",
    "a cheerful barista",
    "a mountain guide",
    "a ship's doctor",
    "a veteran journalist",
    "a fashion stylist",
    "a history professor",
    "a car mechanic",
    "a real estate agent",
    "a film director",
    "a beekeeper",
    "a park ranger",
    "a chess grandmaster",
    "a financial advisor",
    "a speech therapist",
    "a software architect",
    "a tax accountant",
    "a marine biologist",
    "an ancient Greek philosopher",
    "a robot who has just become self-aware",
    "a talking cat",
    "a time traveler from the year 3000",
    "the mayor of a small town",
    "a dragon guarding its treasure",
]
PERSONA_QUESTIONS = [
    "What is the most important lesson your work has taught you?",
    "Describe a typical day for you.",
    'A customer says: "I\'m not sure this is worth the money." How do you reply?',
    "What advice would you give to someone just starting out in your field?",
    "Tell me about the hardest decision you ever had to make.",
    "What do you think about {t}?",
    "How would you explain {t} to me?",
    "I feel stuck and unmotivated lately. What should I do?",
    "What is your opinion on working from home?",
    "Convince me to try something new this weekend.",
    "Give me your honest review of the last book you read.",
    "What do you do to relax?",
    "Someone has just insulted you in public. How do you respond?",
    "What would you change about the world?",
    "Plan a day out for me in {c}.",
    "What is the biggest mistake people make about {t}?",
]
ROLE_ASKS = [
    "Pretend you are {p}. {q}",
    "Act as {p} and stay in character. {q}",
    "You are {p}. Answer in character: {q}",
    "Take on the role of {p} for this conversation. {q}",
    "Imagine you are {p}. {q} Keep it under 150 words.",
]

STEM = [
    "entropy",
    "natural selection",
    "superconductivity",
    "the greenhouse effect",
    "plate tectonics",
    "photosynthesis and cellular respiration",
    "Newton's third law",
    "the Doppler effect",
    "half-life",
    "the central limit theorem",
    "Bayes' theorem",
    "public-key cryptography",
    "the theory of relativity",
    "quantum entanglement",
    "the immune response to a virus",
    "CRISPR gene editing",
    "the nitrogen cycle",
    "ocean acidification",
    "the speed of light",
    "electromagnetic induction",
    "Ohm's law",
    "nuclear fusion",
    "how a transistor works",
    "how a compiler works",
    "gradient descent",
    "the Big Bang",
    "exoplanets",
    "enzymes",
    "the placebo effect",
    "antibiotic resistance",
    "the structure of an atom",
    "chemical bonds",
    "buoyancy",
    "friction",
    "how vaccines train the immune system",
    "neural networks",
    "hash tables",
    "binary search",
    "the Fibonacci sequence in nature",
    "the Pythagorean theorem",
    "compound interest",
]
HUMANITIES = [
    "utilitarianism",
    "the social contract",
    "the separation of powers",
    "supply and demand",
    "opportunity cost",
    "the causes of World War I",
    "the fall of the Roman Empire",
    "the Enlightenment",
    "existentialism",
    "the role of the central bank",
    "free trade",
    "the tragedy of the commons",
    "cultural relativism",
    "the printing press and the Reformation",
    "the Marshall Plan",
    "monetary versus fiscal policy",
    "the Stoic idea of control",
    "the trolley problem",
    "minimum wage laws",
    "globalization",
    "the influence of Greek theater",
    "impressionism in painting",
    "the Harlem Renaissance",
    "the history of human rights",
    "colonialism and its legacy",
    "the role of museums in society",
    "the ethics of eating meat",
    "propaganda in wartime",
    "the rise of the nation state",
    "Keynesian economics",
]
STEM_ASKS = [
    "Explain {c} in a few paragraphs, with an everyday example.",
    "What is {c}? Give a clear, accurate answer.",
    "Describe a simple experiment or example that demonstrates {c}.",
    "How would you teach {c} to a first-year university student?",
    "What are common misunderstandings of {c}?",
    "In what ways is {c} used or seen in daily life?",
    "Explain the difference between {c} and {d}.",
]
HUMANITIES_ASKS = [
    "Discuss {c}. What are the main arguments for and against it?",
    "Explain {c} and why it matters today.",
    "Write a short essay on {c}.",
    "Give a balanced overview of {c}, with two examples.",
    "How did {c} shape the modern world?",
    "What would a critic say about {c}, and how would a supporter answer?",
]

SENTENCES = [  # (sentence, a phrase in it, that phrase made ungrammatical)
    ("The meeting has been moved to Thursday because the manager is travelling.", "has been", "have been"),
    ("Our team finished the project two weeks ahead of schedule.", "finished", "finish"),
    ("The new park opened last spring near the river.", "opened", "open"),
    ("Many people prefer to read the news on their phones in the morning.", "prefer", "prefers"),
    ("The museum will be closed for renovations until the end of the year.", "will be", "will been"),
    ("She learned to play the violin when she was seven years old.", "learned", "learn"),
    ("The company plans to hire fifty new engineers next year.", "plans", "plan"),
    ("It rained all weekend, so the festival was cancelled.", "was", "were"),
    ("The recipe calls for two cups of flour and one egg.", "calls", "call"),
    ("He forgot his umbrella at the train station again.", "forgot", "forgotten"),
    ("The library offers free language classes on Saturday mornings.", "offers", "offer"),
    ("Prices at the local market have risen sharply this month.", "have risen", "has rose"),
    ("The students presented their research to a panel of experts.", "presented", "present"),
    ("Our flight was delayed by three hours because of a storm.", "was delayed", "were delay"),
    ("The city council voted to add more bicycle lanes downtown.", "voted", "vote"),
]
REWRITE_ASKS = [
    "Rewrite the following text in a more formal tone:\n{x}",
    "Make this text shorter without losing meaning:\n{x}",
    "Rewrite the following as a friendly message to a friend:\n{x}",
    "Turn the following into a short news item:\n{x}",
    "Paraphrase the following text in plain language:\n{x}",
    "Translate the following text into French:\n{x}",
    "Edit the following paragraph to correct any grammatical errors:\n{x}",
    "Proofread this text and list every change you make:\n{x}",
]


def role_play(rng: random.Random, topics: list[str]) -> str:
    q = rng.choice(PERSONA_QUESTIONS).format(t=rng.choice(topics), c=rng.choice(CITIES))
    return rng.choice(ROLE_ASKS).format(p=rng.choice(PERSONAS), q=q)


def reasoning(rng: random.Random, topics: list[str]) -> str:
    a, b, c, d = rng.sample(NAMES, 4)
    n, m = rng.randint(3, 12), rng.randint(2, 9)
    kinds = [
        (
            f"{a} is taller than {b}, and {c} is shorter than {b}. {d} is taller than {a}. Who is the shortest? "
            "Explain your reasoning step by step."
        ),
        f"In a race, {a} finished ahead of {b} but behind {c}. {d} finished last. What was the finishing order?",
        (
            f"If there are {n} people at a party and each person shakes hands with every other person exactly once, "
            "how many handshakes are there?"
        ),
        f"{a} has {n} more marbles than {b}. Together they have {2 * m + n + 10} marbles. How many does each have?",
        f"A farmer has {n * 3} animals, chickens and cows, with {n * 8} legs in all. How many of each are there?",
        (
            f"If it takes {m} machines {m} minutes to make {m} widgets, how long would it take {n * 10} machines "
            f"to make {n * 10} widgets?"
        ),
        (
            f'{a} says: "{b} is lying." {b} says: "{c} is lying." {c} says: "Both {a} and {b} are lying." '
            "Who is telling the truth?"
        ),
        (
            f"A bat and a ball cost ${n}.10 in total. The bat costs ${n}.00 more than the ball. How much does the ball "
            "cost?"
        ),
        (
            f"{a}'s father has {m + 2} children. {m + 1} of them are named {', '.join(rng.sample(NAMES, m + 1))}. "
            "What is the name of the last child?"
        ),
        (
            f"Is the following argument valid? All {rng.choice(['artists', 'pilots', 'teachers'])} in the club are "
            f"members of the choir. {a} is in the choir. Therefore {a} is an artist."
        ),
        f"Facing north, {a} turns right, then right again, then left. Which direction is {a} facing now?",
    ]
    return rng.choice(kinds)


def school_math(rng: random.Random, topics: list[str]) -> str:
    a, b, c = rng.randint(2, 9), rng.randint(1, 30), rng.randint(31, 99)
    p, q = rng.randint(2, 7), rng.randint(2, 7)
    x1, y1, x2, y2, x3, y3 = (rng.randint(-5, 9) for _ in range(6))
    kinds = [
        f"Solve for x: {a}x + {b} = {c}.",
        f"Find the derivative of f(x) = {a}x^3 - {b}x^2 + {p}x - {q}.",
        f"What is the area of the triangle with vertices at ({x1}, {y1}), ({x2}, {y2}) and ({x3}, {y3})?",
        f"How many positive integers less than {c * 3} are divisible by {p} or {q + 1}?",
        f"Find the sum of the first {b} terms of the arithmetic sequence {a}, {a + p}, {a + 2 * p}, ...",
        f"Solve the system: {a}x + {p}y = {c} and x - y = {q}.",
        f"What is the remainder when {a}^{b + 10} is divided by {q + 3}?",
        f"Two dice are rolled. What is the probability that the sum is {p + q}?",
        f"Evaluate the integral of {a}x^2 + {p} from 0 to {q}.",
        f"A rectangle has a perimeter of {2 * (b + c)} and one side of length {b}. What is its area?",
        f"Find all real solutions of x^2 - {p + q}x + {p * q} = 0.",
        f"Simplify ({a}x^2 - {a * p * p}) / (x - {p}).",
        "Prove that the sum of two odd numbers is even.",
        f"What is {b}% of {c * 10}, and what percentage of {c} is {b}?",
    ]
    return rng.choice(kinds)


def _passage(rng: random.Random) -> str:
    co, city, n, name = rng.choice(COMPANIES), rng.choice(CITIES), rng.randint(20, 900), rng.choice(NAMES)
    yr = rng.randint(2015, 2025)
    kinds = [
        (
            f"In {yr}, {co}, based in {city}, reported revenue of ${n} million, up {rng.randint(2, 40)}% from the "
            f"previous year. Its CEO, {name} {rng.choice(['Park', 'Silva', 'Novak', 'Okafor', 'Lindqvist'])}, said the "
            f"growth came from new contracts in {rng.choice(CITIES)} and {rng.choice(CITIES)}."
        ),
        (
            f"I bought {rng.choice(PRODUCTS)} last month for ${rng.randint(20, 400)}. The build quality is "
            f"{rng.choice(['excellent', 'disappointing', 'decent'])}, but the battery "
            f"{rng.choice(['lasts all day', 'died after a week', 'is only average'])}. I would rate it "
            f"{rng.randint(1, 5)} out of 5. -- {name}, {city}"
        ),
        (
            f"Dear {name}, your order #{rng.randint(10000, 99999)} for {rng.choice(PRODUCTS)} has shipped from our "
            f"{city} warehouse on {rng.choice(['March', 'June', 'October'])} {rng.randint(1, 28)} and should arrive "
            f"within {rng.randint(2, 9)} days. Total charged: ${rng.randint(20, 400)}.{rng.randint(10, 99)}."
        ),
        (
            f"The {city} marathon, held on {rng.choice(['April', 'May', 'September'])} {rng.randint(1, 28)}, {yr}, drew "  # noqa: E501
            f"{n * 20} runners. {name} won the women's race in 2:{rng.randint(20, 45)}:{rng.randint(10, 59)}, while "
            f"{rng.choice(NAMES)} took the men's title. Organizers raised ${n * 100} for local charities."
        ),
    ]
    return rng.choice(kinds)


def extraction(rng: random.Random, topics: list[str]) -> str:
    asks = [
        "Extract every person, organization and place named in the text below, as JSON.\n\n{x}",
        "From the text below, pull out all numbers and say what each one refers to.\n\n{x}",
        "Summarize the following text in one sentence, then list its key facts as bullet points.\n\n{x}",
        "Read the text below and return a JSON object with the fields: who, what, where, when.\n\n{x}",
        "What is the overall sentiment of the following text (positive, negative or neutral)? Explain.\n\n{x}",
        "Answer from the text only: what are the two most important facts here?\n\n{x}",
    ]
    x = "\n\n".join(_passage(rng) for _ in range(rng.randint(1, 3)))
    return rng.choice(asks).format(x=x)


def stem_or_humanities(rng: random.Random, topics: list[str]) -> str:
    pool, asks = (STEM, STEM_ASKS) if rng.random() < 0.55 else (HUMANITIES, HUMANITIES_ASKS)
    c, d = rng.sample(pool, 2)
    return rng.choice(asks).format(c=c, d=d)


def rewriting(rng: random.Random, topics: list[str]) -> str:
    picks = rng.sample(range(len(SENTENCES)), rng.randint(2, 4))
    ask = rng.choice(REWRITE_ASKS)
    errors = "error" in ask or "Proofread" in ask
    picked = [SENTENCES[i] for i in picks]
    return ask.format(x=" ".join(s.replace(good, bad, 1) if errors else s for s, good, bad in picked))


KINDS = [role_play, reasoning, school_math, extraction, stem_or_humanities, rewriting]


def kind_prompts(n: int, rng: random.Random, topics: list[str]) -> list[str]:
    """Up to `n` distinct prompts, the kinds in turn."""
    out, seen = [], set()
    for i in range(n * 4):
        p = KINDS[i % len(KINDS)](rng, topics)
        if p not in seen:
            seen.add(p)
            out.append(p)
        if len(out) >= n:
            break
    return out
