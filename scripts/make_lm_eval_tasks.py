"""Write the JSONL data of the local lm-eval tasks in configs/tasks/ (deterministic; the output is committed).

    .venv/bin/python scripts/make_lm_eval_tasks.py

Hand-written facts plus generated arithmetic: easy enough that a 135 M model scores above chance,
so the metrics move when something breaks. No network, no external data set.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "configs" / "tasks" / "data"

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Japan": "Tokyo",
    "China": "Beijing",
    "Russia": "Moscow",
    "Egypt": "Cairo",
    "Greece": "Athens",
    "Ireland": "Dublin",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Denmark": "Copenhagen",
    "Poland": "Warsaw",
    "Austria": "Vienna",
    "Hungary": "Budapest",
    "Belgium": "Brussels",
    "Netherlands": "Amsterdam",
    "Canada": "Ottawa",
    "Mexico": "Mexico City",
    "Argentina": "Buenos Aires",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Colombia": "Bogota",
    "Kenya": "Nairobi",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "South Korea": "Seoul",
    "India": "New Delhi",
    "Iran": "Tehran",
    "Turkey": "Ankara",
    "Australia": "Canberra",
    "Cuba": "Havana",
    "Czech Republic": "Prague",
    "Romania": "Bucharest",
    "Ukraine": "Kyiv",
    "Iceland": "Reykjavik",
    "Scotland": "Edinburgh",
    "England": "London",
    "Switzerland": "Bern",
    "Brazil": "Brasilia",
    "Indonesia": "Jakarta",
    "Philippines": "Manila",
    "Saudi Arabia": "Riyadh",
    "Morocco": "Rabat",
    "Nigeria": "Abuja",
    "Venezuela": "Caracas",
    "New Zealand": "Wellington",
}
OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "up": "down",
    "fast": "slow",
    "happy": "sad",
    "light": "dark",
    "open": "closed",
    "old": "young",
    "early": "late",
    "full": "empty",
    "hard": "soft",
    "high": "low",
    "rich": "poor",
    "strong": "weak",
    "wet": "dry",
    "long": "short",
    "loud": "quiet",
    "thick": "thin",
    "clean": "dirty",
    "heavy": "light",
    "win": "lose",
    "push": "pull",
    "buy": "sell",
    "begin": "end",
    "day": "night",
    "inside": "outside",
    "true": "false",
    "love": "hate",
    "first": "last",
    "north": "south",
}
FACTS = [
    ("Which animal says moo?", "cow", ["cat", "dog", "duck"]),
    ("Which animal barks?", "dog", ["cow", "fish", "horse"]),
    ("How many legs does a spider have?", "eight", ["six", "four", "ten"]),
    ("How many days are in a week?", "seven", ["five", "six", "ten"]),
    ("What color is the sky on a clear day?", "blue", ["green", "red", "yellow"]),
    ("What color is grass?", "green", ["blue", "purple", "white"]),
    ("What do bees make?", "honey", ["milk", "silk", "bread"]),
    ("Which planet do we live on?", "Earth", ["Mars", "Venus", "Jupiter"]),
    ("What is frozen water called?", "ice", ["steam", "sand", "glass"]),
    ("Which season is the coldest?", "winter", ["summer", "spring", "autumn"]),
    ("How many months are in a year?", "twelve", ["ten", "eleven", "thirteen"]),
    ("What do you use to write on paper?", "a pen", ["a spoon", "a shoe", "a cup"]),
    ("Which organ pumps blood through the body?", "the heart", ["the lungs", "the liver", "the skin"]),
    ("What gas do plants take in from the air?", "carbon dioxide", ["helium", "neon", "argon"]),
    (
        "Which is the largest ocean on Earth?",
        "the Pacific Ocean",
        ["the Indian Ocean", "the Arctic Ocean", "the Atlantic Ocean"],
    ),
    ("What is the opposite of yes?", "no", ["maybe", "always", "often"]),
    ("What do cows drink?", "water", ["milk", "oil", "juice"]),
    ("Which star is closest to the Earth?", "the Sun", ["Sirius", "Polaris", "Vega"]),
    ("What is the main language spoken in Brazil?", "Portuguese", ["Spanish", "French", "German"]),
    ("Who wrote Romeo and Juliet?", "William Shakespeare", ["Charles Dickens", "Mark Twain", "Jane Austen"]),
]
NUMBER_WORDS = "zero one two three four five six seven eight nine ten".split()

PASSAGES = [
    "The river starts high in the mountains, where snow melts each spring. It runs through narrow valleys, "
    "past small villages and old stone bridges, and slowly grows wider as other streams join it. By the time it "
    "reaches the plain, boats can travel on it, and farmers use its water for their fields.",
    "Bread is made from flour, water, salt and yeast. The baker mixes the ingredients into a dough and kneads it "
    "until it becomes smooth. The dough rests for a few hours while the yeast produces gas, which makes it rise. "
    "Then it is shaped, baked in a hot oven, and left to cool before it is sliced.",
    "A computer program is a list of instructions that a machine follows step by step. Programmers write these "
    "instructions in a programming language, test them to find mistakes, and fix the mistakes they find. Good "
    "programs are easy to read, so that other people can understand and improve them later.",
    "Every morning the market opens at six. Farmers arrive with fresh vegetables, fruit, eggs and cheese, and set up "
    "their stalls along the square. By eight o'clock the square is full of people who come to buy food for the day, "
    "talk with their neighbours and drink a cup of coffee.",
    "The moon goes around the Earth about once a month. As it moves, we see different parts of it lit by the Sun, "
    "which is why it seems to change shape from a thin crescent to a full circle and back again. The moon also pulls "
    "on the oceans and causes the tides.",
    "Learning to ride a bicycle takes patience. At first it is hard to keep your balance, and most children fall a "
    "few times. With practice, they learn to look ahead, pedal steadily and steer gently. After a while, riding feels "
    "natural, and they can go to school or visit friends on their own.",
    "Trees are important for life on our planet. They produce oxygen, store carbon, and give shelter and food to many "
    "animals. Their roots hold the soil in place and help to prevent floods. In cities, trees provide shade in summer "
    "and make the streets more pleasant for the people who live there.",
    "The library in our town is open six days a week. Anyone can borrow books, read newspapers, or use the computers "
    "for free. On Saturday mornings there is a reading hour for children, and in the evenings adults can join classes "
    "on history, languages and local art.",
    "Water boils at one hundred degrees Celsius at sea level. High in the mountains the air pressure is lower, so water "
    "boils at a lower temperature, and food takes longer to cook. This is why climbers often use pressure cookers "
    "when they prepare meals at high altitude.",
    "The old lighthouse stands on a rock at the edge of the harbour. For more than a century its light warned ships "
    "of the dangerous coast. Today the light is automatic, and the keeper's house has become a small museum that "
    "tells the story of the sailors and fishermen of the town.",
    "A healthy diet includes many kinds of food: vegetables, fruit, grains, beans, and some meat or fish. Drinking "
    "enough water is also important. Eating a variety of foods gives the body the vitamins and minerals it needs to "
    "grow, to repair itself, and to fight illness.",
    "The train leaves the city at nine and crosses wide fields of wheat before it climbs into the hills. Passengers "
    "read, sleep, or watch the landscape change through the windows. In the early afternoon it arrives at the coast, "
    "where many travellers spend their holidays by the sea.",
]


def _mc_items(rng: random.Random) -> list[dict]:
    items: list[dict] = []

    def add(question: str, gold: str, wrong: list[str]) -> None:
        choices = [gold, *wrong[:3]]
        rng.shuffle(choices)
        items.append({"question": question, "choices": choices, "answer": choices.index(gold)})

    caps = list(CAPITALS.values())
    for country, city in CAPITALS.items():
        add(f"What is the capital of {country}?", city, rng.sample([c for c in caps if c != city], 3))
    words = sorted(set(OPPOSITES.values()) | set(OPPOSITES))
    for word, opposite in OPPOSITES.items():
        add(
            f"What is the opposite of {word}?",
            opposite,
            rng.sample([w for w in words if w not in (word, opposite)], 3),
        )
    for question, gold, wrong in FACTS:
        add(question, gold, wrong)
    for _ in range(50):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        s = a + b
        wrong = rng.sample([x for x in range(max(2, s - 5), s + 6) if x != s], 3)
        add(f"What is {a} plus {b}?", str(s), [str(x) for x in wrong])
    return items


def _gen_items(rng: random.Random) -> list[dict]:
    items = []
    for _ in range(40):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        items.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    return items


def main() -> None:
    rng = random.Random(20240601)
    OUT.mkdir(parents=True, exist_ok=True)
    data = {
        "minisgl_mc.jsonl": _mc_items(rng),
        "minisgl_gen.jsonl": _gen_items(rng),
        "minisgl_ppl.jsonl": [{"text": t} for t in PASSAGES],
    }
    for name, rows in data.items():
        (OUT / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{OUT / name}: {len(rows)} rows")


if __name__ == "__main__":
    main()
