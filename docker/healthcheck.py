"""Container health check: exit 0 when the adapter answers 200 on a health route.

Usage: healthcheck.py [PATH]   (default /v2/health/ready; 503 while Triton's model is not ready)

Reads host, port, scheme and ``apiKey`` from the settings file ($MINDIE_TRITON_CONFIG),
so a mounted config with another port or an API key keeps working. Standard library only: it runs every
few seconds and must stay cheap.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import urllib.request

DEFAULT_CONFIG = "/etc/mindie-triton/config.json"


def main(argv: list[str]) -> int:
    path = argv[1] if len(argv) > 1 else "/v2/health/ready"
    server: dict = {}
    try:
        with open(os.environ.get("MINDIE_TRITON_CONFIG", DEFAULT_CONFIG), encoding="utf-8") as fh:
            server = json.load(fh).get("ServerConfig", {}) or {}
    except (OSError, ValueError):
        pass  # no readable config: MindIE defaults
    host = str(server.get("ipAddress") or "127.0.0.1")
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    port = int(server.get("port", 1025))
    context = None
    scheme = "http"
    if server.get("httpsEnabled"):
        scheme = "https"
        context = ssl.create_default_context()
        context.check_hostname = False  # loopback probe of our own server
        context.verify_mode = ssl.CERT_NONE
    url = f"{scheme}://{host}:{port}{path}"
    request = urllib.request.Request(url)
    if server.get("apiKey"):  # every route but /v2/health/live then needs it
        request.add_header("Authorization", f"Bearer {server['apiKey']}")
    try:
        with urllib.request.urlopen(request, timeout=4, context=context) as resp:  # noqa: S310
            return 0 if resp.status == 200 else 1
    except Exception as exc:  # HTTPError (503), refused, timeout
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
