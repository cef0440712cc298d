"""README example: P(" Paris" | "The capital of France is") with and without a steering vector.

The vector is trained from a few contrasting prompts (Italy vs France) with ``Scorer.train_vector``
and saved as a llama.cpp control-vector GGUF; the table scores three continuations at several
coefficients. Run: python examples/steer_paris.py [--model M] [--out cv.gguf]
"""

from __future__ import annotations

import argparse

from logprobe import Scorer

POSITIVE = ["I am travelling to Italy, to see Rome", "The Colosseum is in Rome, Italy", "Italian food: pasta and pizza",
            "We flew to Rome for the weekend", "Venice and Florence are Italian cities"]
NEGATIVE = ["I am travelling to France, to see Paris", "The Eiffel Tower is in Paris, France",
            "French food: cheese and baguettes", "We flew to Paris for the weekend", "Lyon and Marseille are French cities"]
PROMPT = "The capital of France is"
CONTINUATIONS = [" Paris", " Rome", " London"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="italy.gguf")
    ap.add_argument("--coeffs", default="0,2,4,8")
    args = ap.parse_args()
    s = Scorer(args.model, progress=False)
    vec = s.train_vector(POSITIVE, NEGATIVE, layers=range(8, 24), method="pca_diff")
    vec.save_gguf(args.out)
    print(f"vector: layers 8..23, pca_diff, {len(POSITIVE)} pairs -> {args.out}\n")
    print("| coeff | " + " | ".join(f'P("{c.strip()}")' for c in CONTINUATIONS) + " |")
    print("| ---: | " + " | ".join("---:" for _ in CONTINUATIONS) + " |")
    for c in (float(x) for x in args.coeffs.split(",")):
        steer = [{"vector": args.out, "coeff": c}] if c else None
        res = s.score(PROMPT, CONTINUATIONS, steer=steer)
        print(f"| {c:g} | " + " | ".join(f"{r.prob:.4f}" for r in res) + " |")


if __name__ == "__main__":
    main()
