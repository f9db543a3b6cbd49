"""The image's HEALTHCHECK: exit 0 when ``/v2/health/ready`` answers 200, else 1.

The URL is ``$ORTBATCH_HEALTH_URL``, else ``http://127.0.0.1:$ORTBATCH_HTTP_PORT/v2/health/ready``
(the port the entry point serves on). Health routes need no API key. An ``https`` URL (a server
started with ``--ssl-certfile``) is checked without verifying the certificate: the server checks
itself over loopback."""

import os
import ssl
import sys
import urllib.request

port = os.environ.get("ORTBATCH_HTTP_PORT", "8000")
url = os.environ.get("ORTBATCH_HEALTH_URL") or f"http://127.0.0.1:{port}/v2/health/ready"
context = ssl._create_unverified_context() if url.startswith("https:") else None
try:
    with urllib.request.urlopen(url, timeout=2, context=context) as response:
        sys.exit(0 if response.status == 200 else 1)
except Exception as exc:
    print(f"{url}: {exc}", file=sys.stderr)
    sys.exit(1)
