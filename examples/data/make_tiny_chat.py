"""Writes tiny_chat.jsonl: a few hundred chat rows of three small tasks a 2-layer byte-level model
can learn in about a minute on a CPU.

- "Uppercase: cat"      -> "CAT"   (copy with a per-byte change)
- "Reverse: cat"        -> "tac"   (copy in reverse order)
- "What is 3 plus 4?"   -> "7"     (a table of 100 sums)

About one row in six is two turns (two tasks in a row), so `train_on = "all_assistant"` and
`"last_assistant"` differ. Deterministic: `python3 make_tiny_chat.py` rewrites the same file.
"""

import json
import random
from pathlib import Path

WORDS = """ant bee cat dog elk fox gnu hen owl pig rat yak ape bat cod eel emu jay
cow kit ram sow tom bird crab deer duck fish frog goat hare lamb lion mole moth mule
newt puma seal slug swan toad wasp wolf worm bear boar calf colt dove fawn gull hawk
ibis kiwi lynx mink orca pony sheep snake tiger whale zebra camel eagle goose horse
koala llama moose mouse otter panda raven robin shark skunk sloth stork trout viper""".split()


def task(rng):
    kind = rng.choice(["upper", "reverse", "add"])
    if kind == "upper":
        w = rng.choice(WORDS)
        return f"Uppercase: {w}", w.upper()
    if kind == "reverse":
        w = rng.choice(WORDS)
        return f"Reverse: {w}", w[::-1]
    a, b = rng.randrange(10), rng.randrange(10)
    return f"What is {a} plus {b}?", str(a + b)


def main(n_rows=400, seed=0):
    rng = random.Random(seed)
    out = Path(__file__).with_name("tiny_chat.jsonl")
    with out.open("w") as f:
        for _ in range(n_rows):
            messages = []
            for _ in range(2 if rng.random() < 1 / 6 else 1):
                q, a = task(rng)
                messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"messages": messages}) + "\n")
    print(f"wrote {n_rows} rows to {out}")


if __name__ == "__main__":
    main()
