"""The `watch` adapter: the one place that watches files and paces retries.

- `PathWatch` (on the event loop) and `BlockingPathWatch` (for a backend's thread) wake
  their owner when a file or directory may have changed; inotify through `asyncinotify`,
  polling `stat` only where inotify cannot work.
- `Backoff`: the exponential, capped retry delay every retry loop uses.
"""

from kubegpu.watch.backoff import Backoff
from kubegpu.watch.paths import BlockingPathWatch, PathWatch, fingerprint, watched_dirs

__all__ = ["Backoff", "BlockingPathWatch", "PathWatch", "fingerprint", "watched_dirs"]
