"""Where a computed profile's time went, by experiment and by runner within each, from its result rows (each unit's
`unit_compute_s`: every attempt, model loading and the untimed warm-up run included; the notebooks and Sphinx are
not in it).

    python benchmarks/book_times.py --profile embedded
"""

from __future__ import annotations

import argparse

import pandas as pd

from kvlib.paths import repo_root
from kvlib.study.compute_time import minutes_by
from kvlib.study.profile import load_profile
from kvlib.study.run import stored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="embedded")
    args = parser.parse_args()
    profile = load_profile(args.profile, repo_root())
    # this checkout's rows, or the reference book's where none were computed here (kvlib.study.run.stored)
    frame = pd.concat([stored(profile.name, e) for e in profile.experiments], ignore_index=True)
    experiments = minutes_by(frame, ["experiment"])
    print(experiments.to_string(index=False, float_format="%.1f"))
    print(f"in all: {experiments['minutes'].sum():.1f} min of compute")
    for experiment in experiments["experiment"]:
        runners = minutes_by(frame[frame["experiment"] == experiment], ["runner"])
        print(f"\n{experiment}\n" + runners.to_string(index=False, float_format="%.2f"))


if __name__ == "__main__":
    main()
