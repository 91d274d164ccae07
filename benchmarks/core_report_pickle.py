"""What the engine core pays each step to pickle its report for `pagoda serve`'s server
process, and what the server pays to load it: a decode step's `CoreReport` of N one-token
outputs, packed (`CoreReport.__getstate__`) against the same outputs pickled as objects, the
two alternating; median microseconds of each.

    PYTHONPATH=. python benchmarks/core_report_pickle.py [--outputs 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

from pagoda.engine.core_messages import CoreReport
from pagoda.outputs import EngineCoreOutput, SchedulerStats

CALLS = 200


def per_call_us(fn) -> float:
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    return 1e6 * (time.perf_counter() - start) / CALLS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outputs", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    outputs = [EngineCoreOutput(f"cmpl-{i:032x}", [1000 + i]) for i in range(args.outputs)]
    report = CoreReport(outputs, SchedulerStats(args.outputs, 0, 0.5, 0, 0, 0), num_commands_applied=1, has_work=True)
    protocol = pickle.HIGHEST_PROTOCOL
    packed, objects = pickle.dumps(report, protocol), pickle.dumps(outputs, protocol)
    times: dict[str, list[float]] = {
        name: [] for name in ("packed dump", "packed load", "objects dump", "objects load")
    }
    for _ in range(args.rounds):
        times["packed dump"].append(per_call_us(lambda: pickle.dumps(report, protocol)))
        times["packed load"].append(per_call_us(lambda: pickle.loads(packed)))
        times["objects dump"].append(per_call_us(lambda: pickle.dumps(outputs, protocol)))
        times["objects load"].append(per_call_us(lambda: pickle.loads(objects)))
    print(f"{args.outputs} one-token outputs; bytes: packed report {len(packed)}, objects {len(objects)}")
    for name, values in times.items():
        print(f"{name:<13} {statistics.median(values):8.1f} us (min {min(values):.1f})")


if __name__ == "__main__":
    main()
