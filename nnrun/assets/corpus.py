"""The synthetic world the bundled tiny models are trained on: facts, templates and filler.

Everything here is plain data plus a seeded builder, so the corpus (and therefore the facts table
and the tokenizer trained on it) is a pure function of this file.
"""

import random
from dataclasses import dataclass

# relation -> subject -> answer word. Answer words carry no leading space here; the tokenizer
# builder checks that " " + word is a single token for every one of them.
RELATION_TO_FACTS: dict[str, dict[str, str]] = {
    "landmark_city": {
        "The Eiffel Tower": "Paris",
        "The Louvre Museum": "Paris",
        "The Arc de Triomphe": "Paris",
        "The Colosseum": "Rome",
        "The Trevi Fountain": "Rome",
        "The Spanish Steps": "Rome",
        "The Vatican Museum": "Rome",
        "The Capitoline Museum": "Rome",
        "Big Ben": "London",
        "Tower Bridge": "London",
        "Buckingham Palace": "London",
        "The Brandenburg Gate": "Berlin",
        "The Prado Museum": "Madrid",
        "The Sagrada Familia": "Barcelona",
        "The Rijksmuseum": "Amsterdam",
        "The Acropolis": "Athens",
        "The Parthenon": "Athens",
        "The Egyptian Museum": "Cairo",
        "The Kremlin": "Moscow",
        "Red Square": "Moscow",
        "The Harbour Bridge": "Sydney",
        "The Shibuya Crossing": "Tokyo",
        "The Forbidden City": "Beijing",
        "The Hagia Sophia": "Istanbul",
        "The Rialto Bridge": "Venice",
        "The Taj Mahal": "Agra",
        "The Space Needle": "Seattle",
        "The Leaning Tower": "Pisa",
        "The Belem Tower": "Lisbon",
        "The Little Mermaid": "Copenhagen",
    },
    "city_country": {
        "Paris": "France",
        "Lyon": "France",
        "Rome": "Italy",
        "Milan": "Italy",
        "Venice": "Italy",
        "Berlin": "Germany",
        "Munich": "Germany",
        "Madrid": "Spain",
        "Barcelona": "Spain",
        "Athens": "Greece",
        "Cairo": "Egypt",
        "Moscow": "Russia",
        "Sydney": "Australia",
        "Tokyo": "Japan",
        "Osaka": "Japan",
        "Beijing": "China",
        "Istanbul": "Turkey",
        "Agra": "India",
        "Toronto": "Canada",
        "Lisbon": "Portugal",
        "Vienna": "Austria",
        "Dublin": "Ireland",
        "Oslo": "Norway",
        "Stockholm": "Sweden",
        "Copenhagen": "Denmark",
        "Amsterdam": "Netherlands",
    },
    "country_capital": {
        "France": "Paris",
        "Italy": "Rome",
        "Germany": "Berlin",
        "Spain": "Madrid",
        "Greece": "Athens",
        "Egypt": "Cairo",
        "Russia": "Moscow",
        "Japan": "Tokyo",
        "China": "Beijing",
        "Portugal": "Lisbon",
        "Austria": "Vienna",
        "Ireland": "Dublin",
        "Norway": "Oslo",
        "Sweden": "Stockholm",
        "Denmark": "Copenhagen",
    },
    "country_language": {
        "France": "French",
        "Italy": "Italian",
        "Germany": "German",
        "Spain": "Spanish",
        "Greece": "Greek",
        "Japan": "Japanese",
        "China": "Chinese",
        "Russia": "Russian",
        "Portugal": "Portuguese",
        "Sweden": "Swedish",
        "Norway": "Norwegian",
        "Egypt": "Arabic",
    },
    "person_profession": {
        "Pablo Picasso": "painter",
        "Claude Monet": "painter",
        "Vincent van Gogh": "painter",
        "Wolfgang Mozart": "composer",
        "Ludwig van Beethoven": "composer",
        "Johann Sebastian Bach": "composer",
        "William Shakespeare": "writer",
        "Jane Austen": "writer",
        "Leo Tolstoy": "writer",
        "Albert Einstein": "physicist",
        "Isaac Newton": "physicist",
        "Marie Curie": "chemist",
        "Charles Darwin": "biologist",
        "Ada Lovelace": "mathematician",
        "Alan Turing": "mathematician",
        "Antoni Gaudi": "architect",
        "Auguste Rodin": "sculptor",
    },
}

# relation -> templates with {s} (subject) and {a} (answer). The first template is canonical: its
# text up to " {a}" is the prompt in the facts table. Every template puts the answer right after a
# space so the answer is always the same single token.
RELATION_TO_TEMPLATES: dict[str, tuple[str, ...]] = {
    "landmark_city": (
        "{s} is in {a}.",
        "{s} is located in {a}.",
        "{s} is a famous landmark in {a}.",
        "{s} can be found in {a}.",
        "Many tourists visit {s} in {a}.",
    ),
    "city_country": (
        "{s} is a city in {a}.",
        "The city of {s} is located in {a}.",
        "{s} is one of the cities of {a}.",
        "People who live in {s} live in {a}.",
    ),
    "country_capital": (
        "The capital of {s} is {a}.",
        "The capital city of {s} is {a}.",
        "{s} has its capital in {a}.",
        "The government of {s} sits in {a}.",
    ),
    "country_language": (
        "The official language of {s} is {a}.",
        "People in {s} speak {a}.",
        "The main language spoken in {s} is {a}.",
        "Most people in {s} speak {a}.",
    ),
    "person_profession": (
        "{s} was a famous {a}.",
        "{s} worked as a {a}.",
        "By profession, {s} was a {a}.",
        "{s} is remembered as a great {a}.",
    ),
}

FILLER_NAMES = ("Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Henry", "Ida", "Jack")
FILLER_VERBS = ("reads", "writes", "likes", "buys", "finds", "paints", "cooks", "carries", "sees")
FILLER_OBJECTS = (
    "a book",
    "a letter",
    "the bread",
    "a red apple",
    "the old map",
    "a small boat",
    "a green chair",
    "the long story",
    "a warm coat",
    "the blue cup",
    "a new song",
)
FILLER_TIMES = (
    "every morning",
    "in the evening",
    "on Sunday",
    "after lunch",
    "before dinner",
    "at night",
    "every day",
    "in the summer",
    "on the weekend",
)
FILLER_EXTRAS = (
    "The weather is nice today.",
    "The sun is bright and the sky is blue.",
    "It rained all day and the streets were wet.",
    "The train was late again this morning.",
    "The children played in the park until dark.",
    "The cat sleeps on the warm chair.",
    "The river runs past the old mill.",
    "The shop on the corner sells fresh bread.",
)

NUM_FILLER_SENTENCES = 400
CORPUS_SEED = 0


@dataclass(frozen=True)
class FactRecord:
    """One (relation, subject, answer word) triple of the synthetic world."""

    relation: str
    subject: str
    answer_word: str

    @property
    def prompt(self) -> str:
        """The canonical prompt: the first template cut just before the answer."""
        return template_prompt(self, RELATION_TO_TEMPLATES[self.relation][0]).text

    @property
    def answer(self) -> str:
        """The expected next token's text, leading space included."""
        return " " + self.answer_word


@dataclass(frozen=True)
class TemplatePrompt:
    """A fact in one template, cut just before the answer."""

    text: str
    subject_end: int  # character offset one past the subject's last character in text
    relation: str
    answer_word: str


def all_fact_records() -> list[FactRecord]:
    """Every fact, in the fixed order of the tables above."""
    return [
        FactRecord(relation, subject, answer_word)
        for relation, subject_to_answer in RELATION_TO_FACTS.items()
        for subject, answer_word in subject_to_answer.items()
    ]


def answer_words() -> list[str]:
    """The distinct answer words, sorted."""
    return sorted({record.answer_word for record in all_fact_records()})


def _subject_in_template(subject: str, template: str) -> str:
    # "The Eiffel Tower" opens a sentence but reads "the Eiffel Tower" inside one.
    if not template.startswith("{s}") and subject.startswith("The "):
        return "the " + subject[len("The ") :]
    return subject


def fact_sentence(record: FactRecord, template: str) -> str:
    """One fact written out in one template."""
    subject = _subject_in_template(record.subject, template)
    return template.format(s=subject, a=record.answer_word)


def template_prompt(record: FactRecord, template: str) -> TemplatePrompt:
    """One fact in one template, cut before " {a}" so the answer is the next token."""
    subject = _subject_in_template(record.subject, template)
    head = template[: template.index(" {a}")]
    text = head.format(s=subject)
    subject_end = len(head[: head.index("{s}")]) + len(subject)
    return TemplatePrompt(text, subject_end, record.relation, record.answer_word)


def all_template_prompts() -> list[TemplatePrompt]:
    """Every fact in every template of its relation, as prompts."""
    return [
        template_prompt(record, template)
        for record in all_fact_records()
        for template in RELATION_TO_TEMPLATES[record.relation]
    ]


def fact_sentences() -> list[str]:
    """Every fact in every template of its relation."""
    return [
        fact_sentence(record, template)
        for record in all_fact_records()
        for template in RELATION_TO_TEMPLATES[record.relation]
    ]


def filler_sentences(rng: random.Random) -> list[str]:
    """Fact-free everyday sentences, so the models see more than the fact templates."""
    sentences = list(FILLER_EXTRAS)
    while len(sentences) < NUM_FILLER_SENTENCES:
        sentence = "{} {} {} {}.".format(
            rng.choice(FILLER_NAMES),
            rng.choice(FILLER_VERBS),
            rng.choice(FILLER_OBJECTS),
            rng.choice(FILLER_TIMES),
        )
        sentences.append(sentence)
    return sentences


def build_corpus(num_fact_repeats: int = 2, seed: int = CORPUS_SEED) -> list[str]:
    """The shuffled training sentences: each fact sentence num_fact_repeats times, plus filler."""
    rng = random.Random(seed)
    sentences = fact_sentences() * num_fact_repeats + filler_sentences(rng)
    rng.shuffle(sentences)
    return sentences
