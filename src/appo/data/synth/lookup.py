"""`lookup`: questions about an invented world, answerable only by searching its corpus.

From a seed we generate countries, cities, companies and people with made-up names (so no
model can know them), one short document per entity, and questions of one hop ("In which
city was Dorav Kelmin born?") or two hops ("In which country was Dorav Kelmin born?":
person -> city -> country). The corpus is written as JSONL (`id`, `title`, `text`) for
the `bm25` search backend; the same seed always writes the same corpus, shared by all
splits (questions differ per split, documents do not).

Gold demonstrations search once per hop with a query naming the entity plus the relation
word its document uses ("Velkor Tine headquarters"), which BM25 ranks first in this corpus.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from appo.data.synth.common import DemoStep, SynthItem, stable_hash
from appo.fsutil import output_file

DATA_SOURCE = "synth_lookup"
HOPS = (1, 2)
OCCUPATIONS = (
    "architect", "baker", "chemist", "dentist", "engineer", "farmer", "geologist", "historian",
    "journalist", "lawyer", "musician", "nurse", "painter", "pilot", "sculptor", "teacher",
    "translator", "veterinarian", "writer", "zoologist",
)
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr",
           "kl", "tr", "st", "th", "sh", "gr")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "", "n", "r", "l", "s", "th", "m", "x", "nd")


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


@dataclass
class Person:
    name: str
    occupation: str
    year: int
    city: str
    company: str


@dataclass
class World:
    countries: dict[str, str]  # country -> capital
    cities: dict[str, str]  # city -> country
    companies: dict[str, tuple[int, str]]  # company -> (founded, headquarters city)
    people: list[Person]

    def documents(self) -> list[dict[str, str]]:
        docs = []
        for p in self.people:
            docs.append((p.name, f"{p.name} is {_a(p.occupation)} born in {p.city} in {p.year}, "
                                 f"working for {p.company}."))
        for city, country in self.cities.items():
            docs.append((city, f"{city} is a city in the country of {country}."))
        for company, (year, city) in self.companies.items():
            docs.append((company, f"{company} is a company founded in {year}. Its headquarters "
                                  f"are in {city}."))
        for country, capital in self.countries.items():
            docs.append((country, f"{country} is a country. Its capital city is {capital}."))
        return [{"id": str(i), "title": t, "text": c} for i, (t, c) in enumerate(docs)]


def _name_maker(rng: random.Random) -> Callable[[int], str]:
    used: set[str] = set()

    def word(syllables: int) -> str:
        while True:
            w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables))
            w = (w + rng.choice(_CODAS)).capitalize()
            if w not in used and len(w) >= 4:
                used.add(w)
                return w

    return word


def build_world(seed: int, people: int = 240, countries: int = 8, cities_per_country: int = 4,
                companies: int = 24) -> World:
    rng = random.Random(stable_hash(f"lookup-world/{seed}"))
    word = _name_maker(rng)
    country_names = [word(2) for _ in range(countries)]
    cities: dict[str, str] = {}
    capitals: dict[str, str] = {}
    for country in country_names:
        for i in range(cities_per_country):
            city = word(2)
            cities[city] = country
            if i == 0:
                capitals[country] = city
    city_names = list(cities)
    firms = {f"{word(2)} {rng.choice(('Works', 'Labs', 'Group', 'Systems', 'Foods'))}":
             (rng.randint(1850, 2010), rng.choice(city_names)) for _ in range(companies)}
    firm_names = list(firms)
    persons = [
        Person(f"{word(2)} {word(2)}", rng.choice(OCCUPATIONS),
               rng.randint(1920, 2000), rng.choice(city_names), rng.choice(firm_names))
        for _ in range(people)
    ]
    return World(capitals, cities, firms, persons)


def _question_pool(world: World) -> list[SynthItem]:
    """Every question the world supports, in a fixed order."""
    items = []

    def add(question, answer, hops, kind, steps, final):
        items.append(SynthItem(question, str(answer), DATA_SOURCE, "qa", steps, final,
                               {"task": "lookup", "hops": hops, "kind": kind}))

    def find(entity: str, query: str, expect: str) -> DemoStep:
        return DemoStep(f"I need to search for {entity}.", "search", query, expect)

    for p in world.people:
        country = world.cities[p.city]
        year, hq = world.companies[p.company]
        add(f"In which city was {p.name} born?", p.city, 1, "birth_city",
            [find(p.name, p.name, p.city)], f"{p.name} was born in {p.city}.")
        add(f"In what year was {p.name} born?", p.year, 1, "birth_year",
            [find(p.name, p.name, str(p.year))], f"{p.name} was born in {p.year}.")
        add(f"What is the occupation of {p.name}?", p.occupation, 1, "occupation",
            [find(p.name, p.name, p.occupation)], f"{p.name} is {_a(p.occupation)}.")
        add(f"Which company does {p.name} work for?", p.company, 1, "employer",
            [find(p.name, p.name, p.company)], f"{p.name} works for {p.company}.")
        add(f"In which country was {p.name} born?", country, 2, "birth_country",
            [find(p.name, p.name, p.city),
             DemoStep(f"Born in {p.city}. Now I need the country of {p.city}.",
                      "search", f"{p.city} city country", country)],
            f"{p.city} is in {country}.")
        add(f"In what year was the company that {p.name} works for founded?", year, 2,
            "employer_founded",
            [find(p.name, p.name, p.company),
             DemoStep(f"The employer is {p.company}. Now I need its founding year.", "search",
                      f"{p.company} founded", str(year))],
            f"It was founded in {year}.")
        add(f"In which city are the headquarters of the company that {p.name} works for?", hq,
            2, "employer_hq",
            [find(p.name, p.name, p.company),
             DemoStep(f"The employer is {p.company}. Now I need its headquarters.", "search",
                      f"{p.company} headquarters", hq)],
            f"Its headquarters are in {hq}.")
    for city, country in world.cities.items():
        add(f"In which country is the city of {city}?", country, 1, "city_country",
            [find(city, f"{city} city country", country)], f"{city} is in {country}.")
    for company, (year, hq) in world.companies.items():
        add(f"In what year was {company} founded?", year, 1, "founded",
            [find(company, f"{company} founded", str(year))], f"{company} was founded in {year}.")
        add(f"In which city are the headquarters of {company}?", hq, 1, "headquarters",
            [find(company, f"{company} headquarters", hq)],
            f"The headquarters of {company} are in {hq}.")
        country = world.cities[hq]
        add(f"In which country are the headquarters of {company}?", country, 2, "hq_country",
            [find(company, f"{company} headquarters", hq),
             DemoStep(f"The headquarters are in {hq}. Now I need the country of {hq}.",
                      "search", f"{hq} city country", country)],
            f"{hq} is in {country}.")
    for country, capital in world.countries.items():
        add(f"What is the capital city of {country}?", capital, 1, "capital",
            [find(country, f"{country} capital", capital)], f"The capital of {country} is {capital}.")
    return items


def write_corpus(world: World, path: Path) -> Path:
    """Write the corpus JSONL atomically (concurrent writers produce identical files)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in world.documents())
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return path
    with output_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return path


def default_corpus_path(seed: int) -> Path:
    from appo.paths import cache_dir

    return cache_dir("synth") / f"lookup-seed{seed}.jsonl"
