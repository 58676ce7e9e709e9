"""A scraper and a prober that never pause: GETs of the given URLs, in turn, one at a time.

    python -m benchmarks.http_load URL [URL ...]

Prints `ready` after its first answers, runs until its stdin closes, then prints one JSON
object: requests answered, failures, and the seconds it ran. For benchmarks/dra.py's
figures "under load" (`/metrics` and `/healthz` of the DRA node, while claims are
prepared): far more than a Prometheus scrape and a kubelet probe send, on purpose.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request


def main() -> int:
    urls = sys.argv[1:]
    closed = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        closed.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    answered = failed = 0
    start = time.perf_counter()
    while not closed.is_set():
        for url in urls:
            try:
                with urllib.request.urlopen(url, timeout=30) as answer:
                    answer.read()
                answered += 1
            except OSError:
                failed += 1
        if answered == len(urls) and failed == 0:
            print("ready", flush=True)
    seconds = time.perf_counter() - start
    print(json.dumps({"answered": answered, "failed": failed, "seconds": seconds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
