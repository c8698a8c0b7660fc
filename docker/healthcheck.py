"""Docker HEALTHCHECK for Pagoda's images: exit 0 when GET /health answers 200.

    python healthcheck.py PORT [PORT ...]   # healthy when any of these ports answers
    PAGODA_HEALTH_URL=http://127.0.0.1:9000/health python healthcheck.py

Standard library only; Kubernetes ignores HEALTHCHECK and uses the chart's probes instead.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Mapping, Sequence


def health_urls(ports: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    env = os.environ if env is None else env
    if env.get("PAGODA_HEALTH_URL"):
        return [env["PAGODA_HEALTH_URL"]]
    return [f"http://127.0.0.1:{int(port)}/health" for port in ports]


def healthy(url: str, timeout: float = 4.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except OSError:  # refused, timed out, or an HTTP error status (HTTPError is an OSError)
        return False


def main(argv: Sequence[str]) -> int:
    urls = health_urls(argv)
    if not urls:
        print("usage: healthcheck.py PORT [PORT ...] (or set PAGODA_HEALTH_URL)", file=sys.stderr)
        return 2
    return 0 if any(healthy(url) for url in urls) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
