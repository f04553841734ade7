#!/usr/bin/env python3
"""The hello example: a small HTTP server for berth.

It listens on $PORT (the port the node gave the replica), answers `GET /`
with `<greeting> from <revision>` (the revision berth runs, or "berth" when
run by hand) and `GET /healthz` with `ok`, and exits cleanly on SIGTERM.
"""

import argparse
import http.server
import os
import signal
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--greeting", required=True, help="the first word of every answer to GET /")
    args = parser.parse_args()

    port = int(os.environ.get("PORT", "8080"))
    revision = os.environ.get("BERTH_REVISION") or "berth"
    greeting = f"{args.greeting} from {revision}\n".encode()

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/":
                self.answer(200, greeting)
            elif self.path == "/healthz":
                self.answer(200, b"ok\n")
            else:
                self.answer(404, b"not found\n")

        def answer(self, status, body):
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("", port), Hello)
    # berth stops a replica with SIGTERM: finish the way a clean exit does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"hello: listening on port {port} as {revision}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
