"""Benchmarks: `python -m benchmarks.run` (`make bench`); results in docs/performance.md."""

import os

# gRPC core reads its log level once, when first imported: keep its INFO lines (a GOAWAY
# each time a plugin stops) out of the report. Before any benchmark module imports grpc.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
