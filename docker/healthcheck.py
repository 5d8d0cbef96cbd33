"""Container health check: exit 0 when the adapter answers 200 on a health route.

Usage: healthcheck.py [PATH]   (default /v2/health/ready; 503 while Triton's model is not ready)

Reads the management listener (``managementIpAddress``/``managementPort``, else the
business one), scheme and ``apiKey`` from the settings file ($MINDIE_TRITON_CONFIG),
so a mounted config with other ports or an API key keeps working. Standard library only: it runs every
few seconds and must stay cheap.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import urllib.request

DEFAULT_CONFIG = "/etc/mindie-triton/config.json"


def management_listener(server: dict) -> tuple[str, int]:
    """Where the health routes are (adapter/planes.py, in the standard library): the
    business listener unless ``managementPort`` is set to another port."""
    port = int(server.get("port") or 1025)
    host = os.environ.get("MIES_CONTAINER_IP") or str(server.get("ipAddress") or "127.0.0.1")
    management_port = int(server.get("managementPort") or port)
    if management_port == port:
        return host, port
    return (os.environ.get("MIES_CONTAINER_MANAGEMENT_IP") or str(server.get("managementIpAddress") or host),
            management_port)


def main(argv: list[str]) -> int:
    path = argv[1] if len(argv) > 1 else "/v2/health/ready"
    server: dict = {}
    try:
        with open(os.environ.get("MINDIE_TRITON_CONFIG", DEFAULT_CONFIG), encoding="utf-8") as fh:
            server = json.load(fh).get("ServerConfig", {}) or {}
    except (OSError, ValueError):
        pass  # no readable config: MindIE defaults
    host, port = management_listener(server)
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
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
