"""specvox's gRPC services, Redis adapters and command line."""

import pipeline  # noqa: F401  # first: it sets the OpenMP wait policy before torch or ctranslate2 loads
